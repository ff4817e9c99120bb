"""Promotion while clients keep calling, and API-key authentication, against an application of its own.

The module deploys its own app (its own stream: real task data, versions registered in MLflow, reindex policy, an
API key read from a file, two Encoder replicas) beside the session's shared app, on the shared proxy; its calls name
it in their `application` metadata, and at the end it deletes its app only. TLS belongs to the proxy, fixed when
Serve starts: tests/services/test_tls.py has a proxy of its own.
"""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clipstream.promotion import promote
from clipstream.services.client import Client, NotFound, channel
from clipstream.services.health import SERVICES
from clipstream.settings import Settings
from clipstream.training.data.task import Task
from clipstream.v1 import admin_pb2, admin_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tests.conftest import register_version
from tests.services.conftest import side_app, wait_serving

pytestmark = pytest.mark.slow  # an app of its own under load: `make test-all`

KEY = "s3cret-key"
NAME = "live"  # the module's application


@pytest.fixture(scope="module")
def live(served, indexed, stream, tmp_path_factory):
    shared, root = served[0], tmp_path_factory.mktemp("live")
    (root / "api-key").write_text(KEY + "\n")  # as a mounted Secret holds it
    settings = Settings(home=root / "home", grpc_port=shared.grpc_port, serve_app=NAME, api_key_file=root / "api-key",
                        index_policy="reindex", serve_encoder_cpus=0, serve_search_cpus=0,
                        serve_replicas=2).ensure_dirs()  # one may be killed under load
    v1 = register_version(settings, seed=11, task_dirs=stream[:1])
    v2 = register_version(settings, seed=12, task_dirs=stream, parent=v1)
    wait_serving(served[1])  # the shared app, indexed: SERVING throughout, whatever this app's health says
    with side_app(settings) as target, channel(target, application=NAME) as named:
        statuses_before = health_of(named)  # nothing promoted, nothing indexed yet: see test_health_tells_the_truth
        promote(settings, v1)  # gallery of task 0 under v1, then the alias
        wait_for_health(named, "SERVING")
        yield settings, named, (v1, v2), statuses_before


def health_of(named) -> dict[str, str]:
    stub = health_pb2_grpc.HealthStub(named)
    return {name: health_pb2.HealthCheckResponse.ServingStatus.Name(
        stub.Check(health_pb2.HealthCheckRequest(service=name)).status) for name in ("", *SERVICES)}


def wait_for_health(named, status: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while set(health_of(named).values()) != {status}:
        assert time.monotonic() < deadline, f"health never became {status}: {health_of(named)}"
        time.sleep(0.25)


def test_health_tells_the_truth_for_each_application(live, served):
    """NOT_SERVING while no model and no gallery are in place (the app was running, nothing promoted), SERVING
    once promotion put them there (the fixture waited for it); all the while the shared app, which a probe naming
    no application asks about, said SERVING."""
    *_, before = live
    assert {before[s] for s in ("", "clipstream.v1.EncoderService", "clipstream.v1.SearchService")} == {"NOT_SERVING"}, before
    # (Admin answers status with nothing in place, once the app runs: it may already say SERVING)
    assert set(health_of(served[1]).values()) == {"SERVING"}


def client(settings, **kwargs) -> Client:
    return Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, application=NAME, **kwargs)


def test_each_call_reaches_the_application_it_names(live, served):
    """With two applications on the proxy a call goes to the one its metadata names (this one wants an API key, the
    shared one does not); naming none is the proxy's NOT_FOUND."""
    settings, *_ = live
    address = f"127.0.0.1:{settings.grpc_port}"
    with client(settings) as mine:
        assert mine.encode_text(["a cup"])[0].shape == (1, 64)
    with Client(address, application=NAME, retries=0) as anonymous, Client(address, application=served[0].serve_app,
                                                                           retries=0) as shared:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.encode_text(["a cup"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert shared.encode_text(["a cup"])[0].shape == (1, 64)
    with Client(address, retries=0) as unnamed, pytest.raises(NotFound):
        unnamed.encode_text(["a cup"])


def test_without_the_api_key_every_rpc_is_unauthenticated_but_probes_answer(live):
    settings, named, *_ = live
    calls = [lambda md: encoder_pb2_grpc.EncoderServiceStub(named).EncodeText(
                 encoder_pb2.EncodeTextRequest(texts=["a cup"]), metadata=md),
             lambda md: admin_pb2_grpc.AdminServiceStub(named).GetStatus(admin_pb2.GetStatusRequest(), metadata=md)]
    for call in calls:
        for metadata in (None, (("x-api-key", "wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                call(metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "x-api-key" in err.value.details()
        assert call((("x-api-key", KEY),)) is not None
    check = health_pb2_grpc.HealthStub(named).Check(health_pb2.HealthCheckRequest(service="clipstream.v1.SearchService"))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    with Client(f"127.0.0.1:{settings.grpc_port}", application=NAME) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.search(text="a cup")
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_16_clients_through_a_promotion_and_a_replica_kill_fail_no_request(live, stream):
    """The reliability benchmark's load (benchmarks/reliability.py `drive`), shortened: 16 clients of mixed
    EncodeText, EncodeImage and Search while a promotion reindexes and switches the gallery and one of the two
    Encoder replicas is SIGKILLed. Retries come only from the shipped client's gRPC retry policy."""
    from clipstream.benchmarks.reliability import drive, kill_replica

    settings, _, (v1, v2), _ = live
    rows = Task.load(stream[0]).check("test").rows
    texts, images = [r["caption"] for r in rows], [(Task.load(stream[0]).root / r["image"]).read_bytes() for r in rows]
    result = drive(lambda: client(settings), texts, images, clients=16, seconds=6.0, events=[
        (0.5, "kill an Encoder replica", lambda: kill_replica(NAME)),
        (1.0, "promote", lambda: promote(settings, v2)["index"]["query_version"])])
    (_, _, _, killed), (_, _, _, promoted) = result["events"]
    assert killed.startswith("killed") and promoted == v2, result["events"]
    assert not result["failures"], [f[-200:] for f in result["failures"][:5]]
    assert not result["incoherent"], result["incoherent"][:5]  # every hit made by the encoder of its query
    assert result["versions"] == sorted([v1, v2]) and all(k["n"] > 0 for k in result["latency_ms"].values())
    for seen in result["per_client_search_versions"].values():  # each client sees a single switch, never back
        assert seen == sorted(seen, key=lambda v: v == v2), seen


def test_health_is_not_serving_while_the_app_drains(live, served):
    """Last in the module: deleting the application (what an upgrade or a shutdown does) turns its health NOT_SERVING
    before the replicas are gone; the shared app's stays SERVING."""
    from ray import serve

    _, named, *_ = live
    serve.delete(NAME, _blocking=False)
    wait_for_health(named, "NOT_SERVING", timeout_s=30)
    assert set(health_of(served[1]).values()) == {"SERVING"}
