"""EWC's and MAS's per-sample importances (training/methods/importance.py, ewc.py, mas.py) on a real tiny open_clip
model, without Ray: the torch.func measurement equals a loop of one-sample autograd gradients, whatever its chunk, and
it is not the batch-mean gradient's measure that it replaced."""

import pytest
import torch
import torch.nn.functional as F

from clipstream import models
from clipstream.training.engine import prepare_for_deepspeed
from clipstream.training.losses import clip_loss
from clipstream.training.methods import build, resolve
from clipstream.training.methods.base import TaskContext, forward_features

COLOURS = ("red", "blue", "green", "white", "black", "pink", "grey", "brown", "orange", "purple")


@pytest.fixture(scope="module")
def tiny():
    """A real tiny CLIP and two batches (5 and 4 pairs: a mean over batches of different sizes)."""
    torch.manual_seed(0)
    bundle = models.create("clipstream-vit-tiny")
    g = torch.Generator().manual_seed(2)
    captions = [f"a {c} square on a plain background" for c in COLOURS[:9]]
    batches = [{"image": torch.randn(n, 3, 32, 32, generator=g), "text": bundle.tokenizer(texts)}
               for n, texts in ((5, captions[:5]), (4, captions[5:]))]
    return prepare_for_deepspeed(bundle.model), batches


def measured(name: str, model, batches, chunk: int):
    method = build(resolve(name, [f"method.{name}.chunk={chunk}"])).components[0]
    method.prepare_model(model)  # (as the engine does)
    method.after_task(TaskContext(model=model, task_index=0, rank=0, world_size=1, device=torch.device("cpu")), batches)
    return method


def sample_terms(name: str, model, batch):
    """Each sample's term as the definition reads, through autograd on the live model: a forward of the whole batch
    in which only sample i's features carry gradients (the others detached), then EWC's (row i image→text + column i
    text→image cross-entropy) / 2 or MAS's squared norms of sample i's pre-normalisation features."""
    n = len(batch["image"])
    for i in range(n):
        feats = forward_features(model, batch["image"], batch["text"])
        own = (torch.arange(n) == i)[:, None]
        image = torch.where(own, feats.image, feats.image.detach())
        text = torch.where(own, feats.text, feats.text.detach())
        label = torch.tensor([i])
        if name == "ewc":
            yield (F.cross_entropy(feats.logit_scale * image[i:i + 1] @ text.T, label)
                   + F.cross_entropy(feats.logit_scale * text[i:i + 1] @ image.T, label)) / 2
        else:
            yield feats.image_raw[i].pow(2).sum() + feats.text_raw[i].pow(2).sum()


def looped(name: str, model, batches) -> tuple[dict, dict]:
    """(the mean over samples of measure(g_i), the mean over samples of g_i), one sample's gradient at a time."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    measure = (lambda g: g.pow(2)) if name == "ewc" else torch.abs
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    mean = {n: torch.zeros_like(p) for n, p in params.items()}
    count = sum(len(b["image"]) for b in batches)
    for batch in batches:
        for term in sample_terms(name, model, batch):
            for (n, _), g in zip(params.items(), torch.autograd.grad(term, list(params.values()), allow_unused=True)):
                if g is not None:
                    total[n] += measure(g) / count
                    mean[n] += g / count
    return total, mean


def batch_mean(name: str, model, batches) -> dict:
    """The measure the per-sample importances replaced: of each batch's mean gradient, averaged over batches."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: torch.zeros_like(p) for n, p in params.items()}
    for batch in batches:
        feats = forward_features(model, batch["image"], batch["text"])
        objective = (clip_loss(feats.image, feats.text, feats.logit_scale, distributed=False) if name == "ewc" else
                     (feats.image_raw.pow(2).sum(-1) + feats.text_raw.pow(2).sum(-1)).mean())
        for (n, _), g in zip(params.items(), torch.autograd.grad(objective, list(params.values()), allow_unused=True)):
            if g is not None:
                out[n] += (g.pow(2) if name == "ewc" else g.abs()) / len(batches)
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()) + 1e-30)


@pytest.mark.parametrize("name", ["ewc", "mas"])
def test_per_sample_importance_equals_a_loop_of_one_sample_gradients_at_any_chunk(tiny, name):
    model, batches = tiny
    expected, mean = looped(name, model, batches)
    for chunk in (1, 3):  # 3: chunks that do not divide the batches
        method = measured(name, model, batches, chunk)
        assert method.importance.keys() == expected.keys()
        for n, omega in method.importance.items():
            assert close(omega, expected[n]), (name, chunk, n)
        assert method.task_metrics()["importance_seconds"] > 0
    # the mean of the measure is not the measure of the mean (Jensen): larger, strictly so somewhere
    of_mean = {n: (g.pow(2) if name == "ewc" else g.abs()) for n, g in mean.items()}
    assert all((expected[n] >= v - 1e-6 * float(v.abs().max())).all() for n, v in of_mean.items())
    gap = sum(float((expected[n] - v).sum()) for n, v in of_mean.items())
    assert gap > 0.1 * sum(float(v.sum()) for v in of_mean.values())


def test_the_importances_exceed_the_batch_mean_ones_they_replaced(tiny):
    model, batches = tiny
    for name in ("ewc", "mas"):
        new, old = measured(name, model, batches, 8).importance, batch_mean(name, model, batches)
        total_new, total_old = (sum(float(v.sum()) for v in d.values()) for d in (new, old))
        assert total_new > 2 * total_old, name
        if name == "mas":  # the batch objective is the mean of the samples': mean |g_i| ≥ |mean g_i| everywhere
            assert all((new[n] >= v - 1e-6 * float(v.abs().max())).all() for n, v in old.items())
        else:  # the contrastive batch gradient is not the samples' mean: larger on most weights, not on each
            larger = sum(int((new[n] >= v).sum()) for n, v in old.items()) / sum(v.numel() for v in old.values())
            assert larger > 0.9, larger
