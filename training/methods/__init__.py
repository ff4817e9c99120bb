"""Continual-learning methods by name, and the presets that configure and compose them.

The names load on first use (PEP 562): the presets (`config`, `schema`) need no torch, so a command that only reads
them, `clipstream --help` listing the presets, does not import it."""

import importlib

_HOME = {"Features": "base", "Method": "base", "Stack": "base", "TaskContext": "base", "forward_features": "base",
         "METHODS": "catalog", "build": "catalog", "method_presets": "config", "resolve": "config"}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value
