"""Importance-weighted penalties (EWC, MAS) as CTP's baselines measure and apply them (Zhu et al., ICCV 2023,
arXiv:2308.07146; official code train/train_EWC.py, train/train_MAS.py): a quadratic pull toward the previous task's
weights, each parameter weighted by its importance; subclasses say what objective's gradient is measured and how.

Penalty: weight · Σ_k Ω_k (θ_k − θ*_k)², θ* = the previous version (the frozen teacher); zero on task 1. CTP's code
adds λ · Σ Ω (θ − θ*)² / 2, so weight = λ/2 of its λ.

Importances are measured at the end of each task as CTP's code does: Ω is the mean over the task's batches of
measure(∇θ objective(batch)), the gradient of the whole batch's objective (EWC: g², MAS: |g|), taken on the task's
last-epoch batches, every one of them (`batches` null: one pass over the task's data at its final weights, CTP's
`getFisherDiagonal`), or the last `batches` of them (an estimate of the same mean from fewer batches, which the engine
then holds until the task ends); merged over tasks as a running mean, Ω ← ((t−1)·Ω + Ω_new)/t (`alpha =
iteration/(iteration+1)` there). The gradients are taken on a plain fp32 copy of the model made before the engine
takes it and loaded with the live weights for the measurement: under ZeRO-3 the live module holds partitions that
hooks gather around each call, and its backward would reduce into the engine's gradient buffers (CTP's momentum model
is kept the same way). Each rank measures its own batches, with the objective on its local batch; the importances
are averaged over ranks (every rank keeps the same) and kept (on CPU) in the method state registered with the
version; the measurement's seconds are logged as `method/importance_seconds`.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from clipstream.training.methods.base import (
    Features,
    Method,
    TaskContext,
    forward_features,
    frozen,
    gathered,
    trainable,
)


def batch_importance(model: torch.nn.Module, names: list[str], batches: list[dict],
                     objective: Callable[[Features], torch.Tensor],
                     measure: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: the mean over `batches` of measure(∇ objective(the batch's features))} for `model`'s parameters `names`
    (the others constant), fp32. `model` is a plain module (no ZeRO-3 partitions) whose parameters do not otherwise
    train: they take gradients for the duration."""
    params = dict(model.named_parameters())
    wanted = [params[n] for n in names]
    total = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for n, p in zip(names, wanted)}
    for p in wanted:
        p.requires_grad_(True)
    try:
        for b in batches:
            grads = torch.autograd.grad(objective(forward_features(model, b["image"], b["text"])), wanted,
                                        allow_unused=True)  # (MAS's features' norms do not reach the logit scale)
            for n, g in zip(names, grads):
                if g is not None:
                    total[n] += measure(g.float())
    finally:
        for p in wanted:
            p.requires_grad_(False)
    return {n: v / max(len(batches), 1) for n, v in total.items()}


class QuadraticPull(torch.autograd.Function):
    """Σ_k ‖s_k ⊙ (θ_k − θ*_k)‖² with s = √(weight·Ω), and its gradient in closed form, 2 s ⊙ s ⊙ (θ − θ*).

    As a graph of elementwise ops (or one flat concatenation of the parameters, as before) autograd made
    ~20 passes over every parameter per step, 1.29× finetune's step on the tiny models; here forward is a
    subtraction, a multiplication and a norm per tensor, backward one multiplication, all as `torch._foreach_*`
    over the parameter list (no concatenation). Upstream scaling (gradient accumulation, fp16 loss scale)
    arrives as the output gradient, so the engine's arithmetic stays DeepSpeed's."""

    @staticmethod
    def forward(ctx, scale, anchor, *params):
        e = torch._foreach_sub([p.float() for p in params], anchor)  # θ − θ* in fp32, whatever the engine's dtype
        torch._foreach_mul_(e, scale)
        ctx.pull, ctx.dtypes = (e, scale), [p.dtype for p in params]
        return torch.stack(torch._foreach_norm(e)).square().sum()

    @staticmethod
    def backward(ctx, grad):
        e, scale = ctx.pull
        grads = torch._foreach_mul(e, scale)
        torch._foreach_mul_(grads, 2 * grad)
        return (None, None, *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)))


