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
import hashlib
import json
import re
from datetime import datetime, timezone

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from ray import serve
from ray.exceptions import RayActorError

from clipstream import catalogue
from clipstream.index import (
    CATALOGUE,
    MAX_DEPTH,
    MAX_K,
    MODALITIES,
    VectorIndexError,
    check_metadata,
    check_where,
    open_index,
)
from clipstream.registry import PRODUCTION, LockHeld, Registry, RegistryError
from clipstream.roots import under_allowed_root
from clipstream.services.encoder import RequestError, check_count
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
        return await self._search(request)

    async def batch_search(self, request: search_pb2.BatchSearchRequest) -> search_pb2.BatchSearchResponse:
        """Each search as Search answers it, concurrently (the Encoder batches their queries together)."""
        count = len(request.requests)
        self._count(count, "requests", "searches")
        for i, one in enumerate(request.requests):
            if one.page_token:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "a batch takes first pages only: page with "
                                   "Search", "PAGE_TOKEN_IN_BATCH", f"requests[{i}].page_token")
        return search_pb2.BatchSearchResponse(responses=await asyncio.gather(
            *(self._search(one, f"requests[{i}].") for i, one in enumerate(request.requests))))

    async def _search(self, request: search_pb2.SearchRequest, at: str = "") -> search_pb2.SearchResponse:
        """One search; `at` prefixes the fields a refusal names (a batch's `requests[3].`)."""
        kind = request.WhichOneof("query")
        if kind is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "no query: set text, image or vector", "QUERY_MISSING",
                               f"{at}query")
        target = (MODALITY_NAMES.get(request.target_modality, "") if request.target_modality
                  else {"text": "image", "image": "text"}.get(kind, ""))
        if target not in MODALITIES:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "target_modality must be MODALITY_IMAGE or "
                               f"MODALITY_TEXT (required for vector queries), got {request.target_modality}",
                               "TARGET_MODALITY_INVALID", f"{at}target_modality")
        k = request.k or 10
        if not 1 <= k <= MAX_K:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"k must be in [1, {MAX_K}], got {k}", "K_OUT_OF_RANGE",
                               f"{at}k", {"max": MAX_K})
        where = self._where(request.filters, at)
        threshold = request.score_threshold if request.HasField("score_threshold") else None
        if threshold is not None and not -1 <= threshold <= 1:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"score_threshold is a cosine, in [-1, 1]; got "
                               f"{threshold}", "SCORE_THRESHOLD_OUT_OF_RANGE", f"{at}score_threshold")
        offset, generation = self._page(request)
        state = self.index.state()
        if generation is not None and generation != state["generation"]:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"the index was rebuilt since the first page "
                               f"(generation {generation}, now {state['generation']}): search again from the first "
                               "page", "PAGE_TOKEN_EXPIRED", "page_token")
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
                hits = self.index.search(vector, target, request.task or None, k, where=where,
                                         score_threshold=threshold, offset=offset)
            except VectorIndexError as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "VECTOR_INVALID", f"{at}vector") from exc
            state = self.index.state()
            if (state["generation"], state.get("query_version")) == pinned or request.model_version:
                break
        more = len(hits) == k and offset + 2 * k <= MAX_DEPTH
        return search_pb2.SearchResponse(query_model_version=version, hits=[
            search_pb2.Hit(item_id=h.item_id, task=h.task, score=h.score, modality=MODALITY_VALUES[h.modality],
                           model_version=h.model_version, index_generation=h.index_generation, caption=h.caption or "",
                           image_uri=h.image_uri or "", metadata=_struct(h.metadata))
            for h in hits], next_page_token=_token(request, offset + k, state["generation"]) if more else "")

    def _where(self, filters, at: str) -> dict:
        """The request's filters as the index takes them, each checked against the declared fields."""
        where = {}
        for i, f in enumerate(filters):
            field, which = f"{at}filters[{i}]", f.WhichOneof("condition")
            if which is None or f.field in where:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"filter {i} on {f.field!r}: " + (
                    "set any_of or range" if which is None else "a field filtered twice: put every value in one "
                    "any_of"), "FILTER_INVALID", field)
            where[f.field] = ({k: getattr(f.range, k) for k in ("gte", "lte") if f.range.HasField(k)}
                              if which == "range" else json_format.MessageToDict(f.any_of))
            try:
                check_where({f.field: where[f.field]}, self.index.fields)
            except VectorIndexError as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "FILTER_INVALID", field,
                                   {"declared": ",".join(sorted(self.index.fields))}) from exc
        return where

    @staticmethod
    def _page(request) -> tuple[int, int | None]:
        """(offset, the generation the first page read) of a page token; (0, None) for a first page."""
        if not request.page_token:
            return 0, None
        try:
            page = json.loads(base64.urlsafe_b64decode(request.page_token.encode()))
            offset, query, generation = int(page["o"]), page["q"], int(page["g"])
        except (ValueError, KeyError, TypeError):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"page_token {request.page_token[:40]!r} is not one "
                               "a SearchResponse gave: pass its next_page_token, or none for the first page",
                               "PAGE_TOKEN_INVALID", "page_token") from None
        if query != _digest(request):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "page_token belongs to another search: send the "
                               "first page's request again, only page_token changed", "PAGE_TOKEN_MISMATCH",
                               "page_token")
        return offset, generation

    def _count(self, count: int, field: str, what: str) -> None:
        check_count(count, self.settings.serve_max_items, field, what)

    # ---- catalogues -----------------------------------------------------------------------------------------
    async def add_items(self, request: search_pb2.AddItemsRequest) -> search_pb2.AddItemsResponse:
        """Check every item, embed them with the catalogue's version, then (under the stream's lock) index them and
        store them: a refusal changes nothing."""
        name = self._catalogue_name(request.catalogue)
        self._count(len(request.items), "items", "items")
        items, images, seen = [], [], set()
        for i, given in enumerate(request.items):
            at = f"items[{i}]"
            try:
                catalogue.check_item_id(given.item_id)
            except catalogue.CatalogueError as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "ITEM_ID_INVALID", f"{at}.item_id")
            if given.item_id in seen:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"item id {given.item_id!r} is sent twice",
                                   "ITEM_ID_REPEATED", f"{at}.item_id")
            seen.add(given.item_id)
            data = given.image or (self._read_image(given.image_uri, at) if given.image_uri else b"")
            if not data and not given.text:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"item {given.item_id!r} has no image and no "
                                   "text: send one or both", "ITEM_EMPTY", at)
            try:
                metadata = check_metadata(json_format.MessageToDict(given.metadata), self.index.fields,
                                          f"item {given.item_id!r} metadata")
            except VectorIndexError as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "FIELD_INVALID", f"{at}.metadata",
                                   {"declared": ",".join(sorted(self.index.fields))}) from exc
            items.append(catalogue.Item(given.item_id, text=given.text, image_uri=given.image_uri, metadata=metadata))
            images.append(data)
        version = self._catalogue_version(name)
        image_rows = [k for k, data in enumerate(images) if data]
        text_rows = [k for k, item in enumerate(items) if item.text]
        image_vectors = await self._encode_items("image", [images[k] for k in image_rows], image_rows, version)
        text_vectors = await self._encode_items("text", [items[k].text for k in text_rows], text_rows, version)

        def write():
            with self.registry.lock(f"add items to catalogue {name}"):
                self._still_embedded_by(name, version)
                store = catalogue.Catalogue.of(self.settings, name)
                held = store.items()
                for item, data in zip(items, images):
                    if data:
                        item.image = store.put_image(data)
                        item.image_uri = item.image_uri or str(store.image_path(item))
                state = self.index.upsert(catalogue.vectors(name, version, items, image_vectors, text_vectors))
                store.write({**held, **{item.item_id: item for item in items}})
                return state, sum(item.item_id in held for item in items)

        state, replaced = await self._locked(write)
        return search_pb2.AddItemsResponse(added=len(items) - replaced, replaced=replaced, model_version=version,
                                           index_generation=state["generation"])

    async def delete_items(self, request: search_pb2.DeleteItemsRequest) -> search_pb2.DeleteItemsResponse:
        name = self._catalogue_name(request.catalogue)
        ids = list(request.item_ids)
        self._count(len(ids), "item_ids", "item ids")
        for i, item_id in enumerate(ids):
            try:
                catalogue.check_item_id(item_id)
            except catalogue.CatalogueError as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "ITEM_ID_INVALID", f"item_ids[{i}]")
        self._catalogue_version(name, new=False)

        def write():
            with self.registry.lock(f"delete items of catalogue {name}"):
                state, missing = self.index.delete(name, ids)
                store = catalogue.Catalogue.of(self.settings, name)
                store.write({i: item for i, item in store.items().items() if i not in set(ids)})
                return state, missing

        state, missing = await self._locked(write)
        return search_pb2.DeleteItemsResponse(deleted=len(set(ids)) - len(set(missing)), not_found=missing,
                                              index_generation=state["generation"])

    def _catalogue_name(self, name: str) -> str:
        try:
            return catalogue.check_name(name)
        except catalogue.CatalogueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "CATALOGUE_NAME_INVALID", "catalogue")

    def _catalogue_version(self, name: str, new: bool = True) -> str:
        """The version that embeds catalogue `name`: its own; for a new one (`new`), the gallery's query version."""
        state = self.index.state()
        held = state["tasks"].get(name)
        if held and held.get("kind") != CATALOGUE:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{name!r} is a trained task's gallery, not a "
                               "catalogue: name another", "CATALOGUE_IS_A_TASK", "catalogue")
        if held:
            return held["model_version"]
        if not new:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"no catalogue {name!r}; catalogues: "
                               f"{', '.join(sorted(t for t, m in state['tasks'].items() if m.get('kind') == CATALOGUE)) or 'none'}",
                               "CATALOGUE_NOT_FOUND", "catalogue")
        if not state.get("query_version"):
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "the index is empty: promote a version first "
                               "(`clipstream promote`); a catalogue is embedded by the version queries are",
                               "INDEX_EMPTY")
        return state["query_version"]

    def _still_embedded_by(self, name: str, version: str) -> None:
        """Under the stream's lock, before writing: the catalogue is still embedded by `version` (a promotion between
        the check and the lock may have re-embedded it, or moved the query version a new one takes)."""
        now = self._catalogue_version(name)
        if now != version:
            raise RequestError(grpc.StatusCode.ABORTED, f"catalogue {name!r} is embedded by version {now} since this "
                               f"request was embedded by {version} (a promotion ran meanwhile): send it again",
                               "CATALOGUE_VERSION_CHANGED", "catalogue", {"model_version": now})

    def _read_image(self, uri: str, at: str) -> bytes:
        """The bytes of an image the server reads itself: only under a root the user allowed (Settings image_roots)."""
        where = under_allowed_root(uri, self.settings.image_roots)
        if where is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"image_uri {uri!r} is not under an allowed root: "
                               "send the image's bytes, or allow its folder with CLIPSTREAM_IMAGE_ROOTS (Settings "
                               "image_roots)", "IMAGE_URI_NOT_ALLOWED", f"{at}.image_uri")
        try:
            data = where.read_bytes()
        except OSError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"image_uri {uri!r} cannot be read: {exc}",
                               "IMAGE_URI_UNREADABLE", f"{at}.image_uri") from exc
        if len(data) > self.settings.serve_max_image_bytes:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"image_uri {uri!r} is {len(data)} bytes; the limit "
                               f"is {self.settings.serve_max_image_bytes}", "IMAGE_TOO_LARGE", f"{at}.image_uri",
                               {"limit": self.settings.serve_max_image_bytes})
        return data

    async def _encode_items(self, kind: str, inputs: list, rows: list[int], version: str) -> np.ndarray:
        """Vectors of the items' images or texts by `version`; a refusal names the item (items[i].image)."""
        if not inputs:
            return np.zeros((0, 0), np.float32)
        try:
            return (await self._encode(kind, inputs, version, "", many=True))[1]
        except RequestError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), RequestError) else exc  # (Ray's wrapper)
            found = re.fullmatch(r"(texts|images)\[(\d+)\]", cause.field or "")
            if not found:
                raise
            raise RequestError(cause.code, str(cause), cause.reason, f"items[{rows[int(found.group(2))]}].{kind}",
                               cause.metadata) from None

    async def _locked(self, write):
        """`write` in a thread (it waits on MLflow and storage); a promotion holding the stream's lock is UNAVAILABLE,
        which the client's retry policy retries."""
        try:
            return await asyncio.to_thread(write)
        except LockHeld as exc:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{exc}; retry shortly", "STREAM_LOCKED") from exc
        except VectorIndexError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "ITEMS_REFUSED", "items") from exc

    async def _encode(self, kind: str, item, version: str, language: str, attempts: int = 4, many: bool = False):
        """The query's vector (`many`: the list `item`'s vectors) from an Encoder replica; one that dies holding it
        (killed, its node lost) is retried on another after Serve's router has had a moment to drop it: encoding is a
        read, and the caller's own request is still alive (its retry policy covers only the hop it sees)."""
        for attempt in range(attempts):
            try:
                return await self.encoder.encode.remote(kind, item if many else [item], version, language)
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
                                      indexed_at=timestamp(datetime.fromisoformat(t["indexed_at"])),
                                      catalogue=t.get("kind") == CATALOGUE)
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


def _struct(fields: dict) -> Struct:
    out = Struct()
    out.update(fields)
    return out


def _digest(request: search_pb2.SearchRequest) -> str:
    """What names a search across its pages: the request without its page token."""
    bare = search_pb2.SearchRequest()
    bare.CopyFrom(request)
    bare.page_token = ""
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).hexdigest()[:16]


def _token(request: search_pb2.SearchRequest, offset: int, generation: int) -> str:
    page = {"o": offset, "q": _digest(request), "g": generation}
    return base64.urlsafe_b64encode(json.dumps(page).encode()).decode()
