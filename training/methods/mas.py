"""MAS: importance = mean |gradient| of the squared L2 norm of the *pre-normalisation* features (a
normalised vector's norm is constant, so it has no gradient); accumulated, Ω ← Ω + Ω_new
(as in "Continual learning in cross-modal retrieval", Wang et al., arXiv:2104.06806)."""

from clipstream.training.methods.importance import Importance


class MAS(Importance):
    name = "mas"

    def objective(self, feats):
        return (feats.image_raw.float().pow(2).sum(-1) + feats.text_raw.float().pow(2).sum(-1)).mean()

    def measure(self, grad):
        return grad.abs()

    def merge(self, old, new, t):
        return new if old is None else old + new
