"""ZeRO 0, 2 and 3 train the same: on 2 CPU workers (Ray Train + DeepSpeed on gloo, the job's own `prepare` and
`fit`, hence `engine.train_loop`), each method's per-step losses agree across stages over the same deterministic
steps, and so do the exported weights and the method state the task leaves.

The methods that look back (EWC, LwF, CTP) train a second task on top of a registered parent, so their terms are
non-zero: the parent is the teacher, and EWC's importances come with it in its method state.

Tolerance: relative 1e-4 on losses and 1e-3 (absolute) on weights. The stages compute the same fp32 maths; what
differs is how gradients are reduced (all-reduce at 0, reduce-scatter into partitions at 2 and 3) and so the order
of float additions, ~1e-7 relative per reduction. AdamW divides each update by √v, which turns such differences in
near-zero gradients into differences of a few ulp of the learning rate per step; over the steps trained here the
losses move apart by less than 1e-5 and the weights by less than 1e-5 (1e-3 is the rate, the largest one step
can move a weight). A stage whose gathering or export were wrong moves losses at 1e-2 and weights at the rate.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from clipstream import models
from clipstream.registry import Registry
from clipstream.training.engine import prepare_for_deepspeed
from clipstream.training.job import fit, prepare
from clipstream.training.methods.state import load_state
from tests.conftest import DETERMINISTIC, register_version

RTOL_LOSS, ATOL_WEIGHT = 1e-4, 1e-3
# 1 epoch (2 workers x 16 pairs a step), the rate at its peak from the second step
OVERRIDES = [*DETERMINISTIC, "train.epochs=1", "train.log_every=1", "train.warmup_steps=1"]
TERMS = {"finetune": [], "ewc": ["penalty"], "lwf": ["distill"], "ctp": ["cmc", "topology_c", "topology_s"],
         "cclip": ["ckc"]}


def _parent(settings, stream, method: str) -> str:
    """Version 1 of the stream, as the second task's parent; EWC's with importances (one value per weight, so the
    pull is felt everywhere) in its method state."""
    model = settings.home / "parent"
    models.export(models.create("clipstream-vit-tiny"), model)
    state = {}
    if method == "ewc":
        named = prepare_for_deepspeed(models.load_exported(model).model).named_parameters()
        state = {"ewc": {"importance": {n: torch.full_like(p, 0.01) for n, p in named}, "tasks": 1}}
    return register_version(settings, seed=1, task_dirs=[stream[0]], model=model, state=state)


def train(settings, stream, method: str, stage: int, parent: str | None) -> dict:
    """One job's training at ZeRO `stage`: its logged losses by term, its run's metrics, exported weights and method
    state."""
    registry = Registry(settings)
    # C-CLIP's adapter dropout draws its masks from torch's generator whenever a weight is read, which ZeRO-3's
    # gathering does a different number of times: a different draw, not different maths, so it is off here
    extra = ["method.cclip.dropout=0.0"] if method == "cclip" else []
    plan = prepare(registry, stream[1] if parent else stream[0], method, parent, workers=2,
                   overrides=[*OVERRIDES, f"train.zero_stage={stage}", *extra])
    try:
        with registry.run(f"{method}-zero{stage}", plan.tags) as run_id:
            run = registry.log(run_id)
            trained = fit(plan, settings, run)
            losses = {key: [m.value for m in sorted(run.metric_history(key), key=lambda m: m.step)]
                      for key in ["loss", *(f"loss/{t}" for t in TERMS[method])]}
            metrics = run.metrics()
        return {"losses": losses, "weights": load_file(trained / models.WEIGHTS_FILE), "state": load_state(trained),
                "metrics": metrics}
    finally:
        shutil.rmtree(plan.workdir, ignore_errors=True)


def assert_same_training(a: dict, b: dict) -> None:
    for key, values in a["losses"].items():
        assert len(values) == len(b["losses"][key]) >= 3, key
        assert values == pytest.approx(b["losses"][key], rel=RTOL_LOSS, abs=1e-6), key
    assert a["weights"].keys() == b["weights"].keys()
    for name, weight in a["weights"].items():
        other = b["weights"][name]
        assert weight.dtype == other.dtype == torch.float32 and weight.shape == other.shape, name  # whole, fp32
        assert torch.allclose(weight, other, atol=ATOL_WEIGHT, rtol=0), name


@pytest.mark.slow
@pytest.mark.parametrize("method", ["finetune", "ewc", "lwf", "ctp", "cclip"])
def test_every_method_trains_the_same_at_zero_0_2_and_3(ray_cluster, settings, stream, method):
    parent = _parent(settings, stream, method) if method in ("ewc", "lwf", "ctp") else None
    runs = {stage: train(settings, stream, method, stage, parent) for stage in (0, 2, 3)}
    for term in TERMS[method]:  # each method's own terms count in what is compared
        assert max(abs(v) for v in runs[0]["losses"][f"loss/{term}"]) > 1e-6, term
    for stage in (2, 3):
        assert_same_training(runs[0], runs[stage])
    if method == "ewc":  # the per-sample importances measured at task end, under ZeRO-3 on the gathered weights
        for name, omega in runs[0]["state"]["ewc"]["importance"].items():
            assert torch.allclose(omega, runs[3]["state"]["ewc"]["importance"][name], rtol=1e-3, atol=1e-9), name
        assert all(run["metrics"]["method/importance_seconds"] > 0 for run in runs.values())
    if method == "ctp":  # the momentum model, updated from the live weights every step
        for name, value in runs[0]["state"]["ctp"]["momentum"].items():
            assert torch.allclose(value, runs[3]["state"]["ctp"]["momentum"][name], atol=ATOL_WEIGHT), name


def _bf16_ctp_steps(rank: int, world: int) -> dict:
    """A few of the engine's steps of CTP in bf16 at ZeRO-3 on CPU (gloo), and the dtypes it kept."""
    import os

    import deepspeed

    from clipstream.training import methods
    from clipstream.training.engine import deepspeed_config, param_groups, train_step
    from clipstream.training.methods.base import TaskContext

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    torch.manual_seed(0)
    config = methods.resolve("ctp", ["train.precision=bf16", "train.zero_stage=3", "train.micro_batch=4",
                                     "train.warmup_steps=1", "method.ctp.queue_size=16"])
    method = methods.build(config)
    model = method.prepare_model(prepare_for_deepspeed(models.create("clipstream-vit-tiny").model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1, 1e-3),
                                      config=deepspeed_config(config["train"], world, 4))
    ctx = TaskContext(model=engine.module, task_index=0, rank=rank, world_size=world, device=engine.device)
    method.before_task(ctx)
    g = torch.Generator().manual_seed(1)
    batch = {"image": torch.randn(4, 3, 32, 32, generator=g), "text": torch.randint(1, 400, (4, 32), generator=g)}
    losses = [float(train_step(engine, method, ctx, batch)[0].detach()) for _ in range(4)]
    ctp = method.components[0]
    return {"losses": losses, "engine": str(next(engine.module.parameters()).dtype),
            "momentum": str(next(ctp.momentum_model.parameters()).dtype), "queue": str(ctp.queues["image"].rows.dtype)}


