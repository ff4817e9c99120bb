"""Python client for the clipstream gRPC services: batches large inputs, shows progress, retries while
the server is UNAVAILABLE (starting, or a replica swapping) through gRPC's own retry policy in the channel's
service config, speaks TLS when asked, and returns numpy arrays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
MAX_REQUEST_BYTES = 64 << 20  # the server's cap on one request message (services/app.py SERVE_ENV)
SERVICES = ("clipstream.v1.Encoder", "clipstream.v1.Search", "clipstream.v1.Admin", "grpc.health.v1.Health")


def service_config(retries: int) -> str:
    """gRPC's retry policy for every clipstream RPC: UNAVAILABLE (the proxy starting, a replica being replaced)
    is retried with exponential backoff, up to `retries` times (gRPC caps attempts at 5); nothing else is. Waits
    are random up to 1, 2, 4, 5 s: ~6 s in all on average, longer than Serve takes to stop routing to a dead
    replica (its health check, every 2 s)."""
    policy = {"maxAttempts": min(retries, 4) + 1, "initialBackoff": "1s", "maxBackoff": "5s",
              "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}
    return json.dumps({"methodConfig": [{"name": [{"service": s} for s in SERVICES],
                                         **({"retryPolicy": policy} if retries else {})}]})


def channel(address: str, *, tls: bool = False, ca_file: Optional[str | Path] = None, retries: int = 4) -> grpc.Channel:
    """A channel to a clipstream server: TLS verified against `ca_file` (PEM; default the system roots) when `tls`."""
    options = [("grpc.service_config", service_config(retries)), ("grpc.enable_retries", int(retries > 0))]
    if not tls:
        return grpc.insecure_channel(address, options=options)
    roots = Path(ca_file).read_bytes() if ca_file else None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=roots), options=options)


class RpcError(grpc.RpcError):
    """A clipstream RPC that failed: `code()` and `details()` as grpc.RpcError's (it is one), `exc.status` the
    grpc.StatusCode; a subclass per status a caller acts on differently."""

    def __init__(self, status: grpc.StatusCode, details: str):
        super().__init__(f"{status.name}: {details}")
        self.status, self._details = status, details

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
    """The typed exception of a raw gRPC error (RpcError itself for a status without its own class)."""
    status = exc.code() if callable(getattr(exc, "code", None)) else grpc.StatusCode.UNKNOWN
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return TYPED.get(status, RpcError)(status, details or "")


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


class Client:
    def __init__(self, address: str = "127.0.0.1:9000", *, api_key: Optional[str] = None, timeout_s: float = 30.0,
                 retries: int = 4, tls: bool = False, ca_file: Optional[str | Path] = None):
        """`address`: HOST:PORT, or grpc://HOST:PORT / grpcs://HOST:PORT (the latter speaks TLS)."""
        address, uri_tls = parse_address(address)
        tls = tls or uri_tls
        self.address = address
        self.channel = channel(address, tls=tls, ca_file=ca_file, retries=retries)
        self.encoder = encoder_pb2_grpc.EncoderStub(self.channel)
        self.searcher = search_pb2_grpc.SearchStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = ((API_KEY_HEADER, api_key),) if api_key else None

    def encode_text(self, texts: Sequence[str], batch_size: int = 64, model_version: str = "",
                    progress: Optional[bool] = None, language: str = "") -> tuple[np.ndarray, str]:
        """(unit vectors [N, D], the version that made them); with `language`, refused (FAILED_PRECONDITION) by a
        version not trained on it."""
        return self._encode(list(texts), batch_size, progress, lambda chunk: self._call(
            self.encoder.EncodeText, encoder_pb2.EncodeTextRequest(texts=chunk, model_version=model_version,
                                                                   language=language)))

    def encode_image(self, images: Sequence[str | Path | bytes], batch_size: int = 32, model_version: str = "",
                     progress: Optional[bool] = None) -> tuple[np.ndarray, str]:
        data = [x if isinstance(x, bytes) else Path(x).read_bytes() for x in images]
        return self._encode(data, batch_size, progress, lambda chunk: self._call(
            self.encoder.EncodeImage, encoder_pb2.EncodeImageRequest(images=chunk, model_version=model_version)))

    def search(self, text: Optional[str] = None, image: Optional[str | Path | bytes] = None,
               vector: Optional[Iterable[float]] = None, *, task: str = "", k: int = 10, target_modality: str = "",
               model_version: str = "", language: str = "") -> list[dict]:
        """Hits best first, as dicts: item_id, task, score, modality, model_version, index_generation, caption."""
        if sum(x is not None for x in (text, image, vector)) != 1:
            raise ValueError("give exactly one of text, image or vector")
        query = ({"text": text} if text is not None else {"vector": search_pb2.Vector(values=list(vector))}
                 if vector is not None else {"image": image if isinstance(image, bytes) else Path(image).read_bytes()})
        response = self._call(self.searcher.Search, search_pb2.SearchRequest(
            task=task, k=k, target_modality=target_modality, model_version=model_version, language=language, **query))
        return [{"item_id": h.item_id, "task": h.task, "score": h.score, "modality": h.modality,
                 "model_version": h.model_version, "index_generation": h.index_generation,
                 "caption": h.caption or None, "query_model_version": response.query_model_version}
                for h in response.hits]

    def status(self) -> dict:
        """What the server holds: production and query versions, indexed tasks, loaded versions, problems."""
        status = MessageToDict(self._call(self.admin.GetStatus, admin_pb2.GetStatusRequest()),
                               preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for task in status["tasks"]:  # the JSON mapping writes uint64 as strings
            task["images"], task["texts"] = int(task["images"]), int(task["texts"])
        return status

    def versions(self) -> list[dict]:
        response = self._call(self.admin.ListVersions, admin_pb2.ListVersionsRequest())
        return MessageToDict(response, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)["versions"]

    def health(self, service: str = "") -> str:
        """The standard grpc.health.v1 status of `service` ('' = the server): SERVING, NOT_SERVING, ... ."""
        response = self._call(self.health_stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _encode(self, items: list, batch_size: int, progress: Optional[bool], call) -> tuple[np.ndarray, str]:
        if not items:
            raise ValueError("nothing to encode")
        vectors, versions = [], set()
        with console.bar(total=len(items), unit="item", disable=not (progress if progress is not None else len(items) > 10 * batch_size)) as bar:
            for chunk in _chunks(items, batch_size, MAX_REQUEST_BYTES // 2):
                response = call(chunk)
                vectors.append(np.array([e.values for e in response.embeddings], dtype=np.float32))
                versions.add(response.model_version)
                bar.update(len(response.embeddings))
        if len(versions) > 1:  # production moved mid-way: vectors from two versions must not be mixed
            raise RuntimeError(f"the production version changed during the request ({sorted(versions)}); "
                               "retry, or pin model_version")
        return np.concatenate(vectors), versions.pop()

    @classmethod
    def from_env(cls, **options) -> "Client":
        """A client configured as this machine's settings say (CLIPSTREAM_* variables, the settings file): the
        server at Settings `server` (default grpc://127.0.0.1:<grpc_port>), its API key, TLS roots."""
        from clipstream.settings import Settings

        settings = Settings()
        return cls(settings.server or f"grpc://127.0.0.1:{settings.grpc_port}", api_key=settings.secret("api_key"),
                   tls=settings.tls, ca_file=settings.tls_ca_file or settings.tls_cert_file, **options)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout_s, metadata=self.metadata)
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
