"""The Python client against the real served app: batching, numpy outputs, search dicts, retries."""

import json

import grpc
import numpy as np
import pytest

from clipstream.runtime import free_port
from clipstream.services.client import AsyncClient, Client, channel, service_config

pytestmark = pytest.mark.component  # the session's served app

QUICK = (0.01, 0.05)  # the retry policy's waits in tests: the same policy, not its seconds of backoff


def test_client_batches_and_returns_numpy(served):
    settings, _, _, (v1, _) = served
    texts = [f"a red cup number {i}" for i in range(20)]  # the server's limit is 8 per request
    with Client(f"127.0.0.1:{settings.grpc_port}") as client:
        vectors, version = client.encode_text(texts, batch_size=8)
        single, _ = client.encode_text(texts[:1])
    assert version == v1 and vectors.shape == (20, 64) and vectors.dtype == np.float32
    assert np.allclose(vectors[0], single[0], atol=1e-6)


def test_client_refuses_ambiguous_queries_and_empty_input(served):
    settings = served[0]
    with Client(f"127.0.0.1:{settings.grpc_port}") as client:
        with pytest.raises(ValueError, match="exactly one of"):
            client.search(text="a", vector=[1.0])
        with pytest.raises(ValueError, match="nothing to encode"):
            client.encode_text([])


class FlakyHealth:
    """A real gRPC server whose health check answers `codes` in turn, then SERVING: what the client's retry
    policy sees while a proxy starts or a replica is replaced."""

    def __init__(self, codes):
        from concurrent import futures

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self.codes, self.attempts, self.metadata = list(codes), 0, []
        outer = self

        class Servicer(health_pb2_grpc.HealthServicer):
            def Check(self, request, context):
                outer.attempts += 1
                outer.metadata.append(dict(context.invocation_metadata()))
                if outer.codes:
                    context.abort(outer.codes.pop(0), "not yet")
                return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        health_pb2_grpc.add_HealthServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.stop(None)


def test_client_retries_unavailable_through_its_service_config():
    with FlakyHealth([grpc.StatusCode.UNAVAILABLE] * 2) as server, Client(f"127.0.0.1:{server.port}",
                                                                          backoff_s=QUICK) as client:
        assert client.health() == "SERVING"
        assert server.attempts == 3  # two refusals retried by the channel's retry policy, no code of ours
    with FlakyHealth([grpc.StatusCode.UNAVAILABLE] * 2) as server, Client(f"127.0.0.1:{server.port}", retries=1,
                                                                          backoff_s=QUICK) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and server.attempts == 2  # gave up after 1 retry


def test_a_catalogue_write_aborted_by_a_promotion_is_sent_again_and_nothing_else_is():
    """ABORTED (the catalogue re-embedded by a promotion while the request was embedded) is retried for AddItems and
    DeleteItems, which are idempotent, and for no other RPC."""
    from concurrent import futures

    from clipstream.v1 import search_pb2, search_pb2_grpc

    attempts = {"AddItems": 0, "Search": 0}

    class Servicer(search_pb2_grpc.SearchServiceServicer):
        def AddItems(self, request, context):
            attempts["AddItems"] += 1
            if attempts["AddItems"] < 3:
                context.abort(grpc.StatusCode.ABORTED, "re-embedded meanwhile")
            return search_pb2.AddItemsResponse(added=1, model_version="2", index_generation=3)

        def Search(self, request, context):
            attempts["Search"] += 1
            context.abort(grpc.StatusCode.ABORTED, "no")

    server = grpc.server(futures.ThreadPoolExecutor(2))
    search_pb2_grpc.add_SearchServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", backoff_s=QUICK) as client:
            assert client.add_items("mugs", [{"item_id": "m", "text": "a mug"}])["model_version"] == "2"
            with pytest.raises(grpc.RpcError) as err:
                client.search(text="a mug")
        assert err.value.code() == grpc.StatusCode.ABORTED and attempts == {"AddItems": 3, "Search": 1}
    finally:
        server.stop(None)


def test_client_does_not_retry_what_a_retry_cannot_fix():
    with FlakyHealth([grpc.StatusCode.INVALID_ARGUMENT]) as server, Client(f"127.0.0.1:{server.port}",
                                                                           backoff_s=QUICK) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.health()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and server.attempts == 1


