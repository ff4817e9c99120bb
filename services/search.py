"""Ray Serve gRPC Search, the application's ingress: encode the query with the Encoder deployment
(through its handle), rank the indexed gallery of the other modality, and name, for every hit, the
version that made its vector. One gRPC application means one ingress, so it also answers the Encoder
RPCs by handing them to the Encoder deployment, where batching happens."""

from __future__ import annotations

import grpc
import numpy as np
from ray import serve

from clipstream.v1 import encoder_pb2, search_pb2
from services.encoder import RequestError
from services.index import MAX_K, MODALITIES, VectorIndexError, open_index


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
class Search:
    def __init__(self, encoder, settings):
        self.encoder, self.settings = encoder, settings
        self.index = open_index(settings)  # Edge: reads the published manifest, reloads when it changes

    async def Search(self, request: search_pb2.SearchRequest, grpc_context=None) -> search_pb2.SearchResponse:
        return await _answer(self._search(request), search_pb2.SearchResponse, grpc_context)

    async def EncodeText(self, request: encoder_pb2.EncodeTextRequest, grpc_context=None) -> encoder_pb2.EncodeResponse:
        return await _answer(self.encoder.EncodeText.remote(request), encoder_pb2.EncodeResponse, grpc_context)

    async def EncodeImage(self, request: encoder_pb2.EncodeImageRequest, grpc_context=None) -> encoder_pb2.EncodeResponse:
        return await _answer(self.encoder.EncodeImage.remote(request), encoder_pb2.EncodeResponse, grpc_context)

    async def _search(self, request: search_pb2.SearchRequest) -> search_pb2.SearchResponse:
        kind = request.WhichOneof("query")
        if kind is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no query: set text, image or vector")
        target = request.target_modality or {"text": "image", "image": "text"}.get(kind, "")
        if target not in MODALITIES:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"target_modality must be 'image' or 'text' (required for vector queries), got {target!r}")
        k = request.k or 10
        if not 1 <= k <= MAX_K:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [1, {MAX_K}], got {k}")
        state = self.index.state()
        if not state["tasks"]:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the index is empty: run `clipstream index` first")
        if request.task and request.task not in state["tasks"]:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"unknown task {request.task!r}; indexed tasks: {', '.join(sorted(state['tasks']))}")
        version = ""
        if kind == "vector":
            vector = np.asarray(request.vector.values, dtype=np.float32)
        else:
            item = request.text if kind == "text" else request.image
            version, vectors = await self.encoder.encode.remote(kind, [item], request.model_version)
            vector = vectors[0]
        try:
            hits = self.index.search(vector, target, request.task or None, k)
        except VectorIndexError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        return search_pb2.SearchResponse(query_model_version=version, hits=[
            search_pb2.Hit(item_id=h.item_id, task=h.task, score=h.score, modality=h.modality,
                           model_version=h.model_version, index_generation=h.index_generation, caption=h.caption or "")
            for h in hits])


async def _answer(work, empty, grpc_context):
    """Await `work`; a RequestError (ours, or the Encoder's re-raised by Ray) becomes the gRPC status."""
    try:
        return await work
    except Exception as exc:
        cause = exc if isinstance(exc, RequestError) else getattr(exc, "cause", None)  # Ray keeps it as `cause`
        if not isinstance(cause, RequestError) or grpc_context is None:
            raise
        grpc_context.set_code(cause.code)
        grpc_context.set_details(str(cause))
        return empty()
