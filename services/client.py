"""Python client for the clipstream gRPC services: batches large inputs, shows progress, retries while
the server is UNAVAILABLE (starting, or a replica swapping) through gRPC's own retry policy in the channel's
service config, speaks TLS when asked, and returns numpy arrays."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import ListValue, Struct
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from clipstream import console
from clipstream.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)

API_KEY_HEADER = "x-api-key"  # the metadata key the server checks when Settings.api_key is set
# the metadata key Ray Serve's gRPC proxy routes a call by when several applications share it (Settings.serve_app)
APPLICATION_HEADER = "application"
BACKOFF_S = (1.0, 5.0)  # the retry policy's first and longest wait (service_config)
MAX_REQUEST_BYTES = 64 << 20  # the server's cap on one request message (services/app.py SERVE_ENV)
SERVICES = ("clipstream.v1.EncoderService", "clipstream.v1.SearchService", "clipstream.v1.AdminService", "grpc.health.v1.Health")


def service_config(retries: int, backoff_s: tuple[float, float] = BACKOFF_S) -> str:
    """gRPC's retry policy for every clipstream RPC: UNAVAILABLE (the proxy starting, a replica being replaced)
    is retried with exponential backoff, up to `retries` times (gRPC caps attempts at 5); nothing else is, but
    ABORTED for a catalogue's writes (a promotion re-embedded the catalogue while the request was embedded: sent
    again, it is embedded by the new version; the writes are idempotent). Waits are random up to 1, 2, 4, 5 s
    (`backoff_s`, the first and the longest): ~6 s in all on average, longer than Serve takes to stop routing to a
    dead replica (its health check, every 2 s)."""
    first, longest = backoff_s
    if not 0 < first <= longest:
        raise ValueError(f"backoff_s={backoff_s!r}: give (first, longest) wait in seconds, 0 < first <= longest")
    policy = {"maxAttempts": min(retries, 4) + 1, "initialBackoff": f"{first:.9f}s", "maxBackoff": f"{longest:.9f}s",
              "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    writes = {**policy, "retryableStatusCodes": ["UNAVAILABLE", "ABORTED"]}
    return json.dumps({"methodConfig": [
        {"name": [{"service": s} for s in SERVICES], **({"retryPolicy": policy} if retries else {})},
        {"name": [{"service": "clipstream.v1.SearchService", "method": m} for m in ("AddItems", "DeleteItems")],
         **({"retryPolicy": writes} if retries else {})}]})


def channel(address: str, *, tls: bool = False, ca_file: Optional[str | Path] = None, retries: int = 4,
            aio: bool = False, application: str | None = None, backoff_s: tuple[float, float] = BACKOFF_S):
    """A channel to a clipstream server (grpc.aio's with `aio`): TLS verified against `ca_file` (PEM; default the
    system roots) when `tls`; every call on it names `application` (Settings.serve_app) when given, which the server
    needs when several applications share its proxy (without it the proxy answers NOT_FOUND there, and health speaks
    for its default application)."""
    options = [("grpc.service_config", service_config(retries, backoff_s)), ("grpc.enable_retries", int(retries > 0))]
    credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes() if ca_file else None) if tls else None
    if aio:
        interceptors = [_AsyncApplication(application)] if application else None
        if tls:
            return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    made = (grpc.secure_channel(address, credentials, options=options) if tls
            else grpc.insecure_channel(address, options=options))
    return grpc.intercept_channel(made, _Application(application)) if application else made


def _with_application(details, application: str):
    return details._replace(metadata=(*(details.metadata or ()), (APPLICATION_HEADER, application)))


class _Application(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Names the application in every call's metadata (the retry policy, in the channel below, sends it again)."""

    def __init__(self, application: str):
        self.application = application

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with_application(details, self.application), request)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = intercept_unary_unary


class _AsyncApplication(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
                        grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor):
    """_Application for grpc.aio."""

    def __init__(self, application: str):
        self.application = application

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_application(details, self.application), request)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = intercept_unary_unary


class RpcError(grpc.RpcError):
    """A clipstream RPC that failed: `code()` and `details()` as grpc.RpcError's (it is one), `exc.status` the
    grpc.StatusCode; a subclass per status a caller acts on differently. From the status's google.rpc details, when
    the server sent them: `reason` (ErrorInfo's, e.g. TEXT_TOO_LONG, K_OUT_OF_RANGE), `metadata` (ErrorInfo's, e.g.
    the limit) and `field_violations` (BadRequest's: [(field, description)], e.g. ("texts[3]", ...))."""

    def __init__(self, status: grpc.StatusCode, details: str, reason: str = "", metadata: Optional[dict] = None,
                 field_violations: Sequence[tuple[str, str]] = ()):
        super().__init__(f"{status.name}: {details}")
        self.status, self._details = status, details
        self.reason, self.metadata, self.field_violations = reason, dict(metadata or {}), list(field_violations)

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self._details


