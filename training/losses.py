"""Contrastive losses over features gathered from every worker.

Each worker scores its local rows against the global batch, so the loss and its gradients equal a
single process training on the whole batch (the rank-r positives sit at column r*B + i).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import wait_tensor

try:
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch 2.11 (the GPU machines' image) has only the name later releases deprecate
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as all_gather_single_autograd


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather(features: torch.Tensor) -> torch.Tensor:
    """Concatenate every worker's features in rank order, keeping the autograd graph."""
    _, size = world()
    if size == 1:
        return features
    return wait_tensor(all_gather_single_autograd(features.contiguous(), 0, dist.group.WORLD))


def positive_columns(local_batch: int, device=None) -> torch.Tensor:
    """Column of each local row's positive inside the gathered batch."""
    rank, _ = world()
    return torch.arange(local_batch, device=device) + rank * local_batch


def clip_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor, distributed: bool = True) -> torch.Tensor:
    """Symmetric InfoNCE of open_clip's `ClipLoss(local_loss=True, gather_with_grad=True)`;
    `distributed=False` scores the local batch alone (no collective)."""
    if not distributed:
        labels = torch.arange(image.shape[0], device=image.device)
        logits = logit_scale * image @ text.T
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    all_image, all_text = gather(image), gather(text)
    labels = positive_columns(image.shape[0], image.device)
    logits_i2t = logit_scale * image @ all_text.T
    logits_t2i = logit_scale * text @ all_image.T
    return (F.cross_entropy(logits_i2t, labels) + F.cross_entropy(logits_t2i, labels)) / 2


def row_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Per row, KL(softmax(teacher) || softmax(student)) in fp32; the teacher's gradient is cut."""
    log_q = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    log_p = F.log_softmax(student_logits.float(), dim=-1)
    return (log_q.exp() * (log_q - log_p)).sum(dim=-1)


def fill_positives(scores: torch.Tensor, value: float) -> torch.Tensor:
    """`scores` (local rows x gathered columns) with each row's own column (rank*B + i) set to `value`."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    out = scores.clone()
    out[rows, positive_columns(scores.shape[0], scores.device)] = value
    return out


def ckc_loss(new: list[torch.Tensor], old: list[torch.Tensor], logit_scale: torch.Tensor) -> torch.Tensor:
    """C-CLIP's contrastive knowledge consolidation: the projected new features of both modalities, stacked (2N
    rows), against the previous model's features of the same items; each item's only positive is its own old
    feature, every other old feature (its pair's included) a negative. The paper's Eq. 5 sums the row and column
    softmax terms (twice the usual symmetric InfoNCE), over the batch gathered from every worker. The old features
    get no gradient."""
    h = F.normalize(torch.cat(new), dim=-1)
    z = F.normalize(torch.cat(old), dim=-1).detach()
    return 2 * clip_loss(h, z, logit_scale)
