"""End to end on the embedded stack: Ray Train + DeepSpeed on 2 workers, MLflow on SQLite."""

import json
import time

import numpy as np
import pytest
import torch
import yaml
from mlflow import MlflowClient

from clipstream import models
from clipstream.cli import main
from clipstream.registry import Registry, RegistryError
from clipstream.training import evaluate
from clipstream.training.data.synth import HELD_OUT_DIGITS, held_out_task, synthesize
from clipstream.training.data.task import DataError, Task
from clipstream.training.job import TrainingFailed, check_placement, run_task, zero_shot_classification
from tests.conftest import DETERMINISTIC, FAST
from tests.training.methods.test_streams import assert_both_policies


@pytest.mark.e2e
def test_two_tasks_on_a_version_0_register_versions_with_tags_parent_and_matrix(two_tasks, stream, monkeypatch,
                                                                                 capsys):
    """The quick tier's stream (tests/conftest.py two_tasks): version 0 from a checkpoint (`register --from`), then
    what its two jobs registered and logged on top of it."""
    settings, version0, first, second = two_tasks
    for name, value in settings.env().items():  # the CLI below reads the same settings
        monkeypatch.setenv(name, value)

    registry = Registry(settings)
    versions = registry.versions()
    assert [v.version for v in versions] == [version0.version, first.version, second.version] == ["1", "2", "3"]
    v0, v1, v2 = versions
    assert v0.tags["method"] == "pretrained" and v0.tags["parent_version"] == "" and v0.aliases == ["start"]
    assert v0.tags["source"].startswith("clipstream-vit-tiny:") and v0.tags["source"].endswith("epoch_32.pt")
    assert v1.tags["task"] == "task-00-household" and v1.tags["task_index"] == "0" and v1.tags["parent_version"] == "1"
    assert v2.tags["task"] == "task-01-furnishing" and v2.tags["task_index"] == "1" and v2.tags["parent_version"] == "2"
    assert v1.tags["method"] == "finetune" and v2.tags["method"] == "joint"
    assert len(v1.tags["data_sha"]) == 64 and v1.tags["data_sha"] != v2.tags["data_sha"]
    assert v2.aliases == ["candidate"] and v1.aliases == ["s1-1"]
    assert settings.mlflow_tracking_uri.startswith("sqlite:///") and (settings.home / "mlflow.db").is_file()
    # runs_dir is a file:// URI: the jobs' workers read their parents through it (shared storage, cleared when each
    # job ended), and nothing is left there nor made as a local `file:` folder once the versions are registered
    store = settings.home.parent / "store"
    assert settings.runs_dir == store.as_uri()
    assert [p.name for p in store.iterdir()] == ["inputs"] and not any((store / "inputs").iterdir())
    assert sorted(p.name for p in settings.home.parent.iterdir()) == ["epoch_32.pt", "home", "store"]

    # the run holds the loss curve, the evaluation, the matrix row and the heatmap
    client = MlflowClient(settings.mlflow_tracking_uri)
    run = client.get_run(v2.run_id)
    rows = [len(Task.load(p).check("train").rows) for p in stream]
    assert client.get_run(v1.run_id).data.params["train_rows"] == str(rows[0])
    assert run.data.params["train_rows"] == str(sum(rows))  # joint trains on every task so far
    assert len(client.get_metric_history(v2.run_id, "loss")) >= 2
    assert run.data.metrics["train/start_epoch"] == 0
    assert len(run.data.tags["ray.worker_nodes"].split(",")) == 2  # each rank's Ray node (one node here)
    # a step's own time fits within the epoch's time per step, which also waits on the input pipeline
    step_budget_ms = 1000 * 16 * 2 / run.data.metrics["train/samples_per_s"]  # FAST's micro batch x 2 workers
    assert 0 < run.data.metrics["train/step_ms"] <= step_budget_ms
    # (one epoch here: the mean includes its first step)
    assert 0 < run.data.metrics["train/first_step_ms"] <= run.data.metrics["train/step_ms"] * run.data.metrics["train/step"]
    assert {"known/AA", "known/forgetting", "known/BWT", "unknown/AA"} <= set(run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(v2.run_id)} | {a.path for a in client.list_artifacts(v2.run_id, "plots")}
    assert {"matrix_known.json", "config.json", "plots/01-task-01-furnishing-joint-known.png",
            "plots/01-task-01-furnishing-joint-known-recall.png", "plots/01-task-01-furnishing-joint-loss.png"} <= artifacts

    # the version carries the lineage and the matrix; row 2 is this version evaluated on both tasks, and version 0's
    # row 0 (its evaluation before any training) is kept beside the trained rows
    resolved = registry.resolve("3")
    assert [e["task"] for e in resolved.lineage] == ["task-00-household", "task-01-furnishing"]
    matrix = evaluate.ResultMatrix.from_dict(resolved.manifest["matrix"]["known"])
    assert_both_policies(resolved.manifest["matrix"])
    assert matrix.tasks == ["task-00-household", "task-01-furnishing"]
    assert matrix.values[0, 0] == pytest.approx(first.known.values[0, 0])
    labels, shown = matrix.shown()
    assert labels == [evaluate.BASELINE, "task-00-household", "task-01-furnishing"]
    assert np.allclose(shown[1:], matrix.values, equal_nan=True)
    assert matrix.baseline == evaluate.ResultMatrix.from_dict(version0.manifest["matrix"]["known"]).baseline
    assert set(matrix.baseline) == {"task-00-household", "task-01-furnishing"}  # `register --evaluate` both tasks
    bundle = models.load_exported(resolved.folder)
    again = evaluate.evaluate_seen([evaluate.embed_task(bundle, Task.load(p)) for p in stream])
    assert again["known"]["task-00-household"]["Rm"] == pytest.approx(matrix.values[1, 0], abs=1e-6)
    assert again["known"]["task-01-furnishing"]["Rm"] == pytest.approx(matrix.values[1, 1], abs=1e-6)
    assert run.data.metrics["known/AA"] == pytest.approx(matrix.average_accuracy())

    # zero-shot retention: the held-out task given to version 0 is evaluated with every version after it, measured
    # from version 0's score
    held_out = Task.load(held_out_task(stream[0].parent))
    zs0, zs1, zs2 = (registry.resolve(v).manifest["zero_shot"] for v in ("1", "2", "3"))
    assert zs0["tasks"] == zs1["tasks"] == zs2["tasks"] and [e["task"] for e in zs2["tasks"]] == [held_out.name]
    assert zs0["Rm"] == zs2["Rm"][:1] and zs1["Rm"] == first.zero_shot == zs2["Rm"][:2]
    assert second.zero_shot == zs2["Rm"] and len(zs2["Rm"]) == 3
    zero_shot = evaluate.evaluate_seen([evaluate.embed_task(bundle, held_out)])["known"][held_out.name]
    assert zs2["Rm"][2] == pytest.approx(zero_shot["Rm"], abs=1e-6)
    assert run.data.metrics["zero_shot/Rm"] == pytest.approx(zero_shot["Rm"])
    assert run.data.metrics["zero_shot/drop"] == pytest.approx(zs2["Rm"][0] - zs2["Rm"][2])
    assert run.data.metrics[f"eval/zero_shot/{held_out.name}/i2t_R1"] == pytest.approx(zero_shot["i2t_R@1"])
    # beside retrieval, classification of its images among its class names (8 classes: top-1 and top-5)
    labels = [held_out.classes.index(r["label"]) for r in held_out.check("test").rows]
    accuracy = evaluate.classification_accuracy(evaluate.embed_task(bundle, held_out).img,
                                                evaluate.class_vectors(bundle, held_out.classes), labels)
    assert zs1["accuracy"] == first.zero_shot_accuracy == zs2["accuracy"][:2] and zs0["accuracy"] == zs2["accuracy"][:1]
    assert second.zero_shot_accuracy == zs2["accuracy"] and zs2["accuracy"][2] == pytest.approx(accuracy["top1"])
    assert run.data.metrics["zero_shot/accuracy"] == pytest.approx(accuracy["top1"])
    assert run.data.metrics["zero_shot/accuracy_drop"] == pytest.approx(zs2["accuracy"][0] - zs2["accuracy"][2])
    assert run.data.metrics[f"eval/zero_shot/{held_out.name}/top5"] == pytest.approx(accuracy["top5"])

    # every test query's rank, per gallery mode and the held-out tasks (what a bootstrap resamples): R@K is the
    # share of ranks below K; the run keeps them as ranks.npz
    assert set(second.ranks) == {"known", "unknown", "noreindex_known", "noreindex_unknown", "zero_shot"}
    assert "ranks.npz" in artifacts
    for mode, name in (("known", "task-00-household"), ("unknown", "task-01-furnishing"), ("zero_shot", held_out.name)):
        i2t, t2i = second.ranks[mode][name]
        assert len(i2t) == len(t2i) == 24  # the session stream's test pairs per task
        key = f"eval/{mode}/{name}" if mode != "zero_shot" else f"eval/zero_shot/{name}"
        assert run.data.metrics[f"{key}/i2t_R1"] == pytest.approx(100 * (i2t < 1).mean())
        assert run.data.metrics[f"{key}/t2i_R10"] == pytest.approx(100 * (t2i < 10).mean())

    # the model learned something on its own task: far above chance (R@1 chance ~ 1/24)
    assert second.known.values[1, 1] > 25

    # the CLI shows the same: `eval` recomputes version 3's row, `runs` lists the three versions
    assert main(["eval", "--version", "3"]) == 0
    out = capsys.readouterr().out
    assert "version 3 (joint, after task task-01-furnishing)" in out
    assert f"{again['known']['task-00-household']['Rm']:.1f}" in out
    assert main(["runs"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[3].split()[:5] == ["2", "s1-1", "task-00-household", "finetune", "1"]
    assert listing[4].split()[:5] == ["3", "candidate", "task-01-furnishing", "joint", "2"]
    assert listing[0].split()[-2:] == ["ZS", "ZSdrop"]
    assert listing[4].split()[-2:] == [f"{zs2['Rm'][2]:.1f}", f"{zs2['Rm'][0] - zs2['Rm'][2]:.1f}"]

    # a task already in the lineage is refused; unknown references are clear errors
    with pytest.raises(ValueError, match="already been trained on task 'task-01-furnishing'"):
        run_task(stream[1], "finetune", "3", workers=2, overrides=FAST, settings=settings)
    with pytest.raises(RegistryError, match="no such model version"):
        registry.resolve("models:/clipstream@production")
    with pytest.raises(RegistryError, match="not 'other'"):
        registry.resolve("models:/other/1")


class _ByClassName:
    """A stand-in model whose text vector is the one-hot of the class name a prompt holds (classes given), so that a
    labelled image's right vector is known; records the prompts it was given."""

    def __init__(self, classes):
        self.classes, self.prompts = classes, []

    def embed_texts(self, texts, batch_size):
        self.prompts += list(texts)
        return np.eye(len(self.classes), dtype=np.float32)[[self._class(t) for t in texts]]

    def _class(self, text):
        return next(k for k, c in enumerate(self.classes) if f" {c}." in f" {text}" or f" {c} " in f" {text} ")


def test_zero_shot_classification_prompts_the_task_classes_and_leaves_out_what_has_no_label(tmp_path):
    out = tmp_path / "d"
    synthesize(out, tasks=1, train_pairs=40, test_per_task=12, image_size=16, digits=False, progress=False)
    task = Task.load(out / HELD_OUT_DIGITS)
    rows = task.check("test").rows
    bundle = _ByClassName(task.classes)
    right = np.eye(10, dtype=np.float32)[[task.classes.index(r["label"]) for r in rows]]
    assert zero_shot_classification(bundle, task, right, 64) == {"top1": 100.0, "top5": 100.0}
    assert bundle.prompts == [t.replace("{}", c) for c in task.classes for t in task.templates]  # its own templates
    wrong = 0.5 * right + np.roll(right, 1, axis=1)  # each image nearest the next class, its own second
    assert zero_shot_classification(bundle, task, wrong, 64) == {"top1": 0.0, "top5": 100.0}

    # rows without a label are left out; a task without classes, or without a labelled row, is not classified
    unlabelled = [{k: v for k, v in r.items() if k != "label" or i % 2} for i, r in enumerate(rows)]
    (out / HELD_OUT_DIGITS / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unlabelled))
    half = zero_shot_classification(bundle, Task.load(out / HELD_OUT_DIGITS), np.where(
        (np.arange(len(rows)) % 2)[:, None] == 1, right, wrong), 64)
    assert half == {"top1": 100.0, "top5": 100.0}
    (out / HELD_OUT_DIGITS / "test.jsonl").write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "label"}) + "\n" for r in rows))
    assert zero_shot_classification(bundle, Task.load(out / HELD_OUT_DIGITS), right, 64) is None
    meta = yaml.safe_load((out / "zero-shot-toys" / "task.yaml").read_text())
    (out / "zero-shot-toys" / "task.yaml").write_text(yaml.safe_dump({k: v for k, v in meta.items() if k != "classes"}))
    assert zero_shot_classification(bundle, Task.load(out / "zero-shot-toys"), right, 64) is None


