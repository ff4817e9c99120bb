"""What the papers specify of each method that applies to CLIP: each term's algebra on hand-made features and
on a real tiny open_clip model, without Ray (the end-to-end streams are in test_streams.py)."""

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clipstream.training.data.task import Task
from clipstream.training.losses import clip_loss, fill_positives
from clipstream.training.methods import build, resolve
from clipstream.training.methods.base import TaskContext, forward_features, frozen
from clipstream.training.methods.ctp import CTP, Queue, cmc_loss, topology_losses
from clipstream.training.methods.er import ER, REPLAY, reservoir
from clipstream.training.methods.lwf import lwf_distill
from clipstream.training.methods.modx import modx_distill


def unit(n=8, d=16, seed=0, grad=False):
    x = F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)), dim=-1)
    return x.requires_grad_(grad)


def _ctx(model, teacher, task_index=1):
    return TaskContext(model=model, task_index=task_index, rank=0, world_size=1, device=torch.device("cpu"),
                       teacher=teacher)


ZERO_WEIGHTS = {"ewc": ["method.ewc.weight=0"], "mas": ["method.mas.weight=0"], "lwf": ["method.lwf.weight=0"],
                "modx": ["method.modx.alpha=0"],
                "ctp": ["method.ctp.cmc_weight=0", "method.ctp.topology_weight=0"]}


@pytest.mark.parametrize("name", sorted(ZERO_WEIGHTS))
def test_with_zero_weights_the_loss_is_the_clip_loss_and_not_otherwise(pair, name):
    student, teacher, batch = pair
    for overrides, vanishes in ((ZERO_WEIGHTS[name], True), ([], False)):
        model = copy.deepcopy(student)
        stack = build(resolve(name, overrides))
        ctx = _ctx(model, teacher)
        stack.prepare_model(model)  # (as the engine does: CTP copies its momentum model's module there)
        stack.before_task(ctx)
        feats = forward_features(model, batch["image"], batch["text"])
        if name in ("ewc", "mas"):  # importances as after a first task, so the penalty has something to weigh
            stack.after_task(ctx, [batch])
            with torch.no_grad():
                next(model.parameters()).add_(0.1)
            feats = forward_features(model, batch["image"], batch["text"])
        extra = sum(stack.loss_terms(ctx, batch, feats).values())
        assert (float(extra.detach() if torch.is_tensor(extra) else extra) == 0.0) == vanishes, (name, overrides, float(extra))
    if vanishes:
        grads = torch.autograd.grad(clip_loss(feats.image, feats.text, feats.logit_scale) + extra,
                                    [feats.image, feats.text])
        plain = torch.autograd.grad(clip_loss(feats.image, feats.text, feats.logit_scale), [feats.image, feats.text])
        assert all(torch.equal(a, b) for a, b in zip(grads, plain))


def test_distillation_terms_vanish_with_zero_gradient_when_student_is_teacher():
    img, txt = unit(seed=1, grad=True), unit(seed=2, grad=True)
    raw = [img * 3, txt * 2]
    for loss in (modx_distill(img, txt, img.detach(), txt.detach()),
                 modx_distill(img, txt, img.detach(), txt.detach(), mask_diagonal=True),
                 lwf_distill(raw, [r.detach() for r in raw], 2.0),
                 *topology_losses(img, txt, img.detach(), txt.detach(), 0.07)):
        g_img, g_txt = torch.autograd.grad(loss, [img, txt])
        assert abs(float(loss)) < 1e-6 and g_img.abs().max() < 1e-6 and g_txt.abs().max() < 1e-6
    other = unit(seed=3)
    assert float(modx_distill(img, txt, img.detach(), other)) > 0  # and > 0 when they differ
    assert float(topology_losses(img, txt, other, txt.detach(), 0.07)[0]) > 0


def _paper_modx(img, txt, t_img, t_txt):
    """Mod-X's loss as the paper writes it (Ni et al., arXiv:2305.07437, §4), literally (single process)."""
    y = torch.arange(len(img))
    S, S0 = img @ txt.T, t_img @ t_txt.T

    def kl(X, X0):
        m = (X0.argmax(1) == y).float()[:, None]
        q = torch.softmax(X0.float(), 1)
        logp = torch.log_softmax(X.float(), 1)
        return (m * q * (q.log() - logp)).sum()

    return (kl(S, S0) + kl(S.T, S0.T)) / 2


