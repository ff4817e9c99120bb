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
    """One job's training at ZeRO `stage`: its logged losses by term, exported weights and method state."""
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
        return {"losses": losses, "weights": load_file(trained / models.WEIGHTS_FILE), "state": load_state(trained)}
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


@pytest.mark.component
def test_finetune_trains_the_same_at_zero_0_and_3(ray_cluster, settings, stream):
    """The quick tier's representative: ZeRO-3's gathering (the CLIP's own parameters, attention's projections)
    and its export of whole fp32 weights give what ZeRO 0 gives."""
    zero0, zero3 = (train(settings, stream, "finetune", stage, None) for stage in (0, 3))
    assert zero0["losses"]["loss"][0] != zero0["losses"]["loss"][-1]  # it trained
    assert_same_training(zero0, zero3)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["finetune", "ewc", "lwf", "ctp", "cclip"])
def test_every_method_trains_the_same_at_zero_0_2_and_3(ray_cluster, settings, stream, method):
    parent = _parent(settings, stream, method) if method in ("ewc", "lwf", "ctp") else None
    runs = {stage: train(settings, stream, method, stage, parent) for stage in (0, 2, 3)}
    for term in TERMS[method]:  # each method's own terms count in what is compared
        assert max(abs(v) for v in runs[0]["losses"][f"loss/{term}"]) > 1e-6, term
    for stage in (2, 3):
        assert_same_training(runs[0], runs[stage])
    if method == "ewc":  # the importances measured at task end, under ZeRO-3 from gathered gradients
        for name, omega in runs[0]["state"]["ewc"]["importance"].items():
            assert torch.allclose(omega, runs[3]["state"]["ewc"]["importance"][name], rtol=1e-3, atol=1e-9), name
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
