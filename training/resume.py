"""Resuming a job, and refusing one that would train a task twice: the bookkeeping around `job.run_task`.

A job's Ray Train run is named after what it trains (`run_key`: the stream, the task's data, the parent version, the
method, the resolved config and the workers), so the same command run again after its driver died finds the run's
last epoch checkpoint (`checkpointed_epoch`), and the MLflow run the dead driver left RUNNING is marked KILLED
(`end_interrupted_runs`; a live driver of the same job on this host refuses the rerun: `JobRunning`). Once the task
has a version from the same parent, method and data, a rerun is refused (`AlreadyRegistered`) unless retrained.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

from clipstream.registry import Registry, Version
from clipstream.training.engine import STATE_FILE
from clipstream.training.methods.config import flatten


class AlreadyRegistered(ValueError):
    """The task already registered a version from the same parent with the same method on the same data: training
    it again would give the task a second version, so a rerun is refused (exit 2) unless `retrain` asks for it."""


class JobRunning(ValueError):
    """A live driver on this host is training the same job (same `Plan.run_key`) now."""


# what does not change the trained weights, left out of the run key: a rerun with more restarts allowed, other
# logging or another evaluation batch still resumes the same run
NOT_TRAINED = ("train.max_failures", "train.log_every", "train.data_cpus", "eval.")


def same_versions(registry: Registry, tags: dict) -> list[Version]:
    """The registered versions trained on the same task data from the same parent with the same method."""
    keys = ("task", "parent_version", "method", "data_sha")
    return [v for v in registry.versions() if all(v.tags.get(k, "") == tags[k] for k in keys)]


def refuse_registered(registry: Registry, tags: dict, generation: int) -> None:
    """AlreadyRegistered when the task has more versions from this parent, method and data than the job may
    find (`generation`: 0, or the number there were when `retrain` was asked for)."""
    same = same_versions(registry, tags)
    if len(same) <= generation:
        return
    found = same[-1]
    run = registry.client.get_run(found.run_id)
    if run.info.status == "RUNNING" and not alive(run.data.tags.get("driver", "")):  # killed just after registering
        registry.client.set_tag(found.run_id, "interrupted", "driver gone after registering the version")
        registry.client.set_terminated(found.run_id, "FINISHED")
    parent = f"parent version {tags['parent_version']}" if tags["parent_version"] else "no parent"
    raise AlreadyRegistered(f"task {tags['task']!r} already registered version {found.version} (method "
                            f"{tags['method']!r}, {parent}, the same data): not training it again; to train it again "
                            f"on purpose, as a new version, rerun with --retrain")


def run_key(stream: str, config: dict, tags: dict, workers: int, generation: int) -> str:
    """What the job trains, hashed: the same job run again has the same key, hence the same Ray Train run."""
    trained = {k: v for k, v in flatten(config).items() if not k.startswith(NOT_TRAINED)}
    what = {"stream": stream, "config": trained, "workers": workers, "generation": generation,
            **{k: tags[k] for k in ("task", "parent_version", "method", "data_sha")}}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def driver() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def alive(driver: str) -> bool:
    """Whether the driver `host:pid` (a run's tag) is a live process on this host other than this one; a driver on
    another host cannot be asked (a RayJob's submitter pod that died is retried on another)."""
    host, _, pid = driver.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) in (0, os.getpid()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed driver its parent has not reaped yet is a zombie: gone
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def end_interrupted_runs(registry: Registry, run_key: str, task: str) -> list[str]:
    """Mark KILLED the MLflow runs of this job (its run key) that a dead driver left RUNNING; returns their ids.
    JobRunning when this job's driver is alive on this host."""
    found = registry.client.search_runs([registry.experiment_id()], max_results=1000,
                                        filter_string=f"tags.run_key = '{run_key}' and attributes.status = 'RUNNING'")
    for run in found:
        driver = run.data.tags.get("driver", "")
        if alive(driver):
            raise JobRunning(f"task {task!r}: the same job is running now (MLflow run {run.info.run_id}, "
                             f"driver pid {driver.rpartition(':')[2]}); wait for it to end")
    for run in found:
        registry.client.set_tag(run.info.run_id, "interrupted", "driver gone; a rerun resumed from its last checkpoint")
        registry.client.set_terminated(run.info.run_id, "KILLED")
    return [run.info.run_id for run in found]


def checkpointed_epoch(storage: Path) -> int | None:
    """The epoch of the last checkpoint Ray Train recorded for the run stored at `storage` (its checkpoint
    manager's snapshot, which it restores when a run of that name starts again); None when there is none."""
    try:
        snapshot = json.loads((storage / "checkpoint_manager_snapshot.json").read_text())
        latest = snapshot["latest_checkpoint_result"]
        if latest is None:
            return None
        return int(json.loads((storage / latest["checkpoint_dir_name"] / STATE_FILE).read_text())["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