def test_modx_equals_the_papers_loss_and_keeps_only_rows_the_teacher_gets_right():
    img, txt = unit(seed=4, grad=True), unit(seed=5, grad=True)
    t_img = F.normalize(torch.eye(8, 16), dim=-1)
    assert float(modx_distill(img, txt, t_img, t_img.roll(1, 0))) == 0.0  # teacher wrong on every row
    t_txt = t_img.clone()
    t_txt[0] = F.normalize(t_img[0] + 3 * t_img[1], dim=-1)  # text 0 nearest image 1: t2i row 0 wrong, i2t right
    t_txt[5] = t_img[6]  # image 5's best text is now 6 (i2t row 5 wrong), text 5 still best at image 6
    sims = t_img @ t_txt.T
    i2t_ok, t2i_ok = sims.argmax(1) == torch.arange(8), sims.T.argmax(1) == torch.arange(8)
    assert not torch.equal(i2t_ok, t2i_ok)  # the two directions keep different rows
    ours = modx_distill(img, txt, t_img, t_txt)
    paper = _paper_modx(img, txt, t_img, t_txt)
    assert torch.allclose(ours, paper, atol=1e-6) and float(ours) > 0
    g_ours = torch.autograd.grad(ours, [img, txt])
    g_paper = torch.autograd.grad(_paper_modx(img, txt, t_img, t_txt), [img, txt])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_ours, g_paper))


def test_modx_is_invariant_to_batch_order_and_a_shared_rotation():
    img, txt, t_img, t_txt = unit(seed=6), unit(seed=7), unit(seed=8), unit(seed=9)
    t_txt = F.normalize(t_img + 0.3 * t_txt, dim=-1)  # a teacher that is mostly right
    base = modx_distill(img, txt, t_img, t_txt)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
    assert torch.allclose(modx_distill(img[perm], txt[perm], t_img[perm], t_txt[perm]), base, atol=1e-5)
    assert torch.allclose(modx_distill(img @ q, txt @ q, t_img @ q, t_txt @ q), base, atol=1e-5)
    assert float(base) >= 0


def test_compatible_momentum_model_is_the_midpoint_of_the_old_model_and_an_ema():
    torch.manual_seed(0)
    old, live = frozen(torch.nn.Linear(4, 3)), torch.nn.Linear(4, 3)
    live.load_state_dict(old.state_dict())
    m, ema = 0.9, {k: v.clone() for k, v in old.state_dict().items()}
    ctp = CTP({"momentum": m, "first_task_momentum": 0.995})
    ctx = _ctx(live, old)
    ctp.prepare_model(live)
    ctp.before_task(ctx)  # M starts as θ(t-1)
    assert all(not p.requires_grad for p in ctp.momentum_model.parameters())
    for step in range(5):
        with torch.no_grad():
            for p in live.parameters():
                p.add_(torch.randn_like(p))
        ctp.update_momentum(ctx)
        for k, v in live.state_dict().items():
            ema[k] = m * ema[k] + (1 - m) * v
    for k, v in ctp.momentum_model.state_dict().items():
        assert torch.allclose(v, (old.state_dict()[k] + ema[k]) / 2, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(old.parameters(), frozen(copy.deepcopy(old)).parameters()))
    midpoint = CTP({"momentum": 0.0, "first_task_momentum": 0.995})
    midpoint.prepare_model(live)
    midpoint.before_task(ctx)
    midpoint.update_momentum(ctx)
    for k, v in midpoint.momentum_model.state_dict().items():
        assert torch.allclose(v, (old.state_dict()[k] + live.state_dict()[k]) / 2, atol=1e-6)
    first = CTP({"momentum": 0.9, "first_task_momentum": 0.5})  # no θ(t-1): a plain EMA of the live model
    first.prepare_model(live)
    first.before_task(_ctx(live, None, 0))
    start = copy.deepcopy(first.momentum_model.state_dict())
    with torch.no_grad():
        live.weight.add_(1.0)
    first.update_momentum(_ctx(live, None, 0))
    assert torch.allclose(first.momentum_model.weight, 0.5 * start["weight"] + 0.5 * live.weight)


def test_each_step_through_the_engines_hooks_moves_the_momentum_model(pair):
    """The same rule, driven as the engine drives it (loss_terms, after_step), on a real tiny CLIP."""
    _, teacher, batch = pair
    live = copy.deepcopy(teacher).requires_grad_(True)  # a task starts from θ(t-1)
    m = 0.9
    ctp = build(resolve("ctp", [f"method.ctp.momentum={m}"])).components[0]
    ctx = _ctx(live, teacher)
    ctp.prepare_model(live)
    ctp.before_task(ctx)
    ema = {k: v.detach().clone() for k, v in teacher.named_parameters()}
    for step in range(3):
        with torch.no_grad():
            for p in live.parameters():
                p.add_(0.01 * torch.randn_like(p))
        for k, v in live.named_parameters():
            ema[k] = m * ema[k] + (1 - m) * v.detach()
        ctp.loss_terms(ctx, batch, forward_features(live, batch["image"], batch["text"]))
        ctp.after_step(ctx)
    old = dict(teacher.named_parameters())
    for k, v in ctp.momentum_model.named_parameters():
        assert torch.allclose(v, (old[k] + ema[k]) / 2, atol=1e-5), k


