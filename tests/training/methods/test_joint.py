"""Joint training from the stream's start (training/methods/joint.py, job.stream_start): each job of a joint stream
trains the union of the tasks so far from the weights the stream started from, not from its parent's. The job's
steps one at a time without Ray, as in test_lifecycle.py: the "trained" versions are other tiny models."""

import pytest
import torch

from clipstream import models
from clipstream.registry import Registry
from clipstream.training.data.task import Task
from clipstream.training.engine import METHOD_STATE_FILE
from clipstream.training.job import evaluate_version, prepare, register
from clipstream.training.methods.state import save_state
from clipstream.training.version0 import register_version0

ARCH = "clipstream-vit-tiny"


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch):
    """The jobs' scratch dirs (tempfile.mkdtemp) under this test's tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def weights(source) -> dict:
    return models.create(ARCH, str(source)).model.state_dict()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1), b[k].reshape(-1)) for k in a)


def train_fake(registry, settings, plan, seed: int) -> str:
    """What `fit` would leave (another model: "trained"), evaluated and registered as the plan's version."""
    with registry.run(plan.run_name, plan.tags) as run_id:
        torch.manual_seed(seed)
        trained = models.export(models.create(ARCH), plan.workdir / "checkpoint")
        save_state(plan.method.state_dict(), trained / METHOD_STATE_FILE)
        result = evaluate_version(registry, plan, trained, settings.home / "plots" / run_id, registry.log(run_id))
        return register(registry, plan, trained, result, run_id)


@pytest.mark.parametrize("start", ["version 0", "random init", "checkpoint"])
def test_a_joint_job_trains_the_union_from_the_streams_start_not_from_its_parent(settings, stream, tmp_path, start):
    registry = Registry(settings)
    torch.manual_seed(7)
    checkpoint = tmp_path / "start.pt"
    torch.save(models.create(ARCH).model.state_dict(), checkpoint)
    overrides = ["train.micro_batch=16", "train.seed=5"]
    root = None
    if start == "version 0":
        root = register_version0(f"{ARCH}:{checkpoint}", settings=settings).version
    elif start == "checkpoint":
        overrides.append(f"model.pretrained={checkpoint}")
    first = prepare(registry, stream[0], "joint", root, workers=2, overrides=overrides)
    if start == "version 0":  # the stream's start is then the first job's parent
        assert first.model_source == str(first.parent.folder) and first.started_from == f"version 0 (v{root})"
    else:
        assert first.model_source == (str(checkpoint) if start == "checkpoint" else None)
        assert first.started_from == (f"pretrained {ARCH}:{checkpoint}" if start == "checkpoint" else
                                      f"random init of {ARCH}, seed 5")
    v1 = train_fake(registry, settings, first, seed=11)

    plan = prepare(registry, stream[1], "joint", v1, workers=2, overrides=overrides)
    # still the next version of the stream, trained on the union of its tasks ...
    assert plan.tags["parent_version"] == v1 and plan.task_index == 1
    assert [t.name for t, _ in plan.sources] == [Task.load(stream[1]).name, Task.load(stream[0]).name]
    # ... from the weights the stream started from, not the parent's
    started = weights(plan.model_source)
    assert not same(started, weights(plan.parent.folder))
    if start == "random init":  # the first job's init made again: rank 0's, seeded with train.seed (+ rank 0)
        torch.manual_seed(5)
        assert same(started, models.create(ARCH).model.state_dict())
        assert plan.started_from == f"random init of {ARCH}, seed 5 (as v{v1})"
    else:
        assert same(started, weights(registry.resolve(root).folder if root else checkpoint))
        assert plan.started_from == (f"version 0 (v{root})" if root else f"pretrained {ARCH}:{checkpoint} (as v{v1})")
    # a finetune job from the same parent starts from the parent
    plan = prepare(registry, stream[1], "finetune", v1, workers=2, overrides=overrides)
    assert plan.model_source == str(plan.parent.folder) and plan.started_from == f"parent v{v1}"
