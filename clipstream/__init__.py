"""clipstream: continual vision-language pretraining."""