def test_the_momentum_model_keeps_fp32_weights_and_runs_at_the_live_models_precision(pair):
    """In bf16 training M's EMA stays in fp32 (its small steps would vanish in bf16) while its forward's matrix
    products run in bf16, as the live and teacher forwards do; in fp32 training everything stays fp32."""
    _, teacher, batch = pair
    for dtype in (torch.bfloat16, torch.float32):
        live = copy.deepcopy(teacher).to(dtype).requires_grad_(True)
        ctp = build(resolve("ctp", [])).components[0]
        ctx = _ctx(live, frozen(copy.deepcopy(teacher).to(dtype)))
        ctp.prepare_model(live)
        ctp.before_task(ctx)
        seen = []
        hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
                 for m in ctp.momentum_model.modules() if isinstance(m, torch.nn.Linear)]
        ctp.loss_terms(ctx, batch, forward_features(live, batch["image"], batch["text"]))
        for h in hooks:
            h.remove()
        assert seen and set(seen) == {dtype}, (dtype, set(seen))
        assert {p.dtype for p in ctp.momentum_model.parameters()} == {torch.float32}


def test_queue_is_a_fifo_of_fixed_length():
    q = Queue(6, 4, "cpu", key_len=3)
    assert q.rows.shape == (6, 4) and torch.allclose(q.rows.norm(dim=1), torch.ones(6))
    assert not q.holding(torch.zeros(1, 3, dtype=torch.long)).any()  # its random start is of no pair
    pushed = [torch.full((2, 4), float(i)) for i in range(5)]
    for i, x in enumerate(pushed):
        q.push(x, torch.full((2, 3), i))
        assert q.rows.shape == (6, 4) and q.keys.shape == (6, 3)
    assert torch.equal(q.ordered(), torch.cat(pushed[-3:]))  # oldest first, only the last K rows
    assert torch.equal(q.holding(torch.tensor([[3, 3, 3], [0, 0, 0]])), q.rows[:, 0] == 3)  # each row's pair with it
    q.push(torch.arange(32.0).reshape(8, 4), torch.arange(24).reshape(8, 3))  # more than K at once: the newest K
    assert torch.equal(q.ordered(), torch.arange(8.0, 32.0).reshape(6, 4))
    assert q.holding(torch.tensor([[6, 7, 8]])).sum() == 1 and not q.holding(torch.tensor([[3, 4, 5]])).any()


def test_cmc_positive_is_the_momentum_feature_of_the_same_pair_and_queue_counts_as_negatives():
    img, txt = unit(seed=10, grad=True), unit(seed=11, grad=True)
    queue = unit(n=16, seed=12)
    # momentum text i == live image i (and vice versa): every positive scores a cosine of 1
    matched, (m_img, _) = cmc_loss(img, txt, txt.detach(), img.detach(), queue, queue, 0.07)
    shuffled, _ = cmc_loss(img, txt, txt.detach().roll(1, 0), img.detach().roll(1, 0), queue, queue, 0.07)
    assert torch.equal(m_img, txt.detach()) and float(matched) < 0.1 < float(shuffled)
    harder = torch.cat([queue, F.normalize(img.detach() + 0.1 * unit(seed=13), dim=-1)])  # near-duplicate negatives
    more, _ = cmc_loss(img, txt, txt.detach(), img.detach(), harder, harder, 0.07)
    assert float(more) > float(matched)


def test_topology_suppresses_the_diagonal_before_temperature():
    x = unit(seed=15)
    probs = torch.softmax(fill_positives(x @ x.T, -1000.0) / 0.07, dim=1)
    assert probs.diagonal().max() < 1e-30 and torch.allclose(probs.sum(1), torch.ones(8))
    plain = torch.softmax(x @ x.T / 0.07, dim=1)
    assert plain.diagonal().min() > 0.5  # without suppression self-similarity dominates


def test_importances_are_nonnegative_and_merge_as_the_papers_say(pair):
    student, teacher, batch = pair
    for name in ("ewc", "mas"):
        model = copy.deepcopy(student)
        method = build(resolve(name)).components[0]
        method.prepare_model(model)  # (as the engine does: the copy the importances are measured on)
        ctx = _ctx(model, teacher, 0)
        assert method.loss_terms(ctx, batch, forward_features(model, batch["image"], batch["text"])) == {}
        method.after_task(ctx, [batch])
        first = {k: v.clone() for k, v in method.importance.items()}
        assert all((v >= 0).all() for v in first.values()) and sum(float(v.sum()) for v in first.values()) > 0
        half = {"image": batch["image"][:3], "text": batch["text"][:3]}
        method.after_task(ctx, [half])
        second = method.importance
        # both a running mean over tasks, as CTP's code merges them: between the two tasks' importances
        solo = build(resolve(name)).components[0]
        solo.prepare_model(model)
        solo.after_task(ctx, [half])
        for k in first:
            assert torch.allclose(second[k], (first[k] + solo.importance[k]) / 2, atol=1e-7)
        # the penalty is zero at the anchor and grows with distance from it
        anchored = _ctx(copy.deepcopy(teacher).requires_grad_(True), teacher)
        feats = forward_features(anchored.model, batch["image"], batch["text"])
        assert float(method.loss_terms(anchored, batch, feats)["penalty"]) == 0.0
        with torch.no_grad():
            anchored.model.text_projection.add_(0.05)
        assert float(method.loss_terms(anchored, batch, feats)["penalty"]) > 0


