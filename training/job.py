"""One task = one job, as four steps that read top to bottom:

    prepare  → the config, the method, the parent version and checked data; nothing runs yet
    fit      → a Ray Train `TorchTrainer` of DeepSpeed workers (`engine.train_loop`); the trained export
    evaluate → the new version on every task seen so far: one more row of R[i][j], plots, diagnostics; and on
               the stream's held-out zero-shot tasks, which no version trains on: retrieval, and prompted
               class-name classification where their rows carry labels (retention: the drop from the first
               version evaluated on them)
    register → the export + what the next task needs, as a new MLflow model version (alias `candidate`)

`run_task` runs them inside the task's MLflow run; each step can also be called (and tested) alone.

A task registers one version. The Ray Train run of a job is named after what it trains (the stream, the task's
data, the parent version, the method, the resolved config and the workers: `Plan.run_key`), so rerunning the
command of a job whose driver died resumes from its last epoch checkpoint, and the dead job's MLflow run is marked
KILLED; once the task has a version from the same parent, method and data, rerunning is refused
(`AlreadyRegistered`) unless the user asks to train it again (`retrain`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import ray
import ray.data
import torch
from ray.train import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from ray.train.torch import TorchTrainer

from clipstream import models
from clipstream.registry import CANDIDATE, MANIFEST, PRODUCTION, Registry, RunLog, Version
from clipstream.runtime import init_ray
from clipstream.settings import Settings
from clipstream.training import diagnostics, evaluate, launch, methods, resume, shared
from clipstream.training.data.reader import training_dataset
from clipstream.training.data.task import DataError, Task
from clipstream.training.engine import EXPORT_DIR, METHOD_STATE_FILE, check_precision
from clipstream.training.methods.config import flatten
from clipstream.training.methods.state import load_state, save_state
from clipstream.training.progress import Progress
from clipstream.training.resume import AlreadyRegistered, JobRunning  # noqa: F401 (raised by run_task and prepare)

logger = logging.getLogger(__name__)


class TrainingFailed(RuntimeError):
    """The job's workers failed more often than the preset allows (`train.max_failures`): a lost node, a
    crash. Not the user's input: the CLI says so in one line and exits 1."""


@dataclass
class Plan:
    """What `prepare` decided: everything the other steps need, checked before anything runs."""

    config: dict
    method: methods.Stack
    task: Task
    parent: Optional[Version]
    current: dict  # the lineage entry of this task
    sources: list[tuple[Task, set]]  # training data: (task, ids to skip), the current task's first
    rows: int
    skipped: list[str]
    workers: int
    workdir: Path  # scratch space of this job (a method's extra data, the staged version), removed at the end
    tags: dict = field(default_factory=dict)
    gpus_per_worker: Optional[float] = None  # None: one GPU per worker when the driver sees CUDA, else CPU only
    aliases: tuple[str, ...] = ()  # set on the new version besides `candidate` (a stream's jobs chain by them)
    zero_shot: list[dict] = field(default_factory=list)  # held-out tasks (lineage-style entries), never trained on
    grown: Optional[Path] = None  # the model folder the method made to train instead (CLL-CLIP: vocabulary grown)
    start_source: Optional[str] = None  # the stream's start model, for a method that trains from it (joint)
    started_from: str = ""  # the weights the job starts from, in words (recorded in the run: param `start_model`)
    teacher_source: Optional[str] = None  # the frozen teacher's folder or pretrained model; None: no teacher
    state_path: Optional[Path] = None  # the method state the workers start from, as the driver holds it
    generation: int = 0  # versions the task had from this parent, method and data when the job was asked (retrain)
    run_key: str = ""  # what this job trains, hashed: a rerun of the same job has the same (see `resume.run_key`)
    ray_name: str = ""  # the Ray Train run (its folder under runs_dir): the stream, run_name and run_key
    resume_after: Optional[int] = None  # the epoch of the checkpoint the Ray Train run resumes from (None: from the start)
    started_at: float = 0.0  # when the job was asked (time.time()): its time before the first step is measured from it

    @property
    def history(self) -> list[dict]:
        return self.parent.lineage if self.parent else []

    @property
    def task_index(self) -> int:
        return len(self.history)

    @property
    def run_name(self) -> str:
        return f"{self.task_index:02d}-{self.task.name}-{self.method.name}"

    @property
    def steps_per_epoch(self) -> int:
        full = self.rows // self.workers // self.config["train"]["micro_batch"]
        return min(full, self.config["train"]["max_steps"]) if self.config["train"]["max_steps"] else full

    @property
    def model_source(self) -> Optional[str]:
        """What the job trains: the method's grown folder, else the stream's start model where the method trains
        from it (`start_source`), else the parent's exported folder, else the preset's pretrained tag or checkpoint
        (None = random init)."""
        if self.grown:
            return str(self.grown)
        if self.start_source:
            return self.start_source
        return str(self.parent.folder) if self.parent else self.config["model"]["pretrained"]


class Matrices:
    """What holds a version's R matrices by name (`MATRICES`), with the reindex ones by their old names."""

    matrices: dict[str, evaluate.ResultMatrix]

    @property
    def known(self) -> evaluate.ResultMatrix:
        """The task-known matrix under the reindex policy (every gallery embedded by this version)."""
        return self.matrices["known"]

    @property
    def unknown(self) -> evaluate.ResultMatrix:
        """The task-unknown matrix under the reindex policy."""
        return self.matrices["unknown"]


