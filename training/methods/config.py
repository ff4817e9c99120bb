"""Method presets: one YAML of named presets composed with `inherit_from`, plus `key=value` overrides.
The shipped presets can be extended, not changed, by a file of one's own (Settings.presets)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Iterable, Optional

import yaml

PRESETS = Path(__file__).with_name("presets.yaml")
BASE = "base"  # the preset every other one inherits from; not a method of its own


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads `1e-4` as a float (PyYAML's YAML 1.1 wants a dot: `1.0e-4`)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def merge(base: dict, over: dict) -> dict:
    """Deep merge: mappings merge key by key, everything else in `over` replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else copy.deepcopy(value)
    return out


def load_presets(path: Optional[Path] = None) -> dict[str, dict]:
    """The presets of `path`; by default the shipped ones plus those of `CLIPSTREAM_PRESETS` (Settings.presets),
    which may add presets (composing shipped ones with `inherit_from`) but not redefine a shipped one."""
    if path is not None:
        return yaml.load(Path(path).read_text(), Loader=_Loader)
    from clipstream.settings import Settings

    presets, own = load_presets(PRESETS), Settings().presets
    if own is None:
        return presets
    if not own.is_file():
        raise ValueError(f"CLIPSTREAM_PRESETS={own}: no such file")
    added = load_presets(own) or {}
    if not isinstance(added, dict) or not all(isinstance(v, dict) for v in added.values()):
        raise ValueError(f"{own}: expected a mapping of preset names to sections")
    clash = sorted(set(added) & set(presets))
    if clash:
        raise ValueError(f"{own}: presets {clash} are shipped ones; give yours other names (and inherit_from them)")
    return {**presets, **added}


def method_presets(presets: Optional[dict] = None) -> list[str]:
    """The presets one can train with (every preset but the shared base), in the file's order."""
    return [name for name in (presets if presets is not None else load_presets()) if name != BASE]


def resolve(name: str, overrides: Iterable[str] = (), presets: Optional[dict] = None) -> dict:
    """The full config of preset `name`, its parents merged first, then `a.b=value` overrides (YAML values)."""
    presets = presets if presets is not None else load_presets()

    def lineage(key: str, stack: tuple[str, ...]) -> list[str]:
        """Ancestors first, each once (a shared grandparent such as `base` does not come back after a
        parent that overrides it), then `key`."""
        if key not in presets:
            raise ValueError(f"unknown method preset {key!r}; known: {', '.join(sorted(presets))}")
        if key in stack:
            raise ValueError(f"preset inheritance cycle: {' -> '.join(stack + (key,))}")
        order: list[str] = []
        for parent in presets[key].get("inherit_from") or []:
            order += [k for k in lineage(parent, stack + (key,)) if k not in order]
        return order + [key]

    config: dict = {}
    for key in lineage(name, ()):
        config = merge(config, {k: v for k, v in presets[key].items() if k != "inherit_from"})
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
        node[leaf] = yaml.load(raw, Loader=_Loader)
    config["preset"] = name
    return config