class InvalidArgument(RpcError):
    """The request itself is wrong (a bad input, a too-large item): fix it, do not retry."""


class NotFound(RpcError):
    """A task, version or service the server does not have."""


class FailedPrecondition(RpcError):
    """The server cannot do it in its present state (no production version, a language a version was not taught)."""


class Unauthenticated(RpcError):
    """No API key, or a wrong one (Settings api_key)."""


class Unavailable(RpcError):
    """No server answered, or it stayed unavailable through the retries: check the address, or try later."""


class DeadlineExceeded(RpcError):
    """No answer within the client's timeout."""


class ResourceExhausted(RpcError):
    """Too much at once (a request over the server's size limit)."""


TYPED = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.NOT_FOUND: NotFound,
         grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
         grpc.StatusCode.PERMISSION_DENIED: Unauthenticated, grpc.StatusCode.UNAVAILABLE: Unavailable,
         grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted}


def typed(exc: grpc.RpcError) -> RpcError:
    """The typed exception of a raw gRPC error (RpcError itself for a status without its own class), with the
    ErrorInfo and BadRequest of its google.rpc status details where the server sent them."""
    status = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    reason, metadata, violations = "", {}, []
    try:
        rich = rpc_status.from_call(exc) if callable(getattr(exc, "trailing_metadata", None)) else None
    except ValueError:  # details that disagree with the call's own code or message: not this call's
        rich = None
    for detail in rich.details if rich is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    return TYPED.get(status, RpcError)(status, details or "", reason, metadata, violations)


def parse_address(uri: str) -> tuple[str, bool]:
    """(HOST:PORT, tls) of `grpc://HOST:PORT`, `grpcs://HOST:PORT` (TLS) or a bare HOST:PORT (plaintext)."""
    for scheme, tls in (("grpcs://", True), ("grpc://", False)):
        if uri.startswith(scheme):
            uri = uri[len(scheme):]
            break
    else:
        if "://" in uri:
            raise ValueError(f"server address {uri!r}: use grpc://HOST:PORT, grpcs://HOST:PORT (TLS) or HOST:PORT")
        tls = False
    host, _, port = uri.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"server address {uri!r}: expected HOST:PORT")
    return f"{host}:{port}", tls


