"""Method presets: one YAML of named presets composed with `inherit_from`, plus `key=value` overrides.
The shipped presets can be extended, not changed, by a file of one's own (Settings.presets). Every resolved
config is checked against the schema (`schema.py`) before it is returned: a bad value is a ValueError naming the
`--set` or the preset it came from, before anything starts."""

from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from clipstream.training.methods import schema

PRESETS = Path(__file__).with_name("presets.yaml")
BASE = "base"  # the preset every other one inherits from; not a method of its own
SCALES = ("vit-b-16", "vit-b-32")  # every method is also shipped as `<method>-<scale>`: a pretrained CLIP on GPUs


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads `1e-4` as a float (PyYAML's YAML 1.1 wants a dot: `1.0e-4`)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


class Presets(dict):
    """Preset name -> its section, and `files`: the file of each preset a user added (CLIPSTREAM_PRESETS)."""

    files: dict[str, Path] = {}


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
        try:
            return yaml.load(Path(path).read_text(), Loader=_Loader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            raise ValueError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML "
                             f"({getattr(exc, 'problem', None) or exc})") from None
    from clipstream.settings import Settings

    presets, own = Presets(load_presets(PRESETS)), Settings().presets
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
    out = Presets({**presets, **added})
    out.files = {name: own for name in added}
    return out


def method_presets(presets: Optional[dict] = None) -> list[str]:
    """The presets one can train with (every preset but the shared base), in the file's order."""
    return [name for name in (presets if presets is not None else load_presets()) if name != BASE]


def resolve(name: str, overrides: Iterable[str] = (), presets: Optional[dict] = None, *, validate: bool = True) -> dict:
    """The full config of preset `name`, its parents merged first, then `a.b=value` overrides (YAML values), checked
    against the schema (`validate=False`: not, for presets of another shape). ValueError, one line: every problem,
    each naming the `--set` or the preset (and its file) that the bad value came from."""
    presets = presets if presets is not None else load_presets()

    def lineage(key: str, stack: tuple[str, ...]) -> list[str]:
        """Ancestors first, each once (a shared grandparent such as `base` does not come back after a
        parent that overrides it), then `key`."""
        if key not in presets:
            scaled = tuple(f"-{scale}" for scale in SCALES)
            known = sorted(name for name in presets if not name.endswith(scaled))
            close = difflib.get_close_matches(key, list(presets), n=1)
            raise ValueError(f"unknown method preset {key!r}; known: {', '.join(known)}, each also as NAME-"
                             f"{' / NAME-'.join(SCALES)}" + (f" (did you mean {close[0]}?)" if close else ""))
        if key in stack:
            raise ValueError(f"preset inheritance cycle: {' -> '.join(stack + (key,))}")
        parents = presets[key].get("inherit_from") or []
        if not isinstance(parents, list):
            raise ValueError(f"{_label(key, presets)}: inherit_from must be a list of preset names, got {parents!r}")
        order: list[str] = []
        for parent in parents:
            order += [k for k in lineage(parent, stack + (key,)) if k not in order]
        return order + [key]

    chain = lineage(name, ())
    config: dict = {}
    for key in chain:
        config = merge(config, {k: v for k, v in presets[key].items() if k != "inherit_from"})
    applied: list[tuple[tuple[str, ...], str]] = []  # (path, the override as typed), in order
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep or not path:
            raise ValueError(f"--set {item}: must look like key.sub=value")
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"--set {item}: {part!r} is not a section of preset {name!r}")
            node = node[part]
        if leaf not in node:
            close = difflib.get_close_matches(leaf, [str(k) for k in node], n=1)
            hint = f" (did you mean {'.'.join([*parents, close[0]])}?)" if close else ""
            raise ValueError(f"--set {item}: preset {name!r} has no key {path!r}{hint}")
        try:
            node[leaf] = yaml.load(raw, Loader=_Loader)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or exc
            raise ValueError(f"--set {item}: {raw!r} is not a YAML value ({problem})") from None
        applied.append((tuple(path.split(".")), item))
    config["preset"] = name
    if not validate:
        return config
    valid, problems = schema.check(config)
    if problems:
        lines = [_explain(p, config, applied, chain, presets) for p in problems]
        raise ValueError("; ".join(lines).replace("\n", " "))
    refused = schema.refusals(valid)
    if refused:
        raise ValueError(f"{_label(name, presets)}: {'; '.join(refused)}")
    return valid


def _explain(problem: schema.Problem, config: dict, applied: list[tuple[tuple[str, ...], str]], chain: list[str],
             presets: dict) -> str:
    """One line: where the bad value came from (the last `--set` that wrote it or its section, else the preset that
    set it or, for a missing key, its section), the key and value, and what is expected there."""
    dotted = ".".join(problem.path)
    at = dotted if problem.missing else f"{dotted}={_show(_get(config, problem.path))}"
    for path, item in reversed(applied):
        if problem.path[:len(path)] == path:
            return f"--set {item}: {'' if path == problem.path else f'{at}: '}{problem.message}"
    own = {key: {k: v for k, v in presets[key].items() if k != "inherit_from"} for key in chain}
    owner = next(key for depth in range(len(problem.path), -1, -1) for key in reversed(chain)
                 if _has(own[key], problem.path[:depth]))  # the last to set the key, else its closest section
    hint = f" (a preset that inherits from {BASE!r} has every key)" if problem.missing and BASE not in chain else ""
    return f"{_label(owner, presets)}: {f'{at}: ' if problem.path else ''}{problem.message}{hint}"


def _label(preset: str, presets: dict) -> str:
    """`preset 'x'`, with the file of a user's own preset."""
    file = getattr(presets, "files", {}).get(preset)
    return f"preset {preset!r}" + (f" ({file})" if file else "")


def _has(tree: Any, path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _show(value: Any) -> str:
    """A value as one would write it in YAML, on one line (and short)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip().removesuffix("...").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def flatten(config: dict, prefix: str = "") -> dict:
    """A resolved config as {dotted key: value}, the keys as `--set` names them (`train.lr`)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.update(flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out
