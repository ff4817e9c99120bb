"""Method state on disk without pickle: one safetensors file whose tensors are the state's tensors (and its bytes,
as uint8) and whose metadata holds the rest of the tree as JSON. Loading it runs no code, so a registry artifact
written by someone else cannot execute anything in the training workers or the driver that read it.

The tree may hold dicts with string keys, lists (tuples come back as lists), str, int, float, bool, None, bytes
and tensors; anything else is refused when saving, naming where it sits. Versions registered before this format
hold `method_state.pt`: it is read with torch's restricted unpickler (`weights_only=True`), never the full one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STATE_FILE = "method_state.safetensors"
LEGACY_FILE = "method_state.pt"
_TREE = "clipstream.method_state"  # the metadata key of the JSON tree


class StateError(ValueError):
    """A method state that cannot be written or read safely."""


def save_state(state: dict[str, Any], path: str | Path) -> Path:
    tensors: dict[str, torch.Tensor] = {}

    def encode(value, where: str):
        if isinstance(value, torch.Tensor):
            tensors[where] = value.detach().cpu().contiguous().clone()  # (safetensors refuses shared storage)
            return {"$tensor": where}
        if isinstance(value, (bytes, bytearray, memoryview)):
            tensors[where] = torch.frombuffer(bytearray(value), dtype=torch.uint8) if len(value) else torch.zeros(0, dtype=torch.uint8)
            return {"$bytes": where}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, str) or k.startswith("$")]
            if bad:
                raise StateError(f"method state at {where or '/'}: keys must be strings not starting with '$', got {bad[:3]}")
            return {k: encode(v, f"{where}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(v, f"{where}/{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        raise StateError(f"method state at {where or '/'}: {type(value).__name__} cannot be stored without pickle "
                         "(use tensors, bytes, str, numbers, lists and dicts)")

    tree = encode(state, "")
    path = Path(path)
    save_file(tensors, path, metadata={_TREE: json.dumps(tree)})
    return path


def load_state(folder: str | Path) -> dict[str, Any]:
    """The method state kept in `folder` (a version or a checkpoint); {} when it holds none."""
    folder = Path(folder)
    if (folder / STATE_FILE).is_file():
        return read_state(folder / STATE_FILE)
    if (folder / LEGACY_FILE).is_file():
        try:
            return torch.load(folder / LEGACY_FILE, weights_only=True)
        except Exception as exc:
            raise StateError(f"{folder / LEGACY_FILE}: refused to load this method state, which holds more than "
                             f"tensors and plain values ({exc.__class__.__name__}); retrain the version's task") from exc
    return {}


def read_state(path: str | Path) -> dict[str, Any]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        tree = json.loads(meta[_TREE])
    except Exception as exc:
        raise StateError(f"{path}: not a clipstream method state ({exc.__class__.__name__}: {exc})") from exc

    def decode(value):
        if isinstance(value, dict):
            if set(value) == {"$tensor"}:
                return tensors[value["$tensor"]]
            if set(value) == {"$bytes"}:
                return tensors[value["$bytes"]].numpy().tobytes()
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(tree)