class _Calls:
    """What both clients share: the address, the stubs on a channel, the request messages and the answers' shapes."""

    def __init__(self, address: str, api_key: Optional[str], timeout_s: float, retries: int, tls: bool,
                 ca_file: Optional[str | Path], aio: bool, application: str | None, backoff_s: tuple[float, float]):
        address, uri_tls = parse_address(address)
        self.address = address
        self.channel = channel(address, tls=tls or uri_tls, ca_file=ca_file, retries=retries, aio=aio,
                               application=application, backoff_s=backoff_s)
        self.encoder = encoder_pb2_grpc.EncoderServiceStub(self.channel)
        self.searcher = search_pb2_grpc.SearchServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = ((API_KEY_HEADER, api_key),) if api_key else None

    @classmethod
    def from_env(cls, **options):
        """A client configured as this machine's settings say (CLIPSTREAM_* variables, the settings file): the
        server at Settings `server` (default grpc://127.0.0.1:<grpc_port>), its API key, TLS roots, the application
        (`serve_app`)."""
        from clipstream.settings import Settings

        settings = Settings()
        return cls(settings.server or f"grpc://127.0.0.1:{settings.grpc_port}", api_key=settings.secret("api_key"),
                   tls=settings.tls, ca_file=settings.tls_ca_file or settings.tls_cert_file,
                   application=settings.serve_app, **options)

    @staticmethod
    def _text_request(chunk: list, model_version: str, language: str):
        return encoder_pb2.EncodeTextRequest(texts=chunk, model_version=model_version, language=language)

    @staticmethod
    def _image_request(chunk: list, model_version: str):
        return encoder_pb2.EncodeImageRequest(images=chunk, model_version=model_version)

    @staticmethod
    def _images(images: Sequence[str | Path | bytes]) -> list[bytes]:
        return [x if isinstance(x, bytes) else Path(x).read_bytes() for x in images]

    @classmethod
    def _search_request(cls, text=None, image=None, vector=None, task: str = "", k: int = 10,
                        target_modality: str = "", model_version: str = "", language: str = "",
                        filters: Optional[dict] = None, score_threshold: Optional[float] = None, page_token: str = ""):
        if sum(x is not None for x in (text, image, vector)) != 1:
            raise ValueError("give exactly one of text, image or vector")
        query = ({"text": text} if text is not None else {"vector": search_pb2.Vector(values=list(vector))}
                 if vector is not None else {"image": image if isinstance(image, bytes) else Path(image).read_bytes()})
        if target_modality not in ("", "image", "text"):
            raise ValueError(f"target_modality must be 'image', 'text' or '' (the query's other modality), "
                             f"got {target_modality!r}")
        modality = search_pb2.Modality.Value(f"MODALITY_{target_modality.upper()}") if target_modality else 0
        return search_pb2.SearchRequest(task=task, k=k, target_modality=modality, model_version=model_version,
                                        language=language, filters=cls._filters(filters or {}),
                                        score_threshold=score_threshold, page_token=page_token, **query)

    @staticmethod
    def _filters(filters: dict) -> list:
        """{field: value, field: [v1, v2], field: {"gte": x, "lte": y}} as FieldFilters: equal to a value, to any of
        several, or within a range; all must hold."""
        out = []
        for field, condition in filters.items():
            if isinstance(condition, dict):
                out.append(search_pb2.FieldFilter(field=field, range=search_pb2.Range(**condition)))
            else:
                any_of = ListValue()
                any_of.extend(list(condition) if isinstance(condition, (list, tuple)) else [condition])
                out.append(search_pb2.FieldFilter(field=field, any_of=any_of))
        return out

    @classmethod
    def _items_request(cls, catalogue: str, items: Sequence[dict]):
        """Items as dicts: item_id, and image (a path or bytes), image_uri, text, metadata as they apply."""
        out = []
        for item in items:
            unknown = set(item) - {"item_id", "image", "image_uri", "text", "metadata"}
            if unknown:
                raise ValueError(f"item {item.get('item_id')!r}: unknown keys {sorted(unknown)} (an item has item_id, "
                                 "image, image_uri, text, metadata)")
            metadata = Struct()
            metadata.update(item.get("metadata") or {})
            image = item.get("image")
            out.append(search_pb2.Item(item_id=item.get("item_id", ""), image=cls._images([image])[0] if image else b"",
                                       image_uri=item.get("image_uri", ""), text=item.get("text", ""),
                                       metadata=metadata))
        return search_pb2.AddItemsRequest(catalogue=catalogue, items=out)

    @staticmethod
    def _added(responses: list) -> dict:
        return {"added": sum(r.added for r in responses), "replaced": sum(r.replaced for r in responses),
                "model_version": responses[-1].model_version, "index_generation": responses[-1].index_generation}

    @staticmethod
    def _deleted(responses: list) -> dict:
        return {"deleted": sum(r.deleted for r in responses), "not_found": [i for r in responses for i in r.not_found]}

    @staticmethod
    def _hits(response) -> list[dict]:
        return [{"item_id": h.item_id, "task": h.task, "score": h.score,
                 "modality": search_pb2.Modality.Name(h.modality).removeprefix("MODALITY_").lower(),
                 "model_version": h.model_version, "index_generation": h.index_generation,
                 "caption": h.caption or None, "image_uri": h.image_uri or None,
                 "metadata": MessageToDict(h.metadata), "query_model_version": response.query_model_version}
                for h in response.hits]

    @staticmethod
    def _status(response) -> dict:
        status = MessageToDict(response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for task in status["tasks"]:  # the JSON mapping writes uint64 as strings
            task["images"], task["texts"] = int(task["images"]), int(task["texts"])
        return status

    @staticmethod
    def _versions(response) -> list[dict]:
        return MessageToDict(response, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)["versions"]

    @staticmethod
    def _page(token: str, page_size: int):
        return admin_pb2.ListVersionsRequest(page_token=token, page_size=page_size)

    @staticmethod
    def _health(response) -> str:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    @staticmethod
    def _vectors(responses: list) -> tuple[np.ndarray, str]:
        """The chunks' vectors in order, and the one version that made them all."""
        versions = {r.model_version for r in responses}
        if len(versions) > 1:  # production moved mid-way: vectors from two versions must not be mixed
            raise RuntimeError(f"the production version changed during the request ({sorted(versions)}); "
                               "retry, or pin model_version")
        return np.concatenate([np.array([e.values for e in r.embeddings], dtype=np.float32) for r in responses]), \
            versions.pop()


class Client(_Calls):
    """The clipstream services from Python: `Client("grpc://HOST:PORT")` (grpcs:// speaks TLS), or
    `Client.from_env()`. A failed call raises the typed exception of its status (`RpcError` and subclasses).
    `application`: the Serve application to call where several share the server's proxy (Settings.serve_app);
    `backoff_s`: the retry policy's first and longest wait (service_config)."""

    def __init__(self, address: str = "127.0.0.1:9000", *, api_key: Optional[str] = None, timeout_s: float = 30.0,
                 retries: int = 4, tls: bool = False, ca_file: Optional[str | Path] = None,
                 application: str | None = None, backoff_s: tuple[float, float] = BACKOFF_S):
        super().__init__(address, api_key, timeout_s, retries, tls, ca_file, False, application, backoff_s)

    def encode_text(self, texts: Sequence[str], batch_size: int = 64, model_version: str = "",
                    progress: Optional[bool] = None, language: str = "") -> tuple[np.ndarray, str]:
        """(unit vectors [N, D], the version that made them); with `language`, refused (FAILED_PRECONDITION) by a
        version not trained on it."""
        return self._encode(list(texts), batch_size, progress, lambda chunk: self._call(
            self.encoder.EncodeText, self._text_request(chunk, model_version, language)))

    def encode_image(self, images: Sequence[str | Path | bytes], batch_size: int = 32, model_version: str = "",
                     progress: Optional[bool] = None) -> tuple[np.ndarray, str]:
        return self._encode(self._images(images), batch_size, progress, lambda chunk: self._call(
            self.encoder.EncodeImage, self._image_request(chunk, model_version)))

    def search(self, text: Optional[str] = None, image: Optional[str | Path | bytes] = None,
               vector: Optional[Iterable[float]] = None, **options) -> list[dict]:
        """Hits best first, as dicts: item_id, task, score, modality, model_version, index_generation, caption,
        image_uri, metadata. Options: task, k, target_modality, model_version, language, filters ({field: value,
        field: [any, of], field: {"gte": x, "lte": y}} on declared fields), score_threshold."""
        return self._hits(self._call(self.searcher.Search, self._search_request(text, image, vector, **options)))

    def search_pages(self, text: Optional[str] = None, image: Optional[str | Path | bytes] = None,
                     vector: Optional[Iterable[float]] = None, **options) -> Iterator[list[dict]]:
        """The same search page after page (k hits each), for as long as the caller reads and the server has more."""
        token = ""
        while True:
            response = self._call(self.searcher.Search, self._search_request(text, image, vector, page_token=token,
                                                                             **options))
            yield self._hits(response)
            token = response.next_page_token
            if not token:
                return

    def search_batch(self, queries: Sequence[dict], **options) -> list[list[dict]]:
        """Several searches in one call: each query a dict of `search`'s arguments (text/image/vector and its own
        options), `options` the ones they share."""
        requests = [self._search_request(**{**options, **query}) for query in queries]
        response = self._call(self.searcher.BatchSearch, search_pb2.BatchSearchRequest(requests=requests))
        return [self._hits(r) for r in response.responses]

    def add_items(self, catalogue: str, items: Sequence[dict], batch_size: int = 64) -> dict:
        """Add items to a catalogue or replace them (by item_id): each a dict of item_id, and image (a path or
        bytes), image_uri, text, metadata as it has them. Sent `batch_size` at a time; returns added, replaced,
        model_version, index_generation."""
        return self._added([self._call(self.searcher.AddItems, self._items_request(catalogue, chunk))
                            for chunk in _chunks(list(items), batch_size, 1 << 62)])

    def delete_items(self, catalogue: str, item_ids: Sequence[str], batch_size: int = 256) -> dict:
        """Delete items by id; returns deleted, and the ids not_found."""
        return self._deleted([self._call(self.searcher.DeleteItems, search_pb2.DeleteItemsRequest(
            catalogue=catalogue, item_ids=chunk)) for chunk in _chunks(list(item_ids), batch_size, 1 << 62)])

    def status(self) -> dict:
        """What the server holds: production and query versions, indexed tasks, loaded versions, problems."""
        return self._status(self._call(self.admin.GetStatus, admin_pb2.GetStatusRequest()))

    def versions(self, page_size: int = 0) -> list[dict]:
        """Every registered version, newest first, asked for a page (`page_size`; 0: the server's 50) at a time."""
        found, token = [], ""
        while True:
            response = self._call(self.admin.ListVersions, self._page(token, page_size))
            found, token = found + self._versions(response), response.next_page_token
            if not token:
                return found

    def health(self, service: str = "") -> str:
        """The standard grpc.health.v1 status of `service` ('' = the server): SERVING, NOT_SERVING, ... ."""
        return self._health(self._call(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service)))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _encode(self, items: list, batch_size: int, progress: Optional[bool], call) -> tuple[np.ndarray, str]:
        if not items:
            raise ValueError("nothing to encode")
        responses = []
        with console.bar(total=len(items), unit="item",
                         disable=not (progress if progress is not None else len(items) > 10 * batch_size)) as bar:
            for chunk in _chunks(items, batch_size, MAX_REQUEST_BYTES // 2):
                responses.append(call(chunk))
                bar.update(len(responses[-1].embeddings))
        return self._vectors(responses)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise typed(exc) from exc


class AsyncClient(_Calls):
    """The same calls on grpc.aio, to await from an event loop: `async with AsyncClient("grpc://HOST:PORT") as c:
    vectors, version = await c.encode_text(texts)`. A large input goes as chunks with up to `in_flight` requests
    on the wire at once (the server batches them together), their vectors put back in order."""

    def __init__(self, address: str = "127.0.0.1:9000", *, api_key: Optional[str] = None, timeout_s: float = 30.0,
                 retries: int = 4, tls: bool = False, ca_file: Optional[str | Path] = None, in_flight: int = 8,
                 application: str | None = None, backoff_s: tuple[float, float] = BACKOFF_S):
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        super().__init__(address, api_key, timeout_s, retries, tls, ca_file, True, application, backoff_s)
        self.in_flight = in_flight

    async def encode_text(self, texts: Sequence[str], batch_size: int = 64, model_version: str = "",
                          language: str = "") -> tuple[np.ndarray, str]:
        return await self._encode(list(texts), batch_size, lambda chunk: self._call(
            self.encoder.EncodeText, self._text_request(chunk, model_version, language)))

    async def encode_image(self, images: Sequence[str | Path | bytes], batch_size: int = 32,
                           model_version: str = "") -> tuple[np.ndarray, str]:
        return await self._encode(self._images(images), batch_size, lambda chunk: self._call(
            self.encoder.EncodeImage, self._image_request(chunk, model_version)))

    async def search(self, text: Optional[str] = None, image: Optional[str | Path | bytes] = None,
                     vector: Optional[Iterable[float]] = None, **options) -> list[dict]:
        return self._hits(await self._call(self.searcher.Search, self._search_request(text, image, vector, **options)))

    async def search_batch(self, queries: Sequence[dict], **options) -> list[list[dict]]:
        requests = [self._search_request(**{**options, **query}) for query in queries]
        response = await self._call(self.searcher.BatchSearch, search_pb2.BatchSearchRequest(requests=requests))
        return [self._hits(r) for r in response.responses]

    async def add_items(self, catalogue: str, items: Sequence[dict], batch_size: int = 64) -> dict:
        # one chunk after another: a catalogue's writes take the stream's lock in turn anyway
        return self._added([await self._call(self.searcher.AddItems, self._items_request(catalogue, chunk))
                            for chunk in _chunks(list(items), batch_size, 1 << 62)])

    async def delete_items(self, catalogue: str, item_ids: Sequence[str], batch_size: int = 256) -> dict:
        return self._deleted([await self._call(self.searcher.DeleteItems, search_pb2.DeleteItemsRequest(
            catalogue=catalogue, item_ids=chunk)) for chunk in _chunks(list(item_ids), batch_size, 1 << 62)])

    async def status(self) -> dict:
        return self._status(await self._call(self.admin.GetStatus, admin_pb2.GetStatusRequest()))

    async def versions(self, page_size: int = 0) -> list[dict]:
        found, token = [], ""
        while True:
            response = await self._call(self.admin.ListVersions, self._page(token, page_size))
            found, token = found + self._versions(response), response.next_page_token
            if not token:
                return found

    async def health(self, service: str = "") -> str:
        return self._health(await self._call(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service)))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _encode(self, items: list, batch_size: int, call) -> tuple[np.ndarray, str]:
        if not items:
            raise ValueError("nothing to encode")
        slots = asyncio.Semaphore(self.in_flight)

        async def one(chunk):
            async with slots:
                return await call(chunk)
        return self._vectors(await asyncio.gather(*(one(c) for c in _chunks(items, batch_size, MAX_REQUEST_BYTES // 2))))

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise typed(exc) from exc


def _chunks(items: list, count: int, max_bytes: int):
    """`items` in requests of at most `count` items and (images) `max_bytes` bytes; a larger single item goes alone,
    for the server to refuse with its own limit."""
    chunk, size = [], 0
    for item in items:
        n = len(item) if isinstance(item, bytes) else 0
        if chunk and (len(chunk) == count or size + n > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += n
    if chunk:
        yield chunk
