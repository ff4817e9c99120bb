"""One task = one job: check the data, train on a Ray Train `TorchTrainer` of DeepSpeed workers,
evaluate on every task seen so far, and register the result as a new model version in MLflow."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import mlflow
import numpy as np
import ray
import ray.data
import torch
from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from clipstream.settings import Settings
from training import diagnostics, evaluate, methods, models
from training.data.reader import training_dataset
from training.data.task import DataError, Task
from training.engine import EXPORT_DIR, METHOD_STATE_FILE, train_loop
from training.registry import MANIFEST, Registry, Version


@dataclass
class TaskResult:
    version: str
    run_id: str
    task: str
    task_index: int
    known: evaluate.ResultMatrix
    unknown: evaluate.ResultMatrix
    heatmap: Path
    skipped: int
    seconds: float


def init_ray(settings: Settings, num_cpus: Optional[int] = None) -> None:
    if ray.is_initialized():
        return
    ray.data.DataContext.get_current().enable_progress_bars = False
    if settings.ray_address:
        ray.init(address=settings.ray_address, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus or os.cpu_count(), log_to_driver=True,
                 configure_logging=False)


def run_task(task_dir: str | Path, method: str = "finetune", parent: Optional[str] = None, workers: int = 2,
             overrides: Iterable[str] = (), settings: Optional[Settings] = None) -> TaskResult:
    """Train `method` on one task starting from `parent` (a registry reference; None = the preset's
    model), evaluate, and register the new version with alias `candidate`."""
    tic = time.perf_counter()
    settings = (settings or Settings()).ensure_dirs()
    config = methods.resolve(method, overrides)
    method_obj = methods.build(config)
    train_cfg = config["train"]
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    task = Task.load(task_dir)
    registry = Registry(settings)
    parent_v: Optional[Version] = registry.resolve(parent) if parent else None
    history = parent_v.lineage if parent_v else []
    if any(entry["task"] == task.name for entry in history):
        raise ValueError(f"version {parent_v.version} has already been trained on task {task.name!r}")
    current = {"task": task.name, "path": str(task.root), "data_sha": task.data_sha()}
    parent_state = parent_v.folder / METHOD_STATE_FILE if parent_v else None
    if parent_state:  # e.g. ER's buffer: the driver reads it to build the training data
        method_obj.load_state_dict(torch.load(parent_state, weights_only=False))
    workdir = tempfile.mkdtemp(prefix="clipstream-job-")  # data a method adds (ER's buffer as a task)

    sources, rows, skipped = [], 0, []
    for entry in [current, *method_obj.extra_tasks(current, history, workdir)]:
        source = _task_of(entry)
        check = source.check("train", train_cfg["on_bad_image"])
        sources.append((source, check.skipped_ids))
        rows += len(check.rows)
        skipped += check.skipped
    for line in skipped:
        print(f"[data] skipped {line}", flush=True)
    steps_per_epoch = rows // workers // train_cfg["micro_batch"]
    if steps_per_epoch < 1:
        raise DataError(f"task {task.name!r}: {rows} usable training rows cannot fill one step of "
                        f"{workers} workers x micro batch {train_cfg['micro_batch']}")

    model_source = str(parent_v.folder) if parent_v else config["model"]["pretrained"]
    bundle = models.create(config["model"]["arch"], model_source)
    tokenizer = f"local-dir:{parent_v.folder}" if parent_v else bundle.arch
    init_ray(settings)
    deterministic = train_cfg["deterministic"]
    dataset = training_dataset(sources, bundle.preprocess_train, tokenizer, seed=train_cfg["seed"] if deterministic else None)
    ingest = DataConfig.default_ingest_options()
    ingest.preserve_order = deterministic  # rows reach the workers in the same order on every run

    tags = {"task": task.name, "task_index": str(len(history)), "method": method_obj.name,
            "parent_version": parent_v.version if parent_v else "", "data_sha": current["data_sha"]}
    run_name = f"{len(history):02d}-{task.name}-{method_obj.name}"
    with registry.run(run_name, tags) as run_id:
        mlflow.log_params({**_flatten(config), "task": task.name, "parent": parent or "", "workers": workers,
                           "train_rows": rows})
        mlflow.log_dict(config, "config.json")
        mlflow.log_metric("data/skipped_rows", len(skipped))
        fail_once = os.environ.get("CLIPSTREAM_FAIL_ONCE")
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={**config, "model_source": model_source, "task_index": len(history),
                               "steps_per_epoch": steps_per_epoch, "fail_once": fail_once,
                               "threads_per_worker": max(1, int(ray.available_resources().get("CPU", 1)) // workers),
                               "parent_state": str(parent_state) if parent_state else None, "current": current,
                               "tracking": {"uri": settings.mlflow_tracking_uri, "run_id": run_id}},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=torch.cuda.is_available(),
                                         resources_per_worker=None if torch.cuda.is_available() else {"CPU": 0.5}),
            run_config=RunConfig(name=f"{settings.stream}-{run_id}", storage_path=str(settings.runs_dir),
                                 failure_config=FailureConfig(max_failures=train_cfg["max_failures"]),
                                 checkpoint_config=CheckpointConfig(num_to_keep=1)),
            datasets={"train": dataset}, dataset_config=DataConfig(execution_options=ingest),
        )
        try:
            result = trainer.fit()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        mlflow.log_metrics({f"train/{k}": v for k, v in result.metrics.items() if k in ("samples_per_s", "step_ms", "start_epoch", "step")})

        staging = Path(tempfile.mkdtemp(prefix="clipstream-version-")) / "checkpoint"  # the artifact's name
        with result.checkpoint.as_directory() as folder:
            shutil.copytree(Path(folder) / EXPORT_DIR, staging, dirs_exist_ok=True)
            shutil.copy(Path(folder) / METHOD_STATE_FILE, staging / METHOD_STATE_FILE)

        trained = models.load_exported(staging)
        seen = [*history, current]
        embedded = [evaluate.embed_task(trained, _task_of(e)) for e in seen]
        scores = evaluate.evaluate_seen(embedded)
        previous = parent_v.manifest.get("matrix", {}) if parent_v else {}
        known = evaluate.ResultMatrix.from_dict(previous["known"]) if previous else evaluate.ResultMatrix()
        unknown = evaluate.ResultMatrix.from_dict(previous["unknown"]) if previous else evaluate.ResultMatrix()
        known.add_row(task.name, {name: m["Rm"] for name, m in scores["known"].items()})
        unknown.add_row(task.name, {name: m["Rm"] for name, m in scores["unknown"].items()})

        for mode, per_task in scores.items():
            for name, metrics in per_task.items():
                mlflow.log_metrics({f"eval/{mode}/{name}/{k.replace('@', '')}": v for k, v in metrics.items()})
        for mode, matrix in (("known", known), ("unknown", unknown)):
            mlflow.log_metrics({f"{mode}/AA": matrix.average_accuracy(), f"{mode}/forgetting": matrix.mean_forgetting(),
                                f"{mode}/BWT": matrix.bwt()})
            mlflow.log_dict(matrix.to_dict(), f"matrix_{mode}.json")
        plots = settings.home / "plots" / run_id
        heatmap = known.heatmap(plots / f"{run_name}-known.png", title=f"R[i][j] (Rm, task-known) after {task.name}")
        unknown.heatmap(plots / f"{run_name}-unknown.png", title=f"R[i][j] (Rm, task-unknown) after {task.name}")
        if parent_v:  # Mod-X's spatial disorder: how the old tasks' test pairs moved from parent to this version
            before = [evaluate.embed_task(models.load_exported(parent_v.folder), _task_of(e)) for e in history]
            probe = [np.concatenate([getattr(e, m) for e in es]) for es in (before, embedded[:-1]) for m in ("img", "txt")]
            mlflow.log_metrics(diagnostics.spatial_disorder(*probe))  # old_img, old_txt, new_img, new_txt
            diagnostics.plot_spatial_disorder(*probe, plots / f"{run_name}-spatial-disorder.png",
                                              title=f"v{parent_v.version} -> {task.name}: old tasks' test pairs")
        mlflow.log_artifacts(str(plots), "plots")

        (staging / MANIFEST).write_text(json.dumps({
            "lineage": seen, "matrix": {"known": known.to_dict(), "unknown": unknown.to_dict()},
            "config": config, "parent_version": tags["parent_version"],
            "unchanged_towers": [t for t in ("image", "text") if parent_v and t not in method_obj.trains_towers]},
            indent=2))
        version = registry.register(staging, tags)
        mlflow.set_tag("model_version", version)
    return TaskResult(version, run_id, task.name, len(history), known, unknown, heatmap, len(skipped),
                      time.perf_counter() - tic)


def _task_of(entry: dict) -> Task:
    """A lineage entry's task, with an error naming the stream's entry when its data is gone."""
    try:
        task = Task.load(entry["path"])
    except DataError as exc:
        raise DataError(f"task {entry['task']!r} of this stream is no longer readable: {exc}") from exc
    return task


def _flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        out.update(_flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out
