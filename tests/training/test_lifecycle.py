"""The job's steps one at a time, without Ray: `prepare` decides and checks everything before anything
runs; `evaluate_version` and `register` turn a trained export into the next version of the stream. (`fit`
runs Ray Train; the end-to-end tests in test_job.py cover it.) Here the "trained" export is a fresh model."""

import json

import mlflow
import pytest
import torch

from clipstream import models
from clipstream.registry import MANIFEST, Registry
from clipstream.training.data.task import DataError, Task
from clipstream.training.engine import METHOD_STATE_FILE
from clipstream.training.evaluate import ResultMatrix
from clipstream.training.job import evaluate_version, prepare, register
from clipstream.training.methods.state import save_state
from tests.conftest import register_version


def _trained(plan, seed: int):
    """What `fit` leaves: an open_clip export and the method state, in the job's workdir."""
    torch.manual_seed(seed)
    folder = plan.workdir / "checkpoint"
    models.export(models.create(plan.config["model"]["arch"]), folder)
    save_state(plan.method.state_dict(), folder / METHOD_STATE_FILE)
    return folder


def _step(registry, settings, task_dir, parent, seed):
    plan = prepare(registry, task_dir, "ewc", parent, workers=2, overrides=["train.micro_batch=16"])
    with registry.run(plan.run_name, plan.tags) as run_id:
        trained = _trained(plan, seed)
        result = evaluate_version(registry, plan, trained, settings.home / "plots" / run_id, registry.log(run_id))
        return plan, run_id, result, register(registry, plan, trained, result, run_id)


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch):
    """The jobs' scratch dirs (tempfile.mkdtemp) under this test's tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_prepare_then_evaluate_then_register_makes_a_stream_of_versions(settings, stream):
    registry = Registry(settings)
    plan1, run1, result1, v1 = _step(registry, settings, stream[0], None, seed=0)
    assert (plan1.task_index, plan1.run_name, plan1.model_source) == (0, "00-task-00-household-ewc", None)
    assert plan1.rows == len(Task.load(stream[0]).check("train").rows) and plan1.steps_per_epoch == plan1.rows // 2 // 16
    assert v1 == "1" and result1.known.tasks == ["task-00-household"] and result1.heatmap.is_file()

    plan2, run2, result2, v2 = _step(registry, settings, stream[1], v1, seed=1)
    assert plan2.parent.version == "1" and plan2.task_index == 1 and plan2.model_source == str(plan2.parent.folder)
    assert plan2.tags == {"task": "task-01-furnishing", "task_index": "1", "method": "ewc", "parent_version": "1",
                          "data_sha": plan2.current["data_sha"]}
    # the parent's matrix grew by one row: its first row is carried, the new row scores both tasks
    assert result2.known.tasks == ["task-00-household", "task-01-furnishing"]
    assert result2.known.values[0, 0] == pytest.approx(result1.known.values[0, 0])
    version = registry.resolve(v2)
    assert version.tags["parent_version"] == "1" and version.tags["lineage_tasks"] == "task-00-household,task-01-furnishing"
    assert version.aliases == ["candidate"] and [e["task"] for e in version.lineage] == version.tasks
    assert ResultMatrix.from_dict(version.manifest["matrix"]["known"]).values.tolist()[1] == \
        result2.known.values.tolist()[1]
    metrics = registry.run_metrics(run2)
    assert metrics["known/AA"] == pytest.approx(result2.known.average_accuracy())
    assert "sd/image_rotation_mean" in metrics and "sd/image_rotation_mean" not in registry.run_metrics(run1)
    assert {a.path for a in registry.client.list_artifacts(run2, "plots")} >= {
        "plots/01-task-01-furnishing-ewc-known.png", "plots/01-task-01-furnishing-ewc-spatial-disorder.png"}
    assert json.loads((version.folder / MANIFEST).read_text())["config"]["preset"] == "ewc"


def test_prepare_refuses_bad_input_before_a_run_or_ray_and_leaves_nothing(settings, stream, scratch):
    registry = Registry(settings)
    v1 = register_version(settings, seed=1, task_dirs=[stream[0]])
    with pytest.raises(ValueError, match=f"version {v1} has already been trained on task 'task-00-household'"):
        prepare(registry, stream[0], "finetune", v1, workers=2)
    with pytest.raises(DataError, match="cannot fill one step"):
        prepare(registry, stream[1], "finetune", v1, workers=2, overrides=["train.micro_batch=4096"])
    with pytest.raises(ValueError, match="workers must be >= 1"):
        prepare(registry, stream[1], "finetune", None, workers=0)
    with pytest.raises(ValueError, match="train.precision=fp16: DeepSpeed cannot train in it on CPU workers"):
        prepare(registry, stream[1], "finetune", v1, workers=2, overrides=["train.precision=fp16"], gpus_per_worker=0)
    assert not list(scratch.glob("clipstream-job-*"))  # a refused job leaves no scratch dir behind
    assert mlflow.active_run() is None and [v.version for v in registry.versions()] == [v1]
