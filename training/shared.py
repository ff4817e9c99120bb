"""What a training job's driver shares with its workers under `runs_dir` (Settings): a folder every node mounts,
or a URI (s3://, gs://, file://) that every node reaches through fsspec (universal-pathlib), as Ray Train reaches
its checkpoints there through pyarrow.

The model loaders and open_clip's tokenizer read local files: on a URI, the driver uploads what it shares
(`share`) and each worker process reads a local copy of it (`local`)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

from clipstream.settings import is_uri


def share(path, dest) -> Optional[str]:
    """`path` (a model folder or file) copied to `dest` (a `Settings.runs_path` below runs_dir), or as it is when it
    names no local file (a pretrained tag, None)."""
    if not path or not Path(path).exists():
        return path
    if is_uri(str(dest)):
        remove(dest)  # (fsspec puts a folder into one that exists, as a rerun of the job would find it)
        dest.fs.makedirs(dest.parent.path, exist_ok=True)  # (a local filesystem's put makes no parent folder)
        dest.fs.put(str(path), dest.path, recursive=Path(path).is_dir())
    elif Path(path).is_dir():
        shutil.copytree(path, dest, dirs_exist_ok=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
    return str(dest)


def remove(path) -> None:
    """A folder under runs_dir and all it holds; nothing when it is not there."""
    if not is_uri(str(path)):
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.fs.rm(path.path, recursive=True)


@lru_cache(maxsize=8)
def local(source: Optional[str]) -> Optional[str]:
    """On a worker: a local copy of what `share` put on a URI (fetched once per process, removed when it exits);
    anything else as it is."""
    if not source or not is_uri(source):
        return source
    from upath import UPath

    remote = UPath(source)
    folder = Path(tempfile.mkdtemp(prefix="clipstream-shared-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    target = folder / remote.name
    remote.fs.get(remote.path, str(target), recursive=remote.is_dir())
    return str(target)
