"""Low-rank adapters on named weights of an open_clip model, its fused attention projections included.

open_clip's attention is torch's `nn.MultiheadAttention`: q, k and v live in one Parameter (`in_proj_weight`),
and `out_proj.weight` is read by `F.multi_head_attention_forward` directly, never through `out_proj.forward`.
Module wrappers (peft's LoRA `Linear`) miss all four; peft's own `MultiheadAttention` layer merges and unmerges
the weights around every forward, which ZeRO's partitioned, flattened parameters do not survive. A
parametrization (`torch.nn.utils.parametrize`) fits instead: wherever the weight is read, eval fast path
included, it is W + s·B·A, with A random, B zero (the adapted model starts as the base model) and s = alpha/rank.

LoRA's dropout acts on the adapter's input; a weight cannot see inputs, so here it drops input features of A
(columns), one mask per forward: the same expectation, a mask shared by the batch.

A weight trained in full beside the adapters (C-CLIP's embedding layers) gets the same kind of parametrization with a
full-size delta D, zero at the start: D gets W's gradient, so the optimizer moves W + D as it would move W (only a
decoupled weight decay differs: it pulls D to 0, W to the task's start; the engine decays no embedding either way).
Like an adapter it can be switched off, which gives the task's start weights without a copy, and it merges whole.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
from torch import nn
from torch.nn.utils import parametrize


class Adapter(nn.Module):
    """The parametrization W -> W + delta() of one weight, which `disabled` switches off and `merge` folds in."""

    enabled = True

    def delta(self) -> torch.Tensor:
        raise NotImplementedError

    def merged(self, coefficient: float) -> torch.Tensor:
        """What a merge with `coefficient` adds to the weight."""
        raise NotImplementedError

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta() if self.enabled else weight


class LoRA(Adapter):
    """The parametrization W -> W + scale·B·A of one weight (out × in)."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        out_features, in_features = weight.shape
        self.A = nn.Parameter(torch.empty(rank, in_features, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as peft and the LoRA paper's code
        self.B = nn.Parameter(torch.zeros(out_features, rank, dtype=weight.dtype, device=weight.device))
        self.scale, self.dropout = alpha / rank, dropout

    def delta(self) -> torch.Tensor:
        A = self.A
        if self.training and self.dropout > 0:
            keep = torch.rand(A.shape[1], device=A.device) >= self.dropout
            A = A * keep.to(A.dtype) / (1 - self.dropout)
        return self.scale * (self.B @ A)

    def merged(self, coefficient: float) -> torch.Tensor:
        return coefficient * self.scale * (self.B @ self.A)


class Full(Adapter):
    """The parametrization W -> W + D of a weight trained in full, D (any shape) zero at the start."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.D = nn.Parameter(torch.zeros_like(weight))

    def delta(self) -> torch.Tensor:
        return self.D

    def merged(self, coefficient: float) -> torch.Tensor:
        return self.D  # trained directly, so kept whole: the merge coefficient scales the low-rank adapters only


def inject(model: nn.Module, targets: list[str], rank: int, alpha: float, dropout: float = 0.0,
           full: list[str] = ()) -> list[str]:
    """A fresh adapter on every 2-D parameter whose name ends with one of `targets` (e.g. `attn.in_proj_weight`,
    `mlp.c_fc.weight`) and a fresh full delta on each parameter named exactly in `full` (e.g.
    `token_embedding.weight`); every other parameter is frozen. Returns the adapted parameter names."""
    pattern = re.compile("|".join(rf"(^|\.){re.escape(t)}$" for t in targets))
    params = dict(model.named_parameters())
    chosen = [name for name, p in params.items() if p.ndim == 2 and pattern.search(name)]
    if not chosen:
        raise ValueError(f"no weight of the model matches the LoRA targets {targets}")
    missing = [name for name in full if name not in params]
    if missing:
        raise ValueError(f"the model has no parameter {', '.join(missing)} to train in full: name parameters exactly "
                         f"as the model does, e.g. {', '.join(n for n in params if 'embedding' in n)}")
    both = sorted(set(full) & set(chosen))
    if both:
        raise ValueError(f"{', '.join(both)}: both a LoRA target and trained in full; leave it in one of the two")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        owner, attr = _owner(model, name)
        parametrize.register_parametrization(owner, attr, LoRA(getattr(owner, attr), rank, alpha, dropout))
    for name in full:
        owner, attr = _owner(model, name)
        parametrize.register_parametrization(owner, attr, Full(getattr(owner, attr)))
    return [*chosen, *full]


def adapters(model: nn.Module) -> dict[str, Adapter]:
    """{adapted parameter name: its adapter}, low-rank and full."""
    found = {}
    for prefix, module in model.named_modules():
        for attr, plist in getattr(module, "parametrizations", {}).items():
            for p in plist:
                if isinstance(p, Adapter):
                    found[f"{prefix}.{attr}" if prefix else attr] = p
    return found


@contextlib.contextmanager
def disabled(model: nn.Module):
    """The base model (the previous task's weights) for the duration: every adapter off, none copied."""
    found = list(adapters(model).values())
    for a in found:
        a.enabled = False
    try:
        yield model
    finally:
        for a in found:
            a.enabled = True


def merge(model: nn.Module, coefficient: float) -> nn.Module:
    """W <- W + coefficient·scale·B·A for every low-rank adapter (C-CLIP's merge, coefficient α) and W <- W + D for
    every full one, then the adapters are removed: a plain model again, with exactly the base model's parameter names
    and shapes."""
    owners = {id(o): o for o in (_owner(model, name)[0] for name in adapters(model))}
    for owner in owners.values():
        # torch made one class per parametrized module, and a deepcopy (an export of the live model) shares it:
        # removing a parametrization deletes its property from that class, which would break the original too
        cls = owner.__class__
        owner.__class__ = type(cls.__name__, cls.__bases__, dict(cls.__dict__))
    with torch.no_grad():
        for name, adapter in adapters(model).items():
            owner, attr = _owner(model, name)
            delta = adapter.merged(coefficient)
            parametrize.remove_parametrizations(owner, attr, leave_parametrized=False)
            getattr(owner, attr).add_(delta.to(getattr(owner, attr).dtype))
    return model


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr
