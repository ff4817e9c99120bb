"""Resume bookkeeping (clipstream.training.resume): a job named after what it trains, the run a dead driver left,
and the refusal to train a task twice."""

import shutil
import socket
import subprocess
import sys

import pytest

from clipstream.cli import main
from clipstream.registry import Registry
from clipstream.training import resume
from clipstream.training.data.task import Task
from clipstream.training.job import prepare, run_task
from clipstream.training.resume import AlreadyRegistered, JobRunning
from tests.conftest import register_version


@pytest.mark.component
def test_a_task_that_registered_a_version_is_refused_unless_retrained_and_a_job_names_its_ray_run_by_what_it_trains(
        settings, stream, capsys):
    """Before anything runs: the task's version from the same parent, method and data refuses the job (exit 2 from the
    CLI, in one line), unless retrain; the Ray Train run a job resumes is named after what it trains, so that the
    same job run again finds it (tests/reliability/test_training_faults.py kills a driver for real)."""
    registry = Registry(settings)
    v1 = register_version(settings, seed=1, task_dirs=[stream[0]])
    registry.set_tags(v1, {"data_sha": Task.load(stream[0]).data_sha()})  # as run_task tags its versions
    with pytest.raises(AlreadyRegistered, match=f"task 'task-00-household' already registered version {v1} "
                                                r"\(method 'finetune', no parent, the same data\).*--retrain"):
        prepare(registry, stream[0], "finetune", None, workers=2)
    assert main(["train", "--task", str(stream[0]), "--method", "finetune", "--set", "train.epochs=1"]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("clipstream:")]  # (not MLflow's log)
    assert len(said) == 1 and said[0].startswith(f"clipstream: error: task 'task-00-household' already registered version {v1} ")

    plans = [prepare(registry, *args, **kwargs) for args, kwargs in [
        ((stream[0], "finetune", None, 2), {"retrain": True}),  # trains it again: a run of its own
        ((stream[0], "ewc", None, 2), {}),  # another method: another job
        ((stream[1], "finetune", None, 2), {}),
        ((stream[1], "finetune", None, 2), {"overrides": ["train.max_failures=5", "train.log_every=1"]}),  # the same
        ((stream[1], "finetune", None, 2), {"overrides": ["train.lr=0.01"]}),
        ((stream[1], "finetune", None, 1), {}),
    ]]
    for plan in plans:
        shutil.rmtree(plan.workdir)
    retrain, ewc, first, same, other_lr, one_worker = plans
    assert retrain.generation == 1 and first.generation == 0
    assert first.ray_name == same.ray_name == f"clipstream-00-task-01-furnishing-finetune-{first.run_key}"
    assert len({retrain.run_key, ewc.run_key, first.run_key, other_lr.run_key, one_worker.run_key}) == 5
    assert [v.version for v in registry.versions()] == [v1]

    # the MLflow run a job left RUNNING: refused while its driver lives (before Ray starts), marked KILLED once it died
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    left = registry.client.create_run(registry.experiment_id(), tags={
        **first.tags, "run_key": first.run_key, "driver": f"{socket.gethostname()}:{driver.pid}"}).info.run_id
    try:
        with pytest.raises(JobRunning, match=f"the same job is running now \\(MLflow run {left}, driver pid {driver.pid}\\)"):
            run_task(stream[1], "finetune", None, workers=2, settings=settings)
    finally:
        driver.kill()
        driver.wait()
    assert resume.end_interrupted_runs(registry, first.run_key, first.task.name) == [left]
    assert registry.client.get_run(left).info.status == "KILLED"
