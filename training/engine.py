"""One task's train loop on a DeepSpeed engine, run by every Ray Train worker.

The step is plain: forward both towers, CLIP loss over the gathered batch plus the method's terms,
`engine.backward`, `engine.step`. A method that distils from the previous version gets it as a frozen
`ctx.teacher`, loaded from the registered parent (so a resumed worker gets the same one). Checkpoints are DeepSpeed's own (every rank writes its shard) and
are reported to Ray Train each epoch, so a restarted worker group resumes from the last epoch.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import deepspeed
import torch
from torch.profiler import record_function

from clipstream import models
from clipstream.training import methods
from clipstream.training.losses import clip_loss
from clipstream.training.methods.base import TaskContext, forward_features, frozen, gathered
from clipstream.training.methods.state import STATE_FILE as METHOD_STATE_FILE
from clipstream.training.methods.state import read_state, save_state
from clipstream.training.shared import local

STATE_FILE = "train_state.json"
EXPORT_DIR = "export"
CKPT_TAG = "last"


def prepare_for_deepspeed(model: torch.nn.Module) -> torch.nn.Module:
    """DeepSpeed broadcasts parameters as bytes and cannot view a 0-dim tensor that way, so the
    0-dim `logit_scale` becomes shape [1] while training (open_clip's maths broadcasts either way;
    `models.export` makes it 0-dim again)."""
    for name in ("logit_scale", "logit_bias"):
        param = getattr(model, name, None)
        if isinstance(param, torch.nn.Parameter) and param.dim() == 0:
            setattr(model, name, torch.nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))
    return model


def deepspeed_config(train: dict, world_size: int, total_steps: int) -> dict:
    """DeepSpeed JSON config from a preset's `train` section."""
    precision = train["precision"]
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    # torch's AdamW on every device: DeepSpeed's FusedAdam JIT-compiles a CUDA op when the engine starts,
    # which would need nvcc and a C++ toolchain in the cluster image (k8s/images/Dockerfile has none).
    return {
        "train_micro_batch_size_per_gpu": train["micro_batch"],
        "gradient_accumulation_steps": train["grad_accum"],
        "train_batch_size": train["micro_batch"] * train["grad_accum"] * world_size,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": train["lr"], "betas": list(train["betas"]), "eps": train["eps"],
                       "weight_decay": train["weight_decay"], "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"total_num_steps": max(total_steps, 1), "warmup_num_steps": warmup_steps(train, total_steps),
                       "warmup_type": "linear", "cos_min_ratio": train["min_lr_ratio"]},
        },
        "gradient_clipping": train["grad_clip"],
        **zero_section(precision, train["zero_stage"]),
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "steps_per_print": 10**9,
    }


