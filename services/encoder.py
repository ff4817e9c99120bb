"""Ray Serve gRPC Encoder, the application's ingress: EncodeText / EncodeImage for any registered
version (the production one by default), answered here; Search and Admin RPCs handed to the Search
deployment; the optional API key checked for all of them.

The encoder is the ingress because encoding is the high-volume call: a hop through another deployment
cost ~20% of encoding throughput on a 2-core machine (benchmarks/grpc_encode.py). Requests are batched
across callers (`@serve.batch`); a batch may hold several versions, so it is split by (version, modality)
and each group runs through its model once, on a thread of its own: the replica's event loop keeps taking
requests while the model computes, so under load the next batch is full when the model is free (run on the
loop, batches at 16-64 clients held 2-4 requests; benchmarks/grpc_encode.py). Loaded versions live in a per-replica cache
(`@serve.multiplexed`); `production` is re-resolved every few seconds, so moving the alias swaps the
model without a restart, and every response names the version that made its vectors; while MLflow does not answer,
the version last seen keeps serving (Registry's stale-on-error cache; the gauge clipstream_registry_stale_seconds says
for how long). A replica given a GPU
(settings.serve_encoder_gpus) loads every version onto it in half precision (settings.embed_precision), through the
Ray-free model path of services/encoding.py; the vectors are unit float32 either way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import ray
import torch
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from PIL import UnidentifiedImageError
from ray import serve
from ray.serve.metrics import Gauge

from clipstream.models import keep_freed_memory, load_image
from clipstream.registry import Registry, RegistryError, RegistryUnavailable
from clipstream.services.client import API_KEY_HEADER
from clipstream.services.encoding import ModelPath
from clipstream.settings import configure_process
from clipstream.v1 import admin_pb2, encoder_pb2, search_pb2

ERROR_DOMAIN = "clipstream.v1"  # google.rpc.ErrorInfo.domain of every error this service gives

logger = logging.getLogger("ray.serve")
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls (but tab, newline, CR) and DEL


class RequestError(Exception):
    """A refused request and the gRPC status that says why; survives Ray's trip between deployments. `reason` (a
    constant in UPPER_SNAKE_CASE) and `metadata` become the status's google.rpc.ErrorInfo, `field` (the request field
    at fault, e.g. `texts[3]`) a google.rpc.BadRequest violation: what a program acts on without parsing the
    message."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "", field: str = "",
                 metadata: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.field, self.metadata = code, reason or code.name, field, dict(metadata or {})

    def __reduce__(self):
        return RequestError, (self.code, str(self), self.reason, self.field, self.metadata)

    def rich_status(self) -> status_pb2.Status:
        """The google.rpc.Status the client reads from the trailing metadata (grpc-status-details-bin)."""
        details = [error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN,
                                               metadata={k: str(v) for k, v in self.metadata.items()})]
        if self.field:
            details.append(error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=self.field, description=str(self))]))
        status = status_pb2.Status(code=self.code.value[0], message=str(self))
        for detail in details:
            status.details.add().Pack(detail)
        return status


def check_count(count: int, limit: int, field: str, what: str) -> None:
    """A request's list `field` of `what` holds 1 to `limit` entries (Settings serve_max_items)."""
    if not count:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"empty batch: send at least one of {what}",
                           "EMPTY_BATCH", field)
    if count > limit:
        raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{count} {what} in one request; the limit is {limit}: "
                           "split the request (the Python client does this for you)", "TOO_MANY_ITEMS", field,
                           {"limit": limit})


