"""Search over real gRPC: task-known and task-unknown rankings from the index, each hit naming its version."""

import grpc
import numpy as np
import pytest
import torch

from clipstream.index import open_index
from clipstream.v1 import search_pb2
from tests.conftest import COLOURS
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


# ---- catalogues: AddItems, DeleteItems, filters, paging, BatchSearch ------------------------------------------------
BRANDS = ["acme", "zed", "acme", "bolt", "zed", "acme"]


def item(i: int, **kw) -> search_pb2.Item:
    from google.protobuf.struct_pb2 import Struct

    metadata = Struct()
    metadata.update(kw.pop("metadata", {"brand": BRANDS[i], "price": 10.0 * i, "stock": i}))
    fields = {"item_id": f"mug-{i}", "image": png(COLOURS[i]), "text": f"a {COLOURS[i]} mug", **kw}
    return search_pb2.Item(metadata=metadata, **fields)


def refusal(call, request):
    """The typed error a refused call raises (reason, field violations), asserting it was refused."""
    from clipstream.services.client import typed

    with pytest.raises(grpc.RpcError) as err:
        call(request)
    return typed(err.value)


def stored(settings):
    """What a refusal must leave alone: the index's tasks and the catalogue's stored items."""
    from clipstream.catalogue import Catalogue

    with open_index(settings) as index:
        state = index.state()
    return ({t: (m["counts"], m["model_version"]) for t, m in state["tasks"].items()},
            {i: vars(x) for i, x in Catalogue.of(settings, "mugs").items().items()})