@pytest.mark.parametrize("status, kind", [
    (grpc.StatusCode.INVALID_ARGUMENT, "InvalidArgument"), (grpc.StatusCode.NOT_FOUND, "NotFound"),
    (grpc.StatusCode.FAILED_PRECONDITION, "FailedPrecondition"), (grpc.StatusCode.UNAUTHENTICATED, "Unauthenticated"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "ResourceExhausted"), (grpc.StatusCode.INTERNAL, "RpcError")])
def test_a_failed_call_raises_a_typed_exception_that_is_still_a_grpc_error(status, kind):
    from clipstream.services import client as client_module

    with FlakyHealth([status]) as server, Client(f"grpc://127.0.0.1:{server.port}", retries=0) as client:
        with pytest.raises(client_module.RpcError) as err:
            client.health()
    assert type(err.value).__name__ == kind and isinstance(err.value, grpc.RpcError)
    assert err.value.code() == status and err.value.details() == "not yet" and str(err.value) == f"{status.name}: not yet"


@pytest.mark.parametrize("uri, expected", [("grpc://h.example:9000", ("h.example:9000", False)),
                                           ("grpcs://h.example:443", ("h.example:443", True)),
                                           ("127.0.0.1:9000", ("127.0.0.1:9000", False)),
                                           ("grpc://[::1]:9000/", ("[::1]:9000", False))])
def test_server_addresses_as_uris(uri, expected):
    from clipstream.services.client import parse_address

    assert parse_address(uri) == expected


@pytest.mark.parametrize("uri", ["http://h:9000", "grpc://h", "h:port"])
def test_a_bad_server_address_is_refused(uri):
    from clipstream.services.client import parse_address

    with pytest.raises(ValueError, match="server address"):
        parse_address(uri)


