"""The continual-learning methods by name, and the stack a preset's `method` section builds from them."""

from clipstream.training.methods.base import Method, Stack
from clipstream.training.methods.cclip import CClip
from clipstream.training.methods.cllclip import CllClip
from clipstream.training.methods.ctp import CTP
from clipstream.training.methods.er import ER
from clipstream.training.methods.ewc import EWC
from clipstream.training.methods.joint import Joint
from clipstream.training.methods.lwf import LwF
from clipstream.training.methods.mas import MAS
from clipstream.training.methods.modx import ModX

METHODS: dict[str, type[Method]] = {cls.name: cls for cls in (Joint, EWC, MAS, LwF, ER, ModX, CTP, CClip, CllClip)}


def build(config: dict) -> Stack:
    """The methods of a resolved preset's `method` section ({name: params}), applied together; an empty
    section is sequential fine-tuning. The stack is named after the preset."""
    section = config.get("method") or {}
    unknown = sorted(set(section) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} in preset {config.get('preset')!r}; known: {', '.join(sorted(METHODS))}")
    return Stack(config.get("preset", "+".join(section) or "finetune"),
                 [METHODS[name](dict(params or {})) for name, params in section.items()])
