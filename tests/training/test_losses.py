"""The CLIP loss over gathered features equals open_clip's ClipLoss, on one process and across two."""

import pytest
import torch
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from clipstream.training.losses import clip_loss
from tests.conftest import on_gloo


def _features(n=8, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (F.normalize(torch.randn(n, d, generator=g), dim=-1), F.normalize(torch.randn(n, d, generator=g), dim=-1),
            torch.tensor(14.3))


def test_single_process_equals_open_clip_loss():
    img, txt, scale = _features()
    assert torch.allclose(clip_loss(img, txt, scale), ClipLoss()(img, txt, scale), atol=1e-6)


def test_loss_is_low_for_matched_pairs_and_high_for_shuffled():
    img, _, scale = _features()
    assert clip_loss(img, img, torch.tensor(100.0)) < 1e-3
    assert clip_loss(img, img.roll(1, 0), torch.tensor(100.0)) > 10


def _worker(rank, world):
    img, txt, scale = _features(8)
    b = img.shape[0] // world
    local_img = img[rank * b:(rank + 1) * b].detach().requires_grad_(True)
    local_txt = txt[rank * b:(rank + 1) * b].detach().requires_grad_(True)
    ours = clip_loss(local_img, local_txt, scale)
    ours.backward()
    theirs = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)(local_img.detach(), local_txt.detach(), scale)
    return float(ours), float(theirs), local_img.grad.numpy().copy(), local_txt.grad.numpy().copy()


@pytest.mark.component
def test_two_workers_equal_one_process_on_the_whole_batch():
    """Mean of the ranks' losses = full-batch loss; rank gradients (summed by gather's backward,
    averaged over ranks as DeepSpeed does) = the full-batch gradient rows of each rank."""
    results = on_gloo(_worker, 2)
    img, txt, scale = _features(8)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    full = clip_loss(img, txt, scale)
    full.backward()
    mean_loss = sum(r[0] for r in results.values()) / 2
    assert mean_loss == pytest.approx(float(full.detach()), abs=1e-5), (results, float(full.detach()))
    for rank, (ours, theirs, g_img, g_txt) in results.items():
        assert ours == pytest.approx(theirs, abs=1e-5)
        assert torch.allclose(torch.from_numpy(g_img) / 2, img.grad[rank * 4:(rank + 1) * 4], atol=1e-5)
        assert torch.allclose(torch.from_numpy(g_txt) / 2, txt.grad[rank * 4:(rank + 1) * 4], atol=1e-5)
