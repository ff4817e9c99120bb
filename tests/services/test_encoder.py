"""The Encoder over real gRPC on loopback against a real Ray Serve app."""

import io
import threading

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from PIL import Image

from clipstream.registry import Registry
from clipstream.v1 import encoder_pb2
from tests.services.conftest import png as _png
from tests.services.conftest import set_production, wait_serving

pytestmark = pytest.mark.component  # the session's served app


def _vectors(response):
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def test_encode_text_equals_the_in_process_model_and_names_the_version(served):
    settings, _, stub, (v1, v2) = served
    texts = ["a large red lamp in the top left", "a small blue cup on a striped background"]
    response = stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=texts))
    assert response.model_version == v1 and response.dim == 64
    local = Registry(settings).load(v1)
    with torch.no_grad():
        expected = local.model.encode_text(local.tokenizer(texts), normalize=True).numpy()
    assert np.allclose(_vectors(response), expected, atol=1e-5)
    other = stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=texts, model_version=v2))
    assert other.model_version == v2 and not np.allclose(_vectors(other), expected, atol=1e-3)


def test_encode_image_equals_the_in_process_model(served):
    settings, _, stub, (v1, _) = served
    images = [_png("red"), _png("navy")]
    response = stub.EncodeImage(encoder_pb2.EncodeImageRequest(images=images))
    local = Registry(settings).load(v1)
    pixels = torch.stack([local.preprocess_val(Image.open(io.BytesIO(b)).convert("RGB")) for b in images])
    with torch.no_grad():
        expected = local.model.encode_image(pixels, normalize=True).numpy()
    assert response.model_version == v1
    assert np.allclose(_vectors(response), expected, atol=1e-5)
    assert np.allclose(np.linalg.norm(_vectors(response), axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("call, code, words", [
    (lambda s: s.EncodeText(encoder_pb2.EncodeTextRequest(texts=[])), grpc.StatusCode.INVALID_ARGUMENT, "empty batch"),
    (lambda s: s.EncodeText(encoder_pb2.EncodeTextRequest(texts=[" "])), grpc.StatusCode.INVALID_ARGUMENT, "text 0 is empty"),
    (lambda s: s.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a"] * 9)), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit is 8"),
    (lambda s: s.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a" * 101])), grpc.StatusCode.RESOURCE_EXHAUSTED, "limit is 100"),
    (lambda s: s.EncodeImage(encoder_pb2.EncodeImageRequest(images=[b"not an image"])), grpc.StatusCode.INVALID_ARGUMENT, "not a decodable image"),
    (lambda s: s.EncodeImage(encoder_pb2.EncodeImageRequest(images=[b"0" * 200_001])), grpc.StatusCode.RESOURCE_EXHAUSTED, "200000 bytes"),
    (lambda s: s.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a"], model_version="99")), grpc.StatusCode.NOT_FOUND, "99: no such model version"),
    (lambda s: s.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a"], model_version="staging")), grpc.StatusCode.NOT_FOUND, "staging: no such model version"),
])
def test_bad_requests_get_the_right_status_and_the_server_keeps_serving(served, call, code, words):
    _, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as err:
        call(stub)
    assert err.value.code() == code and words in err.value.details()
    assert len(stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=["still here"])).embeddings) == 1


def test_concurrent_requests_are_batched(served):
    from ray import serve

    settings, _, stub, _ = served
    results, threads = [], []
    for i in range(24):
        t = threading.Thread(target=lambda i=i: results.append(stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=[f"cup {i}"]))))
        threads.append(t)
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 24
    sizes = serve.get_deployment_handle("Encoder", settings.serve_app).BatchSizes.remote().result()
    assert max(sizes) > 1


def test_batches_are_pipelined_and_each_caller_gets_its_own_answer(served):
    """While the model thread runs one batch the next waits on it (no round trip through the event loop between
    batches); answers are still each request's own."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    settings, _, stub, _ = served
    texts = [f"{colour} cup number {i}" for i, colour in enumerate(["red", "blue", "green"] * 10)]
    alone = {t: list(stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=[t])).embeddings[0].values) for t in texts}
    with ThreadPoolExecutor(len(texts)) as pool:
        together = list(pool.map(lambda t: stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=[t, t])), texts))
    for t, answer in zip(texts, together):
        np.testing.assert_allclose([list(e.values) for e in answer.embeddings], [alone[t]] * 2, atol=1e-5)
    assert serve.get_deployment_handle("Encoder", settings.serve_app).most_batches_handed.remote().result() == 2


def test_health_and_reflection_work_without_our_stubs(served, indexed):
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, channel, _, (v1, _) = served
    wait_serving(channel)  # a production model and a gallery are in place
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "clipstream.v1.EncoderService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING

    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    listed = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in listed.list_services_response.service}
    assert {"clipstream.v1.EncoderService", "clipstream.v1.SearchService", "clipstream.v1.AdminService", "grpc.health.v1.Health"} <= names
    found = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="clipstream.v1.EncoderService")])))
    pool = descriptor_pool.DescriptorPool()
    for raw in found.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(raw))
    method = pool.FindServiceByName("clipstream.v1.EncoderService").FindMethodByName("EncodeText")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_unary("/clipstream.v1.EncoderService/EncodeText", request_serializer=request_cls.SerializeToString,
                               response_deserializer=response_cls.FromString)
    response = call(request_cls(texts=["a red triangle"]))
    assert response.model_version == v1 and len(response.embeddings[0].values) == response.dim == 64


def test_moving_the_production_alias_swaps_the_model_without_a_restart(served):
    settings, _, stub, (v1, v2) = served
    set_production(settings, stub, v2)  # waits until responses name v2: no restart, no failed request
    try:
        response = stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=["a cup"]))
        assert response.model_version == v2
    finally:  # and back: later tests expect v1
        set_production(settings, stub, v1)


def test_each_version_encodes_with_its_own_tokenizer_and_refuses_a_language_it_never_learnt(served, tmp_path):
    """A CLL-CLIP version (vocabulary grown for language xa) answers xa queries with its grown tokenizer; the
    English version it grew from refuses them when the caller names the language."""
    from clipstream.training.data.synth import synthesize_languages
    from clipstream.training.data.task import Task
    from clipstream.training.methods import build, resolve
    from tests.conftest import register_version

    settings, _, stub, _ = served
    en, xa = synthesize_languages(tmp_path / "data", 2, seed=1, train_pairs=40, test_per_task=2, progress=False)
    english = register_version(settings, seed=7, task_dirs=[en])
    config = resolve("teir")
    method = build(config)
    grown = method.prepare_version(str(Registry(settings).resolve(english).folder), english, config,
                                   {"task": xa.name, "path": str(xa)}, [{"task": en.name, "path": str(en)}], tmp_path)
    learnt = register_version(settings, seed=8, task_dirs=[en, xa], model=grown, parent=english)
    assert Registry(settings).resolve(learnt, download=False).languages == ["en", "xa"]

    texts = [r["caption"] for r in Task.load(xa).check("train").rows[:3]]
    response = stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=texts, model_version=learnt, language="xa"))
    local = Registry(settings).load(learnt)
    assert local.tokenizer(texts).max() > 49407  # the grown subwords: the English tokenizer has none of them
    with torch.no_grad():
        expected = local.model.encode_text(local.tokenizer(texts), normalize=True).numpy()
    assert response.model_version == learnt and np.allclose(_vectors(response), expected, atol=1e-5)

    with pytest.raises(grpc.RpcError) as refused:
        stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=texts, model_version=english, language="xa"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"model version {english} was not trained on language 'xa' (it knows en" in refused.value.details()
    # without a language the old version still answers: byte-level BPE has no unknown token (documented)
    assert stub.EncodeText(encoder_pb2.EncodeTextRequest(texts=texts, model_version=english)).model_version == english
