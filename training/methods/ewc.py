"""EWC as CTP's baseline (Zhu et al., ICCV 2023, arXiv:2308.07146; official code train/train_EWC.py): importance =
the diagonal Fisher as that code measures it, the square of each batch's gradient of the training loss (there
L_ita + L_mlm, here the CLIP loss at the model's own temperature), averaged over the task's batches at the task's
end; merged over tasks as a running mean (training/methods/importance.py). Its λ = 5000 is `weight` = 2500."""

from clipstream.training.losses import clip_loss
from clipstream.training.methods.importance import Importance


class EWC(Importance):
    name = "ewc"

    def objective(self, feats):
        # the worker's own batch, one of the batches averaged over: CTP's code also squares each GPU's own gradient
        # (of its module, not DDP's all-reduced one), though its loss there contrasts with the gathered batch
        return clip_loss(feats.image, feats.text, feats.logit_scale, distributed=False)

    def measure(self, grad):
        return grad.pow(2)
