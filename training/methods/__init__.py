"""Continual-learning methods by name, and their presets."""

from training.methods.base import Features, Method, TaskContext
from training.methods.config import resolve
from training.methods.finetune import Finetune
from training.methods.joint import Joint

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Finetune, Joint)}


def build(config: dict) -> Method:
    """The method named by a resolved preset's `method.name`, given the rest of `method` as params."""
    params = dict(config["method"])
    name = params.pop("name")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(sorted(METHODS))}")
    return METHODS[name](params)


__all__ = ["Features", "METHODS", "Method", "TaskContext", "build", "resolve"]
