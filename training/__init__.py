"""Everything that makes a model version: data, models, methods, the train loop, evaluation, registry."""
