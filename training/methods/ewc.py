"""EWC: importance = diagonal Fisher, the mean squared gradient of the CLIP loss at the end of the task;
merged as a running mean over tasks, Ω ← ((t-1)·Ω + Ω_new)/t (CTP's EWC baseline, Zhu et al., ICCV 2023, arXiv:2308.07146)."""

from clipstream.training.losses import clip_loss
from clipstream.training.methods.importance import Importance


class EWC(Importance):
    name = "ewc"

    def objective(self, feats):
        return clip_loss(feats.image, feats.text, feats.logit_scale, distributed=False)

    def measure(self, grad):
        return grad.pow(2)

    def merge(self, old, new, t):
        return new if old is None else ((t - 1) * old + new) / t