def zero_section(precision: str, zero_stage: int) -> dict:
    """The config's ZeRO section; in bf16 below ZeRO 2, DeepSpeed's BF16_Optimizer: fp32 master weights and
    fp32 gradient accumulation in flat buffers, which DeepSpeed runs at stage 1 (on one worker it partitions nothing;
    on several, only the optimizer's states). Stage 0 in bf16 would take DeepSpeed's unfused per-tensor fp16 path,
    whose step is about twice a plain loop's on a GPU (benchmarks/results/gpu.md), and accumulate gradients in bf16."""
    if precision == "bf16" and zero_stage <= 1:
        return {"zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}}
    # torch's attention (and open_clip's ResNet attention pool) reads its projections' weights without calling
    # them, which ZeRO-3's per-module gathering would leave placeholders: each is gathered whole (a "leaf")
    leaf = {"leaf_module": {"classes": ["MultiheadAttention", "AttentionPool2d"]}} if zero_stage == 3 else {}
    return {"zero_optimization": {"stage": zero_stage, **leaf}}


def warmup_steps(train: dict, total_steps: int) -> int:
    """The task's linear warm-up: `warmup_steps`, or `warmup_ratio` of its steps where that is more (the papers give
    warm-up as epochs or a fraction, which depends on the task's size), at least 1 and short of the last step."""
    wanted = max(train["warmup_steps"], round(train.get("warmup_ratio", 0.0) * total_steps))
    return max(1, min(wanted, total_steps - 1))


def check_precision(precision: str, gpus_per_worker: float) -> None:
    """Refuse, in one line and before the job starts, a precision that the workers' device cannot train in: what
    DeepSpeed's accelerator of that device supports (its CPU one has no fp16). A GPU seen only by the workers, not by
    the driver, is left to DeepSpeed's own check there."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if not gpus_per_worker:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        if dtype not in CPU_Accelerator().supported_dtypes():
            raise ValueError(f"train.precision={precision}: DeepSpeed cannot train in it on CPU workers (no GPU per "
                             "worker); use bf16 or fp32, or give the workers GPUs")
    elif torch.cuda.is_available() and precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"train.precision=bf16: {torch.cuda.get_device_name()} has no bf16; use fp16 or fp32")


ALIGN_ELEMENTS = 64  # 128 bytes of bf16: the alignment tensor-core GEMMs want of their operands


def param_groups(model: torch.nn.Module, weight_decay: float, lr: float | None = None, lr_scale=None) -> list[dict]:
    """open_clip's split: no decay on gains, biases, embeddings and the logit scale. `lr_scale(name)` (a method's:
    C-CLIP's text learning rate is a multiple of the image one) puts a parameter whose scale is not 1 in a group
    with its own rate, lr × scale, which DeepSpeed's schedule then warms up and decays like the others."""
    groups: dict[tuple[bool, float], dict] = {(False, 1.0): {"params": [], "weight_decay": 0.0},
                                              (True, 1.0): {"params": [], "weight_decay": weight_decay}}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exclude = param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name or "embedding" in name
        scale = float(lr_scale(name)) if lr_scale else 1.0
        if (not exclude, scale) not in groups:
            groups[(not exclude, scale)] = {"params": [], "weight_decay": 0.0 if exclude else weight_decay, "lr": lr * scale}
        groups[(not exclude, scale)]["params"].append(param)
    for group in groups.values():
        # DeepSpeed's bf16/fp16 optimizers and ZeRO keep each group in one flat buffer, the parameters views into it
        # in this order: one tensor of an odd size (the logit scale) ahead of the others would leave every later one
        # misaligned, and cuBLAS then runs their Linear layers on slow fallback kernels. Odd sizes last.
        group["params"].sort(key=lambda p: p.numel() % ALIGN_ELEMENTS != 0)
    return list(groups.values())


def train_step(engine, method, task_ctx: TaskContext, batch: dict) -> tuple[torch.Tensor, dict]:
    """The whole step: CLIP loss over the gathered batch plus the method's terms, backward, optimizer
    step, the method's after-step hook (e.g. CTP's momentum update). Returns the loss and its terms."""
    with record_function("step: forward"):  # the phases, named for `clipstream bench method-step --profile`
        feats = forward_features(engine.module, batch["image"], batch["text"])
        terms = {"clip": method.clip_weight * clip_loss(feats.image, feats.text, feats.logit_scale)}
    with record_function("step: method terms"):
        terms.update(method.loss_terms(task_ctx, batch, feats))
    loss = sum(terms.values())
    with record_function("step: backward"):
        engine.backward(loss)
    task_ctx.lr = engine.get_lr()[0]  # the rate this step applies (the scheduler moves on inside `step`)
    with record_function("step: optimizer"):
        engine.step()
    with record_function("step: after_step"):
        method.after_step(task_ctx)
    return loss, terms


def train_loop(config: dict) -> None:
    """`TorchTrainer` entry point. `config`: the resolved preset plus `model_source`, `teacher_source` (None: no
    teacher), `method_state`, `steps_per_epoch`, `task_index`, `tracking` (MLflow URI and run id for live metrics)."""
    import ray.train  # here, not at the top: `train_step` is also measured where Ray is not installed (bench gpu)

    logging.getLogger("ray.train").setLevel(logging.WARNING)  # our own progress lines say enough
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    train = config["train"]
    torch.manual_seed(train["seed"] + rank)
    if not torch.cuda.is_available():  # Ray pins OMP_NUM_THREADS to the worker's fractional CPU share: 1
        torch.set_num_threads(config["threads_per_worker"])
    models.keep_freed_memory()  # every step re-allocates what the last one freed

    bundle = models.create(config["model"]["arch"], local(config["model_source"]))
    method = methods.build(config)
    model = method.prepare_model(prepare_for_deepspeed(bundle.model))
    if config.get("method_state"):
        method.load_state_dict(read_state(local(config["method_state"])))

    steps_per_epoch = config["steps_per_epoch"]
    total = steps_per_epoch * train["epochs"] // train["grad_accum"]
    groups = param_groups(model, train["weight_decay"], train["lr"], method.lr_scale)
    frozen_fp32 = frozen_weights(model) if rank == 0 and train["precision"] != "fp32" else {}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=deepspeed_config(train, world, total))
    teacher = None
    if method.needs_teacher and config.get("teacher_source"):  # θ(t-1) as registered (or pinned): also after a resume
        teacher = prepare_for_deepspeed(models.create(config["model"]["arch"], local(config["teacher_source"])).model)
        teacher = frozen(teacher.to(device=engine.device, dtype=next(engine.module.parameters()).dtype))
    task_ctx = TaskContext(model=engine.module, task_index=config["task_index"], rank=rank, world_size=world,
                           device=engine.device, teacher=teacher, current=config["current"])

    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            engine.load_checkpoint(folder, tag=CKPT_TAG)
            state = json.loads((Path(folder) / STATE_FILE).read_text())
            method.load_state_dict(read_state(Path(folder) / METHOD_STATE_FILE))
        start_epoch, task_ctx.step = state["epoch"] + 1, state["step"]
    else:
        method.before_task(task_ctx)

    logger = _MetricLogger(config.get("tracking"), rank)
    logger.tag("ray.worker_nodes", ",".join(_gather_strings(ray.get_runtime_context().get_node_id())))
    shard = ray.train.get_dataset_shard("train")
    first_at = 0.0  # when this job's first step ended (wall clock)
    for epoch in range(start_epoch, train["epochs"]):
        engine.train()
        batches = shard.iter_torch_batches(batch_size=train["micro_batch"], drop_last=True, device=engine.device, prefetch_batches=4,
                                           local_shuffle_buffer_size=train["shuffle_buffer"],
                                           local_shuffle_seed=train["seed"] + 1000 * epoch + rank,
                                           dtypes={"image": torch.float32, "text": torch.long,
                                                   **({"text_en": torch.long} if method.teacher_text else {})})
        last = epoch == train["epochs"] - 1
        kept = collections.deque(maxlen=method.task_end_batches if last else 0)  # for after_task
        tic, seen, steps, busy, first = time.perf_counter(), 0, 0, 0.0, 0.0
        for i, batch in enumerate(batches):
            if i >= steps_per_epoch:  # equal steps on every rank, or collectives would hang
                break
            start = time.perf_counter()
            loss, terms = train_step(engine, method, task_ctx, batch)
            took = time.perf_counter() - start  # the step alone: what a method adds, without the input wait
            busy, first, first_at = busy + took, first or took, first_at or time.time()
            kept.append(batch)
            task_ctx.step, steps, seen = task_ctx.step + 1, steps + 1, seen + batch["image"].shape[0]
            if task_ctx.step % train["log_every"] == 0:
                logger.log(task_ctx.step, {"loss": loss, **{f"loss/{k}": v for k, v in terms.items()}},
                           lr=engine.get_lr()[0], samples_per_s=seen * world / (time.perf_counter() - tic), epoch=epoch)
        rate = seen * world / max(time.perf_counter() - tic, 1e-9)  # the steps alone, not after_task's work
        _maybe_fail(config.get("fail_once"), epoch, rank)  # dies with the epoch trained but not checkpointed
        if last:
            method.after_task(task_ctx, list(kept))
            measured = method.task_metrics()  # (a collective when there is any: every rank's method has the same)
            if measured:
                logger.log(task_ctx.step, {f"method/{k}": torch.tensor(float(v), device=engine.device)
                                           for k, v in measured.items()})
            engine.empty_partition_cache()  # ZeRO-3: what a forward outside `engine.backward` left gathered (EWC's)
        _report_epoch(engine, method, bundle, frozen_fp32, epoch, task_ctx.step, rank,
                      {"epoch": epoch, "step": task_ctx.step, "loss": float(loss.detach()), "start_epoch": start_epoch,
                       "samples_per_s": rate, "step_ms": 1000 * busy / max(steps, 1),
                       # a job's first step also creates AdamW's state and the allocator's pools: a fixed cost per
                       # job that a mean over few steps carries (stream-growth takes it out of the time in steps)
                       "first_step_ms": 1000 * first, "first_step_at": first_at})


