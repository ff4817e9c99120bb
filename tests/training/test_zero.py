"""ZeRO 0, 2 and 3 train the same on 2 CPU workers (DeepSpeed on gloo): each method's per-step losses and terms
agree across stages over the same deterministic steps, and so do the exported weights and the method state the
task leaves. On the engine a Ray Train worker builds (`engine.train_loop`'s calls), in 2 processes of one gloo group:
the same DeepSpeed maths without Ray's start-up per run. The job's own path through Ray Train (`prepare` and `fit`)
runs at ZeRO 0 and 3 in the quick tier's stream (tests/conftest.py `two_tasks`), at 1 and 2 in the method streams
(tests/training/methods/test_streams.py).

The methods that look back train a second task on top of a parent, so their terms are non-zero: the parent is the
teacher, and EWC's importances come with it in its method state.

Tolerance: relative 1e-4 on losses and 1e-3 (absolute) on weights. The stages compute the same fp32 maths; what
differs is how gradients are reduced (all-reduce at 0, reduce-scatter into partitions at 2 and 3) and so the order
of float additions, ~1e-7 relative per reduction. AdamW divides each update by √v, which turns such differences in
near-zero gradients into differences of a few ulp of the learning rate per step; over the steps trained here the
losses move apart by less than 1e-5 and the weights by less than 1e-5 (1e-3 is the rate, the largest one step
can move a weight). A stage whose gathering or export were wrong moves losses at 1e-2 and weights at the rate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clipstream import models
from clipstream.training.engine import prepare_for_deepspeed
from tests.conftest import DETERMINISTIC

RTOL_LOSS, ATOL_WEIGHT = 1e-4, 1e-3
# each method's own terms, which must be felt (non-zero) for the comparison to count
TERMS = {"ewc": ["penalty"], "lwf": ["distill"], "ctp": ["cmc", "topology_c", "topology_s"], "cclip": ["ckc"]}


def weights_apart(a: dict, b: dict) -> list[str]:
    """The names of the exported weights that are not whole fp32 tensors equal within ATOL_WEIGHT in both."""
    assert a.keys() == b.keys()
    return [n for n, w in a.items() if not (w.dtype == b[n].dtype == torch.float32 and w.shape == b[n].shape
                                            and torch.allclose(w, b[n], atol=ATOL_WEIGHT, rtol=0))]


def _methods_at_stages(rank: int, world: int) -> dict:
    """EWC, LwF, CTP and C-CLIP on their second task at ZeRO 0, 2 and 3: 4 of the engine's steps, the task's end
    (EWC measures its importances), the export. Compared here against ZeRO 0 (tensors do not cross processes): the
    names of the weights and method-state tensors that moved apart; the losses and terms go back as numbers."""
    import os
    import tempfile

    from clipstream.training.engine import export, train_step
    from clipstream.training.methods.base import TaskContext

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    # C-CLIP's adapter dropout draws its masks from torch's generator whenever a weight is read, which ZeRO-3's
    # gathering does a different number of times: a different draw, not different maths, so it is off here
    extra = {"ctp": ["method.ctp.queue_size=16"], "cclip": ["method.cclip.dropout=0.0"]}
    out = {}
    for name in TERMS:
        first = {}
        for stage in (0, 2, 3):
            engine, method, teacher, bundle = _engine(name, stage, world, extra.get(name, ()))
            if name == "ewc":  # the parent's importances: one value per weight, so the pull is felt everywhere
                method.load_state_dict({"ewc": {"tasks": 1, "importance": {
                    n: torch.full(tuple(getattr(p, "ds_shape", p.shape)), 0.01)
                    for n, p in engine.module.named_parameters() if p.requires_grad}}})
            ctx = TaskContext(model=engine.module, task_index=1, rank=rank, world_size=world, device=engine.device,
                              teacher=teacher)
            method.before_task(ctx)
            batches, steps = _batches(rank, 4), []
            for batch in batches:
                loss, terms = train_step(engine, method, ctx, batch)
                steps.append({"loss": float(loss.detach()), **{k: float(v.detach()) for k, v in terms.items()}})
            method.after_task(ctx, batches)
            engine.empty_partition_cache()
            measured = method.task_metrics()  # (what the engine logs after the task: EWC's importance seconds)
            folder = _broadcast_string(tempfile.mkdtemp(prefix="zero-parity-") if rank == 0 else None)
            export(engine, method, bundle, Path(folder), rank)
            found = {"steps": steps, "task metrics": sorted(k for k, v in measured.items() if v > 0)}
            if rank == 0:
                state = method.state_dict()[name]
                tensors = {**load_file(Path(folder) / models.WEIGHTS_FILE),
                           **{f"importance/{n}": v for n, v in state.get("importance", {}).items()},
                           **{f"momentum/{n}": v for n, v in state.get("momentum", {}).items()}}
                tensors = {n: _without_key_bias(n, v) for n, v in tensors.items()}
                first = first or tensors
                found["tensors"] = len(tensors)
                # importances: relative 1e-3, and as near zero the same reductions' float order allows
                found["apart"] = [n for n, v in tensors.items() if v.shape != first[n].shape or not torch.allclose(
                    v, first[n], atol=ATOL_WEIGHT if not n.startswith("importance/") else 1e-6 * float(v.abs().max()),
                    rtol=0 if not n.startswith("importance/") else 1e-3)]
                shutil.rmtree(folder)
            out[name, stage] = found
            torch.distributed.barrier()
    return out


def _without_key_bias(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight with the key projection's bias (the middle third of an attention's in_proj_bias) zeroed: softmax over
    the keys is invariant to it, so the loss gives it no gradient but rounding noise, which Adam scales up to steps
    of the rate whose sign each stage's order of reductions sets (seen with EWC's pull on: ±the rate, every stage)."""
    if not name.endswith("attn.in_proj_bias"):
        return weight
    q, _, v = weight.chunk(3)
    return torch.cat([q, torch.zeros_like(q), v])


