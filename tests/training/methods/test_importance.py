"""EWC's and MAS's per-sample importances (training/methods/importance.py, ewc.py, mas.py) on a real tiny open_clip
model, without Ray: the torch.func measurement equals a loop of one-sample autograd gradients, whatever its chunk, and
it is not the batch-mean gradient's measure that it replaced (larger: mean g² >= (mean g)²)."""

import pytest
import torch
import torch.nn.functional as F
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

from clipstream.training.engine import prepare_for_deepspeed
from clipstream.training.losses import clip_loss
from clipstream.training.methods import build, resolve
from clipstream.training.methods.base import TaskContext, forward_features


@pytest.fixture(scope="module")
def tiny():
    """A real open_clip CLIP, smaller than the presets' (a 300-token vocabulary: the loop below takes every weight's
    gradient once per sample), and two batches of 5 pairs."""
    torch.manual_seed(0)
    model = CLIP(embed_dim=32, vision_cfg=CLIPVisionCfg(layers=2, width=64, head_width=32, patch_size=8, image_size=32),
                 text_cfg=CLIPTextCfg(context_length=16, vocab_size=300, width=64, heads=2, layers=2))
    g = torch.Generator().manual_seed(2)
    batches = [{"image": torch.randn(5, 3, 32, 32, generator=g), "text": torch.randint(1, 299, (5, 16), generator=g)}
               for _ in range(2)]
    return prepare_for_deepspeed(model), batches


def measured(name: str, model, batches, chunk: int):
    method = build(resolve(name, [f"method.{name}.chunk={chunk}"])).components[0]
    method.prepare_model(model)  # (as the engine does)
    method.after_task(TaskContext(model=model, task_index=0, rank=0, world_size=1, device=torch.device("cpu")), batches)
    return method


def sample_terms(name: str, model, batch):
    """Each sample's term as the definition reads, through autograd on the live model: the batch's features without
    gradients, then sample i alone forward, its features put in their place, and EWC's (row i image→text + column i
    text→image cross-entropy) / 2 or MAS's squared norms of sample i's pre-normalisation features."""
    with torch.no_grad():
        others = forward_features(model, batch["image"], batch["text"])
    for i in range(len(batch["image"])):
        feats = forward_features(model, batch["image"][i:i + 1], batch["text"][i:i + 1])
        if name == "mas":
            yield feats.image_raw.pow(2).sum() + feats.text_raw.pow(2).sum()
            continue
        image = torch.cat([others.image[:i], feats.image, others.image[i + 1:]])
        text = torch.cat([others.text[:i], feats.text, others.text[i + 1:]])
        label = torch.tensor([i])
        yield (F.cross_entropy(feats.logit_scale * feats.image @ text.T, label)
               + F.cross_entropy(feats.logit_scale * feats.text @ image.T, label)) / 2


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
    return torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def at_least(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a >= b elementwise, but for the float error of summing the same gradients in another order."""
    return bool((a >= b - 1e-4 * b - 1e-6 * float(b.max())).all())


@pytest.mark.parametrize("name", ["ewc", "mas"])
def test_per_sample_importance_equals_a_loop_of_one_sample_gradients_and_exceeds_the_batch_mean_one(tiny, name):
    model, batches = tiny
    expected, mean = looped(name, model, batches)
    for chunk in (3, 16):  # 3: chunks that do not divide the batches
        method = measured(name, model, batches, chunk)
        assert method.importance.keys() == expected.keys()
        for n, omega in method.importance.items():
            assert close(omega, expected[n]), (chunk, n)
        assert method.task_metrics()["importance_seconds"] > 0
    new = method.importance
    # the mean of the measure is not the measure of the mean (Jensen): larger, strictly so somewhere
    of_mean = {n: (g.pow(2) if name == "ewc" else g.abs()) for n, g in mean.items()}
    assert all(at_least(new[n], v) for n, v in of_mean.items())
    gap = sum(float((new[n] - v).sum()) for n, v in of_mean.items())
    assert gap > 0.1 * sum(float(v.sum()) for v in of_mean.values())
    # against what it replaced, the measure of each batch's mean gradient: for MAS, whose batch objective is the mean
    # of the samples', that is the Jensen bound above per batch, on every weight; EWC's contrastive batch gradient is
    # not the samples' mean, and its measure is larger in every tensor and on most weights
    old = batch_mean(name, model, batches)
    if name == "mas":
        assert all(at_least(new[n], v) for n, v in old.items())
    assert all(float(new[n].sum()) > float(v.sum()) for n, v in old.items() if v.any())
    assert sum(int((new[n] >= v).sum()) for n, v in old.items()) > 0.85 * sum(v.numel() for v in old.values())
    assert sum(float(v.sum()) for v in new.values()) > 1.3 * sum(float(v.sum()) for v in old.values())
