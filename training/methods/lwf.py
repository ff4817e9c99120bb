"""LwF: distil the previous model's outputs on the new task's data. As CTP's LwF baseline for a
feature encoder (CTP, Zhu et al., ICCV 2023, arXiv:2308.07146, baselines): per tower, KL(softmax(teacher_raw/T) || softmax(student_raw/T)) over the
feature dimensions of the pre-normalisation features, ×T² as in Hinton's distillation."""

import torch

from clipstream.training.losses import row_kl
from clipstream.training.methods.base import Distillation


def lwf_distill(student_raw: list, teacher_raw: list, temperature: float) -> torch.Tensor:
    """Mean over towers of T²·batch-mean KL(softmax(teacher/T) || softmax(student/T)) over feature dims."""
    t = temperature
    return t * t * sum(row_kl(r / t, s / t).mean() for r, s in zip(teacher_raw, student_raw)) / len(student_raw)


class LwF(Distillation):
    name = "lwf"

    def distill(self, feats, teacher):
        return self.params["weight"] * lwf_distill([feats.image_raw, feats.text_raw], [teacher.image_raw, teacher.text_raw],
                                                   self.params["temperature"])