@pytest.mark.slow
def test_every_method_trains_the_same_at_zero_0_2_and_3():
    from tests.conftest import on_gloo

    for rank, out in on_gloo(_methods_at_stages, 2).items():
        for name, terms in TERMS.items():
            steps = {stage: out[name, stage]["steps"] for stage in (0, 2, 3)}
            for term in terms:  # the method's own terms count in what is compared
                assert max(abs(s[term]) for s in steps[0]) > 1e-6, (name, term)
            assert len({s["loss"] for s in steps[0]}) == 4, name  # it trained
            assert all(out[name, stage]["task metrics"] == (["importance_seconds"] if name == "ewc" else [])
                       for stage in (0, 2, 3)), name
            for stage in (2, 3):
                for key in steps[0][0]:
                    assert [s[key] for s in steps[stage]] == pytest.approx([s[key] for s in steps[0]], rel=RTOL_LOSS,
                                                                           abs=1e-6), (name, stage, key)
                if rank == 0:
                    assert out[name, stage]["tensors"] > 10 and out[name, stage]["apart"] == [], (name, stage)


def _bf16_ctp_steps(rank: int, world: int) -> dict:
    """A few of the engine's steps of CTP in bf16 at ZeRO 0 and 3 on CPU (gloo), the dtypes it kept, and its export
    (`engine.export`, as each epoch's checkpoint writes it) against the optimizer's fp32 master weights."""
    import os
    import tempfile

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from clipstream.training import methods
    from clipstream.training.engine import deepspeed_config, export, frozen_weights, param_groups, train_step
    from clipstream.training.methods.base import TaskContext, gathered

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    out = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        config = methods.resolve("ctp", ["train.precision=bf16", f"train.zero_stage={stage}", "train.micro_batch=4",
                                         "train.warmup_steps=1", "method.ctp.queue_size=16"])
        method = methods.build(config)
        bundle = models.create("clipstream-vit-tiny")
        model = method.prepare_model(prepare_for_deepspeed(bundle.model))
        model.visual.conv1.weight.requires_grad_(False)  # a frozen weight: exported as it was, never rounded
        frozen = frozen_weights(model)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1, 1e-3),
                                          config=deepspeed_config(config["train"], world, 4))
        ctx = TaskContext(model=engine.module, task_index=0, rank=rank, world_size=world, device=engine.device)
        method.before_task(ctx)
        g = torch.Generator().manual_seed(1)
        batch = {"image": torch.randn(4, 3, 32, 32, generator=g), "text": torch.randint(1, 400, (4, 32), generator=g)}
        losses = [float(train_step(engine, method, ctx, batch)[0].detach()) for _ in range(4)]
        ctp = method.components[0]
        # the tensors torch's AdamW steps (ZeRO's partitions, BF16_Optimizer's flat fp32 groups), gathered whole by
        # DeepSpeed's own accessor
        with gathered(engine.module.parameters()):
            masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters() if p.requires_grad}
            engine_values = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        folder = Path(tempfile.mkdtemp(prefix="bf16-export-"))
        export(engine, method, bundle, folder, rank, frozen)
        found = {"losses": losses, "engine": str(next(engine.module.parameters()).dtype),
                 "optimizer": type(engine.optimizer).__name__,
                 "momentum": str(next(ctp.momentum_model.parameters()).dtype),
                 "queue": str(ctp.queues["image"].rows.dtype),
                 "engine after": sorted({str(v.dtype) for v in engine_values.values()})}
        if rank == 0:
            weights = load_file(folder / models.WEIGHTS_FILE)
            found.update(
                dtypes=sorted({str(w.dtype) for w in weights.values()}),
                # the masters, bit for bit, and not their bf16 copies that the engine computes with
                not_master=[n for n, m in masters.items() if not torch.equal(weights[n].reshape(m.shape), m)],
                rounded=all(torch.equal(m, m.bfloat16().float()) for m in masters.values()),
                frozen_kept=torch.equal(weights["visual.conv1.weight"], frozen["visual.conv1.weight"]),
                frozen_was_rounded=not torch.equal(frozen["visual.conv1.weight"],
                                                   engine_values["visual.conv1.weight"].float()))
        shutil.rmtree(folder, ignore_errors=True)
        out[stage] = found
    return out