@dataclass
class Evaluation(Matrices):
    matrices: dict[str, evaluate.ResultMatrix]  # by name (`MATRICES`): both gallery modes under both index policies
    heatmap: Path
    zero_shot: list[float] = field(default_factory=list)  # mean held-out Rm of each version since the set began
    ranks: dict = field(default_factory=dict)  # this version's per-query ranks: see TaskResult.ranks
    zero_shot_accuracy: list[float] = field(default_factory=list)  # mean held-out top-1 accuracy, as zero_shot


@dataclass
class TaskResult(Matrices):
    version: str
    run_id: str
    task: str
    task_index: int
    matrices: dict[str, evaluate.ResultMatrix]  # by name (`MATRICES`); the no-reindex ones may be absent (see there)
    heatmap: Path
    skipped: int
    seconds: float
    zero_shot: list[float] = field(default_factory=list)
    zero_shot_accuracy: list[float] = field(default_factory=list)  # [] when no held-out task has labels
    # this version's 0-based first-hit rank of every test query: {mode: {task: (image->text, text->image)}} for each
    # gallery mode of the evaluation and "zero_shot" (the held-out tasks), so that confidence intervals resample
    # queries without embedding again (also the run's artifact ranks.npz, `evaluate.flat_ranks`)
    ranks: dict = field(default_factory=dict)


def run_task(task_dir: str | Path, method: str = "finetune", parent: Optional[str] = None, workers: int = 2,
             overrides: Iterable[str] = (), settings: Optional[Settings] = None, *,
             gpus_per_worker: Optional[float] = None, aliases: Iterable[str] = (),
             wait_parent_s: float = 0.0, zero_shot: Iterable[str | Path] = (), retrain: bool = False) -> TaskResult:
    """Train `method` on one task starting from `parent` (a registry reference; None = the preset's
    model; waited for up to `wait_parent_s`), evaluate, and register the new version with alias
    `candidate` and `aliases`. `zero_shot`: held-out task directories evaluated with every version of the
    stream (none given: the parent's).

    The same job run again (its driver killed, its workers out of restarts) resumes the Ray Train run from its last
    epoch checkpoint and marks the MLflow run it left RUNNING as KILLED; a task that already registered a version
    from the same parent, method and data is refused (`AlreadyRegistered`) unless `retrain`."""
    tic, started_at = time.perf_counter(), time.time()
    check_aliases(aliases)
    methods.resolve(method, overrides)  # a bad preset or --set fails here, before anything is written
    settings = (settings or Settings()).ensure_dirs()
    models.placement(settings.embed_precision)  # the evaluation's, refused here if this process cannot run it
    registry = Registry(settings)
    plan = prepare(registry, task_dir, method, parent, workers, overrides, wait_parent_s, zero_shot, retrain,
                   gpus_per_worker=gpus_per_worker)
    plan.aliases, plan.started_at = tuple(aliases), started_at
    storage = settings.runs_path / plan.ray_name
    try:
        interrupted = resume.end_interrupted_runs(registry, plan.run_key, plan.task.name)
        plan.resume_after = resume.checkpointed_epoch(storage)
        if plan.resume_after is not None:
            print(f"[train] resuming Ray Train run {plan.ray_name} from its checkpoint after epoch {plan.resume_after}"
                  + (f" (MLflow run {', '.join(interrupted)} interrupted: marked KILLED)" if interrupted else ""),
                  flush=True)
        tags = {**plan.tags, "run_key": plan.run_key, "ray_run": plan.ray_name, "driver": resume.driver(),
                **({"resumes": ",".join(interrupted)} if interrupted else {})}
        with registry.run(plan.run_name, tags) as run_id:
            run = registry.log(run_id)
            trained = fit(plan, settings, run)
            result = evaluate_version(registry, plan, trained, settings.home / "plots" / run_id, run,
                                      settings.embed_precision)
            resume.refuse_registered(registry, plan.tags, plan.generation)  # (an identical job that finished meanwhile)
            version = register(registry, plan, trained, result, run_id)
        shared.remove(storage)  # its checkpoint is the version now: a retrain starts afresh
    finally:
        shutil.rmtree(plan.workdir, ignore_errors=True)
    return TaskResult(version, run_id, plan.task.name, plan.task_index, result.matrices, result.heatmap,
                      len(plan.skipped), time.perf_counter() - tic, result.zero_shot, result.zero_shot_accuracy,
                      result.ranks)


def check_aliases(aliases: Iterable[str]) -> None:
    """MLflow's alias rules, checked before anything runs; production moves only by promotion."""
    for alias in aliases:
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,255}", alias) or re.fullmatch(r"v\d+|latest", alias, re.I) \
                or alias in (PRODUCTION, CANDIDATE):
            raise ValueError(f"alias {alias!r}: use letters, digits, '_' and '-' (not 'v<number>', 'latest', "
                             f"{PRODUCTION!r} or {CANDIDATE!r})")


