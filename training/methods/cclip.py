"""C-CLIP: a fresh LoRA per task on both towers, merged into the weights at task end, plus contrastive knowledge
consolidation (CKC) against the previous model ("C-CLIP: Multimodal Continual Learning for Vision-Language
Model", ICLR 2025 submission).

Per task: adapters on the preset's `targets` (fused attention projections included, see `lora`), the parameters
named in `embeddings` trained in full (§5.2: "most of the trainable parameters are embedding layers"; Table 6's
counts say which, see presets.yaml), the rest frozen; a projector h (linear, identity init, new per task) trained
with them. The text tower's parameters train at `text_lr_scale` × the rate (Appendix A.2). The loss adds CKC
between h(new features) and the previous model's features, obtained by switching the adapters and the embeddings'
deltas off: no second copy in memory. At export every adapter is merged with W += merge·(alpha/rank)·B·A (Eq. 2)
and every embedding keeps its trained value whole (the paper states no merge rule for them), the adapters are
removed and the projector dropped, so a version is a plain open_clip model with no extra inference cost.
"""

from __future__ import annotations

import copy

import torch

from clipstream.training.losses import ckc_loss
from clipstream.training.methods import lora
from clipstream.training.methods.base import Method, forward_features

PROJECTOR = "cclip_projector"  # the projector's attribute on the model while it trains (never exported)


class CClip(Method):
    name = "cclip"

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        p = self.params
        lora.inject(model, p["targets"], p["rank"], p["alpha"], p["dropout"], full=p["embeddings"])
        dim = model.text_projection.shape[1] if model.text_projection is not None else model.visual.output_dim
        projector = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            projector.weight.copy_(torch.eye(dim))
            projector.bias.zero_()
        setattr(model, PROJECTOR, projector.to(next(model.parameters()).device))
        return model

    def lr_scale(self, name: str) -> float:
        """The text tower's rate (its embeddings' included) is `text_lr_scale` × the image one (Appendix A.2: 10, 80 on
        COCO)."""
        text = not name.startswith(("visual.", PROJECTOR)) and name != "logit_scale"
        return float(self.params["text_lr_scale"]) if text else 1.0

    def loss_terms(self, ctx, batch, feats):
        model = ctx.model
        with torch.no_grad(), lora.disabled(model):  # θ(t-1) exactly: the base weights, adapters and deltas off
            old = forward_features(model, batch["image"], batch["text"])
        projector = getattr(model, PROJECTOR)
        dtype = projector.weight.dtype  # the engine's; the features are fp32
        new = [projector(f.to(dtype)).float() for f in (feats.image, feats.text)]
        return {"ckc": self.params["ckc_weight"] * ckc_loss(new, [old.image, old.text], feats.logit_scale)}

    def export_model(self, model: torch.nn.Module) -> torch.nn.Module:
        plain = copy.deepcopy(model)
        delattr(plain, PROJECTOR)
        return lora.merge(plain, self.params["merge"])
