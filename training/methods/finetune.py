"""Sequential fine-tuning (SeqF): train on each task's data alone; the lower bound on forgetting."""

from training.methods.base import Method


class Finetune(Method):
    name = "finetune"