@pytest.mark.parametrize("name", ["ewc", "mas"])
@pytest.mark.parametrize("upstream", [1.0, 0.25])  # 0.25: the 1/grad_accum (or a loss scale) DeepSpeed applies
def test_the_penalty_and_its_closed_form_gradient_equal_the_quadratic_through_autograd(pair, name, upstream):
    student, teacher, batch = pair
    method = build(resolve(name)).components[0]
    model = method.prepare_model(copy.deepcopy(student))
    method.after_task(_ctx(model, teacher, 0), [batch])
    ctx = _ctx(model, teacher)
    method.before_task(ctx)
    penalty = method.loss_terms(ctx, batch, None)["penalty"]
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(upstream * penalty, params)
    anchor, weight = dict(teacher.named_parameters()), method.params["weight"]
    reference = weight * sum((method.importance[n] * (p - anchor[n]).pow(2)).sum() for n, p in model.named_parameters())
    theirs = torch.autograd.grad(upstream * reference, params)
    assert float(penalty) > 0 and torch.allclose(penalty, reference, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-9) for a, b in zip(ours, theirs))
    # the token embedding is pulled through the rows of the tokens the measuring batch held, the rest weigh zero
    live, rows, *_ = method._flat
    embedding = next(r for p, r in zip(live, rows) if p is model.token_embedding.weight)
    assert 0 < len(embedding) and set(embedding.tolist()) <= set(batch["text"].flatten().tolist())


def test_mas_measures_the_pre_normalisation_features(pair):
    student, teacher, batch = pair
    feats = forward_features(student, batch["image"], batch["text"])
    assert torch.allclose(feats.image, F.normalize(feats.image_raw, dim=-1))
    assert not torch.allclose(feats.image_raw.norm(dim=-1), torch.ones(6))  # so its norm has a gradient


def test_reservoir_keeps_every_item_with_equal_probability():
    size, n, runs = 10, 60, 3000
    counts = np.zeros(n)
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        buffer, seen = reservoir([], 0, range(25), size, rng)  # a stream in two tasks
        buffer, seen = reservoir(buffer, seen, range(25, n), size, rng)
        assert len(buffer) == size and len(set(buffer)) == size and seen == n
        counts[buffer] += 1
    expected = runs * size / n  # 500 per item
    assert np.abs(counts - expected).max() < 5 * math.sqrt(expected)  # no item (old or new) favoured
    assert abs(counts[:25].mean() - counts[25:].mean()) < 0.05 * expected
    assert reservoir([], 0, range(3), 10, np.random.default_rng(0)) == ([0, 1, 2], 3)


def test_er_buffer_holds_the_pairs_and_comes_back_as_a_task(stream, tmp_path):
    er = ER({"buffer_pairs": 20, "seed": 0})
    for i, folder in enumerate(stream):
        er.after_task(TaskContext(model=None, task_index=i, rank=0, world_size=1, device=torch.device("cpu"),
                                  current={"task": folder.name, "path": str(folder)}), [])
    rows = {folder.name: Task.load(folder).check("train").rows for folder in stream}
    assert len(er.pairs) == 20 and er.seen == sum(len(r) for r in rows.values())
    assert {p["task"] for p in er.pairs} == set(rows)  # both tasks represented (~50/50 of 20 here)
    restored = ER({"buffer_pairs": 20})
    restored.load_state_dict(er.state_dict())
    assert restored.pairs == er.pairs and restored.seen == er.seen
    [entry] = restored.extra_tasks({"task": "next"}, [], str(tmp_path))
    replay = Task.load(entry["path"])
    replayed = replay.check("train").rows
    assert entry["task"] == replay.name == REPLAY and len(replayed) == 20
    by_caption = {r["caption"]: r for task_rows in rows.values() for r in task_rows}
    for row, pair in zip(replayed, er.pairs):  # the very image bytes and caption of an original pair
        original = by_caption[row["caption"]]
        assert (replay.root / row["image"]).read_bytes() == (Path(stream[0]).parent / pair["task"] / original["image"]).read_bytes()
    assert ER({"buffer_pairs": 5}).extra_tasks({"task": "x"}, [], str(tmp_path)) == []

