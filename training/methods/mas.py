"""MAS as CTP's baseline (Zhu et al., ICCV 2023, arXiv:2308.07146; official code train/train_MAS.py): importance =
|gradient| of the batch mean of the plain L2 norms of the *pre-normalisation* features, image plus text (CTP's model
adds its fused [CLS], which a CLIP has not; a normalised vector's norm is constant, so it has no gradient), averaged
over the task's batches at the task's end; merged over tasks as a running mean (training/methods/importance.py).
Its λ = 1 is `weight` = 0.5."""

from clipstream.training.methods.importance import Importance


class MAS(Importance):
    name = "mas"

    def objective(self, feats):
        return feats.image_raw.norm(dim=-1).mean() + feats.text_raw.norm(dim=-1).mean()

    def measure(self, grad):
        return grad.abs()
