"""Search over real gRPC: task-known and task-unknown rankings from the index, each hit naming its version."""

import grpc
import numpy as np
import pytest
import torch

from clipstream.index import open_index
from clipstream.v1 import search_pb2
from tests.services.conftest import png

pytestmark = pytest.mark.component  # the session's served app


def test_text_query_ranks_images_like_the_index_does_in_process(indexed):
    settings, stub, bundle, v1 = indexed
    response = stub.Search(search_pb2.SearchRequest(text="a red square", k=5))
    assert response.query_model_version == v1 and len(response.hits) == 5
    assert {h.modality for h in response.hits} == {search_pb2.MODALITY_IMAGE} and {h.model_version for h in response.hits} == {v1}
    # an image hit names its image (a user can open it), a text hit its caption
    assert all(h.image_uri == f"s3://bucket/{h.task}/{h.item_id.rsplit('-', 1)[1]}.png" and not h.caption
               for h in response.hits)
    with torch.no_grad():
        q = bundle.model.encode_text(bundle.tokenizer(["a red square"]), normalize=True).numpy()[0]
    with open_index(settings) as index:
        expected = index.search(q, "image", None, 5)
    assert [h.item_id for h in response.hits] == [h.item_id for h in expected]
    assert np.allclose([h.score for h in response.hits], [h.score for h in expected], atol=1e-5)
    assert {h.task for h in response.hits} == {"squares", "discs"} or len({h.task for h in expected}) == 1


def test_task_known_image_query_returns_only_that_tasks_captions(indexed):
    _, stub, _, _ = indexed
    response = stub.Search(search_pb2.SearchRequest(image=png("green"), task="discs", k=3))
    assert [h.task for h in response.hits] == ["discs"] * 3
    assert all(h.modality == search_pb2.MODALITY_TEXT and h.caption.startswith("a ") and h.index_generation == 1 for h in response.hits)


def test_vector_query_needs_a_target(indexed):
    _, stub, _, _ = indexed
    vector = search_pb2.Vector(values=[1.0] + [0.0] * 63)
    assert len(stub.Search(search_pb2.SearchRequest(vector=vector, target_modality=search_pb2.MODALITY_TEXT, k=2)).hits) == 2
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(search_pb2.SearchRequest(vector=vector))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "target_modality" in err.value.details()


@pytest.mark.parametrize("request_args, code, words", [
    ({}, grpc.StatusCode.INVALID_ARGUMENT, "no query"),
    ({"text": "a cup", "task": "nope"}, grpc.StatusCode.NOT_FOUND, "unknown task 'nope'"),
    ({"text": "a cup", "k": 5000}, grpc.StatusCode.INVALID_ARGUMENT, "k must be in [1, 1000]"),
    ({"image": b"garbage"}, grpc.StatusCode.INVALID_ARGUMENT, "not a decodable image"),
    ({"text": "a cup", "model_version": "42"}, grpc.StatusCode.NOT_FOUND, "42: no such model version"),
    ({"text": "qé hë", "language": "xa"}, grpc.StatusCode.FAILED_PRECONDITION, "was not trained on language 'xa'"),
    ({"vector": search_pb2.Vector(values=[1.0, 0.0]), "target_modality": search_pb2.MODALITY_IMAGE}, grpc.StatusCode.INVALID_ARGUMENT, "dimension 2"),
])
def test_bad_searches_get_the_right_status(indexed, request_args, code, words):
    _, stub, _, _ = indexed
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(search_pb2.SearchRequest(**request_args))
    assert err.value.code() == code and words in err.value.details() and "Traceback" not in err.value.details()
