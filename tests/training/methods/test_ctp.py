"""CTP's momentum queue holds other pairs only (training/methods/ctp.py): in CTP's setting (K = 1024 against tasks
of 38k-236k pairs) a pair's earlier momentum features have left the queue before it comes round again; on a task
smaller than the queue they have not, and the queued rows of the batch's own pairs are left out of the contrast set,
on a real tiny open_clip model, without Ray."""

import copy

import torch
import torch.nn.functional as F

from clipstream.training.methods import build, resolve
from clipstream.training.methods.base import TaskContext, forward_features
from clipstream.training.methods.ctp import cmc_loss


def unit(n, d=16, seed=0, grad=False):
    x = F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)
    return x.requires_grad_(grad)


def test_rows_left_out_of_the_contrast_set_weigh_as_if_the_queue_had_never_held_them():
    img, txt, m_img, m_txt = unit(6, seed=1, grad=True), unit(6, seed=2, grad=True), unit(6, seed=3), unit(6, seed=4)
    q_img, q_txt = unit(10, seed=5), unit(10, seed=6)
    stale = torch.tensor([True, False, False, True, True, False, False, False, False, True])
    masked, _ = cmc_loss(img, txt, m_img, m_txt, q_img, q_txt, 0.07, stale)
    grads = torch.autograd.grad(masked, [img, txt])
    without, _ = cmc_loss(img, txt, m_img, m_txt, q_img[~stale], q_txt[~stale], 0.07)
    assert torch.allclose(masked, without, rtol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads, torch.autograd.grad(without, [img, txt])))
    assert not torch.allclose(masked, cmc_loss(img, txt, m_img, m_txt, q_img, q_txt, 0.07)[0])
    none_left_out = cmc_loss(img, txt, m_img, m_txt, q_img, q_txt, 0.07, torch.zeros(10, dtype=torch.bool))[0]
    assert torch.equal(none_left_out, cmc_loss(img, txt, m_img, m_txt, q_img, q_txt, 0.07)[0])


def _started(teacher):
    """A live copy of `teacher`, CTP with a queue of 16 on it and its task's context, the task begun."""
    live = copy.deepcopy(teacher).requires_grad_(True)
    ctp = build(resolve("ctp", ["method.ctp.queue_size=16"])).components[0]
    ctx = TaskContext(model=live, task_index=1, rank=0, world_size=1, device=torch.device("cpu"), teacher=teacher)
    ctp.prepare_model(live)
    ctp.before_task(ctx)
    return live, ctp, ctx


def _step(ctp, ctx, batch):
    """One step's terms, and the queues as that step contrasted against them."""
    queues = {k: (q.rows.clone(), q.keys.clone()) for k, q in ctp.queues.items()}
    terms = ctp.loss_terms(ctx, batch, forward_features(ctx.model, batch["image"], batch["text"]))
    return terms, queues


def test_a_task_smaller_than_the_queue_never_contrasts_a_pair_with_its_own_earlier_features(pair):
    """The task: `pair`'s 6 pairs, smaller than the queue of 16."""
    _, teacher, batch = pair
    live, ctp, ctx = _started(teacher)
    _step(ctp, ctx, batch)  # the first pass over the task: the queue then holds its 6 pairs
    half = {k: v[:3] for k, v in batch.items()}
    for epoch in range(2):  # the task comes round again: its pairs' earlier features are in the queue
        for b in (batch, half):
            terms, queues = _step(ctp, ctx, b)
            rows, keys = queues["text"]
            own = (keys[:, None, :] == b["text"][None]).all(-1).any(-1)
            assert own.sum() >= len(b["text"]), epoch  # (the false negatives the queue holds)
            # the CMC term is the one against the queue without them, M's features as this step's M gave them
            m = forward_features(ctp.momentum_model, b["image"], b["text"])
            feats = forward_features(live, b["image"], b["text"])
            q_img = queues["image"][0]
            expected, _ = cmc_loss(feats.image, feats.text, m.image, m.text, q_img[~own], rows[~own], 0.07)
            assert torch.allclose(terms["cmc"], expected, rtol=1e-5), epoch
            kept_all, _ = cmc_loss(feats.image, feats.text, m.image, m.text, q_img, rows, 0.07)
            assert not torch.allclose(terms["cmc"], kept_all, rtol=1e-3)
    # a resumed worker's state brings back which pairs the queue holds: its next step is the same, rows left out
    resumed = build(resolve("ctp", ["method.ctp.queue_size=16"])).components[0]
    resumed.prepare_model(live)
    resumed.load_state_dict(ctp.state_dict())
    feats = forward_features(live, batch["image"], batch["text"])
    assert torch.allclose(resumed.loss_terms(ctx, batch, feats)["cmc"], ctp.loss_terms(ctx, batch, feats)["cmc"])


def test_pairs_the_queue_has_not_held_leave_it_whole(pair):
    """At CTP's sizes a pair has left the queue before it comes round: the contrast set is [M's batch ; K rows]."""
    _, teacher, batch = pair
    live, ctp, ctx = _started(teacher)
    first, other = ({k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()})
    _step(ctp, ctx, first)
    terms, queues = _step(ctp, ctx, other)
    assert not (queues["text"][1][:, None, :] == other["text"][None]).all(-1).any()
    m = forward_features(ctp.momentum_model, other["image"], other["text"])
    feats = forward_features(live, other["image"], other["text"])
    whole, _ = cmc_loss(feats.image, feats.text, m.image, m.text, queues["image"][0], queues["text"][0], 0.07)
    assert torch.allclose(terms["cmc"], whole, rtol=1e-5)