def test_a_zero_shot_task_the_stream_trains_on_is_refused_before_training(settings, stream):
    with pytest.raises(ValueError, match="zero-shot task 'task-00-household' is trained on by this stream"):
        run_task(stream[0], "finetune", None, workers=2, overrides=FAST, settings=settings, zero_shot=[stream[0]])
    assert Registry(settings).versions() == []


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_last_epoch_checkpoint_with_the_same_weights(two_tasks, settings, stream,
                                                                                       tmp_path, monkeypatch):
    """The quick tier's first deterministic job again (from the same version 0), with rank 1 killed after training
    its last epoch and before that epoch's checkpoint: the job resumes from the epoch before and ends with that
    job's weights, bit for bit (so resuming is exact, and a rerun of a deterministic job gives the same weights)."""
    from clipstream.training.version0 import register_version0

    shared, version0, before, _ = two_tasks
    start = register_version0(version0.tags["source"], settings=settings).version  # the same checkpoint
    marker = tmp_path / "killed"
    monkeypatch.setenv("CLIPSTREAM_FAIL_ONCE", f"1:1:{marker}")
    again = run_task(stream[0], "finetune", start, workers=2, overrides=[*DETERMINISTIC, "train.max_failures=1"],
                     settings=settings)
    assert marker.read_text() == "failed once\n"
    metrics = MlflowClient(settings.mlflow_tracking_uri).get_run(again.run_id).data.metrics
    assert metrics["train/start_epoch"] == 1  # resumed after epoch 0, did not start over
    assert again.version == "2"
    first, second = (models.load_exported(Registry(s).resolve(r.version).folder).model.state_dict()
                     for s, r in ((shared, before), (settings, again)))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert before.known.values[0, 0] == again.known.values[0, 0]


