"""Ray Serve Search deployment: encode the query with the Encoder deployment (through its handle), rank
the indexed gallery of the other modality, and name, for every hit, the version that made its vector.
It also answers Admin (what is served: versions, gallery, consistency). The Encoder ingress hands it
these RPCs.

Queries are encoded by the gallery's pinned query version (VectorIndex.pin), not by reading the
production alias, so a query never changes encoder before the vectors it is ranked against.
"""

from __future__ import annotations

import asyncio
import base64
from datetime import datetime, timezone

import grpc
import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp
from ray import serve
from ray.exceptions import RayActorError

from clipstream.index import MAX_K, MODALITIES, VectorIndexError, open_index
from clipstream.registry import PRODUCTION, Registry, RegistryError
from clipstream.services.encoder import RequestError
from clipstream.settings import configure_process
from clipstream.v1 import admin_pb2, search_pb2

MODALITY_NAMES = {search_pb2.MODALITY_IMAGE: "image", search_pb2.MODALITY_TEXT: "text"}
MODALITY_VALUES = {name: value for value, name in MODALITY_NAMES.items()}
PAGE_SIZE, MAX_PAGE_SIZE = 50, 1000  # ListVersions


def timestamp(when: datetime) -> Timestamp:
    out = Timestamp()
    out.FromDatetime(when)
    return out


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64, health_check_period_s=2.0)
class Search:
    def __init__(self, settings):
        configure_process()  # a replica is a process of its own (on a RayService, not started by the CLI)
        self.settings = settings
        self.index = open_index(settings)  # Edge: reads the published manifest, reloads when it changes
        self.registry = Registry(settings)
        self._encoder = None

    @property
    def encoder(self):
        """The Encoder's handle, looked up at first use: the Encoder (the ingress) is bound to this
        deployment, so this one cannot be bound to it in turn."""
        if self._encoder is None:
            self._encoder = serve.get_deployment_handle("Encoder", serve.get_replica_context().app_name)
        return self._encoder

    async def search(self, request: search_pb2.SearchRequest) -> search_pb2.SearchResponse:
        kind = request.WhichOneof("query")
        if kind is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no query: set text, image or vector", "QUERY_MISSING",
                               "query")
        target = (MODALITY_NAMES.get(request.target_modality, "") if request.target_modality
                  else {"text": "image", "image": "text"}.get(kind, ""))
        if target not in MODALITIES:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "target_modality must be MODALITY_IMAGE or "
                               f"MODALITY_TEXT (required for vector queries), got {request.target_modality}",
                               "TARGET_MODALITY_INVALID", "target_modality")
        k = request.k or 10
        if not 1 <= k <= MAX_K:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [1, {MAX_K}], got {k}", "K_OUT_OF_RANGE",
                               "k", {"max": MAX_K})
        state = self.index.state()
        if not state["tasks"]:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the index is empty: run `clipstream index` first",
                               "INDEX_EMPTY")
        if request.task and request.task not in state["tasks"]:
            raise RequestError(grpc.StatusCode.NOT_FOUND,
                               f"unknown task {request.task!r}; indexed tasks: {', '.join(sorted(state['tasks']))}",
                               "TASK_NOT_FOUND", "task")
        for _ in range(3):  # optimistic: redo the query if the gallery or its pin moved while it ran
            version, pinned = "", (state["generation"], state.get("query_version"))
            if kind == "vector":
                vector = np.asarray(request.vector.values, dtype=np.float32)
            else:
                item = request.text if kind == "text" else request.image
                version, vectors = await self._encode(kind, item, request.model_version or pinned[1] or "", request.language)
                vector = vectors[0]
            try:
                hits = self.index.search(vector, target, request.task or None, k)
            except VectorIndexError as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "VECTOR_INVALID", "vector") from exc
            state = self.index.state()
            if (state["generation"], state.get("query_version")) == pinned or request.model_version:
                break
        return search_pb2.SearchResponse(query_model_version=version, hits=[
            search_pb2.Hit(item_id=h.item_id, task=h.task, score=h.score, modality=MODALITY_VALUES[h.modality],
                           model_version=h.model_version, index_generation=h.index_generation, caption=h.caption or "",
                           image_uri=h.image_uri or "")
            for h in hits])

    async def _encode(self, kind: str, item, version: str, language: str, attempts: int = 4):
        """The query's vector from an Encoder replica; one that dies holding it (killed, its node lost) is retried on
        another after Serve's router has had a moment to drop it: encoding is a read, and the caller's own request
        is still alive (its retry policy covers only the hop it sees)."""
        for attempt in range(attempts):
            try:
                return await self.encoder.encode.remote(kind, [item], version, language)
            except RayActorError:  # (ActorDiedError, ActorUnavailableError)
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.5 * 2 ** attempt)

    async def ready(self) -> bool:
        """Whether searches can be answered: a gallery is indexed."""
        return bool(self.index.state()["tasks"])

    async def status(self) -> admin_pb2.GetStatusResponse:
        state, problems = self.index.state(), []
        try:
            production = self.registry.number(PRODUCTION)
        except RegistryError:
            production = ""
            problems.append(f"no version carries the alias {PRODUCTION!r}: run `clipstream promote VERSION`")
        if not state["tasks"]:
            problems.append("the index is empty: run `clipstream index` or `clipstream promote`")
        query = state.get("query_version") or ""
        holder = self.registry.lock_holder()
        if holder:  # a promotion (or a follower honouring an alias moved in MLflow) is putting a gallery in place
            problems.append(f"{holder.get('purpose', 'a promotion')} in progress (pid {holder.get('pid')} on "
                            f"{holder.get('host')}): queries stay with v{query or '-'} until its gallery is in place")
        elif production and query and production != query:
            problems.append(f"production is v{production} but the gallery serves queries for v{query}: "
                            f"`clipstream promote {production}` (or `clipstream follow`, which `clipstream serve` "
                            "runs) puts its gallery in place")
        if production:
            missing = [t for t in self.registry.resolve(production, download=False).tasks if t not in state["tasks"]]
            if missing:
                problems.append(f"production v{production} was trained on task(s) {missing} that are not indexed")
        return admin_pb2.GetStatusResponse(
            stream=self.settings.stream, production_version=production, query_version=query,
            index_generation=state["generation"], loaded_versions=await self.encoder.loaded.remote(),
            consistent=not problems, problems=problems, tasks=[
                admin_pb2.IndexedTask(task=name, task_index=t["task_index"], model_version=t["model_version"],
                                      images=t["counts"]["image"], texts=t["counts"]["text"],
                                      indexed_at=timestamp(datetime.fromisoformat(t["indexed_at"])))
                for name, t in sorted(state["tasks"].items(), key=lambda kv: kv[1]["task_index"])])

    async def versions(self, request: admin_pb2.ListVersionsRequest) -> admin_pb2.ListVersionsResponse:
        """A page of the registered versions, newest first. The page token names the last version a page held, so
        the next page starts below it however many versions are registered meanwhile (AIP-158)."""
        size = min(request.page_size or PAGE_SIZE, MAX_PAGE_SIZE)  # (over the most: coerced, as AIP-158 says)
        newest = list(reversed(self.registry.versions()))
        if request.page_token:
            try:
                below = int(base64.urlsafe_b64decode(request.page_token.encode()).decode().removeprefix("below:"))
            except ValueError:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"page_token {request.page_token!r} is not one "
                                   "a ListVersionsResponse gave: pass its next_page_token, or none for the first page",
                                   "PAGE_TOKEN_INVALID", "page_token")
            newest = [v for v in newest if int(v.version) < below]
        page, loaded = newest[:size], set(await self.encoder.loaded.remote())
        more = len(newest) > size
        return admin_pb2.ListVersionsResponse(
            next_page_token=base64.urlsafe_b64encode(f"below:{page[-1].version}".encode()).decode() if more else "",
            versions=[admin_pb2.ModelVersion(
                version=v.version, task=v.tags.get("task", ""), task_index=int(v.tags.get("task_index") or 0),
                method=v.tags.get("method", ""), parent_version=v.tags.get("parent_version", ""),
                aliases=v.aliases, loaded=v.version in loaded,
                created_at=timestamp(datetime.fromtimestamp(v.created_ms / 1000, timezone.utc)))
                for v in page])