@pytest.mark.slow  # (two DeepSpeed engines in bf16 on gloo, 15 s)
def test_bf16_trains_on_cpu_at_zero_0_and_3_and_exports_the_fp32_masters():
    """DeepSpeed's bf16 on CPU workers, asked for ZeRO 0 (run as BF16_Optimizer's stage 1) and 3, with CTP (momentum
    model, queues, a teacher-free first task): it trains, keeps the method's state in fp32, and exports fp32 weights, the optimizer's masters."""
    from tests.conftest import on_gloo

    results = on_gloo(_bf16_ctp_steps, 2)
    for rank, by_stage in results.items():
        for stage, out in by_stage.items():
            assert out["engine"] == "torch.bfloat16" and out["engine after"] == ["torch.bfloat16"], stage
            # below ZeRO 2, bf16 steps BF16_Optimizer (fp32 gradient accumulation), not the unfused fp16 path
            assert out["optimizer"] == ("BF16_Optimizer" if stage == 0 else "DeepSpeedZeroOptimizer_Stage3"), stage
            assert out["momentum"] == out["queue"] == "torch.float32", stage  # an EMA's small steps would vanish in bf16
            # it trained (CTP's queue moves its contrast every step, so the loss need not fall in so few)
            assert all(torch.isfinite(torch.tensor(out["losses"]))) and len(set(out["losses"])) == 4, stage
            if rank == 0:
                assert out["dtypes"] == ["torch.float32"] and out["not_master"] == [], stage
                assert not out["rounded"], stage  # (else the comparison could not tell masters from bf16 copies)
                assert out["frozen_kept"] and out["frozen_was_rounded"], stage


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
    bundle = models.create("clipstream-vit-tiny")
    model = method.prepare_model(prepare_for_deepspeed(bundle.model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.1, 1e-3),
                                      config=deepspeed_config(config["train"], world, 8))
    teacher = None
    if method.needs_teacher:  # the parent: another model, so the method's terms are not zero
        torch.manual_seed(1)
        teacher = frozen(prepare_for_deepspeed(models.create("clipstream-vit-tiny").model))
    return engine, method, teacher, bundle


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
            engine, method, teacher, _ = _engine(name, stage, world)
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
        engine, method, teacher, _ = _engine("ctp", 3, world, ["method.ctp.queue_size=16"])
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


@pytest.mark.slow  # (2 gloo processes, 30 s: the quick tier trains at ZeRO 3 in its one trained world, `two_tasks`)
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
