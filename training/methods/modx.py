"""Mod-X ("Continual Vision-Language Representation Learning with Off-Diagonal Information", Ni et al.,
ICML 2023, arXiv:2305.07437): distil the previous model's whole row distribution of the image-text cosine
matrix, off-diagonal entries included, in both directions:

    L = L_CLIP + α/2 · [KL_mask(S, S') + KL_mask(Sᵀ, S'ᵀ)],   KL_mask = Σ_i m_i KL(softmax(S'_i) || softmax(S_i))

on raw cosines (temperature 1), summed over rows, keeping only rows the teacher gets right
(m_i = [argmax_j S'_ij = i]). Rows are this rank's pairs, columns the gathered global batch, so the sum
over ranks is the single-process sum; ×world_size because DeepSpeed averages the ranks' gradients.
"""

import torch

from clipstream.training.losses import (
    fill_positives,
    gather,
    positive_columns,
    row_kl,
    world,
)
from clipstream.training.methods.base import Distillation


def modx_distill(img, txt, t_img, t_txt, mask_diagonal: bool = False) -> torch.Tensor:
    """(KL_mask(S, S') + KL_mask(Sᵀ, S'ᵀ)) / 2 for this rank's rows (unit features, teacher's without
    gradient); ×world_size, so the ranks' mean is the single-process value."""
    with torch.no_grad():
        all_t_img, all_t_txt = gather(t_img), gather(t_txt)
    own = positive_columns(img.shape[0], img.device)
    total = 0.0
    for s_rows, s_cols, t_rows, t_cols in ((img, gather(txt), t_img, all_t_txt), (txt, gather(img), t_txt, all_t_img)):
        student, target = s_rows @ s_cols.T, t_rows @ t_cols.T
        keep = (target.argmax(dim=1) == own).float()  # the teacher's own answer, before any masking
        if mask_diagonal:  # a variant the paper does not test: renormalise without j = i
            student, target = fill_positives(student, -1000.0), fill_positives(target, -1000.0)
        total = total + (keep * row_kl(target, student)).sum()
    return world()[1] * total / 2


class ModX(Distillation):
    name = "modx"

    def distill(self, feats, teacher):
        return self.params["alpha"] * modx_distill(feats.image, feats.text, teacher.image, teacher.text,
                                                   bool(self.params.get("mask_diagonal")))
