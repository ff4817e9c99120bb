"""Importance-weighted penalties (EWC, MAS): a quadratic pull toward the previous task's weights,
each parameter weighted by its importance; subclasses say how importance is measured and merged.

Penalty: weight · Σ_k Ω_k (θ_k − θ*_k)², θ* = the previous version (the frozen teacher); zero on task 1.

Importances are measured at the end of each task on its last `batches` batches, from per-sample gradients: Ω is the
mean over the samples of measure(∇θ ℓ_i) (EWC: g², the diagonal empirical Fisher; MAS: |g|), not the measure of the
batch's mean gradient, which underestimates it (mean g² ≥ (mean g)²). Each sample's gradient is one sample's forward
and backward (`Importance.sample_objective` says what ℓ_i is), taken `chunk` samples at a time with torch.func
(vmap of grad; memory: chunk × the trainable parameters). They run on a plain fp32 copy of the model made before the
engine takes it and loaded with the live weights for the measurement: under ZeRO-3 the live module holds partitions
that hooks gather around each call, which torch.func does not trace through (CTP's momentum model is kept the same
way). The importances are averaged over ranks and kept (on CPU) in the method state registered with the version;
the measurement's seconds are logged as `method/importance_seconds`.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from clipstream.training.methods.base import (
    Method,
    TaskContext,
    frozen,
    gathered,
    towers,
    trainable,
)

# objective(image_raw, text_raw, scale, batch, i): sample i's scalar term from its own pre-normalisation features
# ([D] each) and exp(logit_scale), with `batch` = (images, texts), the batch's normalised features, as constants
Objective = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple, torch.Tensor], torch.Tensor]


def per_sample_importance(model: torch.nn.Module, names: list[str], batches: list[dict], objective: Objective,
                          measure: Callable[[torch.Tensor], torch.Tensor], chunk: int) -> dict[str, torch.Tensor]:
    """{name: the mean over every sample of `batches` of measure(∇ objective_i)} for `model`'s parameters `names`
    (the others constant), fp32. `model` is a plain module (no ZeRO-3 partitions); its forward is swapped for the
    towers' for the duration."""
    wanted = set(names)
    theta = {n: p.detach() for n, p in model.named_parameters() if n in wanted}
    dtype = next(iter(theta.values())).dtype

    def term(theta, image, text, i, batch):
        image_raw, text_raw, scale = functional_call(model, theta, (image[None], text[None]))
        return objective(image_raw[0].float(), text_raw[0].float(), scale.float().reshape(()), batch, i)

    per_sample = vmap(grad(term), in_dims=(None, 0, 0, 0, None))
    total = {n: torch.zeros(t.shape, dtype=torch.float32, device=t.device) for n, t in theta.items()}
    count = 0
    # On CUDA, vmap hands the fused attention kernels a mask without the batch dimension they check for ("attn_bias:
    # wrong shape"): torch's math attention there, which vmap batches like any matmul and softmax.
    math_attention = sdpa_kernel(SDPBackend.MATH) if next(iter(theta.values())).is_cuda else contextlib.nullcontext()
    with towers(model), warnings.catch_warnings(), math_attention:
        # torch's fused CPU attention has no vmap rule: vmap runs it sample by sample, which costs little next to the
        # gradients themselves, and says so on every call
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        for b in batches:
            image, text = b["image"].to(dtype), b["text"]
            with torch.no_grad():
                image_raw, text_raw, _ = model(image, text)
            batch = (F.normalize(image_raw.float(), dim=-1), F.normalize(text_raw.float(), dim=-1))
            for start in range(0, len(image), chunk):
                i = torch.arange(start, min(start + chunk, len(image)), device=image.device)
                for n, g in per_sample(theta, image[i], text[i], i, batch).items():
                    total[n] += measure(g.float()).sum(0)
            count += len(image)
    return {n: v / max(count, 1) for n, v in total.items()}


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
        self.task_end_batches = int(params.get("batches", 8))
        self.chunk = int(params.get("chunk", 16))
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
        new = per_sample_importance(plain, list(trainable(ctx.model)), batches, self.sample_objective, self.measure,
                                    self.chunk)
        if ctx.world_size > 1:  # every rank keeps the same importances: the mean over their samples
            for v in new.values():
                dist.all_reduce(v)
                v /= ctx.world_size
        self.tasks += 1
        self.importance = {n: self.merge(self.importance.get(n), v.cpu(), self.tasks) for n, v in new.items()}
        self._flat = None
        self._seconds = time.perf_counter() - tic

    def task_metrics(self):
        return {} if self._seconds is None else {"importance_seconds": self._seconds}

    def sample_objective(self, image_raw: torch.Tensor, text_raw: torch.Tensor, scale: torch.Tensor, batch: tuple,
                         i: torch.Tensor) -> torch.Tensor:
        """Sample i's term whose gradient is measured (an `Objective`)."""
        raise NotImplementedError

    def measure(self, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, old, new: torch.Tensor, t: int) -> torch.Tensor:
        raise NotImplementedError

    def state_dict(self):
        return {"importance": self.importance, "tasks": self.tasks}

    def load_state_dict(self, state):
        self.importance, self.tasks = dict(state.get("importance", {})), int(state.get("tasks", 0))