def prepare(registry: Registry, task_dir: str | Path, method: str, parent: Optional[str], workers: int,
            overrides: Iterable[str] = (), wait_parent_s: float = 0.0, zero_shot: Iterable[str | Path] = (),
            retrain: bool = False, *, gpus_per_worker: Optional[float] = None) -> Plan:
    """Resolve the preset and the parent, and check all training data and the precision on the workers' device
    (`gpus_per_worker`, None: one GPU each when the driver sees CUDA); a bad input fails here, before
    Ray starts or a run is opened. A task that already registered a version from the same parent with the same
    method on the same data is refused (`AlreadyRegistered`) unless `retrain`."""
    overrides = list(overrides)
    config = methods.resolve(method, overrides)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    gpus = gpus_per_worker if gpus_per_worker is not None else float(torch.cuda.is_available())
    check_precision(config["train"]["precision"], gpus)
    task = Task.load(task_dir)
    parent_v = registry.resolve(parent, wait_s=wait_parent_s) if parent else None
    if parent_v and task.name in [e["task"] for e in parent_v.lineage]:
        raise ValueError(f"version {parent_v.version} has already been trained on task {task.name!r}")
    if parent_v:  # a child trains its parent's weights: the run records the parent's architecture, not the preset's
        _inherit_arch(config, models.exported_arch(parent_v.folder), overrides)
    stack = methods.build(config)
    if parent_v:  # e.g. ER's buffer: the driver reads it to build the training data
        stack.load_state_dict(load_state(parent_v.folder))
    current = {"task": task.name, "path": str(task.root), "data_sha": task.data_sha(),
               **({"lang": str(task.meta["lang"])} if task.meta.get("lang") else {})}
    tags = {"task": task.name, "task_index": str(len(parent_v.lineage) if parent_v else 0), "method": stack.name,
            "parent_version": parent_v.version if parent_v else "", "data_sha": current["data_sha"]}
    generation = 0 if not retrain else len(resume.same_versions(registry, tags))
    resume.refuse_registered(registry, tags, generation)
    held_out = zero_shot_entries(zero_shot, parent_v, [*(parent_v.lineage if parent_v else []), current])
    plan = Plan(config, stack, task, parent_v, current, [], 0, [], workers,
                Path(tempfile.mkdtemp(prefix="clipstream-job-")), gpus_per_worker=gpus_per_worker, zero_shot=held_out)
    try:
        _check_data(plan)
        _prepare_model(registry, plan)
    except BaseException:
        shutil.rmtree(plan.workdir, ignore_errors=True)
        raise
    plan.tags = tags
    plan.generation = generation
    plan.run_key = resume.run_key(registry.name, config, tags, workers, generation)
    plan.ray_name = f"{registry.name}-{plan.run_name}-{plan.run_key}"
    return plan


def _inherit_arch(config: dict, arch: str, overrides: Iterable[str]) -> None:
    asked = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "model.arch"]
    if asked and asked[-1] != arch:
        raise ValueError(f"model.arch={asked[-1]} asked, but the parent is a {arch}: a child trains its parent's "
                         "architecture (drop --set model.arch, or start a new stream with `clipstream register --from`)")
    config["model"].update(arch=arch, pretrained=None)


def zero_shot_entries(dirs: Iterable[str | Path], parent: Optional[Version], trained: list[dict]) -> list[dict]:
    """The held-out tasks of this version: the given directories (test split checked now), else the parent's.
    A task the stream trains on is not zero-shot, and is refused."""
    dirs = list(dirs)
    if not dirs:
        return (parent.manifest.get("zero_shot") or {}).get("tasks", []) if parent else []
    entries = []
    for folder in dirs:
        task = Task.load(folder)
        task.check("test")
        if task.name in [e["task"] for e in trained]:
            raise ValueError(f"zero-shot task {task.name!r} is trained on by this stream: a held-out task must not be")
        entries.append({"task": task.name, "path": str(task.root), "data_sha": task.data_sha()})
    return entries


def _prepare_model(registry: Registry, plan: Plan) -> None:
    """The starting weights (the parent's, or the stream's start model for a method that trains from it: joint),
    what the method makes of them (CLL-CLIP grows them; its state then goes to the workers from the workdir) and
    the teacher: the one the method pins for its stream, else the parent."""
    if plan.parent and plan.method.starts_from_stream_start:
        plan.start_source, plan.started_from = stream_start(registry, plan.parent, plan.workdir)
    elif plan.parent:
        plan.started_from = f"parent v{plan.parent.version}"
    else:
        plan.started_from = _initial_weights(plan.config)
    source = plan.model_source
    plan.grown = plan.method.prepare_version(source, plan.parent.version if plan.parent else None, plan.config,
                                             plan.current, plan.history, plan.workdir)
    plan.state_path = save_state(plan.method.state_dict(), plan.workdir / METHOD_STATE_FILE)
    pinned = plan.method.teacher()
    if pinned and pinned.get("version"):
        plan.teacher_source = str(registry.resolve(pinned["version"]).folder)
    else:
        plan.teacher_source = pinned["source"] if pinned else (str(plan.parent.folder) if plan.parent else None)


