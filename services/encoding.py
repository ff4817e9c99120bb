"""What an Encoder replica does with its models, apart from Ray: where a version's model runs (the GPU Ray gave the
replica, else the CPU) and in which dtype, the model's input made from images, and one batch of requests encoded
(split by version and modality, each group through its model once, the vectors split back per request).

Ray-free so that `clipstream bench gpu` measures the served code on a machine without Ray (services/encoder.py
wraps it in Ray Serve's batching and multiplexing).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from clipstream import models

Request = tuple[str, str, object]  # (version, "text" | "image", texts | the request's pixels from `prepare`)


class ModelPath:
    """One replica's placement: every version it loads goes to `device` in `dtype` (`models.placement` from the
    embed_precision setting and whether the process has a GPU)."""

    def __init__(self, precision: str = "auto", gpu: Optional[bool] = None):
        self.device, self.dtype = models.placement(precision, gpu)

    def place(self, bundle: models.ClipBundle) -> models.ClipBundle:
        """`bundle` on this replica's device, in its dtype, in eval mode."""
        bundle.to(self.device, self.dtype).model.eval()
        return bundle

    @staticmethod
    def prepare(bundle: models.ClipBundle, images: Sequence[models.ImageSource]) -> torch.Tensor:
        """One request's images as the model's input (decoded and preprocessed on the CPU, while the model runs the
        batch before)."""
        return bundle.pixels(images)

    @staticmethod
    def encode(requests: Sequence[Request], bundles: Mapping[str, models.ClipBundle]) -> list[np.ndarray]:
        """Unit float32 vectors for each request of a batch: the requests grouped by (version, modality), each
        group through its version's model (`bundles`) in one call, and split back in request order."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, (version, modality, _) in enumerate(requests):
            groups[(version, modality)].append(i)
        out: list = [None] * len(requests)
        for (version, modality), members in groups.items():
            bundle = bundles[version]
            if modality == "text":
                flat, embed = [x for i in members for x in requests[i][2]], bundle.embed_texts
            else:  # each request's pixels, prepared already
                flat, embed = torch.cat([requests[i][2] for i in members]), bundle.embed_pixels
            vectors = embed(flat, batch_size=len(flat))
            start = 0
            for i in members:
                n = len(requests[i][2])
                out[i], start = vectors[start:start + n], start + n
        return out