def test_bf16_trains_on_cpu_at_zero_3_with_fp32_method_state():
    """DeepSpeed's bf16 on CPU workers, under ZeRO-3, with CTP (momentum model, queues, a teacher-free first task)."""
    from tests.conftest import on_gloo

    for out in on_gloo(_bf16_ctp_steps, 2).values():
        assert out["engine"] == "torch.bfloat16"
        assert out["momentum"] == out["queue"] == "torch.float32"  # an EMA's small steps would vanish in bf16
        # it trained (CTP's queue moves its contrast every step, so the loss need not fall in so few)
        assert all(torch.isfinite(torch.tensor(out["losses"]))) and len(set(out["losses"])) == 4


def _engine(method_name: str, stage: int, world: int, extra=()):
    """The engine a Ray Train worker builds (engine.train_loop's calls), on a fixed tiny CLIP, for `method_name`."""
    import deepspeed

    from clipstream.training import methods
    from clipstream.training.engine import deepspeed_config, param_groups
    from clipstream.training.methods.base import frozen

    torch.manual_seed(0)
    config = methods.resolve(method_name, [*DETERMINISTIC, f"train.zero_stage={stage}", "train.micro_batch=4",
                                           "train.warmup_steps=1", *extra])
    method = methods.build(config)
    model = method.prepare_model(prepare_for_deepspeed(models.create("clipstream-vit-tiny").model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1, 1e-3),
                                      config=deepspeed_config(config["train"], world, 8))
    teacher = None
    if method.needs_teacher:  # the parent: another model, so the method's terms are not zero
        torch.manual_seed(1)
        teacher = frozen(prepare_for_deepspeed(models.create("clipstream-vit-tiny").model))
    return engine, method, teacher


