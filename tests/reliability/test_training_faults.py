"""Training faults: the `clipstream train` driver SIGKILLed mid-task, then the same command run again.

A killed worker is tests/training/test_job.py's (Ray Train restarts the worker group from the last epoch). Here
the driver itself dies, with its local Ray: rerunning the command resumes the same Ray Train run from its last
epoch checkpoint, ends the dead job's MLflow run, registers the task's one version (weights and method state
equal to an uninterrupted run's, bit for bit, under train.deterministic); once it is registered, the same command
is refused in one line (exit 2) and registers nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from clipstream.cli import main
from clipstream.models import WEIGHTS_FILE
from clipstream.registry import Registry
from clipstream.settings import Settings
from clipstream.training.methods.state import STATE_FILE, read_state

pytestmark = pytest.mark.slow  # faults: `make test-all`

# three epochs: the driver is killed right after the first epoch's checkpoint, with two epochs still to train
SETS = ["train.epochs=3", "train.micro_batch=16", "train.log_every=1", "train.max_failures=0", "train.warmup_steps=1",
        "train.deterministic=true", "method.ewc.batches=2"]
TIMEOUT_S = 900  # one job on a busy 2-core machine takes ~2 minutes


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    from clipstream.training.data.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("faults") / "data", tasks=1, seed=3, train_pairs=96, test_per_task=8,
                      digits=False, held_out=False, progress=False)[0]


def _command(task: Path) -> list[str]:
    cmd = [sys.executable, "-m", "clipstream.cli", "train", "--task", str(task), "--method", "ewc", "--workers", "1"]
    for item in SETS:
        cmd += ["--set", item]
    return cmd


def _env(home: Path) -> dict:
    """This environment with one setting, the home (no other CLIPSTREAM_ variable, and a Ray of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLIPSTREAM_") and k != "RAY_ADDRESS"}
    return {**env, "CLIPSTREAM_HOME": str(home)}


def _started_by(home: Path) -> list[int]:
    """The processes a job with this home started, wherever they are: the driver's process group holds the driver
    and Ray's head processes, but Ray's workers run in sessions of their own; all of them carry the environment."""
    marker = f"CLIPSTREAM_HOME={home}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "environ").read_bytes() and (proc / "stat").read_text().split(")")[-1].split()[0] != "Z":
                    found.append(int(proc.name))
            except (OSError, IndexError):
                pass
    return found


def _wait_gone(home: Path, timeout_s: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _started_by(home)) and time.monotonic() < deadline:
        time.sleep(1)
    return left


def _kill_all(home: Path) -> None:
    for pid in _started_by(home):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _checkpointed(runs: Path) -> bool:
    """Ray Train has recorded an epoch checkpoint of a run under `runs` (its checkpoint manager's snapshot)."""
    for snapshot in runs.glob("*/checkpoint_manager_snapshot.json"):
        try:
            if json.loads(snapshot.read_text()).get("latest_checkpoint_result"):
                return True
        except (OSError, ValueError):
            pass
    return False


class _Job:
    """`clipstream train` in a session of its own, started now; `wait()` returns its exit status and output, and
    what it left running a minute after it ended (a job that ends shuts its Ray down itself); `stop()` ends it and
    everything it started."""

    def __init__(self, cmd: list[str], home: Path, cwd: Path):
        name = f"{home.name}-{time.monotonic_ns()}"
        self.home, self.log, self.err, self.tic = home, cwd / f"{name}.out", cwd / f"{name}.err", time.monotonic()
        with open(self.log, "wb") as out, open(self.err, "wb") as err:  # (files: a pipe left unread would fill)
            self.proc = subprocess.Popen(cmd, env=_env(home), cwd=cwd, stdout=out, stderr=err, start_new_session=True)

    def wait(self) -> tuple[int, str, str, list[int]]:
        try:
            self.proc.wait(timeout=TIMEOUT_S)
            self.seconds = time.monotonic() - self.tic
            return self.proc.returncode, self.log.read_text(errors="replace"), self.err.read_text(errors="replace"), \
                _wait_gone(self.home, 60)
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the driver and the Ray head it started
            self.proc.wait()
        _kill_all(self.home)  # Ray's workers, in their own sessions


