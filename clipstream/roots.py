"""Where images may come from outside a task: the user's allowed roots (Settings image_roots), folders and URI
prefixes, none by default. A task's rows (training.data.task) and a catalogue's items (AddItems by URI) both ask
here, so the one rule holds for both."""

from __future__ import annotations

import functools
import os
from pathlib import Path, PurePosixPath
from typing import Optional, Sequence


def location(path: str | Path):
    """A local path (absolute), or a `UPath` for a URI: the same path API over fsspec's filesystems."""
    if "://" in str(path):
        from upath import UPath

        return UPath(str(path))
    return Path(path).absolute()

def image_roots() -> tuple[str, ...]:
    """Where outside a task its rows may name images (Settings image_roots): none unless the user allows some."""
    return _image_roots(os.environ.get("CLIPSTREAM_IMAGE_ROOTS"), os.environ.get("CLIPSTREAM_CONFIG"))

@functools.lru_cache(maxsize=8)
def _image_roots(variable: Optional[str], config: Optional[str]) -> tuple[str, ...]:  # (keyed by what Settings reads)
    from clipstream.settings import Settings

    return tuple(Settings().image_roots)

def under_allowed_root(rel: str, roots: Optional[Sequence[str]] = None):
    """The image at absolute path or URI `rel` when it lies under an allowed root (`roots`, default this process's
    settings': a local path after resolving its symlinks, so a link inside a root that points out of it is still
    out), else None."""
    if not ("://" in rel or rel.startswith("/")):
        return None
    for root in image_roots() if roots is None else roots:
        if "://" in root or "://" in rel:
            prefix = root.rstrip("/") + "/"
            if rel.startswith(prefix) and ".." not in PurePosixPath(rel[len(prefix):]).parts:
                return location(rel)
        else:
            try:
                if Path(rel).resolve().is_relative_to(Path(root).resolve()):
                    return Path(rel)
            except (OSError, RuntimeError):
                return None
    return None

