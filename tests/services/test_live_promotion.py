"""Promotion while clients keep calling, TLS and API-key authentication, against a redeployed real app.

The module restarts Serve with its own stream (real task data, versions registered in MLflow, reindex
policy, an API key read from a file, TLS with a self-signed certificate) on the session's gRPC port, and puts
the shared app back afterwards.
"""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clipstream.promotion import promote
from clipstream.services import app
from clipstream.services.client import Client, channel
from clipstream.services.health import SERVICES
from clipstream.settings import Settings
from clipstream.training.data.task import Task
from clipstream.v1 import admin_pb2, admin_pb2_grpc, encoder_pb2, encoder_pb2_grpc
from tests.conftest import register_version
from tests.services.conftest import self_signed, still_needed

pytestmark = pytest.mark.slow  # a redeployed app under load: `make test-all`

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def live(served, stream, tmp_path_factory, request):
    from ray import serve

    shared, root = served[0], tmp_path_factory.mktemp("live")
    cert, key = self_signed(root / "tls")
    (root / "api-key").write_text(KEY + "\n")  # as a mounted Secret holds it
    settings = Settings(home=root / "home", grpc_port=shared.grpc_port, api_key_file=root / "api-key",
                        tls_cert_file=cert, tls_key_file=key, index_policy="reindex", serve_encoder_cpus=0,
                        serve_search_cpus=0, serve_replicas=2).ensure_dirs()  # one may be killed under load
    v1 = register_version(settings, seed=11, task_dirs=stream[:1])
    v2 = register_version(settings, seed=12, task_dirs=stream, parent=v1)
    serve.shutdown()  # the proxy listens differently (TLS): it must start again
    app.start(settings)  # nothing promoted, nothing indexed yet: see test_health_tells_the_truth
    with channel(f"127.0.0.1:{settings.grpc_port}", tls=True, ca_file=cert) as secure:
        statuses_before = health_of(secure)
        promote(settings, v1)  # gallery of task 0 under v1, then the alias
        wait_for_health(secure, "SERVING")
        yield settings, secure, (v1, v2), statuses_before
    serve.shutdown()
    if still_needed(request):  # conftest runs this module after the other users of the shared app
        app.start(shared)


def health_of(secure) -> dict[str, str]:
    stub = health_pb2_grpc.HealthStub(secure)
    return {name: health_pb2.HealthCheckResponse.ServingStatus.Name(
        stub.Check(health_pb2.HealthCheckRequest(service=name)).status) for name in ("", *SERVICES)}


def wait_for_health(secure, status: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while set(health_of(secure).values()) != {status}:
        assert time.monotonic() < deadline, f"health never became {status}: {health_of(secure)}"
        time.sleep(0.25)


def test_health_tells_the_truth(live):
    """NOT_SERVING while no model and no gallery are in place (the app was running, nothing promoted), SERVING
    once promotion put them there (the fixture waited for it)."""
    *_, before = live
    assert {before[s] for s in ("", "clipstream.v1.EncoderService", "clipstream.v1.SearchService")} == {"NOT_SERVING"}, before
    # (Admin answers status with nothing in place, once the app runs: it may already say SERVING)


def client(settings, **kwargs) -> Client:
    return Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, tls=True, ca_file=settings.tls_cert_file, **kwargs)


def test_tls_only_with_the_right_certificate(live, tmp_path):
    settings, *_ = live
    with client(settings) as secure:
        assert secure.health() == "SERVING" and secure.encode_text(["a cup"])[0].shape[0] == 1
    with Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, retries=0, timeout_s=5) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # a plaintext client gets no answer
    other, _ = self_signed(tmp_path / "other")
    with Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, retries=0, timeout_s=5, tls=True, ca_file=other) as fooled:
        with pytest.raises(grpc.RpcError) as err:
            fooled.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # nor one that trusts another certificate


def test_the_cli_speaks_tls(live, capsys, monkeypatch):
    from clipstream.cli import main

    settings, *_ = live
    monkeypatch.setenv("CLIPSTREAM_API_KEY_FILE", str(settings.api_key_file))
    monkeypatch.setenv("CLIPSTREAM_TLS_CA_FILE", str(settings.tls_cert_file))
    address = f"127.0.0.1:{settings.grpc_port}"
    assert main(["health", "--address", address, "--tls"]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert main(["encode", "a red cup", "--address", address, "--tls"]) == 0
    assert "1 vectors" in capsys.readouterr().out


def test_without_the_api_key_every_rpc_is_unauthenticated_but_probes_answer(live):
    settings, secure, *_ = live
    calls = [lambda md: encoder_pb2_grpc.EncoderServiceStub(secure).EncodeText(
                 encoder_pb2.EncodeTextRequest(texts=["a cup"]), metadata=md),
             lambda md: admin_pb2_grpc.AdminServiceStub(secure).GetStatus(admin_pb2.GetStatusRequest(), metadata=md)]
    for call in calls:
        for metadata in (None, (("x-api-key", "wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                call(metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "x-api-key" in err.value.details()
        assert call((("x-api-key", KEY),)) is not None
    check = health_pb2_grpc.HealthStub(secure).Check(health_pb2.HealthCheckRequest(service="clipstream.v1.SearchService"))
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    with Client(f"127.0.0.1:{settings.grpc_port}", tls=True, ca_file=settings.tls_cert_file) as anonymous:
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
        (0.5, "kill an Encoder replica", kill_replica),
        (1.0, "promote", lambda: promote(settings, v2)["index"]["query_version"])])
    (_, _, _, killed), (_, _, _, promoted) = result["events"]
    assert killed.startswith("killed") and promoted == v2, result["events"]
    assert not result["failures"], [f[-200:] for f in result["failures"][:5]]
    assert not result["incoherent"], result["incoherent"][:5]  # every hit made by the encoder of its query
    assert result["versions"] == sorted([v1, v2]) and all(k["n"] > 0 for k in result["latency_ms"].values())
    for seen in result["per_client_search_versions"].values():  # each client sees a single switch, never back
        assert seen == sorted(seen, key=lambda v: v == v2), seen


def test_health_is_not_serving_while_the_app_drains(live):
    """Last in the module: deleting the application (what an upgrade or a shutdown does) turns health NOT_SERVING
    before the replicas are gone."""
    from ray import serve

    _, secure, *_ = live
    serve.delete(app.APP, _blocking=False)
    wait_for_health(secure, "NOT_SERVING", timeout_s=30)
