"""Every method loss that looks at other pairs of the batch gives 2 workers (gloo, real processes) the
loss and gradients of 1 process on the whole batch: the ranks' mean loss is the full-batch loss, and
each rank's gradient, averaged over ranks as DeepSpeed does, is the full-batch gradient of its rows."""

import pytest
import torch
import torch.nn.functional as F

from clipstream.training.losses import ckc_loss
from clipstream.training.methods.ctp import cmc_loss, topology_losses
from clipstream.training.methods.lwf import lwf_distill
from clipstream.training.methods.modx import modx_distill
from tests.conftest import on_gloo

N, D, WORLD = 8, 16, 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = [F.normalize(torch.randn(N, D, generator=g), dim=-1) for _ in range(6)]
    x[2] = F.normalize(x[0] + 0.4 * x[2], dim=-1)  # a teacher that is right on most rows, so Mod-X keeps some
    x[3] = F.normalize(x[0] + 0.4 * x[3], dim=-1)
    return x + [F.normalize(torch.randn(12, D, generator=g), dim=-1)]  # img, txt, t_img, t_txt, m_img, m_txt, queue


CASES = {
    "modx": lambda i, t, ti, tt, mi, mt, q: modx_distill(i, t, ti, tt),
    "modx_masked": lambda i, t, ti, tt, mi, mt, q: modx_distill(i, t, ti, tt, mask_diagonal=True),
    "lwf": lambda i, t, ti, tt, mi, mt, q: lwf_distill([3 * i, 2 * t], [3 * ti, 2 * tt], 2.0),
    "ctp_cmc": lambda i, t, ti, tt, mi, mt, q: cmc_loss(i, t, mi, mt, q, q, 0.07)[0],
    "ctp_topology_c": lambda i, t, ti, tt, mi, mt, q: topology_losses(i, t, ti, tt, 0.07)[0],
    "ctp_topology_s": lambda i, t, ti, tt, mi, mt, q: topology_losses(i, t, ti, tt, 0.07)[1],
    # C-CLIP's CKC over the stacked items: gathered rank by rank ([img0, txt0, img1, txt1]), a reordering of the
    # single process's [img, txt] that the loss does not see
    "cclip_ckc": lambda i, t, ti, tt, mi, mt, q: ckc_loss([3 * i, 2 * t], [ti, tt], torch.tensor(10.0)),
}


def _worker(rank, world):
    x = _inputs()
    rows = slice(rank * N // world, (rank + 1) * N // world)
    out = {}
    for name, fn in CASES.items():
        img, txt = (v[rows].clone().requires_grad_(True) for v in x[:2])
        loss = fn(img, txt, *(v[rows] for v in x[2:6]), x[6])
        loss.backward()
        out[name] = (float(loss), img.grad.numpy().copy(), txt.grad.numpy().copy())
    return out


@pytest.fixture(scope="module")
def two_workers():
    return on_gloo(_worker, WORLD)


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_workers_equal_one_process_on_the_whole_batch(two_workers, name):
    x = _inputs()
    img, txt = (v.clone().requires_grad_(True) for v in x[:2])
    full = CASES[name](img, txt, *x[2:])
    full.backward()
    assert float(full) > 1e-4  # a case that is zero everywhere would prove nothing
    mean = sum(two_workers[r][name][0] for r in range(WORLD)) / WORLD
    assert mean == pytest.approx(float(full), rel=1e-5, abs=1e-6)
    half = N // WORLD
    for rank in range(WORLD):
        _, g_img, g_txt = two_workers[rank][name]
        assert torch.allclose(torch.from_numpy(g_img) / WORLD, img.grad[rank * half:(rank + 1) * half], atol=1e-5)
        assert torch.allclose(torch.from_numpy(g_txt) / WORLD, txt.grad[rank * half:(rank + 1) * half], atol=1e-5)
