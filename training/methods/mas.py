"""MAS: importance = the mean over samples of |gradient| of each sample's squared L2 norm of its *pre-normalisation*
features, image and text (MAS's F(x) = ℓ2²(output) per sample; a normalised vector's norm is constant, so it has no
gradient); accumulated, Ω ← Ω + Ω_new (as in "Continual learning in cross-modal retrieval", Wang et al.,
arXiv:2104.06806)."""

from clipstream.training.methods.importance import Importance


class MAS(Importance):
    name = "mas"

    def sample_objective(self, image_raw, text_raw, scale, batch, i):
        return image_raw.pow(2).sum() + text_raw.pow(2).sum()

    def measure(self, grad):
        return grad.abs()

    def merge(self, old, new, t):
        return new if old is None else old + new