def _batches(rank: int, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(10 + rank)
    return [{"image": torch.randn(4, 3, 32, 32, generator=g), "text": torch.randint(1, 400, (4, 32), generator=g)}
            for _ in range(n)]


def _hooks_at_stages(rank: int, world: int) -> dict:
    """MAS and Mod-X (the methods the Ray parity test leaves out) at ZeRO 0 and 3: losses of 4 of the engine's steps
    and MAS's importances measured at task end; CTP's resume at ZeRO 3 from a DeepSpeed checkpoint taken after 2
    steps (partitioned parameters and optimizer state, the method's state) against the same 4 steps uninterrupted."""
    import os
    import tempfile

    from clipstream.training.engine import train_step
    from clipstream.training.methods.base import TaskContext
    from clipstream.training.methods.state import read_state, save_state

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    out, importance = {}, {}
    for name in ("mas", "modx"):
        for stage in (0, 3):
            engine, method, teacher = _engine(name, stage, world)
            ctx = TaskContext(model=engine.module, task_index=1, rank=rank, world_size=world, device=engine.device,
                              teacher=teacher)
            method.before_task(ctx)
            batches = _batches(rank, 4)
            out[name, stage] = [float(train_step(engine, method, ctx, b)[0].detach()) for b in batches]
            method.after_task(ctx, batches)
            engine.empty_partition_cache()
            if name == "mas":
                importance[stage] = method.state_dict()["mas"]["importance"]
    # compared here: tensors do not cross processes
    zero0, zero3 = importance[0], importance[3]
    out["importance"] = {"names": (sorted(zero0), sorted(zero3)),
                         "not whole": [n for n, v in zero0.items() if v.shape != zero3[n].shape],
                         "unmeasured": [n for n, v in zero0.items() if not v.any()],
                         # (tolerance: relative 1e-3, and as near zero the same reductions' float order allows)
                         "differ": [n for n, v in zero0.items()
                                    if not torch.allclose(v, zero3[n], rtol=1e-3, atol=1e-6 * float(v.abs().max()))]}

    folder = tempfile.mkdtemp(prefix="zero3-resume-") if rank == 0 else None
    folder = _broadcast_string(folder)
    runs = []
    for resumed in (False, True):
        engine, method, teacher = _engine("ctp", 3, world, ["method.ctp.queue_size=16"])
        ctx = TaskContext(model=engine.module, task_index=1, rank=rank, world_size=world, device=engine.device,
                          teacher=teacher)
        batches, losses = _batches(rank, 4), []
        if resumed:  # as engine.train_loop resumes: the DeepSpeed checkpoint, then the method's state
            engine.load_checkpoint(folder, tag="last")
            method.load_state_dict(read_state(f"{folder}/method_state"))
            batches = batches[2:]
        else:
            method.before_task(ctx)
        for i, batch in enumerate(batches):
            losses.append(float(train_step(engine, method, ctx, batch)[0].detach()))
            if not resumed and i == 1:
                engine.save_checkpoint(folder, tag="last")
                if rank == 0:
                    save_state(method.state_dict(), f"{folder}/method_state")
                torch.distributed.barrier()
        runs.append(losses)
    out["resume"] = runs
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(folder)
    return out


def _broadcast_string(value):
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def test_mas_and_modx_train_the_same_at_zero_0_and_3_and_zero_3_resumes_where_it_stopped():
    from tests.conftest import on_gloo

    for rank, out in on_gloo(_hooks_at_stages, 2).items():
        for name in ("mas", "modx"):
            assert len(set(out[name, 0])) == 4, name  # it trained
            assert out[name, 0] == pytest.approx(out[name, 3], rel=RTOL_LOSS, abs=1e-6), name
        names0, names3 = out["importance"]["names"]
        assert names0 == names3 and len(names0) > 10
        # whole tensors (not ZeRO-3's partitions), the same at both stages, and measured: MAS's objective (the
        # features' norms) does not reach the temperature
        assert out["importance"]["not whole"] == out["importance"]["differ"] == []
        assert out["importance"]["unmeasured"] == ["logit_scale"]
        uninterrupted, resumed = out["resume"]
        assert resumed == pytest.approx(uninterrupted[2:], rel=RTOL_LOSS, abs=1e-6), rank
