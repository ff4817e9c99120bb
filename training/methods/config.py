"""Method presets: one YAML of named presets composed with `inherit_from`, plus `key=value` overrides."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterable, Optional

import yaml

PRESETS = Path(__file__).with_name("presets.yaml")


def merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, everything else in `over` replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else copy.deepcopy(value)
    return out


def load_presets(path: Optional[Path] = None) -> dict[str, dict]:
    return yaml.safe_load(Path(path or PRESETS).read_text())


def resolve(name: str, overrides: Iterable[str] = (), presets: Optional[dict] = None) -> dict:
    """The full config of preset `name`, its parents merged first, then `a.b=value` overrides (YAML values)."""
    presets = presets if presets is not None else load_presets()

    def expand(key: str, stack: tuple[str, ...]) -> dict:
        if key not in presets:
            raise ValueError(f"unknown method preset {key!r}; known: {', '.join(sorted(presets))}")
        if key in stack:
            raise ValueError(f"preset inheritance cycle: {' -> '.join(stack + (key,))}")
        own = dict(presets[key])
        out: dict = {}
        for parent in own.pop("inherit_from", []) or []:
            out = merge(out, expand(parent, stack + (key,)))
        return merge(out, own)

    config = expand(name, ())
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise ValueError(f"override {item!r} must look like key.sub=value")
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section of preset {name!r}")
            node = node[part]
        if leaf not in node:
            raise ValueError(f"override {item!r}: preset {name!r} has no key {path!r}")
        node[leaf] = yaml.safe_load(raw)
    config["preset"] = name
    return config
