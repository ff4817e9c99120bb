"""The CLIP loss over gathered features equals open_clip's ClipLoss, on one process and across two."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from open_clip.loss import ClipLoss

from training.losses import clip_loss


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


def _worker(rank, world, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    img, txt, scale = _features(8)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    b = img.shape[0] // world
    local_img = img[rank * b:(rank + 1) * b].detach().requires_grad_(True)
    local_txt = txt[rank * b:(rank + 1) * b].detach().requires_grad_(True)
    ours = clip_loss(local_img, local_txt, scale)
    ours.backward()
    theirs = ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)(local_img.detach(), local_txt.detach(), scale)
    # numpy, not tensors: a tensor crosses processes through shared memory that dies with this process
    queue.put((rank, float(ours), float(theirs), local_img.grad.numpy().copy(), local_txt.grad.numpy().copy()))
    dist.destroy_process_group()


def test_two_workers_equal_one_process_on_the_whole_batch():
    """Mean of the ranks' losses = full-batch loss; rank gradients (summed by gather's backward,
    averaged over ranks as DeepSpeed does) = the full-batch gradient rows of each rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    img, txt, scale = _features(8)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    full = clip_loss(img, txt, scale)
    full.backward()
    mean_loss = sum(r[1] for r in results) / 2
    assert mean_loss == pytest.approx(float(full.detach()), abs=1e-5), (results, float(full.detach()))
    for rank, ours, theirs, g_img, g_txt in results:
        assert ours == pytest.approx(theirs, abs=1e-5)
        assert torch.allclose(torch.from_numpy(g_img) / 2, img.grad[rank * 4:(rank + 1) * 4], atol=1e-5)
        assert torch.allclose(torch.from_numpy(g_txt) / 2, txt.grad[rank * 4:(rank + 1) * 4], atol=1e-5)