def stream_start(registry: Registry, version: Version, workdir: Path) -> tuple[str, str]:
    """The model the stream of `version` started from, as `models.create` loads it, and in words: its version 0
    (`clipstream register --from`: the root of the parent chain, with an empty lineage), else the weights its first
    trained version started from: that job's pretrained tag or checkpoint, or its seeded random init made again
    into `workdir` (rank 0's, which DeepSpeed broadcasts to the other workers: `engine.train_loop` seeds with
    train.seed + rank before it creates the model)."""
    root = version
    while root.tags.get("parent_version"):  # (tags only: the versions in between are not downloaded)
        root = registry.resolve(root.tags["parent_version"], download=False)
    root = registry.resolve(root.version)
    if not root.lineage:
        return str(root.folder), f"version 0 (v{root.version})"
    config = root.manifest["config"]
    model, seed = config["model"], config["train"]["seed"]
    if model["pretrained"]:
        return model["pretrained"], f"{_initial_weights(config)} (as v{root.version})"
    with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
        torch.manual_seed(seed)
        bundle = models.create(model["arch"])
    return str(models.export(bundle, workdir / "start")), f"{_initial_weights(config)} (as v{root.version})"


def _initial_weights(config: dict) -> str:
    """The weights a stream's first job starts from, in words."""
    model = config["model"]
    if model["pretrained"]:
        return f"pretrained {model['arch']}:{model['pretrained']}"
    return f"random init of {model['arch']}, seed {config['train']['seed']}"


def _check_data(plan: Plan) -> None:
    """The task's rows plus what the method adds (joint: the earlier tasks; ER: its buffer, written as a
    task into the workdir), each checked; the plan must fill at least one step on every worker."""
    train = plan.config["train"]
    # the evaluation after training ranks the task's test pairs: a task without them is refused now, not after the job
    _task_of(plan.current).split("test")
    for entry in [plan.current, *plan.method.extra_tasks(plan.current, plan.history, str(plan.workdir))]:
        source = _task_of(entry)
        check = source.check("train", train["on_bad_image"])
        plan.sources.append((source, check.skipped_ids))
        plan.rows += len(check.rows)
        plan.skipped += check.skipped
    if plan.steps_per_epoch < 1:
        raise DataError(f"task {plan.task.name!r}: {plan.rows} usable training rows cannot fill one step of "
                        f"{plan.workers} workers x micro batch {train['micro_batch']}")
    for line in plan.skipped:
        print(f"[data] skipped {line}", flush=True)