class Importance(Method):
    needs_teacher = True

    def __init__(self, params: dict):
        super().__init__(params)
        # null: every batch of the last epoch (the engine's window of them is then unbounded)
        self.task_end_batches = sys.maxsize if params.get("batches") is None else int(params["batches"])
        self.importance: dict[str, torch.Tensor] = {}
        self.tasks = 0
        self._flat = None  # (live parameters, rows pulled, √(weight·Ω), θ*) for this task, on the device
        self._plain = None  # the fp32 copy the importances are measured on (`prepare_model`)
        self._seconds = None  # the last measurement's

    def prepare_model(self, model):
        self._plain = frozen(copy.deepcopy(model).float())
        return model

    def before_task(self, ctx):
        self._flat = None

    def loss_terms(self, ctx, batch, feats):
        if not self.importance or ctx.teacher is None:
            return {}
        if self._flat is None:
            self._flat = self._pulled(trainable(ctx.model), dict(ctx.teacher.named_parameters()), ctx.device)
        live, rows, scale, anchor = self._flat
        # under ZeRO-3 the live weights are whole only while gathered; the pull keeps θ − θ*, not them, for its
        # backward, whose gradients then reach each parameter as its forward's do
        with gathered(live):
            params = [p if r is None else p.index_select(0, r) for p, r in zip(live, rows)]
            return {"penalty": QuadraticPull.apply(scale, anchor, *params)}

    def _pulled(self, live: dict, anchor: dict, device) -> tuple:
        """Per parameter the pull needs: the live tensor, the rows it reaches (None: all), √(weight·Ω) and θ* there.

        A row whose importance is zero everywhere adds nothing to the penalty or its gradient: the token embedding's
        rows of tokens the measuring batches never held (most of a 49k vocabulary; on the tiny models 87% of all
        parameters). Those tensors are pulled through their nonzero rows alone (index_select: its backward scatters
        into the full gradient): the penalty's passes then touch ~13% of the parameters there."""
        names, rows, scale, theta = [n for n in live if n in self.importance], [], [], []
        for n in names:
            omega, reach = self.importance[n].float(), None
            if omega.dim() and omega.shape[0] > 1:
                nonzero = omega.reshape(omega.shape[0], -1).ne(0).any(dim=1).nonzero().squeeze(1)
                if len(nonzero) <= omega.shape[0] // 2:
                    reach, omega = nonzero, omega.index_select(0, nonzero)
            rows.append(None if reach is None else reach.to(device))
            scale.append((self.params["weight"] * omega).sqrt().to(device))
            t = anchor[n].detach().float()
            theta.append(t if reach is None else t.index_select(0, reach.to(t.device)))
        return [live[n] for n in names], rows, scale, theta

    def after_task(self, ctx: TaskContext, batches: list[dict]) -> None:
        tic = time.perf_counter()
        plain = self._plain.to(ctx.device)
        live, buffers = dict(ctx.model.named_parameters()), dict(ctx.model.named_buffers())
        with torch.no_grad(), gathered(live.values()):  # (ZeRO-3: a collective, every rank enters)
            for n, p in plain.named_parameters():
                p.copy_(live[n])
            for n, b in plain.named_buffers():
                b.copy_(buffers[n])
        new = batch_importance(plain, list(trainable(ctx.model)), batches, self.objective, self.measure)
        if ctx.world_size > 1:  # every rank keeps the same importances: the mean over their batches
            for v in new.values():
                dist.all_reduce(v)
                v /= ctx.world_size
        self.tasks += 1
        t, old = self.tasks, self.importance
        self.importance = {n: ((t - 1) * old[n] + v.cpu()) / t if n in old else v.cpu() for n, v in new.items()}
        self._flat = None
        self._seconds = time.perf_counter() - tic

    def task_metrics(self):
        return {} if self._seconds is None else {"importance_seconds": self._seconds}

    def objective(self, feats: Features) -> torch.Tensor:
        """The scalar of one batch's features whose gradient is measured."""
        raise NotImplementedError

    def measure(self, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self):
        return {"importance": self.importance, "tasks": self.tasks}

    def load_state_dict(self, state):
        self.importance, self.tasks = dict(state.get("importance", {})), int(state.get("tasks", 0))