def _report_epoch(engine, method, bundle, frozen_fp32: dict, epoch: int, step: int, rank: int, metrics: dict) -> None:
    """Every rank saves its DeepSpeed shard; rank 0 adds the method state, position and an open_clip export."""
    import ray.train

    with tempfile.TemporaryDirectory() as folder:
        engine.save_checkpoint(folder, tag=CKPT_TAG)
        if rank == 0:
            (Path(folder) / STATE_FILE).write_text(json.dumps({"epoch": epoch, "step": step}))
            save_state(method.state_dict(), Path(folder) / METHOD_STATE_FILE)
        export(engine, method, bundle, Path(folder) / EXPORT_DIR, rank, frozen_fp32)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))


def frozen_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the parameters that do not train, taken before a bf16/fp16 engine casts the module: the
    optimizer keeps fp32 masters of the trained ones only, and an export must not round the others."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if not p.requires_grad}


def export(engine, method, bundle, folder: Path, rank: int, frozen_fp32: dict | None = None) -> None:
    """The version's open_clip export, written by rank 0 (a collective: every rank enters): whole weights, gathered
    under ZeRO-3, and fp32 whatever the engine computes in. Under bf16/fp16 they are the optimizer's fp32 master
    weights, not the engine's rounded copies: the next task starts from this export, and rounding it at every task
    would drop each task's updates below bf16's resolution. `frozen_fp32`: `frozen_weights` of the module (rank 0)."""
    with gathered(engine.module.parameters()), _master_weights(engine, rank, frozen_fp32 or {}):
        if rank == 0:
            bundle.model = method.export_model(engine.module)
            models.export(bundle, folder)