def _unexpected(exc: Exception) -> RequestError:
    """A failure that is not the request's fault, as the caller should see it: UNAVAILABLE (worth a retry, which
    the client's retry policy makes) when a replica or the registry went away, else INTERNAL; never a traceback,
    which goes to the replica's log under an id the message names."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    incident = uuid.uuid4().hex[:12]
    logger.error("request failed, incident %s", incident, exc_info=exc)
    from mlflow.exceptions import MlflowException  # (what a registry that is down or locked raises)

    gone = (ActorDiedError, ActorUnavailableError, RayActorError, BackPressureError, DeploymentUnavailableError,
            ConnectionError, TimeoutError, MlflowException)
    if isinstance(exc, gone) or isinstance(getattr(exc, "cause", None), gone):  # (RayTaskError: the remote cause)
        return RequestError(grpc.StatusCode.UNAVAILABLE, f"a serving component is unavailable ({type(exc).__name__}, "
                            f"incident {incident}): retry shortly", "COMPONENT_UNAVAILABLE", metadata={"incident": incident})
    return RequestError(grpc.StatusCode.INTERNAL, f"internal error, incident {incident}: the server's log has the "
                        "details; please report it", "INTERNAL_ERROR", metadata={"incident": incident})


MAX_ONGOING = 128  # requests a replica holds at once, at the least (app.build: room for BATCHES_AT_ONCE full batches)
# Batches at once: while the model thread runs one, the next is already handed to that thread's queue, so the model
# goes from batch to batch without waiting for the event loop in between (a GPU does not idle there). The
# single-thread executor still runs one model call at a time.
BATCHES_AT_ONCE = 2


# A replica that dies is noticed by Serve's health check, and only then do routers stop sending it requests
# (each fails meanwhile, UNAVAILABLE: retried by the client): every 2 s, not Serve's default 10.
@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=MAX_ONGOING, health_check_period_s=2.0)
class Encoder:
    """Limits (settings.serve_max_*) refuse a request with a message naming the limit and how to stay under it."""

    def __init__(self, search, settings, batch_wait_s: float = 0.005, alias_ttl_s: float = 2.0):
        configure_process()  # a replica is a process of its own (on a RayService, not started by the CLI)
        self.search = search
        self.registry = Registry(settings, alias_ttl_s)
        self._staleness = Gauge("clipstream_registry_stale_seconds", description="how long the Encoder has served "
                                "the production version last seen because the model registry does not answer")
        self._staleness.set(0.0)
        self._stale_shown = 0.0
        torch.set_num_threads(max(1, int(settings.serve_encoder_cpus)))  # Ray pins 1 thread to a fractional reservation
        keep_freed_memory()  # every batch re-allocates what the last one freed
        # the GPU Ray gave this replica (settings.serve_encoder_gpus), if any: Ray's own record, since with none
        # asked Ray may leave the node's GPUs visible to torch all the same
        self.path = ModelPath(settings.embed_precision, gpu=bool(ray.get_gpu_ids()) and torch.cuda.is_available())
        self.settings = settings
        self._entries: dict = {}  # version -> its registry entry (languages, tokenizer), read once
        self.batches_seen: list[int] = []  # sizes of recent batches: shows batching at work (tests, debugging)
        self._handed = self.most_handed = 0  # batches handed to the model thread and not answered yet (now, at most)
        self._encode.set_max_batch_size(settings.serve_batch_size)
        self._encode.set_batch_wait_timeout_s(batch_wait_s)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="encode")  # one model call at a time, off the loop
        # images are decoded and preprocessed here, request by request, while the model runs on the batch before: the
        # event loop never decodes (a large image would hold up every other request), the model thread only runs the
        # model, and a queued request holds the model's input, not the decoded image at its full size. (At 16 clients
        # on 2 cores it did not change throughput: grpc-encode's profile note.)
        self._prepare = ThreadPoolExecutor(max(1, int(settings.serve_encoder_cpus)), thread_name_prefix="prepare")

        async def load(version: str):
            return self.path.place(self.registry.load(version))

        # made here, not as a decorated method, so the cache bound comes from Settings (Serve detects it either way)
        self.model = serve.multiplexed(max_num_models_per_replica=settings.serve_model_cache)(load)
        self._loader = load

    # ---- gRPC methods ----------------------------------------------------------------------------------
    async def EncodeText(self, request: encoder_pb2.EncodeTextRequest,
                         grpc_context=None) -> encoder_pb2.EncodeTextResponse:
        return await self._answer(lambda: self._serve(encoder_pb2.EncodeTextResponse, "text", list(request.texts),
                                                      request.model_version, request.language),
                                  encoder_pb2.EncodeTextResponse, grpc_context)

    async def EncodeImage(self, request: encoder_pb2.EncodeImageRequest,
                          grpc_context=None) -> encoder_pb2.EncodeImageResponse:
        return await self._answer(lambda: self._serve(encoder_pb2.EncodeImageResponse, "image", list(request.images),
                                                      request.model_version),
                                  encoder_pb2.EncodeImageResponse, grpc_context)

    async def Search(self, request: search_pb2.SearchRequest, grpc_context=None) -> search_pb2.SearchResponse:
        return await self._answer(lambda: self.search.search.remote(request), search_pb2.SearchResponse, grpc_context)

    async def BatchSearch(self, request: search_pb2.BatchSearchRequest, grpc_context=None
                          ) -> search_pb2.BatchSearchResponse:
        return await self._answer(lambda: self.search.batch_search.remote(request), search_pb2.BatchSearchResponse,
                                  grpc_context)

    async def AddItems(self, request: search_pb2.AddItemsRequest, grpc_context=None) -> search_pb2.AddItemsResponse:
        return await self._answer(lambda: self.search.add_items.remote(request), search_pb2.AddItemsResponse,
                                  grpc_context)

    async def DeleteItems(self, request: search_pb2.DeleteItemsRequest, grpc_context=None
                          ) -> search_pb2.DeleteItemsResponse:
        return await self._answer(lambda: self.search.delete_items.remote(request), search_pb2.DeleteItemsResponse,
                                  grpc_context)

    async def GetStatus(self, request: admin_pb2.GetStatusRequest, grpc_context=None) -> admin_pb2.GetStatusResponse:
        return await self._answer(lambda: self.search.status.remote(), admin_pb2.GetStatusResponse, grpc_context)

    async def ListVersions(self, request: admin_pb2.ListVersionsRequest, grpc_context=None) -> admin_pb2.ListVersionsResponse:
        return await self._answer(lambda: self.search.versions.remote(request), admin_pb2.ListVersionsResponse,
                                  grpc_context)

    # ---- Python methods (through deployment handles) ---------------------------------------------------

    async def encode(self, modality: str, items: list, model_version: str = "", language: str = "") -> tuple[str, np.ndarray]:
        """The Python entry point (used by Search through a deployment handle): (version, unit vectors)."""
        version = self._version(model_version)
        if modality == "text":
            inputs = self._validate(modality, items)
            if language:
                self._check_language(version, language)
        else:  # decoded, checked and made into the model's input off the event loop (`pixels`)
            bundle = await self.model(version)
            inputs = await asyncio.get_running_loop().run_in_executor(
                self._prepare, lambda: self.path.prepare(bundle, self._validate(modality, items)))
        return version, await self._encode((version, modality, inputs))

    async def ready(self) -> dict[str, bool]:
        """What the health service reports: the Encoder is ready with the production model loaded (loaded now if it
        is not), Search with a gallery indexed, Admin when Search answers."""
        try:
            await self.model(self._version(""))
            encoder = True
        except Exception:  # no production version yet, or it does not load
            encoder = False
        try:
            search, admin = await self.search.ready.remote(), True
        except Exception:
            search = admin = False
        return {"clipstream.v1.EncoderService": encoder, "clipstream.v1.SearchService": encoder and search,
                "clipstream.v1.AdminService": admin}

    async def BatchSizes(self, request=None) -> list[int]:
        return list(self.batches_seen)

    async def most_batches_handed(self) -> int:
        """The most batches this replica has had handed to its model thread at once (BATCHES_AT_ONCE: the next one
        waited there)."""
        return self.most_handed

    async def loaded(self) -> list[str]:
        """Versions in this replica's model cache, least recently used first."""
        wrapper = getattr(self._loader, "__serve_multiplex_wrapper", None)
        return list(wrapper.models) if wrapper else []

    def _authorize(self, grpc_context) -> None:
        key = self.settings.secret("api_key")
        if not key:
            return
        sent = dict(grpc_context.invocation_metadata()).get(API_KEY_HEADER, "") if grpc_context else ""
        if not hmac.compare_digest(sent.encode(), key.encode()):
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED,
                               f"missing or wrong API key: send it as gRPC metadata {API_KEY_HEADER!r}",
                               "API_KEY_INVALID", metadata={"header": API_KEY_HEADER})

    async def _answer(self, work, empty, grpc_context):
        """Authorize, then await `work()`; a RequestError (ours, or Search's re-raised by Ray) becomes the
        gRPC status, and the server keeps serving."""
        try:
            self._authorize(grpc_context)
            return await work()
        except Exception as exc:
            if grpc_context is None:
                raise
            # from another deployment, Ray raises a RayTaskError (that may also subclass RequestError) whose
            # `cause` is the original; its own str() holds the remote traceback
            cause = getattr(exc, "cause", None) if isinstance(getattr(exc, "cause", None), RequestError) else exc
            if not isinstance(cause, RequestError):
                cause = _unexpected(exc)
            grpc_context.set_code(cause.code)
            grpc_context.set_details(str(cause))
            grpc_context.set_trailing_metadata(list(rpc_status.to_status(cause.rich_status()).trailing_metadata))
            return empty()

    async def _serve(self, response, modality, items, model_version, language=""):
        version, vectors = await self.encode(modality, items, model_version, language)
        return response(embeddings=[encoder_pb2.Embedding(values=v) for v in vectors.tolist()], dim=vectors.shape[1],
                        model_version=version)

    def _version(self, ref: str) -> str:
        try:
            return self.registry.number(ref)
        except RegistryUnavailable as exc:  # (never for a version already seen: see Registry.number)
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{exc}: retry shortly", "REGISTRY_UNAVAILABLE") from exc
        except RegistryError as exc:
            raise RequestError(grpc.StatusCode.NOT_FOUND, str(exc), "VERSION_NOT_FOUND", "model_version") from exc
        finally:  # on every request, on the event loop: Ray's Gauge.set only when the value changes
            stale = self.registry.staleness_s()
            if stale != self._stale_shown:
                self._staleness.set(stale)
                self._stale_shown = stale

    async def registry_staleness(self) -> float:
        """Seconds this replica has served aliases as last seen because the registry does not answer (0: it does)."""
        return self.registry.staleness_s()

    def _check_language(self, version: str, language: str) -> None:
        """Refuse text in a language `version` was never trained on (its tokenizer has no subwords learnt for it)."""
        if version not in self._entries:  # a version's tags never change
            self._entries[version] = self.registry.resolve(version, download=False)
        known = self._entries[version]
        if language not in known.languages:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"model version {version} was not trained on language {language!r} (it knows "
                               f"{', '.join(known.languages) or 'none'}; tokenizer {known.tags.get('tokenizer') or 'clip-bpe'}): "
                               "ask a version that learnt it, or leave `language` empty to encode the text anyway",
                               "LANGUAGE_NOT_TRAINED", "language",
                               {"model_version": version, "languages": ",".join(known.languages)})

    def _validate(self, modality: str, items: list) -> list:
        limits = self.settings
        check_count(len(items), limits.serve_max_items, f"{modality}s", f"{modality}s")
        if modality == "text":
            for i, text in enumerate(items):
                if not text.strip():
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"text {i} is empty", "EMPTY_TEXT", f"texts[{i}]")
                control = CONTROL.search(text)
                if control:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"text {i} holds control character "
                                       f"{control.group()!r} at {control.start()}: send plain text (tabs and newlines are fine)",
                                       "CONTROL_CHARACTER", f"texts[{i}]")
                if len(text) > limits.serve_max_text_chars:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"text {i} has {len(text)} characters; the limit is {limits.serve_max_text_chars}",
                                       "TEXT_TOO_LONG", f"texts[{i}]", {"limit": limits.serve_max_text_chars})
            return items
        images = []
        for i, data in enumerate(items):
            if len(data) > limits.serve_max_image_bytes:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"image {i} is {len(data)} bytes; the limit is {limits.serve_max_image_bytes} bytes",
                                   "IMAGE_TOO_LARGE", f"images[{i}]", {"limit": limits.serve_max_image_bytes})
            try:
                images.append(load_image(data))
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"image {i} is not a decodable image (PNG, JPEG, WebP...): {exc}",
                                   "IMAGE_NOT_DECODABLE", f"images[{i}]") from exc
        return images

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005, max_concurrent_batches=BATCHES_AT_ONCE)
    async def _encode(self, requests: list[tuple[str, str, list]]) -> list[np.ndarray]:
        self.batches_seen = (self.batches_seen + [len(requests)])[-1000:]
        bundles = {version: await self.model(version) for version in dict.fromkeys(r[0] for r in requests)}
        self._handed += 1
        self.most_handed = max(self.most_handed, self._handed)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._compute, ModelPath.encode, requests, bundles)
        finally:
            self._handed -= 1
