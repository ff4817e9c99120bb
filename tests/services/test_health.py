"""grpc.health.v1 per application (services/health.py) on a real gRPC aio server, as Serve's proxy serves it, with
the applications' readiness given rather than polled; and the poll itself against a stand-in for Serve."""

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clipstream.services import health

ALL = {"": True, **{s: True for s in health.SERVICES}}
LOADING = {"": False, "clipstream.v1.EncoderService": True, "clipstream.v1.SearchService": False,
           "clipstream.v1.AdminService": True}


def checks(apps: dict, asks: list[tuple[str, str | None]]) -> list[str]:
    """The status names a Health servicer whose last poll saw `apps` answers to (service, application) checks;
    NOT_FOUND for a service it does not have."""
    async def run():
        servicer = health.Health()
        servicer.apps = apps
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for service, application in asks:
                    try:
                        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                  metadata=(("application", application),) if application else None)
                        out.append(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))
                    except grpc.aio.AioRpcError as exc:
                        out.append(exc.code().name)
        finally:
            await server.stop(None)
        return out

    with ThreadPoolExecutor(1) as pool:  # asyncio.run on a thread of its own (tests/benchmarks/test_grpc_encode.py)
        return pool.submit(asyncio.run, run()).result()


def test_a_probe_speaks_for_the_application_it_names():
    apps = {"clipstream": ALL, "side": LOADING, "deleting": {}}
    assert checks(apps, [("", "side"), ("clipstream.v1.EncoderService", "side"), ("", "clipstream"),
                         ("", "deleting"), ("", "absent"), ("clipstream.v1.SearchService", None)]) == [
        "NOT_SERVING", "SERVING", "SERVING", "NOT_SERVING", "NOT_SERVING", "SERVING"]  # (none named: clipstream)


def test_without_a_name_a_probe_speaks_for_the_only_application_else_for_clipstream():
    assert checks({"mine": ALL}, [("", None), ("", "clipstream")]) == ["SERVING", "NOT_SERVING"]
    assert checks({"mine": ALL, "other": ALL}, [("", None)]) == ["NOT_SERVING"]  # (no clipstream among them)
    assert checks({}, [("", None), ("", "clipstream")]) == ["NOT_SERVING", "NOT_SERVING"]  # (Serve not answering)


def test_an_unknown_service_is_not_found():
    assert checks({"clipstream": ALL}, [("clipstream.v1.Nope", None), ("clipstream.v1.Nope", "clipstream")]) == [
        "NOT_FOUND", "NOT_FOUND"]


def test_the_poll_asks_the_running_applications_that_have_an_encoder(monkeypatch):
    """Serve's controller lists the applications; the Encoder of each running one of clipstream's is asked (an answer
    that fails or never comes is not serving); one deploying or deleting, or not clipstream's, is not serving."""
    from ray import serve

    def app(status, *deployments):
        return SimpleNamespace(status=status, deployments={d: None for d in deployments})

    listed = {"ready": app("RUNNING", "Encoder", "Search"), "loading": app("RUNNING", "Encoder", "Search"),
              "broken": app("RUNNING", "Encoder", "Search"), "deploying": app("DEPLOYING", "Encoder", "Search"),
              "deleting": app("DELETING", "Encoder", "Search"), "theirs": app("RUNNING", "Ingress")}
    asked = []

    class Handle:
        def __init__(self, name):
            self.ready = SimpleNamespace(remote=lambda: self.answer(name))

        async def answer(self, name):
            asked.append(name)
            if name == "broken":
                raise RuntimeError("the replica died")
            return {s: name == "ready" or s == "clipstream.v1.EncoderService" for s in health.SERVICES}

    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications=listed))
    monkeypatch.setattr(serve, "get_deployment_handle", lambda deployment, name: Handle(name))
    with ThreadPoolExecutor(1) as pool:
        apps = pool.submit(asyncio.run, health._ready()).result()
    assert sorted(asked) == ["broken", "loading", "ready"]
    assert apps == {"ready": ALL, "loading": {**{s: False for s in ALL}, "clipstream.v1.EncoderService": True},
                    "broken": {}, "deploying": {}, "deleting": {}, "theirs": {}}


@pytest.mark.parametrize("application", [None, "side"])
def test_watch_sends_the_status_then_its_changes(application, monkeypatch):
    monkeypatch.setattr(health, "POLL_S", 0.05)

    async def run():
        servicer = health.Health()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), metadata=(("application", application),) if application else None)
                seen = [(await stream.read()).status]
                servicer.apps = {application or "clipstream": ALL}
                seen.append((await stream.read()).status)
                stream.cancel()
                return seen
        finally:
            await server.stop(None)

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(asyncio.run, run()).result() == [health.NOT_SERVING, health.SERVING]
