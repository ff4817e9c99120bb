"""Version 0: an existing CLIP registered as a stream's start with no training (training/version0.py), then taken
as the parent of the stream's first trained version (its steps one at a time, without Ray, as in
test_lifecycle.py: the "trained" export is a fresh model)."""

import json

import numpy as np
import pytest
import torch

from clipstream import models
from clipstream.registry import CANDIDATE, MANIFEST, Registry
from clipstream.training import evaluate
from clipstream.training.data.synth import held_out_task
from clipstream.training.data.task import Task
from clipstream.training.engine import METHOD_STATE_FILE
from clipstream.training.job import evaluate_version, prepare, register
from clipstream.training.methods.state import save_state
from clipstream.training.version0 import METHOD, register_version0


@pytest.fixture(autouse=True)
def scratch(tmp_path, monkeypatch):
    """The jobs' scratch dirs (tempfile.mkdtemp) under this test's tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def checkpoint(tmp_path, seed: int = 0):
    """A tiny open_clip model and its checkpoint as open_clip's trainer writes it (DDP's `module.` prefixes)."""
    torch.manual_seed(seed)
    bundle = models.create("clipstream-vit-tiny")
    path = tmp_path / f"epoch_{seed}.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in bundle.model.state_dict().items()}}, path)
    return bundle, path


def test_version_0_registers_the_checkpoint_with_row_0_and_the_zero_shot_baseline(settings, stream, tmp_path):
    bundle, path = checkpoint(tmp_path)
    held_out = held_out_task(stream[0].parent)
    done = register_version0(f"clipstream-vit-tiny:{path}", stream, [held_out], ["start"], settings)
    registry = Registry(settings)
    version = registry.resolve("start")
    assert done.version == version.version == "1" and sorted(version.aliases) == [CANDIDATE, "start"]
    assert {k: version.tags[k] for k in ("task", "task_index", "method", "parent_version", "source", "lineage_tasks",
                                         "languages")} == {
        "task": "", "task_index": "0", "method": METHOD, "parent_version": "", "source": f"clipstream-vit-tiny:{path}",
        "lineage_tasks": "", "languages": "en"}
    # the registered weights are the checkpoint's
    for (name, a), (_, b) in zip(bundle.model.state_dict().items(), registry.load("start").model.state_dict().items()):
        assert torch.equal(a.reshape(-1), b.reshape(-1)), name

    manifest = version.manifest
    assert manifest["lineage"] == [] and manifest["parent_version"] == "" and manifest["unchanged_towers"] == []
    assert manifest["config"]["model"] == {"arch": "clipstream-vit-tiny", "pretrained": f"clipstream-vit-tiny:{path}"}
    assert manifest["tokenizer"] == {"sha": "clip-bpe", "vocab_size": 49408}
    assert [e["task"] for e in manifest["evaluated"]] == [Task.load(d).name for d in stream]
    # row 0 is the model's own retrieval on each task's test split, task-known and task-unknown
    scores = evaluate.evaluate_seen(evaluate.embed_tasks(bundle, [Task.load(d) for d in stream]))
    for mode in ("known", "unknown"):
        matrix = evaluate.ResultMatrix.from_dict(manifest["matrix"][mode])
        assert matrix.tasks == [] and matrix.baseline == pytest.approx({n: m["Rm"] for n, m in scores[mode].items()})
    zero_shot = evaluate.embed_task(bundle, Task.load(held_out))
    expected = evaluate.retrieval_metrics(zero_shot.img, zero_shot.txt, zero_shot.positive)["Rm"]
    assert manifest["zero_shot"]["Rm"] == pytest.approx([expected]) and done.zero_shot == manifest["zero_shot"]["Rm"]
    # and the accuracy of classifying its images among its class names, prompted: the baseline of the accuracy drop
    task = Task.load(held_out)
    labels = [task.classes.index(r["label"]) for r in task.check("test").rows]
    accuracy = evaluate.classification_accuracy(zero_shot.img, evaluate.class_vectors(bundle, task.classes), labels)
    assert manifest["zero_shot"]["accuracy"] == pytest.approx([accuracy["top1"]])

    run = registry.client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["model_version"] == "1"
    metrics = registry.run_metrics(version.run_id)
    assert metrics["known/pretrained_Rm"] == pytest.approx(np.mean(list(manifest["matrix"]["known"]["baseline"]["scores"].values())))
    assert "known/AA" not in metrics and metrics["zero_shot/drop"] == 0.0 == metrics["zero_shot/accuracy_drop"]
    assert {a.path for a in registry.client.list_artifacts(version.run_id, "plots")} >= {
        "plots/00-pretrained-known.png", "plots/00-pretrained-unknown.png"}


def test_the_first_trained_version_takes_version_0_as_parent_row_0_and_zero_shot_history(settings, stream, tmp_path):
    _, path = checkpoint(tmp_path)
    held_out = held_out_task(stream[0].parent)
    v0 = register_version0(f"clipstream-vit-tiny:{path}", stream, [held_out], settings=settings)
    registry = Registry(settings)
    plan = prepare(registry, stream[0], "lwf", v0.version, workers=2, overrides=["train.micro_batch=16"])
    # the first task of the stream: task index 0, trained from version 0's folder, its teacher the pretrained model
    assert plan.task_index == 0 and plan.history == [] and plan.run_name == "00-task-00-household-lwf"
    assert plan.model_source == plan.teacher_source == str(plan.parent.folder)
    assert plan.tags["parent_version"] == v0.version and plan.zero_shot == plan.parent.manifest["zero_shot"]["tasks"]
    with registry.run(plan.run_name, plan.tags) as run_id:
        torch.manual_seed(1)
        trained = plan.workdir / "checkpoint"
        models.export(models.load_exported(plan.parent.folder), trained)
        save_state(plan.method.state_dict(), trained / METHOD_STATE_FILE)
        with torch.no_grad():  # "training" moved the image tower a little
            state = json.loads((trained / models.CONFIG_FILE).read_text())
            bundle = models.load_exported(trained)
            for p in bundle.model.visual.parameters():
                p.add_(0.05 * torch.randn_like(p))
            models.export(bundle, trained)
            assert json.loads((trained / models.CONFIG_FILE).read_text()) == state
        result = evaluate_version(registry, plan, trained, settings.home / "plots" / run_id, registry.log(run_id))
        child = register(registry, plan, trained, result, run_id)

    version = registry.resolve(child)
    known = evaluate.ResultMatrix.from_dict(version.manifest["matrix"]["known"])
    # R keeps row 0 and adds the first task's row; AA/forgetting/BWT are those of the trained row alone
    assert known.baseline == pytest.approx(v0.known.baseline) and known.tasks == ["task-00-household"]
    for mode in ("known", "unknown"):  # row 0 and the first trained row: every gallery is its own version's
        assert version.manifest["matrix"][f"noreindex_{mode}"] == version.manifest["matrix"][mode]
    labels, shown = known.shown()
    assert labels == ["pretrained", "task-00-household"] and shown.shape == (2, 2)
    metrics = registry.run_metrics(version.run_id)
    assert metrics["known/AA"] == pytest.approx(known.values[0, 0]) and metrics["known/forgetting"] == 0.0
    # zero-shot retention is measured from the pretrained model: the history starts with version 0's Rm
    history = version.manifest["zero_shot"]["Rm"]
    assert history[0] == pytest.approx(v0.zero_shot[0]) and len(history) == 2
    assert metrics["zero_shot/drop"] == pytest.approx(history[0] - history[1])
    accuracies = version.manifest["zero_shot"]["accuracy"]
    assert accuracies[0] == pytest.approx(registry.resolve(v0.version).manifest["zero_shot"]["accuracy"][0])
    assert len(accuracies) == 2 and metrics["zero_shot/accuracy_drop"] == pytest.approx(accuracies[0] - accuracies[1])
    assert version.tags["task_index"] == "0" and version.manifest["image_tower"] is None
    assert json.loads((version.folder / MANIFEST).read_text())["lineage"][0]["task"] == "task-00-household"


def test_a_child_trains_and_records_its_parents_architecture_not_the_presets(settings, stream, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "small.pt"
    torch.save(models.create("clipstream-vit-small").model.state_dict(), path)
    v0 = register_version0(f"clipstream-vit-small:{path}", settings=settings)
    registry = Registry(settings)
    plan = prepare(registry, stream[0], "finetune", v0.version, workers=2)  # the preset names clipstream-vit-tiny
    assert plan.config["model"] == {**plan.config["model"], "arch": "clipstream-vit-small", "pretrained": None}
    with pytest.raises(ValueError, match="model.arch=clipstream-vit-tiny asked, but the parent is a clipstream-vit-small"):
        prepare(registry, stream[0], "finetune", v0.version, workers=2, overrides=["model.arch=clipstream-vit-tiny"])


def test_bad_input_registers_nothing_and_opens_no_run(settings, stream, tmp_path):
    _, path = checkpoint(tmp_path)
    registry = Registry(settings)
    source = f"clipstream-vit-tiny:{path}"
    held_out = held_out_task(stream[0].parent)
    refusals = [
        (dict(source="clipstream-vit-tiny:/no/such.pt"), ValueError, "neither a checkpoint file nor a pretrained tag"),
        (dict(source=source, evaluate_dirs=[stream[0], stream[0]]), ValueError, "names a task twice"),
        (dict(source=source, evaluate_dirs=[tmp_path / "nope"]), Exception, "task directory not found"),
        (dict(source=source, evaluate_dirs=[stream[0]], zero_shot=[stream[0]]), ValueError, "held-out task must not be"),
        (dict(source=source, zero_shot=[held_out], aliases=["production"]), ValueError, "alias 'production'"),
    ]
    for kwargs, error, message in refusals:
        with pytest.raises(error, match=message):
            register_version0(settings=settings, **kwargs)
    assert registry.versions() == []
    assert registry.client.get_experiment_by_name(registry.name) is None  # not even the experiment: no run


@pytest.mark.slow  # a 151M-parameter model: ~600 MB written, logged to MLflow and downloaded again
def test_a_real_vit_b_32_checkpoint_registers_as_version_0(settings, stream, tmp_path):
    torch.manual_seed(0)
    bundle = models.create("ViT-B-32")  # open_clip's own architecture, random weights
    path = tmp_path / "vit-b-32.pt"
    torch.save(bundle.model.state_dict(), path)
    done = register_version0(f"ViT-B-32:{path}", stream[:1], settings=settings)
    version = Registry(settings).resolve(done.version)
    assert version.tags["source"] == f"ViT-B-32:{path}" and version.manifest["config"]["model"]["arch"] == "ViT-B-32"
    loaded = models.load_exported(version.folder)
    assert loaded.embed_dim == 512 and loaded.image_size == 224
    for (name, a), (_, b) in zip(bundle.model.state_dict().items(), loaded.model.state_dict().items()):
        assert torch.equal(a.reshape(-1), b.reshape(-1)), name
    # row 0: the model's retrieval on the task's test split, its images resized to ViT-B-32's 224 pixels
    scores = evaluate.evaluate_seen(evaluate.embed_tasks(loaded, [Task.load(stream[0])]))
    assert done.known.baseline == pytest.approx({n: m["Rm"] for n, m in scores["known"].items()})