def test_catalogue_items_are_added_searched_filtered_paged_and_deleted_over_grpc(indexed):
    settings, stub, _, v1 = indexed
    outside = settings.image_roots[0]
    __import__("os").makedirs(outside, exist_ok=True)
    with open(f"{outside}/navy.png", "wb") as f:
        f.write(png("navy"))
    items = [item(i) for i in range(6)]
    items[1] = item(1, image=b"", image_uri=f"{outside}/navy.png", text="")  # image only, read from an allowed root
    items[4] = item(4, image=b"")  # text only
    try:
        added = stub.AddItems(search_pb2.AddItemsRequest(catalogue="mugs", items=items))
        assert (added.added, added.replaced, added.model_version) == (6, 0, v1)
        with open_index(settings) as index:
            assert index.state()["tasks"]["mugs"]["counts"] == {"image": 5, "text": 5}
        from clipstream.v1 import admin_pb2, admin_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
            status = admin_pb2_grpc.AdminServiceStub(channel).GetStatus(admin_pb2.GetStatusRequest())
        assert {t.task: (t.catalogue, t.images) for t in status.tasks} == {
            "squares": (False, 6), "discs": (False, 6), "mugs": (True, 5)} and status.consistent
        # an image hit names a file a user can open: the stored copy, or the URI the item was given
        hits = stub.Search(search_pb2.SearchRequest(text="a red mug", task="mugs", k=5)).hits
        assert {h.item_id for h in hits} == {"mug-0", "mug-1", "mug-2", "mug-3", "mug-5"}
        uris = {h.item_id: h.image_uri for h in hits}
        assert uris["mug-1"] == f"{outside}/navy.png" and open(uris["mug-0"], "rb").read() == png("red")
        assert {h.item_id: dict(h.metadata)["brand"] for h in hits}["mug-3"] == "bolt"
        # filters on declared fields, in a task-unknown search too (a trained task's items carry none)
        acme = search_pb2.FieldFilter(field="brand", any_of=_values("acme"))
        hits = stub.Search(search_pb2.SearchRequest(text="a mug", k=10, filters=[acme])).hits
        assert sorted(h.item_id for h in hits) == ["mug-0", "mug-2", "mug-5"]
        cheap = search_pb2.FieldFilter(field="price", range=search_pb2.Range(gte=10, lte=30))
        hits = stub.Search(search_pb2.SearchRequest(image=png("red"), task="mugs", k=10, filters=[cheap])).hits
        assert sorted(h.item_id for h in hits) == ["mug-2", "mug-3"]  # (mug-1, at 10, has no text to find)
        # pages of k follow one ranking; a token is for its own search only
        request = search_pb2.SearchRequest(text="a mug", task="mugs", k=2)
        whole = [h.item_id for h in stub.Search(search_pb2.SearchRequest(text="a mug", task="mugs", k=6)).hits]
        pages, token = [], ""
        while True:
            request.page_token = token
            response = stub.Search(request)
            pages += [h.item_id for h in response.hits]
            token = response.next_page_token
            if not token:
                break
        assert pages == whole and len(whole) == 5
        other = search_pb2.SearchRequest(text="a cup", task="mugs", k=2, page_token=stub.Search(
            search_pb2.SearchRequest(text="a mug", task="mugs", k=2)).next_page_token)
        assert refusal(stub.Search, other).reason == "PAGE_TOKEN_MISMATCH"
        # a threshold cuts the ranking at a cosine
        scores = [h.score for h in stub.Search(search_pb2.SearchRequest(text="a mug", task="mugs", k=6)).hits]
        cut = (scores[1] + scores[2]) / 2
        assert len(stub.Search(search_pb2.SearchRequest(text="a mug", task="mugs", k=6, score_threshold=cut)).hits) == 2
        # a batch answers each search as Search does
        singles = [search_pb2.SearchRequest(text="a red mug", task="mugs", k=3),
                   search_pb2.SearchRequest(image=png("green"), k=4, filters=[acme])]
        batch = stub.BatchSearch(search_pb2.BatchSearchRequest(requests=singles)).responses
        assert [[h.item_id for h in r.hits] for r in batch] == [[h.item_id for h in stub.Search(r).hits]
                                                               for r in singles]
        # idempotent: the same items again replace themselves; one changed item replaces its vectors and fields
        again = stub.AddItems(search_pb2.AddItemsRequest(catalogue="mugs", items=items[:3] + [
            item(3, metadata={"brand": "acme"}, image=png("white"))]))
        assert (again.added, again.replaced) == (0, 4)
        hits = stub.Search(search_pb2.SearchRequest(text="a mug", k=10, filters=[acme])).hits
        assert sorted(h.item_id for h in hits) == ["mug-0", "mug-2", "mug-3", "mug-5"]
        deleted = stub.DeleteItems(search_pb2.DeleteItemsRequest(catalogue="mugs", item_ids=["mug-0", "mug-9"]))
        assert (deleted.deleted, list(deleted.not_found)) == (1, ["mug-9"])
        assert "mug-0" not in {h.item_id for h in stub.Search(search_pb2.SearchRequest(text="a red mug", k=20)).hits}
    finally:  # the shared app's other tests see the two tasks only
        stub.DeleteItems(search_pb2.DeleteItemsRequest(catalogue="mugs", item_ids=[f"mug-{i}" for i in range(6)]))
    assert "mugs" not in stored(settings)[0] and stored(settings)[1] == {}


def _values(*values):
    from google.protobuf.struct_pb2 import ListValue

    out = ListValue()
    out.extend(values)
    return out