def test_a_task_too_small_for_one_step_is_refused_before_training(settings, stream):
    with pytest.raises(DataError, match="cannot fill one step"):
        run_task(stream[0], "finetune", None, workers=2, overrides=["train.micro_batch=4096"], settings=settings)
    assert Registry(settings).versions() == []


@pytest.mark.parametrize("alias", ["production", "candidate", "v3", "latest", "a b", ""])
def test_an_alias_that_would_bypass_promotion_or_mlflow_refuses_is_refused_first(settings, stream, alias):
    with pytest.raises(ValueError, match="use letters, digits"):
        run_task(stream[0], "finetune", None, workers=2, overrides=FAST, settings=settings, aliases=[alias])
    assert Registry(settings).versions() == []


@pytest.mark.parametrize("workers, gpus, cluster", [(2, 1, {"CPU": 2}), (4, 1, {"GPU": 2}), (2, 0.5, {"GPU": 0.5})])
def test_a_job_asking_more_gpus_than_the_cluster_has_is_refused(workers, gpus, cluster):
    with pytest.raises(TrainingFailed, match=rf"^the cluster cannot place the job: {workers} workers × {gpus:g} GPUs, "
                                             rf"cluster has {cluster.get('GPU', 0):g};"):
        check_placement(workers, gpus, cluster)


@pytest.mark.parametrize("workers, gpus, cluster", [(2, 0, {"CPU": 2}), (4, 1, {"GPU": 4}), (2, 0.5, {"GPU": 1})])
def test_a_job_the_cluster_can_place_goes_on(workers, gpus, cluster):
    check_placement(workers, gpus, cluster)


@pytest.mark.component
def test_gpu_workers_on_a_cpu_cluster_fail_fast_in_one_line_and_register_nothing(ray_cluster, settings, stream):
    tic = time.monotonic()
    with pytest.raises(TrainingFailed, match="the cluster cannot place the job: 1 workers × 1 GPUs, cluster has 0"):
        run_task(stream[0], "finetune", None, workers=1, gpus_per_worker=1, overrides=FAST, settings=settings)
    assert time.monotonic() - tic < 60  # (Ray Train would wait for the GPU without end)
    assert Registry(settings).versions() == []
