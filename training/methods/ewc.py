"""EWC: importance = the diagonal empirical Fisher, the mean over samples of the squared per-sample gradient of the
CLIP loss at the end of the task; merged as a running mean over tasks, Ω ← ((t-1)·Ω + Ω_new)/t (CTP's EWC baseline,
Zhu et al., ICCV 2023, arXiv:2308.07146)."""

import torch

from clipstream.training.methods.importance import Importance


def sample_clip_loss(image_raw: torch.Tensor, text_raw: torch.Tensor, scale: torch.Tensor, batch: tuple,
                     i: torch.Tensor) -> torch.Tensor:
    """Sample i's share of the symmetric CLIP loss: (row i's image→text + column i's text→image cross-entropy) / 2,
    with sample i's own features live and the batch's other features (`batch`: normalised images, texts) constants.
    One sample's contrastive loss depends on the whole batch; holding the others fixed makes its gradient one
    sample's forward and backward (the batch's loss is the mean of these terms, its gradient not their mean)."""
    image, text = torch.nn.functional.normalize(image_raw, dim=-1), torch.nn.functional.normalize(text_raw, dim=-1)
    images, texts = batch
    own = (torch.arange(len(images), device=images.device) == i)[:, None]
    to_texts = scale * torch.where(own, text, texts) @ image  # row i: the image against every caption
    to_images = scale * torch.where(own, image, images) @ text  # column i: the caption against every image
    positive = scale * image @ text
    return (torch.logsumexp(to_texts, 0) + torch.logsumexp(to_images, 0)) / 2 - positive


class EWC(Importance):
    name = "ewc"

    def sample_objective(self, image_raw, text_raw, scale, batch, i):
        return sample_clip_loss(image_raw, text_raw, scale, batch, i)

    def measure(self, grad):
        return grad.pow(2)

    def merge(self, old, new, t):
        return new if old is None else ((t - 1) * old + new) / t
