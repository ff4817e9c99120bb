"""EWC's and MAS's importances (training/methods/importance.py, ewc.py, mas.py) on a real tiny open_clip model, without
Ray, against CTP's code for its baselines (train/train_EWC.py, train/train_MAS.py): the mean over the task's batches
of the squared (EWC) or absolute (MAS) gradient of each whole batch's objective, every batch of the last epoch unless
capped, merged over tasks as a running mean, and a penalty whose weight is CTP's λ/2."""

import collections
import copy

import pytest
import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

from clipstream.training.engine import prepare_for_deepspeed
from clipstream.training.losses import clip_loss
from clipstream.training.methods import build, resolve
from clipstream.training.methods.base import TaskContext, forward_features

# CTP's λ of each baseline (its train_EWC.py / train_MAS.py), whose penalty is λ/2 · Σ Ω (θ − θ*)² (its App. Eq. 12)
CTP_LAMBDA = {"ewc": 5000.0, "mas": 1.0}


@pytest.fixture(scope="module")
def tiny():
    """A real open_clip CLIP, smaller than the presets' (a 300-token vocabulary), and 9 batches of 3 pairs: more
    than the 8 last batches the importances were measured on before."""
    torch.manual_seed(0)
    model = CLIP(embed_dim=32, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=32, patch_size=8, image_size=32),
                 text_cfg=CLIPTextCfg(context_length=16, vocab_size=300, width=64, heads=2, layers=2))
    g = torch.Generator().manual_seed(2)
    batches = [{"image": torch.randn(3, 3, 32, 32, generator=g), "text": torch.randint(1, 299, (3, 16), generator=g)}
               for _ in range(9)]
    return prepare_for_deepspeed(model), batches


def _ctx(model, task_index=0, teacher=None):
    return TaskContext(model=model, task_index=task_index, rank=0, world_size=1, device=torch.device("cpu"),
                       teacher=teacher)


def objective(name: str, feats) -> torch.Tensor:
    """What CTP's code differentiates: EWC its training loss (here the CLIP loss on the batch), MAS the batch mean of
    the plain L2 norms of the pre-normalisation image and text features."""
    if name == "ewc":
        return clip_loss(feats.image, feats.text, feats.logit_scale, distributed=False)
    return feats.image_raw.norm(dim=-1).mean() + feats.text_raw.norm(dim=-1).mean()


def ctp_importance(name: str, model, batches) -> dict:
    """CTP's getFisherDiagonal / get_Memory_Aware_Synapses, through autograd on the live model: per batch the gradient
    of the batch's objective, squared (EWC) or absolute (MAS), summed over the batches and divided by their number."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: torch.zeros_like(p) for n, p in params.items()}
    for batch in batches:
        feats = forward_features(model, batch["image"], batch["text"])
        grads = torch.autograd.grad(objective(name, feats), list(params.values()), allow_unused=True)
        for n, g in zip(params, grads):
            if g is not None:
                out[n] += g.pow(2) if name == "ewc" else g.abs()
    return {n: v / len(batches) for n, v in out.items()}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("name", ["ewc", "mas"])
def test_the_importances_are_ctps_batch_gradients_over_every_batch_of_the_last_epoch(tiny, name):
    model, batches = tiny
    stack = build(resolve(name))  # the preset, as the engine runs it: batches null
    window = collections.deque(range(10_000), maxlen=stack.task_end_batches)  # the engine's window of the last epoch
    assert len(window) == 10_000
    stack.prepare_model(model)
    stack.after_task(_ctx(model), batches)
    measured, expected = stack.components[0].importance, ctp_importance(name, model, batches)
    assert measured.keys() == expected.keys()
    assert all(close(measured[n], v) for n, v in expected.items())
    assert stack.components[0].task_metrics()["importance_seconds"] > 0
    # every batch counts: the last 8 alone (the old window) measure something else
    assert not all(close(measured[n], v) for n, v in ctp_importance(name, model, batches[-8:]).items())


@pytest.mark.parametrize("name", ["ewc", "mas"])
def test_a_capped_measurement_takes_the_last_batches_it_is_given(tiny, name):
    model, batches = tiny
    stack = build(resolve(name, [f"method.{name}.batches=4"]))
    assert stack.task_end_batches == 4
    stack.prepare_model(model)
    stack.after_task(_ctx(model), batches)
    expected = ctp_importance(name, model, batches[-4:])
    assert all(close(stack.components[0].importance[n], v) for n, v in expected.items())


@pytest.mark.parametrize("name", ["ewc", "mas"])
def test_importances_merge_over_tasks_as_a_running_mean(tiny, name):
    """CTP's code: Ω ← α·Ω + (1 − α)·Ω_new with α = iteration/(iteration + 1), the mean of every task's Ω."""
    model, batches = tiny
    method = build(resolve(name)).components[0]
    method.prepare_model(model)
    tasks = [batches[:1], batches[1:3], batches[3:4]]
    for t, task in enumerate(tasks):
        method.after_task(_ctx(model, t), task)
    each = [ctp_importance(name, model, task) for task in tasks]
    assert method.tasks == 3
    assert all(close(method.importance[n], sum(e[n] for e in each) / 3) for n in each[0])


@pytest.mark.parametrize("preset", ["ewc", "mas", "ewc-vit-b-16", "mas-vit-b-16", "ewc-vit-b-32", "mas-vit-b-32"])
def test_the_presets_penalty_is_ctps_with_its_lambda(tiny, preset):
    model, batches = tiny
    name = preset.split("-")[0]
    method = build(resolve(preset)).components[0]
    method.prepare_model(model)
    method.after_task(_ctx(model), batches[:2])
    teacher = copy.deepcopy(model).requires_grad_(False)
    live = copy.deepcopy(model)
    with torch.no_grad():
        for p in live.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ctx = _ctx(live, 1, teacher)
    method.before_task(ctx)
    penalty = method.loss_terms(ctx, batches[0], None)["penalty"]
    old = dict(teacher.named_parameters())
    ctp = CTP_LAMBDA[name] / 2 * sum((method.importance[n] * (p - old[n]).pow(2)).sum()
                                     for n, p in live.named_parameters() if n in method.importance)
    assert float(penalty.detach()) > 0 and torch.allclose(penalty, ctp, rtol=1e-5)