def fit(plan: Plan, settings: Settings, run: RunLog) -> Path:
    """Train on the plan's data with `workers` Ray Train workers, logging into `run` (rank 0 streams its step
    metrics there); returns the trained open_clip export (with the method state) staged in the job's workdir."""
    config, train = plan.config, plan.config["train"]
    run.log_params({**flatten(config), "task": plan.task.name, "parent": plan.tags["parent_version"],
                    "workers": plan.workers, "train_rows": plan.rows, "start_model": plan.started_from})
    run.log_dict(config, "config.json")
    run.log_metrics({"data/skipped_rows": len(plan.skipped)})
    bundle = models.create(config["model"]["arch"], plan.model_source)
    # what the workers and Ray Data's tasks read goes where Ray Train's checkpoints go: storage every node shares
    # (on Kubernetes the runs volume; HOME, where versions are downloaded, is each pod's own)
    inputs = settings.runs_path / "inputs" / plan.ray_name
    model_source = shared.share(plan.model_source, inputs / "model")
    state_path = shared.share(plan.state_path, inputs / METHOD_STATE_FILE)
    # (the teacher is most often the parent, which is the model: copied once)
    teacher_source = (model_source if plan.teacher_source == plan.model_source
                      else shared.share(plan.teacher_source, inputs / "teacher"))
    init_ray(settings)
    gpus = plan.gpus_per_worker if plan.gpus_per_worker is not None else float(torch.cuda.is_available())
    check_placement(plan.workers, gpus, ray.cluster_resources())
    deterministic = train["deterministic"]
    teacher_tokens = (_tokenizer_spec(plan.teacher_source, teacher_source, bundle.arch) if plan.method.teacher_text
                      else None)
    dataset = training_dataset(plan.sources, bundle.model.visual.preprocess_cfg,
                               _tokenizer_spec(plan.model_source, model_source, bundle.arch),
                               seed=train["seed"] if deterministic else None, cpus=train["data_cpus"],
                               teacher_tokenizer=teacher_tokens)
    ingest = DataConfig.default_ingest_options()
    ingest.preserve_order = deterministic  # rows reach the workers in the same order on every run
    trainer = TorchTrainer(
        launch.train_loop,
        train_loop_config={**config, "model_source": model_source, "task_index": plan.task_index,
                           "steps_per_epoch": plan.steps_per_epoch, "fail_once": os.environ.get("CLIPSTREAM_FAIL_ONCE"),
                           # the cluster's cores, not those free at this moment, which depend on what else holds
                           # CPUs then (`clipstream bench train-throughput` found a lone worker at single-thread speed)
                           "threads_per_worker": max(1, int(ray.cluster_resources().get("CPU", 1)) // plan.workers),
                           "method_state": state_path, "teacher_source": teacher_source,
                           "current": plan.current, "tracking": {"uri": settings.mlflow_tracking_uri, "run_id": run.run_id}},
        # SPREAD: one worker per node where there are several (a RayJob has one worker pod per worker), where
        # PACK would put two CPU workers on one pod's cores and leave the other pod idle
        scaling_config=ScalingConfig(num_workers=plan.workers, use_gpu=gpus > 0, placement_strategy="SPREAD",
                                     resources_per_worker={"CPU": 1, "GPU": gpus} if gpus else {"CPU": 0.5}),
        run_config=run_config(plan.ray_name, settings, train["max_failures"]),
        datasets={"train": dataset}, dataset_config=DataConfig(execution_options=ingest),
    )
    try:
        with Progress(settings.mlflow_tracking_uri, run.run_id, plan.task.name, plan.steps_per_epoch,
                      train["epochs"]):
            result = trainer.fit()
    except TrainingFailedError as exc:  # the run is then closed as FAILED, and nothing is registered
        cause = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise TrainingFailed(f"task {plan.task.name!r}: training failed after train.max_failures="
                             f"{train['max_failures']} restarts ({cause}); no version was registered (rerunning the "
                             "same command resumes from its last epoch checkpoint, if any)") from exc
    finally:
        shared.remove(inputs)
    kept = ("samples_per_s", "step_ms", "first_step_ms", "start_epoch", "step")  # logged as train/<name>
    metrics = {k: v for k, v in result.metrics.items() if k in kept}
    if result.metrics.get("first_step_at") and plan.started_at:  # (wall clocks: the driver's and rank 0's)
        # what a user waits before the model learns: the data check and hash, Ray, the workers, the first batch
        metrics["seconds_to_first_step"] = result.metrics["first_step_at"] - plan.started_at
    if plan.resume_after is not None:  # (the result's metrics are the snapshot's when no epoch was left to train)
        metrics["start_epoch"] = max(metrics.get("start_epoch", 0), plan.resume_after + 1)
    run.log_metrics({f"train/{k}": v for k, v in metrics.items()})
    staged = plan.workdir / "checkpoint"  # the registered artifact's folder
    with result.checkpoint.as_directory() as folder:
        shutil.copytree(Path(folder) / EXPORT_DIR, staged, dirs_exist_ok=True)
        shutil.copy(Path(folder) / METHOD_STATE_FILE, staged / METHOD_STATE_FILE)
    return staged


def check_placement(workers: int, gpus_per_worker: float, cluster: dict) -> None:
    """Refuse (TrainingFailed) a job whose workers' GPUs the cluster (`ray.cluster_resources()`) does not have
    in all: Ray Train would wait for them without end. (An autoscaling cluster reports only the GPUs it has now.)"""
    have = cluster.get("GPU", 0)
    if gpus_per_worker and workers * gpus_per_worker > have:
        raise TrainingFailed(f"the cluster cannot place the job: {workers} workers × {gpus_per_worker:g} GPUs, cluster "
                             f"has {have:g}; lower --workers or --gpus-per-worker (0: CPU workers)")


def evaluate_version(registry: Registry, plan: Plan, trained: Path, plots: Path, run: RunLog,
                     precision: str = "auto") -> Evaluation:
    """The trained model on the test split of every task seen so far: the parent's R matrices grow by
    one row, logged with AA / forgetting / BWT and heatmaps; from task 2 on, Mod-X's spatial disorder
    of the old tasks' test pairs between the parent and this version.

    Two index policies, two pairs of matrices (Wang et al., arXiv:2104.06806): reindex (`known`, `unknown`: every
    gallery embedded by this version) and no-reindex (`noreindex_known`, `noreindex_unknown`: each task's gallery as
    the version trained on it embedded it, queried by this version). This version's own task's test vectors are
    logged with its run (`GALLERY_VECTORS`), so that its children's no-reindex rows read them (`noreindex_galleries`).

    Each version embeds each task's test split once, the seen tasks' rows together in batches of `eval.batch_size`;
    the parent's vectors of the old tasks are the ones its own evaluation made when that ran in this process
    (`evaluate.GALLERIES`), else embedded again. Logged: eval/seconds and eval/cpu_seconds (this step's wall time, and the
    CPU time of this process meanwhile), eval/gallery_pairs (the union gallery of the seen tasks) and
    eval/embedded_pairs (the test pairs this step embedded, with every model). The models embed on this process's GPU
    if it has one (`models.placement` with `precision`), else on its CPU."""
    tic, cpu = time.perf_counter(), time.process_time()
    batch = int(plan.config.get("eval", {}).get("batch_size", 256))
    placed = models.placement(precision)
    bundle = models.load_exported(trained).to(*placed)
    seen = [*plan.history, plan.current]
    embedded = evaluate.embed_tasks(bundle, [_task_of(e) for e in seen], batch_size=batch)
    gallery = sum(len(e.txt) for e in embedded)
    scores = evaluate.evaluate_seen(embedded)
    save_gallery(run, embedded[-1], plan.workdir / "gallery")
    previous = plan.parent.manifest.get("matrix", {}) if plan.parent else {}
    galleries, reembedded = noreindex_galleries(registry, plan, embedded, batch, placed)
    if galleries is not None:
        noreindex = evaluate.evaluate_seen(embedded, galleries)
        scores.update({NOREINDEX + mode: noreindex[mode] for mode in MODES})
    # the parent's matrices (with their row 0, if the stream started from a version 0) grow a row
    matrices = {name: _previous_matrix(previous, name) for name in scores}
    lost = [name for name, matrix in matrices.items() if matrix is None]
    if lost:
        print(f"[eval] version {plan.parent.version} has no {' or '.join(lost)} matrix (registered before they were "
              "kept): this stream's versions go on without them", flush=True)
    matrices = {name: matrix for name, matrix in matrices.items() if matrix is not None}
    scores = {name: scores[name] for name in matrices}
    for name, matrix in matrices.items():
        matrix.add_row(plan.task.name, {task: m["Rm"] for task, m in scores[name].items()})
    log_evaluation(run, scores, matrices, plots, plan.run_name, f"after {plan.task.name}")
    before = (plan.parent.manifest.get("zero_shot") or {}) if plan.parent else {}
    ranks = {mode: {name: m.ranks for name, m in per_task.items()} for mode, per_task in scores.items()}
    ranks[evaluate.ZERO_SHOT] = {}
    zero_shot, zero_shot_pairs, zero_shot_accuracy = evaluate_zero_shot(plan.zero_shot, before, bundle, batch, run,
                                                                        ranks[evaluate.ZERO_SHOT])
    with tempfile.TemporaryDirectory() as folder:
        np.savez_compressed(Path(folder) / "ranks.npz", **evaluate.flat_ranks(ranks))
        run.log_artifacts(folder)
    embedded_pairs = gallery + zero_shot_pairs + reembedded
    if plan.history:  # how the old tasks' test pairs moved from the parent to this version (a version 0 has none)
        before = evaluate.GALLERIES.get(plan.parent.run_id, plan.history, batch)
        if before is None:  # (the parent was evaluated in another process)
            parent = models.load_exported(plan.parent.folder).to(*placed)
            before = [(e.img, e.txt) for e in evaluate.embed_tasks(parent, [_task_of(e) for e in plan.history],
                                                                     batch_size=batch)]
            embedded_pairs += sum(len(txt) for _, txt in before)
        old_img, old_txt = (np.concatenate(vectors) for vectors in zip(*before))
        new_img, new_txt = (np.concatenate([getattr(e, m) for e in embedded[:-1]]) for m in ("img", "txt"))
        probe = (old_img, old_txt, new_img, new_txt)
        run.log_metrics(diagnostics.spatial_disorder(*probe))
        diagnostics.plot_spatial_disorder(*probe, plots / f"{plan.run_name}-spatial-disorder.png",
                                          title=f"v{plan.parent.version} -> {plan.task.name}: old tasks' test pairs")
    # the curves rank 0 logged while it trained
    histories = {key: [(m.step, m.value) for m in run.metric_history(key)]
                 for key in run.metrics() if key == "loss" or key.startswith("loss/")}
    diagnostics.plot_losses(histories, plots / f"{plan.run_name}-loss.png", title=f"training loss, {plan.task.name}")
    run.log_artifacts(plots, "plots")
    evaluate.GALLERIES.put(run.run_id, seen, embedded, batch)  # for the next task's job, whose parent this version will be
    run.log_metrics({"eval/seconds": time.perf_counter() - tic, "eval/cpu_seconds": time.process_time() - cpu,
                        "eval/gallery_pairs": gallery, "eval/embedded_pairs": embedded_pairs})
    return Evaluation(matrices, plots / f"{plan.run_name}-known.png", zero_shot, ranks, zero_shot_accuracy)


MODES = ("known", "unknown")  # task-known and task-unknown galleries
NOREINDEX = "noreindex_"  # the no-reindex policy's matrices: MODES with this prefix (the bare names are reindex's)
MATRICES = (*MODES, *(NOREINDEX + mode for mode in MODES))
GALLERY_VECTORS = "gallery_vectors.npz"  # a version's own task's test-split vectors, an artifact of its run


def _previous_matrix(previous: dict, name: str) -> Optional[evaluate.ResultMatrix]:
    """The parent's matrix `name` to grow (an empty one for a stream's first version). A parent registered before
    the no-reindex matrices were kept has none: its reindex matrix stands in while it holds at most one trained
    row (row 0 and the first trained row rank every gallery as its own version made it: both policies agree);
    after that the rows it lacks cannot be rebuilt here (None)."""
    if not previous:
        return evaluate.ResultMatrix()
    if name in previous:
        return evaluate.ResultMatrix.from_dict(previous[name])
    base = name.removeprefix(NOREINDEX)
    if base != name and base in previous and len(previous[base]["tasks"]) <= 1:
        return evaluate.ResultMatrix.from_dict(previous[base])
    return None


def save_gallery(run: RunLog, own: evaluate.Embedded, folder: Path) -> None:
    """This version's vectors of its own task's test split (with the rows' content keys and captions, which tell
    a reader whether the split still has the same rows) as the run's artifact `GALLERY_VECTORS`."""
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / GALLERY_VECTORS, img=own.img.astype(np.float32), txt=own.txt.astype(np.float32),
             keys=np.asarray(own.keys, dtype=str), captions=np.asarray(own.captions, dtype=str))
    run.log_artifacts(folder)


