"""MAS: importance = mean |gradient| of the squared L2 norm of the *pre-normalisation* features (a
normalised vector's norm is constant, so it has no gradient); accumulated, Ω ← Ω + Ω_new
(continual-cross-modal-retrieval.md §2)."""

from clipstream.training.methods.importance import Importance


class MAS(Importance):
    name = "mas"

    def objective(self, feats):
        return (feats.image_raw.float().pow(2).sum(-1) + feats.text_raw.float().pow(2).sum(-1)).mean()

    def measure(self, grad):
        return grad.abs()

    def merge(self, old, new, t):
        return new if old is None else old + new