@pytest.mark.parametrize("rpc, request_args, code, reason, field", [
    ("AddItems", {"catalogue": "mugs"}, "INVALID_ARGUMENT", "EMPTY_BATCH", "items"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0)] * 9}, "RESOURCE_EXHAUSTED", "TOO_MANY_ITEMS", "items"),
    ("AddItems", {"catalogue": "Mugs!", "items": [item(0)]}, "INVALID_ARGUMENT", "CATALOGUE_NAME_INVALID", "catalogue"),
    ("AddItems", {"catalogue": "squares", "items": [item(0)]}, "INVALID_ARGUMENT", "CATALOGUE_IS_A_TASK", "catalogue"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0, item_id="")]}, "INVALID_ARGUMENT", "ITEM_ID_INVALID",
     "items[0].item_id"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0), item(0)]}, "INVALID_ARGUMENT", "ITEM_ID_REPEATED",
     "items[1].item_id"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0, image=b"", text="")]}, "INVALID_ARGUMENT", "ITEM_EMPTY",
     "items[0]"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0, metadata={"brnd": "acme"})]}, "INVALID_ARGUMENT",
     "FIELD_INVALID", "items[0].metadata"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0, metadata={"price": "cheap"})]}, "INVALID_ARGUMENT",
     "FIELD_INVALID", "items[0].metadata"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0, image=b"", image_uri="/etc/passwd")]}, "INVALID_ARGUMENT",
     "IMAGE_URI_NOT_ALLOWED", "items[0].image_uri"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0), item(1, image=b"garbage")]}, "INVALID_ARGUMENT",
     "IMAGE_NOT_DECODABLE", "items[1].image"),
    ("AddItems", {"catalogue": "mugs", "items": [item(0, text="")] + [item(1, text="x" * 101)]}, "RESOURCE_EXHAUSTED",
     "TEXT_TOO_LONG", "items[1].text"),
    ("DeleteItems", {"catalogue": "mugs", "item_ids": ["mug-0"]}, "NOT_FOUND", "CATALOGUE_NOT_FOUND", "catalogue"),
    ("DeleteItems", {"catalogue": "squares", "item_ids": ["squares-0"]}, "INVALID_ARGUMENT", "CATALOGUE_IS_A_TASK",
     "catalogue"),
    ("DeleteItems", {"catalogue": "mugs"}, "INVALID_ARGUMENT", "EMPTY_BATCH", "item_ids"),
    ("Search", {"text": "a mug", "filters": [search_pb2.FieldFilter(field="brnd", any_of=_values("acme"))]},
     "INVALID_ARGUMENT", "FILTER_INVALID", "filters[0]"),
    ("Search", {"text": "a mug", "filters": [search_pb2.FieldFilter(field="price", any_of=_values(3))]},
     "INVALID_ARGUMENT", "FILTER_INVALID", "filters[0]"),
    ("Search", {"text": "a mug", "filters": [search_pb2.FieldFilter(field="brand", any_of=_values(3))]},
     "INVALID_ARGUMENT", "FILTER_INVALID", "filters[0]"),
    ("Search", {"text": "a mug", "filters": [search_pb2.FieldFilter(field="brand")]}, "INVALID_ARGUMENT",
     "FILTER_INVALID", "filters[0]"),
    ("Search", {"text": "a mug", "page_token": "bm9wZQ=="}, "INVALID_ARGUMENT", "PAGE_TOKEN_INVALID", "page_token"),
    ("Search", {"text": "a mug", "score_threshold": 2.0}, "INVALID_ARGUMENT", "SCORE_THRESHOLD_OUT_OF_RANGE",
     "score_threshold"),
    ("BatchSearch", {}, "INVALID_ARGUMENT", "EMPTY_BATCH", "requests"),
    ("BatchSearch", {"requests": [search_pb2.SearchRequest(text="a")] * 9}, "RESOURCE_EXHAUSTED", "TOO_MANY_ITEMS",
     "requests"),
    ("BatchSearch", {"requests": [search_pb2.SearchRequest(text="a"), search_pb2.SearchRequest(k=3)]},
     "INVALID_ARGUMENT", "QUERY_MISSING", "requests[1].query"),
])
def test_bad_catalogue_and_search_requests_get_their_status_and_change_nothing(indexed, rpc, request_args, code,
                                                                              reason, field):
    settings, stub, _, _ = indexed
    before = stored(settings)
    request = getattr(search_pb2, {"Search": "SearchRequest"}.get(rpc, f"{rpc}Request"))(**request_args)
    error = refusal(getattr(stub, rpc), request)
    assert (error.code().name, error.reason) == (code, reason), error.details()
    assert [f for f, _ in error.field_violations] == [field]
    assert stored(settings) == before