@contextlib.contextmanager
def _master_weights(engine, rank: int, frozen_fp32: dict):
    """On rank 0, the engine's module (whole: gathered) holding fp32 values while inside: the trained parameters'
    master copies, the frozen ones' `frozen_fp32`, the floating buffers upcast; the engine's own tensors are put back on
    the way out. The masters: DeepSpeed's `safe_get_full_fp32_param` under ZeRO and bf16's BF16_Optimizer (a
    collective, so every rank asks for each in turn); without ZeRO, fp16 engines step DeepSpeed's FP16 optimizers,
    whose fp32 groups that function does not reach, so they are read from them."""
    module = engine.module
    named = list(module.named_parameters())
    if all(p.dtype == torch.float32 for _, p in named):
        yield
        return
    from deepspeed.utils import safe_get_full_fp32_param
    from torch._utils import _unflatten_dense_tensors

    optimizer, flat = engine.optimizer, {}
    fp16_groups = getattr(optimizer, "fp16_groups", []) if not engine.zero_optimization() else []
    for i, low in enumerate(fp16_groups):  # (FP16_Optimizer holds flat groups, FP16_UnfusedOptimizer lists)
        fp32 = optimizer.fp32_groups_flat[i] if hasattr(optimizer, "fp32_groups_flat") else optimizer.fp32_groups[i]
        flat.update(zip(map(id, low), _unflatten_dense_tensors(fp32, low) if torch.is_tensor(fp32) else fp32))
    masters = [(flat.get(id(p)) if id(p) in flat else safe_get_full_fp32_param(p)) if p.requires_grad
               else frozen_fp32.get(n) for n, p in named]
    swapped = []
    try:
        if rank == 0:
            for (name, p), master in zip(named, masters):
                if master is None:
                    raise RuntimeError(f"no fp32 master weight of {name} to export ({type(engine.optimizer).__name__})")
                swapped.append((p, p.data))
                p.data = master.to(p.device, torch.float32).reshape(p.shape)
            for b in module.buffers():
                if b.is_floating_point() and b.dtype != torch.float32:
                    swapped.append((b, b.data))
                    b.data = b.data.float()
        yield
    finally:
        for t, data in reversed(swapped):
            t.data = data


class _MetricLogger:
    """Rank 0 streams step metrics into the task's MLflow run and prints a progress line."""

    def __init__(self, tracking: dict | None, rank: int):
        self.rank, self.client, self.run_id = rank, None, None
        if tracking and rank == 0:
            from mlflow import MlflowClient

            self.client, self.run_id = MlflowClient(tracking["uri"]), tracking["run_id"]

    def tag(self, key: str, value: str) -> None:
        if self.client:
            self.client.set_tag(self.run_id, key, value)

    def log(self, step: int, losses: dict, **extra) -> None:
        values = {k: _mean_across_ranks(v) for k, v in losses.items()}  # a collective: every rank calls it
        if self.rank != 0:
            return
        values.update(extra)
        print(f"[train] step {step} " + " ".join(f"{k}={v:.4g}" for k, v in values.items()), flush=True)
        if self.client:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, [Metric(k, float(v), now, step) for k, v in values.items()], synchronous=False)


def _gather_strings(value: str) -> list[str]:
    """`value` of every rank, in rank order (a collective: every rank calls it)."""
    if not torch.distributed.is_initialized():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def _mean_across_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().reshape(1).clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(value)
        value /= torch.distributed.get_world_size()
    return float(value)


def _maybe_fail(spec: str | None, epoch: int, rank: int) -> None:
    """Kill this worker once, for real, when CLIPSTREAM_FAIL_ONCE=`epoch:rank:marker-file` was set for
    the job: the way to test that a job survives a dead worker without a cluster to break."""
    if not spec:
        return
    at_epoch, at_rank, marker = spec.split(":", 2)
    if epoch == int(at_epoch) and rank == int(at_rank) and not os.path.exists(marker):
        # Ray Train's controller collects reported checkpoints when it polls the workers (every
        # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S); die well after that, as a worker lost mid-task would.
        time.sleep(2 * float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0)) + 1)
        Path(marker).write_text("failed once\n")
        os._exit(1)