def _version_files(settings: Settings, version: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    folder = Registry(settings).resolve(version).folder
    return load_file(folder / WEIGHTS_FILE), read_state(folder / STATE_FILE)


def _flat(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flat(value, f"{prefix}/{key}").items()}
    if isinstance(tree, list):
        return {k: v for i, value in enumerate(tree) for k, v in _flat(value, f"{prefix}/{i}").items()}
    return {prefix: tree}


@pytest.mark.slow
def test_a_killed_driver_resumes_on_rerun_registers_one_version_then_a_rerun_is_refused(settings, task, tmp_path,
                                                                                        capsys):
    home, cmd, runs = settings.home, _command(task), settings.runs_path
    client = MlflowClient(settings.mlflow_tracking_uri)
    # the uninterrupted run of the same command, in a home of its own, alongside (the jobs mostly wait on Ray)
    reference = Settings(home=tmp_path / "reference").ensure_dirs()
    whole = _Job(cmd, reference.home, tmp_path)
    try:
        killed_job = _Job(cmd, home, tmp_path)
        try:
            deadline = time.monotonic() + TIMEOUT_S
            while not _checkpointed(runs):
                assert killed_job.proc.poll() is None, f"the job ended (exit {killed_job.proc.returncode}) before " \
                    f"its first checkpoint:\n{killed_job.err.read_text(errors='replace')[-4000:]}"
                assert time.monotonic() < deadline, "no epoch checkpoint in time"
                time.sleep(0.2)
            killed_s = time.monotonic() - killed_job.tic
        finally:
            killed_job.stop()  # SIGKILL to its process group, then to Ray's workers
        assert not _wait_gone(home, 60)

        # what the dead job left: its run RUNNING, a checkpoint, no version
        (killed,) = client.search_runs([Registry(settings).experiment_id()])
        assert killed.info.status == "RUNNING" and Registry(settings).versions() == []

        rerun = _Job(cmd, home, tmp_path)
        code, out, err, left = rerun.wait()
        assert code == 0, out[-3000:] + err[-3000:]
        assert "[train] resuming Ray Train run" in out and f"MLflow run {killed.info.run_id} interrupted" in out
        assert "registered version 1 " in out and not left

        registry = Registry(settings)
        (version,) = registry.versions()  # exactly one version for the task
        assert version.tags["task"] == task.name and version.tags["method"] == "ewc"
        done = client.get_run(version.run_id)
        assert done.info.status == "FINISHED" and done.data.tags["resumes"] == killed.info.run_id
        assert done.data.metrics["train/start_epoch"] >= 1  # resumed after an epoch, did not start over
        old = client.get_run(killed.info.run_id)
        assert old.info.status == "KILLED" and "interrupted" in old.data.tags
        # the Ray Train run is gone with its checkpoints (the version holds them now); the workers' inputs too
        assert not (runs / done.data.tags["ray_run"]).exists() and not any((runs / "inputs").iterdir())

        # the same command again: refused in one line before anything starts (so in this process: the console
        # script's one-line errors are tested as a process in tests/clipstream/test_runtime.py), nothing trained
        # or registered
        capsys.readouterr()
        tic = time.monotonic()
        assert main(cmd[3:]) == 2
        refused_s, err = time.monotonic() - tic, capsys.readouterr().err
        said = [line for line in err.splitlines()
                if line.strip() and not line.startswith("clipstream: Ray, DeepSpeed and MLflow log to ")]
        assert len(said) == 1 and said[0].startswith(f"clipstream: error: task {task.name!r} already registered "
                                                     "version 1 "), err
        assert "--retrain" in said[0]
        assert [v.version for v in registry.versions()] == ["1"]
        assert len(client.search_runs([registry.experiment_id()])) == 2

        code, out, err, left = whole.wait()
        assert code == 0, out[-3000:] + err[-3000:]
        assert "resuming" not in out and not left
    finally:
        whole.stop()
    # the resumed job ends with the uninterrupted one's weights and method state, bit for bit
    (weights, state), (weights_ref, state_ref) = _version_files(settings, "1"), _version_files(reference, "1")
    assert weights.keys() == weights_ref.keys() and all(torch.equal(weights[k], weights_ref[k]) for k in weights)
    state, state_ref = _flat(state), _flat(state_ref)
    assert state.keys() == state_ref.keys() and any(k.startswith("/ewc/importance/") for k in state)
    assert all(torch.equal(v, state_ref[k]) if isinstance(v, torch.Tensor) else v == state_ref[k] for k, v in state.items())
    print(f"killed after {killed_s:.0f} s; resumed job {rerun.seconds:.0f} s; refused in {refused_s:.1f} s; "
          f"uninterrupted job {whole.seconds:.0f} s")