def test_from_env_calls_the_server_and_the_application_the_settings_name(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLIPSTREAM_SERVE_APP", raising=False)
    with FlakyHealth([]) as server:
        monkeypatch.setenv("CLIPSTREAM_SERVER", f"grpc://127.0.0.1:{server.port}")
        with Client.from_env() as client:
            assert client.address == f"127.0.0.1:{server.port}" and client.health() == "SERVING"
        monkeypatch.setenv("CLIPSTREAM_SERVE_APP", "side")
        with Client.from_env() as client:
            client.health()
    assert [m.get("application") for m in server.metadata] == ["clipstream", "side"]


def test_every_call_names_the_application_when_one_is_given_and_none_otherwise():
    """The metadata Serve's proxy routes by when several applications share it: on every call of both clients and of
    a bare channel, health included, and on every attempt the retry policy makes; nothing without `application`."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def aio(address):
        async with AsyncClient(address, application="side", backoff_s=QUICK) as client:
            return await client.health()

    with FlakyHealth([grpc.StatusCode.UNAVAILABLE]) as server:
        address = f"127.0.0.1:{server.port}"
        with Client(address, application="side", backoff_s=QUICK) as client:
            assert client.health() == "SERVING"  # (a refusal first: two attempts)
        with ThreadPoolExecutor(1) as pool:  # (asyncio.run on a thread of its own: see test_one_client_runs_...)
            assert pool.submit(asyncio.run, aio(address)).result() == "SERVING"
        with channel(address, application="side") as named:
            health_pb2_grpc.HealthStub(named).Check(health_pb2.HealthCheckRequest(), metadata=(("x-api-key", "k"),))
        with Client(address) as unnamed:
            unnamed.health()
    assert [m.get("application") for m in server.metadata] == ["side"] * 4 + [None]
    assert server.metadata[3]["x-api-key"] == "k"  # (the caller's own metadata kept)


def test_the_retry_policy_waits_as_told():
    default = json.loads(service_config(4))["methodConfig"][0]["retryPolicy"]
    assert (default["initialBackoff"], default["maxBackoff"], default["maxAttempts"]) == ("1.000000000s",
                                                                                          "5.000000000s", 5)
    quick = json.loads(service_config(2, QUICK))["methodConfig"][1]["retryPolicy"]
    assert (quick["initialBackoff"], quick["maxBackoff"], quick["maxAttempts"]) == ("0.010000000s", "0.050000000s", 3)
    for wrong in ((0, 1), (2, 1)):
        with pytest.raises(ValueError, match="0 < first <= longest"):
            service_config(4, wrong)


def test_client_gives_up_on_a_port_nobody_listens_on():
    """Every attempt the retry policy allows is refused, then the call fails: at once with the waits made short."""
    import time

    port = free_port()  # nothing listens here
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err, Client(f"127.0.0.1:{port}", timeout_s=30, backoff_s=QUICK) as client:
        client.encode_text(["a cup"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 1.0


def test_the_cli_names_the_settings_application(monkeypatch, tmp_path):
    from clipstream.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLIPSTREAM_SERVE_APP", "side")
    with FlakyHealth([]) as server:
        assert main(["health", "--address", f"127.0.0.1:{server.port}"]) == 0
    assert server.metadata[0]["application"] == "side"


def test_cli_search_and_encode_print_tables_and_statuses(served, indexed, capsys, monkeypatch):
    from clipstream.cli import main

    settings = served[0]
    address = f"127.0.0.1:{settings.grpc_port}"
    assert main(["search", "a red square", "--task", "squares", "-k", "3", "--address", address]) == 0
    out = capsys.readouterr().out
    assert "task-known (squares)" in out and out.count("squares-") == 3
    assert main(["encode", "a red cup", "a blue lamp", "--address", address]) == 0
    assert "2 vectors of dimension 64 from model version 1" in capsys.readouterr().out
    # --json: one document each, what the tables show and more (whole vectors, every hit field)
    assert main(["search", "a red square", "--task", "squares", "-k", "3", "--address", address, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["task"] == "squares" and len(found["hits"]) == 3
    assert all(h["task"] == "squares" and h["item_id"].startswith("squares-") and -1 <= h["score"] <= 1
               for h in found["hits"])
    assert main(["encode", "a red cup", "a blue lamp", "--address", address, "--json"]) == 0
    encoded = json.loads(capsys.readouterr().out)
    assert encoded["model_version"] == "1" and encoded["dimension"] == 64
    assert [item["input"] for item in encoded["items"]] == ["a red cup", "a blue lamp"]
    assert all(abs(sum(x * x for x in item["vector"]) - 1) < 1e-3 for item in encoded["items"])  # unit vectors
    assert main(["status", "--address", address, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert "squares" in {t["task"] for t in status["status"]["tasks"]} and status["versions"]
    assert main(["health", "--address", address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"address": address, "service": "", "status": "SERVING"}
    assert main(["search", "a cup", "--task", "nope", "--address", address]) == 2
    assert "NOT_FOUND: unknown task 'nope'" in capsys.readouterr().err


def test_the_async_client_pipelines_chunks_and_answers_as_the_client_does(served, indexed):
    """AsyncClient: a large input in chunks with several on the wire, the vectors back in input order (equal to the
    blocking client's), the same search hits, the same typed errors."""
    import asyncio

    from clipstream.services.client import AsyncClient, NotFound

    address = f"grpc://127.0.0.1:{served[0].grpc_port}"
    captions = [f"a {colour} square number {k}" for k, colour in enumerate(["red", "green", "blue"] * 50)]
    with Client(address) as client:
        expected, version = client.encode_text(captions, batch_size=8)
        hits = client.search(text="a red square", task="squares", k=3)

    async def calls():
        async with AsyncClient(address, in_flight=4) as client:
            vectors = await client.encode_text(captions, batch_size=8)  # 19 chunks (the test app takes 8), 4 at a time
            found = await client.search(text="a red square", task="squares", k=3)
            with pytest.raises(NotFound) as missing:
                await client.search(text="a cup", task="nope")
            assert (missing.value.reason, missing.value.field_violations[0][0]) == ("TASK_NOT_FOUND", "task")
            return vectors, found, await client.health()

    (vectors, got_version), found, health = asyncio.run(calls())
    assert got_version == version and health == "SERVING"
    np.testing.assert_allclose(vectors, expected, atol=1e-5)
    assert [h["item_id"] for h in found] == [h["item_id"] for h in hits]


def test_cli_health_is_a_probe(served, indexed, capsys):
    """`clipstream health` (the Helm chart's test pod runs it): exit 0 and SERVING for the server and each
    service once a model and a gallery are in place; an unknown service is the server's NOT_FOUND, exit 2."""
    from clipstream.cli import main
    from tests.services.conftest import wait_serving

    wait_serving(served[1])
    address = f"127.0.0.1:{served[0].grpc_port}"
    assert main(["health", "--address", address]) == 0
    assert main(["health", "--address", address, "--service", "clipstream.v1.SearchService"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{address} (server): SERVING",
                                                    f"{address} clipstream.v1.SearchService: SERVING"]
    assert main(["health", "--address", address, "--service", "clipstream.v1.Nope"]) == 2
    assert "NOT_FOUND" in capsys.readouterr().err


@pytest.mark.parametrize("call, kind, reason, field, metadata", [
    (lambda c: c.search(text="a cup", task="nope"), "NotFound", "TASK_NOT_FOUND", "task", {}),
    (lambda c: c.search(text="a cup", k=5000), "InvalidArgument", "K_OUT_OF_RANGE", "k", {"max": "1000"}),
    (lambda c: c.encode_text(["a cup", ""]), "InvalidArgument", "EMPTY_TEXT", "texts[1]", {}),
    (lambda c: c.encode_text(["x" * 100_000]), "ResourceExhausted", "TEXT_TOO_LONG", "texts[0]", None),
    (lambda c: c.encode_image([b"garbage"]), "InvalidArgument", "IMAGE_NOT_DECODABLE", "images[0]", {}),
    (lambda c: c.encode_text(["a cup"], model_version="4242"), "NotFound", "VERSION_NOT_FOUND", "model_version", {}),
])
def test_errors_carry_google_rpc_details_that_the_client_reads(served, indexed, call, kind, reason, field, metadata):
    """Each refusal's status carries a google.rpc ErrorInfo (a reason a program can switch on, domain clipstream.v1)
    and, for a bad field, a BadRequest naming it: the client's typed exception exposes both."""
    import clipstream.services.client as client_module

    with Client(f"grpc://127.0.0.1:{served[0].grpc_port}") as client:
        with pytest.raises(client_module.RpcError) as err:
            call(client)
    assert type(err.value).__name__ == kind and err.value.reason == reason
    assert [f for f, _ in err.value.field_violations] == [field]
    assert err.value.field_violations[0][1] == err.value.details()  # the violation's description is the message
    if metadata is not None:
        assert err.value.metadata == metadata
    else:
        assert set(err.value.metadata) == {"limit"}


def test_both_clients_manage_a_catalogue_and_search_it_with_filters_pages_and_batches(served, indexed, tmp_path):
    """add_items (chunked: 11 items go as 2 requests of the test app's most, 8), search with filters and a
    threshold, search_pages, search_batch, delete_items: the blocking and the async client alike."""
    import asyncio

    from clipstream.services.client import AsyncClient, InvalidArgument
    from tests.services.conftest import png

    address = f"grpc://127.0.0.1:{served[0].grpc_port}"
    colours = ["red", "green", "blue", "white", "black", "gray", "pink", "cyan", "teal", "gold", "olive"]
    (tmp_path / "red.png").write_bytes(png("red"))
    items = [{"item_id": f"cap-{k}", "image": tmp_path / "red.png" if k == 0 else png(c), "text": f"a {c} cap",
              "metadata": {"brand": "acme" if k % 2 else "zed", "stock": k}} for k, c in enumerate(colours)]
    with Client(address) as client:
        try:
            assert client.add_items("caps", items, batch_size=8) == {"added": 11, "replaced": 0, "model_version": "1",
                                                                     "index_generation": 1}
            hits = client.search(text="a red cap", task="caps", k=3, filters={"brand": "acme", "stock": {"lte": 5}})
            assert {h["item_id"] for h in hits} <= {"cap-1", "cap-3", "cap-5"} and len(hits) == 3
            assert all(h["metadata"]["brand"] == "acme" for h in hits)
            pages = list(client.search_pages(text="a cap", task="caps", k=4))
            assert [len(p) for p in pages] == [4, 4, 3]
            ranking = [h["item_id"] for h in client.search(text="a cap", task="caps", k=11)]
            assert [h["item_id"] for p in pages for h in p] == ranking
            assert len(client.search(text="a cap", task="caps", k=11, score_threshold=1.0)) == 0
            batch = client.search_batch([{"text": "a red cap"}, {"image": png("blue"), "k": 2}], task="caps", k=3)
            assert [len(b) for b in batch] == [3, 2] and batch[0] == client.search(text="a red cap", task="caps", k=3)
            with pytest.raises(InvalidArgument) as bad:
                client.search(text="a cap", filters={"colour": "red"})
            assert bad.value.reason == "FILTER_INVALID" and "declared fields: brand, price, stock" in str(bad.value)
            with pytest.raises(ValueError, match="unknown keys"):
                client.add_items("caps", [{"item_id": "x", "caption": "a cap"}])

            async def calls():
                async with AsyncClient(address) as aclient:
                    again = await aclient.add_items("caps", items[:2])
                    found = await aclient.search(text="a red cap", task="caps", k=3,
                                                 filters={"brand": "acme", "stock": {"lte": 5}})
                    both = await aclient.search_batch([{"text": "a red cap"}], task="caps", k=3)
                    return again, found, both, await aclient.delete_items("caps", ["cap-0", "cap-99"])

            again, found, both, deleted = asyncio.run(calls())
            assert (again["added"], again["replaced"]) == (0, 2)
            assert [h["item_id"] for h in found] == [h["item_id"] for h in hits]
            assert [h["item_id"] for h in both[0]] == [h["item_id"] for h in batch[0]]
            assert deleted == {"deleted": 1, "not_found": ["cap-99"]}
        finally:
            client.delete_items("caps", [i["item_id"] for i in items], batch_size=8)


def test_cli_items_add_search_with_filters_and_delete(served, indexed, capsys, tmp_path):
    """`clipstream items add` from a JSON-lines file (images relative to it), `search --filter/--score-threshold`,
    `items delete`; a bad file or filter is one line and exit 2, and nothing is added."""
    from clipstream.cli import main
    from tests.services.conftest import png

    address = f"127.0.0.1:{served[0].grpc_port}"
    (tmp_path / "img").mkdir()
    lines = []
    for k, colour in enumerate(["red", "green", "blue"]):
        (tmp_path / "img" / f"{colour}.png").write_bytes(png(colour))
        lines.append(json.dumps({"item_id": f"hat-{k}", "image": f"img/{colour}.png", "text": f"a {colour} hat",
                                 "metadata": {"brand": "acme" if k else "zed", "price": 10.0 * k}}))
    (tmp_path / "hats.jsonl").write_text("\n".join(lines) + "\n")
    try:
        assert main(["items", "add", "hats", str(tmp_path / "hats.jsonl"), "--address", address]) == 0
        assert "catalogue hats: 3 added, 0 replaced (embedded by version 1" in capsys.readouterr().out
        assert main(["search", "a hat", "--task", "hats", "--filter", "brand=acme", "--filter", "price>=5",
                     "--filter", "price<=15", "--address", address, "--json"]) == 0
        assert [h["item_id"] for h in json.loads(capsys.readouterr().out)["hits"]] == ["hat-1"]
        assert main(["search", "a hat", "--task", "hats", "--score-threshold", "1", "--address", address,
                     "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["hits"] == []
        for bad, words in ((["--filter", "brand"], "write FIELD=V1,V2"), (["--filter", "price>=cheap"], "a number"),
                           (["--filter", "colour=red"], "INVALID_ARGUMENT: filter: field 'colour' is not declared")):
            assert main(["search", "a hat", "--address", address, *bad]) == 2
            err = capsys.readouterr().err
            assert words in err and len(err.strip().splitlines()) == 1
        (tmp_path / "bad.jsonl").write_text(lines[0] + "\n" + '{"item_id": "x", "caption": "a hat"}\n')
        assert main(["items", "add", "hats", str(tmp_path / "bad.jsonl"), "--address", address]) == 2
        assert "bad.jsonl:2: unknown keys ['caption']" in capsys.readouterr().err
        assert main(["items", "delete", "hats", "hat-0", "hat-7", "--address", address, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {"catalogue": "hats", "deleted": 1, "not_found": ["hat-7"]}
    finally:
        main(["items", "delete", "hats", "hat-0", "hat-1", "hat-2", "--address", address])
