"""Importance-weighted penalties (EWC, MAS): a quadratic pull toward the previous task's weights,
each parameter weighted by its importance; subclasses say how importance is measured and merged.

Penalty: weight · Σ_k Ω_k (θ_k − θ*_k)², θ* = the previous version (the frozen teacher); zero on task 1.
Importances are measured at the end of each task on its last batches, averaged over ranks, and kept
(on CPU) in the method state that is registered with the version.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from clipstream.training.methods.base import (
    Method,
    TaskContext,
    forward_features,
    gathered,
    trainable,
)


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
    kind = ""

    def __init__(self, params: dict):
        super().__init__(params)
        self.task_end_batches = int(params.get("batches", 8))
        self.importance: dict[str, torch.Tensor] = {}
        self.tasks = 0
        self._flat = None  # (live parameters, rows pulled, √(weight·Ω), θ*) for this task, on the device

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
        params = trainable(ctx.model)
        new = {n: torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), device=ctx.device) for n, p in params.items()}
        for batch in batches:
            feats = forward_features(ctx.model, batch["image"], batch["text"])
            grads = torch.autograd.grad(self.objective(feats), list(params.values()), allow_unused=True)
            for (n, _), g in zip(params.items(), grads):
                if g is not None:
                    new[n] += self.measure(g.float()) / len(batches)
        if ctx.world_size > 1:  # every rank keeps the same importances: the mean over their batches
            for v in new.values():
                dist.all_reduce(v)
                v /= ctx.world_size
        self.tasks += 1
        self.importance = {n: self.merge(self.importance.get(n), v.cpu(), self.tasks) for n, v in new.items()}
        self._flat = None

    def objective(self, feats) -> torch.Tensor:
        raise NotImplementedError

    def measure(self, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, old, new: torch.Tensor, t: int) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self):
        return {"importance": self.importance, "tasks": self.tasks}

    def load_state_dict(self, state):
        self.importance, self.tasks = dict(state.get("importance", {})), int(state.get("tasks", 0))