def load_gallery(registry: Registry, run_id: str, like: evaluate.Embedded) -> Optional[evaluate.Embedded]:
    """The vectors run `run_id` logged (`save_gallery`) as an Embedded of `like`'s rows; None when the run has
    none (a version registered before they were kept) or they are of other rows (the split changed since)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=GALLERY_VECTORS, dst_path=tmp,
                                                       tracking_uri=registry.tracking_uri)
        except (MlflowException, OSError):
            return None
        with np.load(path, allow_pickle=False) as stored:
            if stored["keys"].tolist() != list(like.keys) or stored["captions"].tolist() != list(like.captions):
                return None
            return replace(like, img=stored["img"], txt=stored["txt"])


def _versions_by_task(registry: Registry, version: Optional[Version]) -> dict[str, Version]:
    """task -> the version trained on it, from `version` back through its parents (their tags: nothing is
    downloaded); a version 0 (no task) ends the walk."""
    found = {}
    while version is not None and version.tags.get("task"):
        found.setdefault(version.tags["task"], version)
        parent = version.tags.get("parent_version")
        version = registry.resolve(parent, download=False) if parent else None
    return found


def noreindex_galleries(registry: Registry, plan: Plan, embedded: list[evaluate.Embedded], batch: int,
                        placed: tuple) -> tuple[Optional[list[evaluate.Embedded]], int]:
    """The galleries of the no-reindex policy for the seen tasks (`embedded`, this version's, the current task
    last): each old task's test split as the version trained on it embedded it, and the current task's as this
    version does. An old version's vectors come from this process's cache (`evaluate.GALLERIES`), else its run's
    artifact, else (a version registered before they were kept) its model embeds them again. Returns them and the
    pairs embedded again; (None, 0) when the lineage has a task no ancestor version was trained on."""
    owners = _versions_by_task(registry, plan.parent)
    galleries, reembedded = [], 0
    for entry, own in zip(plan.history, embedded):
        owner = owners.get(entry["task"])
        if owner is None:
            print(f"[eval] no version of this stream's lineage was trained on {entry['task']!r}: no no-reindex row",
                  flush=True)
            return None, 0
        cached = evaluate.GALLERIES.get(owner.run_id, [entry], batch)
        gallery = (replace(own, img=cached[0][0], txt=cached[0][1]) if cached is not None
                   else load_gallery(registry, owner.run_id, own))
        if gallery is None:
            bundle = models.load_exported(registry.resolve(owner.version).folder).to(*placed)
            fresh = evaluate.embed_tasks(bundle, [_task_of(entry)], batch_size=batch)[0]
            gallery, reembedded = replace(own, img=fresh.img, txt=fresh.txt), reembedded + len(fresh.txt)
        galleries.append(gallery)
    return [*galleries, embedded[-1]], reembedded


def log_evaluation(run: RunLog, scores: dict, matrices: dict[str, evaluate.ResultMatrix], plots: Path, run_name: str,
                   when: str) -> None:
    """A version's evaluation into its run: every task's metrics (`evaluate.evaluate_seen`), the summary of each
    matrix (AA, forgetting, BWT over its trained rows; a matrix of row 0 alone, its mean as `NAME/pretrained_Rm`),
    the matrices as JSON and their heatmaps and curves under `plots` (titled with `when` it was evaluated).
    `matrices` and `scores` are keyed alike, by matrix name (`MATRICES`)."""
    logged = {}  # (the metrics of every task go to MLflow in one call)
    for mode, matrix in matrices.items():
        for name, metrics in scores[mode].items():
            logged.update({f"eval/{mode}/{name}/{k.replace('@', '')}": v for k, v in metrics.items()})
        if matrix.tasks:
            logged.update({f"{mode}/AA": matrix.average_accuracy(), f"{mode}/forgetting": matrix.mean_forgetting(),
                           f"{mode}/BWT": matrix.bwt()})
        elif matrix.baseline:
            logged[f"{mode}/{evaluate.BASELINE}_Rm"] = float(np.mean(list(matrix.baseline.values())))
        run.log_dict(matrix.to_dict(), f"matrix_{mode}.json")
        what = f"task-{mode.removeprefix(NOREINDEX)}" + (", no-reindex" if mode.startswith(NOREINDEX) else "")
        matrix.heatmap(plots / f"{run_name}-{mode}.png", title=f"R[i][j] (Rm, {what}) {when}")
        matrix.curves(plots / f"{run_name}-{mode}-recall.png", title=f"{what} Rm over the stream")
    run.log_metrics(logged)


def evaluate_zero_shot(entries: list[dict], before: dict, bundle: models.ClipBundle, batch_size: int,
                       run: RunLog, ranks: Optional[dict] = None) -> tuple[list[float], int, list[float]]:
    """Retrieval on the held-out tasks `entries` (each in its own gallery), and zero-shot classification on those
    whose test rows carry a `label` of the task's `classes` (`zero_shot_classification`), logged per task and as the
    means (Rm, top-1 accuracy) with their drop from the first version evaluated on the same set (`before`: the
    parent's manifest entry; a stream that starts from a version 0 measures from the pretrained model, as the papers
    do). Returns the mean Rm of every such version so far, the test pairs embedded, and the mean accuracy of every
    such version so far ([] when no held-out task is labelled). `ranks`, if given, receives each task's (i2t, t2i)
    query ranks."""
    if not entries:
        return [], 0, []
    tasks = [_task_of(e) for e in entries]
    embedded = evaluate.embed_tasks(bundle, tasks, batch_size=batch_size)
    scores = {e.task: evaluate.retrieval_metrics(e.img, e.txt, e.positive) for e in embedded}
    if ranks is not None:
        ranks.update({name: m.ranks for name, m in scores.items()})
    for name, metrics in scores.items():
        run.log_metrics({f"eval/zero_shot/{name}/{k.replace('@', '')}": v for k, v in metrics.items()})
    accuracy = {task.name: acc for task, e in zip(tasks, embedded)
                if (acc := zero_shot_classification(bundle, task, e.img, batch_size))}
    for name, metrics in accuracy.items():
        run.log_metrics({f"eval/zero_shot/{name}/{k}": v for k, v in metrics.items()})
    same_set = before.get("tasks") == entries  # (same names, paths and data) else the history restarts
    history = [*(before.get("Rm", []) if same_set else []), float(np.mean([m["Rm"] for m in scores.values()]))]
    run.log_metrics({"zero_shot/Rm": history[-1], "zero_shot/drop": history[0] - history[-1]})
    accuracies = []
    if accuracy:
        accuracies = [*(before.get("accuracy", []) if same_set else []),
                      float(np.mean([m["top1"] for m in accuracy.values()]))]
        run.log_metrics({"zero_shot/accuracy": accuracies[-1], "zero_shot/accuracy_drop": accuracies[0] - accuracies[-1]})
    return history, sum(len(e.txt) for e in embedded), accuracies


def zero_shot_classification(bundle: models.ClipBundle, task: Task, img: np.ndarray,
                             batch_size: int) -> Optional[dict[str, float]]:
    """Top-1 (top-5) accuracy of the task's test images `img` (embedded in the order of its checked rows), each
    classified among the task's `classes` by their prompts (its `templates`, else `evaluate.TEMPLATES`); the rows
    without a `label` are left out. None when the task names no classes or no row has a label."""
    if not task.classes:
        return None
    rows = task.check("test").rows
    labelled = [i for i, r in enumerate(rows) if r.get("label") is not None]
    if not labelled:
        return None
    index = {c: k for k, c in enumerate(task.classes)}
    vectors = evaluate.class_vectors(bundle, task.classes, task.templates or evaluate.TEMPLATES, batch_size)
    return evaluate.classification_accuracy(img[labelled], vectors, [index[str(rows[i]["label"])] for i in labelled])


def register(registry: Registry, plan: Plan, trained: Path, result: Evaluation, run_id: str) -> str:
    """The trained folder + its manifest (lineage, matrices, config, unchanged towers) as the next
    version of the stream, the model of run `run_id`."""
    return publish(registry, trained, {
        "lineage": [*plan.history, plan.current],
        "matrix": {name: matrix.to_dict() for name, matrix in result.matrices.items()},
        "config": plan.config, "parent_version": plan.tags["parent_version"],
        "zero_shot": {"tasks": plan.zero_shot, "Rm": result.zero_shot, "accuracy": result.zero_shot_accuracy}
        if plan.zero_shot else None,
        "unchanged_towers": [t for t in ("image", "text") if plan.parent and t not in plan.method.trains_towers],
        "image_tower": plan.parent.image_tower if plan.parent and "image" not in plan.method.trains_towers else None},
        plan.tags, plan.aliases, run_id)


def publish(registry: Registry, folder: Path, manifest: dict, tags: dict, aliases: Iterable[str], run_id: str) -> str:
    """An open_clip folder with its manifest (+ the tokenizer that `folder` holds) registered as the next version of
    the stream, the model of run `run_id`, with alias `candidate` and `aliases`: how every version is made, trained
    or not (a version 0)."""
    manifest = {**manifest, "tokenizer": {"sha": models.tokenizer_digest(folder), "vocab_size": _vocab_size(folder)}}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
    version = registry.register(folder, tags, run_id=run_id)
    for alias in aliases:
        registry.set_alias(alias, version)
    registry.log(run_id).set_tag("model_version", version)
    return version


def _vocab_size(folder: Path) -> int:
    return int(json.loads((folder / models.CONFIG_FILE).read_text())["model_cfg"]["text_cfg"]["vocab_size"])


def run_config(name: str, settings: Settings, max_failures: int) -> RunConfig:
    """Ray Train's storage for the run `name`: named after what it trains (`Plan.ray_name`), the same job run again
    finds the run's checkpoint manager snapshot in its folder and gives the workers its last checkpoint (Ray
    Train's driver fault tolerance). runs_dir goes as written: a URI reaches Ray Train's pyarrow filesystem."""
    return RunConfig(name=name, storage_path=settings.runs_dir, failure_config=FailureConfig(max_failures=max_failures),
                     checkpoint_config=CheckpointConfig(num_to_keep=1))


def _tokenizer_spec(source: Optional[str], shared_source: Optional[str], arch: str) -> str:
    """open_clip's name for a model's tokenizer: its exported folder's own (as shared with the workers), else its
    architecture's."""
    return f"local-dir:{shared_source}" if source and Path(source).is_dir() else arch


def _task_of(entry: dict) -> Task:
    """A lineage entry's task, with an error naming the stream's entry when its data is gone."""
    try:
        return Task.load(entry["path"])
    except DataError as exc:
        raise DataError(f"task {entry['task']!r} of this stream is no longer readable: {exc}") from exc
