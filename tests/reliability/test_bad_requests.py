"""Bad input over gRPC: every case gets its documented status and a message (never INTERNAL, never a
traceback), the server stays healthy, and the registry and the vector store are byte-identical afterwards."""

import hashlib
import io
import struct
import zlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from clipstream.v1 import encoder_pb2, search_pb2, search_pb2_grpc
from tests.services.conftest import png

pytestmark = pytest.mark.component  # the session's served app

C = grpc.StatusCode


def png_header(width: int, height: int) -> bytes:
    """A tiny PNG that claims width x height pixels: a decompression bomb as far as any header check can tell."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def tiny(size=(1, 1)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "red").save(buf, format="PNG")
    return buf.getvalue()


IMAGE_CASES = [  # (name, images, status, words in the message)
    ("zero-byte image", [b""], C.INVALID_ARGUMENT, "not a decodable image"),
    ("truncated PNG", [png("red")[:60]], C.INVALID_ARGUMENT, "not a decodable image"),
    ("decompression bomb", [png_header(100_000, 100_000)], C.INVALID_ARGUMENT, "pixels"),
    ("text sent as an image", [b"a red square, honestly"], C.INVALID_ARGUMENT, "not a decodable image"),
    ("over the per-image limit (5 MB: past gRPC's default 4 MB hop)", [b"\x89PNG" + b"0" * 5_000_000],
     C.RESOURCE_EXHAUSTED, "the limit is 200000"),
    ("too many images", [tiny()] * 9, C.RESOURCE_EXHAUSTED, "the limit is 8"),
    ("no image at all", [], C.INVALID_ARGUMENT, "empty batch"),
]
TEXT_CASES = [
    ("empty caption", [""], C.INVALID_ARGUMENT, "is empty"),
    ("blank caption", ["   "], C.INVALID_ARGUMENT, "is empty"),
    ("1 MB caption", ["a" * 1_000_000], C.RESOURCE_EXHAUSTED, "the limit is 100"),
    ("NUL in a caption", ["a red\x00 cup"], C.INVALID_ARGUMENT, "control character"),
    ("escape sequence in a caption", ["\x1b[2Ja red cup"], C.INVALID_ARGUMENT, "control character"),
    ("too many captions", ["a cup"] * 9, C.RESOURCE_EXHAUSTED, "the limit is 8"),
]
SEARCH_CASES = [
    ("no query", {}, C.INVALID_ARGUMENT, "no query"),
    ("NaN vector", {"vector": search_pb2.Vector(values=[float("nan")] * 64), "target_modality": search_pb2.MODALITY_IMAGE},
     C.INVALID_ARGUMENT, "NaN or infinite"),
    ("inf vector", {"vector": search_pb2.Vector(values=[float("inf")] + [0.0] * 63), "target_modality": search_pb2.MODALITY_IMAGE},
     C.INVALID_ARGUMENT, "NaN or infinite"),
    ("wrong-length vector", {"vector": search_pb2.Vector(values=[0.1] * 7), "target_modality": search_pb2.MODALITY_IMAGE},
     C.INVALID_ARGUMENT, "dimension"),
    ("zero vector", {"vector": search_pb2.Vector(values=[0.0] * 64), "target_modality": search_pb2.MODALITY_IMAGE},
     C.INVALID_ARGUMENT, "zero vector"),
    ("vector without a target modality", {"vector": search_pb2.Vector(values=[0.1] * 64)}, C.INVALID_ARGUMENT,
     "target_modality"),
    ("unknown target modality", {"text": "a cup", "target_modality": 7}, C.INVALID_ARGUMENT, "target_modality"),
    ("k = 10^6", {"text": "a cup", "k": 1_000_000}, C.INVALID_ARGUMENT, "k must be in"),
    ("unknown task", {"text": "a cup", "task": "nope"}, C.NOT_FOUND, "unknown task"),
    ("task with a path in it", {"text": "a cup", "task": "../squares"}, C.NOT_FOUND, "unknown task"),
    ("unknown version", {"text": "a cup", "model_version": "999"}, C.NOT_FOUND, "no such model version"),
    ("unknown alias", {"text": "a cup", "model_version": "nope"}, C.NOT_FOUND, "no such model version"),
    ("a language the version never learnt", {"text": "a cup", "language": "xx"}, C.FAILED_PRECONDITION,
     "not trained on language"),
    ("undecodable image query", {"image": b"\x00\x01"}, C.INVALID_ARGUMENT, "not a decodable image"),
]


def fingerprint(settings) -> dict[str, str]:
    """Every file of the registry (SQLite + artifacts) and the vector store, hashed."""
    roots = [Path(settings.mlflow_tracking_uri.removeprefix("sqlite:///")), Path(settings.mlflow_artifact_root),
             settings.qdrant_path]
    files = [f for root in roots for f in ([root] if root.is_file() else sorted(root.rglob("*"))) if f.is_file()]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture(scope="module")
def before(indexed):
    settings = indexed[0]
    return fingerprint(settings)


def check(call, status, words):
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == status, (err.value.code(), err.value.details())
    assert words in err.value.details() and "Traceback" not in err.value.details(), err.value.details()


@pytest.mark.parametrize("name, images, status, words", IMAGE_CASES, ids=[c[0] for c in IMAGE_CASES])
def test_bad_images(served, before, name, images, status, words):
    stub = served[2]
    check(lambda: stub.EncodeImage(encoder_pb2.EncodeImageRequest(images=images)), status, words)


@pytest.mark.parametrize("name, texts, status, words", TEXT_CASES, ids=[c[0] for c in TEXT_CASES])
def test_bad_texts(served, before, name, texts, status, words):
    stub = served[2]
    check(lambda: stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=texts)), status, words)


@pytest.mark.parametrize("name, fields, status, words", SEARCH_CASES, ids=[c[0] for c in SEARCH_CASES])
def test_bad_searches(indexed, before, name, fields, status, words):
    stub = indexed[1]
    check(lambda: stub.Search(search_pb2.SearchRequest(**fields)), status, words)


def test_a_request_over_the_message_cap_is_refused_by_the_proxy(served, before):
    stub = served[2]
    check(lambda: stub.EncodeImage(encoder_pb2.EncodeImageRequest(images=[b"0" * (33 << 20)] * 2)),
          C.RESOURCE_EXHAUSTED, "larger than max")


def raw(channel, method: str, response):
    """A call that sends the bytes given: what a client in another language (or a hostile one) can put on the wire."""
    return channel.unary_unary(method, request_serializer=None, response_deserializer=response.FromString)


def test_k_minus_1_on_the_wire_is_invalid_argument(served, indexed, before):
    """k is uint32: -1 from a client whose language has signed ints arrives as 2^32 - 1."""
    call = raw(served[1], "/clipstream.v1.SearchService/Search", search_pb2.SearchResponse)
    wire = search_pb2.SearchRequest(text="a cup").SerializeToString() + b"\x30" + b"\xff" * 9 + b"\x01"
    check(lambda: call(wire, timeout=30), C.INVALID_ARGUMENT, "k must be in [1, 1000], got 4294967295")


def test_non_utf8_text_on_the_wire_is_refused_before_any_replica(served, before):
    """Field 1 (texts) holding 0xff 0xfe: Serve's proxy cannot parse the message and answers UNKNOWN with protobuf's
    reason (no traceback); it never reaches a replica. (INVALID_ARGUMENT would be the right code: Serve's proxy
    parses requests itself and offers no hook for the status of a parse failure.)"""
    call = raw(served[1], "/clipstream.v1.EncoderService/EncodeText", encoder_pb2.EncodeTextResponse)
    check(lambda: call(b"\x0a\x02\xff\xfe", timeout=30), C.UNKNOWN, "bad UTF-8")


def test_k_0_means_the_default_and_a_1x1_image_is_fine(indexed, served, before):
    """proto3 cannot tell k = 0 from k unset: 0 is documented as the default, 10."""
    hits = indexed[1].Search(search_pb2.SearchRequest(text="a red square", k=0)).hits
    assert len(hits) == 10
    response = served[2].EncodeImage(encoder_pb2.EncodeImageRequest(images=[tiny((1, 1))]))
    assert response.dim == 64 and len(response.embeddings) == 1


def test_afterwards_the_server_is_healthy_and_nothing_stored_changed(served, indexed, before):
    settings, channel, stub, _ = served
    check_health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert check_health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a red cup"])).embeddings) == 1
    search = search_pb2_grpc.SearchServiceStub(channel)
    assert len(search.Search(search_pb2.SearchRequest(text="a red square", k=3)).hits) == 3
    assert fingerprint(settings) == before
