"""The session's trained method streams, trained in a background process while the other tests run.

A stream is three synthetic tasks trained in turn from the CLI (`clipstream train --parent ...`) with a
method preset and a ZeRO stage. Its jobs are mostly Ray and torch start-up, which leaves a quarter of the
2 cores idle; the rest of the suite fills them. So when the collected tests need streams (the `stream`
marker, see tests/conftest.py), one process started right after collection trains them all, one after
the other, on its own local Ray, and the tests that need them wait for them (they come late in pytest's order,
when the streams are long trained; the local cluster waits for the process to end, tests/conftest.py).

    python -m tests.streams ROOT METHOD:STAGE [METHOD:STAGE ...]

writes ROOT/data (the tasks), ROOT/METHOD-zeroSTAGE/home (the stream's clipstream home, versions 1..3)
and, when that stream is done, ROOT/METHOD-zeroSTAGE.done.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Compositions of shipped presets, as a user would add them (Settings.presets): each stream test then checks
# several methods' state at once, each on its own loss terms (one `penalty`, one `distill`: they never
# collide), and the second composes a shipped composition (ctp_er) with two more methods.
OWN_PRESETS = """
mas_lwf:
  inherit_from: [mas, lwf]
ewc_modx_ctp_er:
  inherit_from: [ewc, modx, ctp_er]
"""

# A language stream (CLL-CLIP's setting): English, then two synthetic languages. Its first version is the
# teacher the methods learn languages from, trained with C-CLIP at ZeRO 0 (so C-CLIP runs at both stages).
LANGUAGE_METHODS = ("cllclip", "teir")
FIRST_LANGUAGE = ("cclip", ["train.epochs=2"])

# 6 steps a job: what the checks read (a method's state carried across jobs, its terms felt from the second task on)
# needs steps, not the 50 a whole epoch of these tasks would take
FAST = ["train.epochs=1", "train.micro_batch=8", "train.max_steps=6", "train.log_every=1", "train.max_failures=0",
        "train.warmup_steps=1"]


def tasks(root: Path) -> list[Path]:
    """Three synthetic domain tasks (800 pairs each: the third task's job must still take several steps)."""
    from clipstream.training.data.synth import synthesize

    data = root / "data"
    if not (data / ".done").exists():
        synthesize(data, tasks=3, seed=5, train_pairs=800, test_per_task=12, digits=False, held_out=False,
                   progress=False)
        (data / ".done").touch()
    return sorted(p for p in data.iterdir() if p.is_dir())


def language_tasks(root: Path) -> list[Path]:
    """English and two synthetic languages, the same 256 images in each."""
    from clipstream.training.data.synth import synthesize_languages

    data = root / "languages"
    if not (data / ".done").exists():
        synthesize_languages(data, 3, seed=5, train_pairs=256, test_per_task=12, progress=False)
        (data / ".done").touch()
    return sorted(p for p in data.iterdir() if p.is_dir())


def tasks_of(root: Path, method: str) -> list[Path]:
    return language_tasks(root) if method in LANGUAGE_METHODS else tasks(root)


def home(root: Path, method: str, stage: int) -> Path:
    return root / f"{method}-zero{stage}" / "home"


def done(root: Path, method: str, stage: int) -> Path:
    return root / f"{method}-zero{stage}.done"


def train(root: Path, method: str, stage: int) -> None:
    """The stream's three tasks trained in turn with `clipstream train` (this process's environment becomes the
    stream's settings)."""
    from clipstream.cli import main
    from clipstream.settings import Settings

    folders = tasks_of(root, method)
    presets = root / "presets.yaml"
    presets.write_text(OWN_PRESETS)
    for name in [n for n in os.environ if n.startswith("CLIPSTREAM_")]:  # (the previous stream's)
        del os.environ[name]
    os.environ.update(Settings(home=home(root, method, stage), presets=presets).ensure_dirs().env())
    # a fixed buffer: the preset's 1% of these small tasks would be a pair or two
    extra = ["method.er.buffer_pairs=40", "method.er.buffer_fraction=null"] if "er" in method.split("_") else []
    for i, folder in enumerate(folders):
        first = method in LANGUAGE_METHODS and i == 0
        args = ["train", "--task", str(folder), "--method", FIRST_LANGUAGE[0] if first else method, "--workers", "2"]
        for item in [*FAST, f"train.zero_stage={stage}", *extra, *(FIRST_LANGUAGE[1] if first else [])]:
            args += ["--set", item]
        if main(args + (["--parent", str(i)] if i else [])) != 0:
            raise SystemExit(f"stream {method} (ZeRO {stage}): `clipstream {' '.join(args)}` failed")
    done(root, method, stage).touch()


class StreamSession:
    """`start()` returns at once (this module runs in a process of its own); `trained(method, stage)` waits for one
    stream; `stop()` ends the process (by its handle) and removes its files."""

    def __init__(self, streams: list[tuple[str, int]], cwd: Path):
        self.streams, self.cwd = streams, cwd
        self.root = Path(tempfile.mkdtemp(prefix="clipstream-streams-"))
        self.proc: subprocess.Popen | None = None

    def start(self) -> StreamSession:
        with open(self.root / "streams.log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.streams", str(self.root),
                                          *[f"{m}:{s}" for m, s in self.streams]],
                                         cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def trained(self, method: str, stage: int, timeout_s: float = 30 * 60) -> Path:
        """The stream's clipstream home once it is trained; an error with the end of the log if it never is."""
        deadline = time.monotonic() + timeout_s
        while not done(self.root, method, stage).exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.root / "streams.log").read_text(errors="replace")[-6000:]
                raise RuntimeError(f"the background streams (exit {self.proc.poll()}) did not train {method} at ZeRO "
                                   f"{stage}; the end of {self.root / 'streams.log'}:\n{tail}")
            time.sleep(1)
        return home(self.root, method, stage)

    def finished(self, timeout_s: float = 30 * 60) -> None:
        """Wait for the process to end (every stream trained, or failed: `trained` says which)."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass  # the tests that need the streams report it; the caller only wanted the cores back

    def stop(self) -> list[str]:
        """SIGTERM (the process shuts its own Ray down on the way out), SIGKILL after a minute; [] when it is gone."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
        return []


def _main(argv: list[str]) -> None:
    # the session stops this process with SIGTERM when it ends early: leave through `finally` and atexit,
    # so that the local Ray this process started is shut down with it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    root = Path(argv[0])
    for spec in argv[1:]:
        method, stage = spec.rsplit(":", 1)
        train(root, method, int(stage))


if __name__ == "__main__":
    _main(sys.argv[1:])
