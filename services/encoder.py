"""Ray Serve gRPC Encoder: EncodeText / EncodeImage for any registered version, the production one by default.

Requests are batched across callers (`@serve.batch`); a batch may hold several versions, so it is split
by (version, modality) and each group runs through its model once. Loaded versions live in a per-replica
cache (`@serve.multiplexed`); `production` is re-resolved every few seconds, so moving the alias swaps
the model without a restart, and every response names the version that made its vectors.
"""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from ray import serve

from clipstream.v1 import encoder_pb2
from services.versions import UnknownVersion, VersionStore


@dataclass(frozen=True)
class Limits:
    """Request limits; each refusal says which limit and how to stay under it."""

    max_items: int = 256
    max_text_chars: int = 2000
    max_image_bytes: int = 8 * 1024 * 1024


class RequestError(Exception):
    """A refused request and the gRPC status that says why; survives Ray's trip between deployments."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return RequestError, (self.code, str(self))


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=128)
class Encoder:
    def __init__(self, tracking_uri: str, stream: str, cache_dir: str, limits: Limits = Limits(),
                 batch_size: int = 32, batch_wait_s: float = 0.005, alias_ttl_s: float = 2.0):
        self.store = VersionStore(tracking_uri, stream, cache_dir, alias_ttl_s)
        self.limits = limits
        self.batches_seen: list[int] = []  # sizes of recent batches: shows batching at work (tests, debugging)
        self._encode.set_max_batch_size(batch_size)
        self._encode.set_batch_wait_timeout_s(batch_wait_s)

    @serve.multiplexed(max_num_models_per_replica=3)
    async def model(self, version: str):
        return self.store.load(version)

    async def EncodeText(self, request: encoder_pb2.EncodeTextRequest) -> encoder_pb2.EncodeResponse:
        return await self._serve("text", list(request.texts), request.model_version)

    async def EncodeImage(self, request: encoder_pb2.EncodeImageRequest) -> encoder_pb2.EncodeResponse:
        return await self._serve("image", list(request.images), request.model_version)

    async def encode(self, modality: str, items: list, model_version: str = "") -> tuple[str, np.ndarray]:
        """The Python entry point (used by Search through a deployment handle): (version, unit vectors)."""
        version = self._version(model_version)
        inputs = self._validate(modality, items)
        return version, await self._encode((version, modality, inputs))

    async def BatchSizes(self, request=None) -> list[int]:
        return list(self.batches_seen)

    async def _serve(self, modality, items, model_version):
        version, vectors = await self.encode(modality, items, model_version)
        return encoder_pb2.EncodeResponse(embeddings=[encoder_pb2.Embedding(values=v) for v in vectors.tolist()],
                                          dim=vectors.shape[1], model_version=version)

    def _version(self, ref: str) -> str:
        try:
            return self.store.resolve(ref)
        except UnknownVersion as exc:
            raise RequestError(grpc.StatusCode.NOT_FOUND, str(exc)) from exc

    def _validate(self, modality: str, items: list) -> list:
        if not items:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"empty batch: send at least one {modality}")
        if len(items) > self.limits.max_items:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{len(items)} {modality}s in one request; the limit is {self.limits.max_items}: "
                               "split the request (the Python client does this for you)")
        if modality == "text":
            for i, text in enumerate(items):
                if not text.strip():
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"text {i} is empty")
                if len(text) > self.limits.max_text_chars:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"text {i} has {len(text)} characters; the limit is {self.limits.max_text_chars}")
            return items
        images = []
        for i, data in enumerate(items):
            if len(data) > self.limits.max_image_bytes:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"image {i} is {len(data)} bytes; the limit is {self.limits.max_image_bytes} bytes")
            try:
                with Image.open(io.BytesIO(data)) as img:
                    images.append(img.convert("RGB"))
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"image {i} is not a decodable image (PNG, JPEG, WebP...): {exc}") from exc
        return images

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def _encode(self, requests: list[tuple[str, str, list]]) -> list[np.ndarray]:
        self.batches_seen = (self.batches_seen + [len(requests)])[-1000:]
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, (version, modality, _) in enumerate(requests):
            groups[(version, modality)].append(i)
        out: list = [None] * len(requests)
        for (version, modality), members in groups.items():
            bundle = await self.model(version)
            flat = [x for i in members for x in requests[i][2]]
            with torch.no_grad():
                if modality == "text":
                    vectors = bundle.model.encode_text(bundle.tokenizer(flat), normalize=True)
                else:
                    vectors = bundle.model.encode_image(torch.stack([bundle.preprocess_val(im) for im in flat]), normalize=True)
            vectors = vectors.float().numpy()
            start = 0
            for i in members:
                n = len(requests[i][2])
                out[i], start = vectors[start:start + n], start + n
        return out
