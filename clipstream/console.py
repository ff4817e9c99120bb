"""What a clipstream command shows: its own lines, progress bars and tables, and nothing of its libraries.

Ray, Ray Data, Ray Train, DeepSpeed and MLflow log hundreds of lines a task (dataset plans, op builds, result
dictionaries), from Python loggers, from C++ (Ray's core worker) and from the processes Ray starts, some of them
while the process exits. Quiet (the default of the commands that start them), everything written to the
process's file descriptors 1 and 2 goes to a log file under HOME/logs instead: the libraries' lines, whatever
their source, and those of every process this one starts (Ray's head processes inherit them). clipstream's own
lines reach the terminal through `sys.stdout`, which is re-opened on a copy of the original descriptor, and its
progress bars and errors through `err()`. The redirection lasts the process's life, so that what Ray prints at
exit lands in the file too. `-v/--verbose` leaves the descriptors alone (and Ray forwards its workers' output).

Called in a process whose streams are not real descriptors (a test's captured `main([...])`), `quiet` changes
nothing: the output stays where the caller collects it.
"""

from __future__ import annotations

import functools
import io
import os
import sys
import time
from pathlib import Path

_err: io.TextIOWrapper | None = None  # the terminal's stderr while quiet
_log: Path | None = None


def err():
    """Where progress bars and clipstream's messages for the user go: the terminal's stderr, also while quiet."""
    return _err or sys.stderr


def log_path() -> Path | None:
    """The log file the libraries write to, while quiet."""
    return _log


def _real(stream) -> bool:
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False


class _Terminal(io.TextIOWrapper):
    """`sys.stdout` while quiet: clipstream's own prints (and a script's, `__main__`) reach the terminal; what any
    other module writes there goes into the log file: a logging handler given sys.stdout when it was made
    (DeepSpeed's), Ray's driver printing what its raylet reports (`(raylet) Task ... failed`)."""

    def write(self, text: str) -> int:
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") == "__main__" or caller.f_code.co_filename.startswith(_own_folders()):
            return super().write(text)
        return sys.stderr.write(text)  # (descriptor 2: the log file)


@functools.cache
def _own_folders() -> tuple[str, ...]:
    """The folders of clipstream's packages (the repository's clipstream/, training/, services/, benchmarks/ in an
    editable install), each ending in a separator."""
    from importlib.util import find_spec

    found = []
    for name in ("clipstream", "clipstream.training", "clipstream.services", "clipstream.benchmarks"):
        spec = find_spec(name)
        found += [os.path.join(folder, "") for folder in (spec.submodule_search_locations or [])] if spec else []
    return tuple(found)


def quiet(folder: Path, name: str) -> Path | None:
    """Send the process's descriptors 1 and 2 to a new log file `folder`/NAME-DATE-TIME-PID.log; keep `sys.stdout`
    and `err()` on the terminal. Returns the file (None where the streams are not the process's own: nothing done)."""
    global _err, _log
    if _log or not (_real(sys.stdout) and _real(sys.stderr)):
        return _log
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    terminal_out, terminal_err = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # sys.stderr stays on descriptor 2 (now the file): Python loggers and warnings write there, whenever they were made
    sys.stdout = _Terminal(io.FileIO(terminal_out, "w"), encoding=sys.stdout.encoding or "utf-8", errors="replace",
                           line_buffering=True)
    _err = open(terminal_err, "w", buffering=1, encoding=sys.stderr.encoding or "utf-8", errors="replace")
    # the progress bar a download from MLflow draws would go to the file, one line per update
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    _log = path
    return path


def is_quiet() -> bool:
    return _log is not None


def bar(**options):
    """A tqdm progress bar on `err()` (the terminal, also while quiet)."""
    from tqdm import tqdm

    return tqdm(file=err(), **options)
