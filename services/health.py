"""grpc.health.v1 on the Serve gRPC proxy, telling the truth for each application: NOT_SERVING until it answers
with a model and an index loaded, SERVING then, NOT_SERVING again while it is deployed anew or deleted (draining).

A probe is about the application its `application` metadata names (what the proxy routes a call by when several
applications share it; clients send Settings.serve_app), else the only one there is, else APP. An application that
is not there, or not clipstream's (no Encoder deployment), is NOT_SERVING.

The proxy answers it itself (a passthrough service, like reflection), from statuses a background task refreshes
every POLL_S by asking each running application's Encoder deployment (`Encoder.ready`, which asks Search) through a
handle, and Serve's controller for the applications' states. A probe thus never waits on a replica.

The module imports nothing heavy: Serve's proxy actors (one per node) import the servicer functions by path,
and through `clipstream.services.app` each proxy process would load torch and open_clip (~0.8 GB, ~8 s) only
to add a health service.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICES = ("clipstream.v1.EncoderService", "clipstream.v1.SearchService", "clipstream.v1.AdminService")
APP = "clipstream"  # clipstream.services.app.APP (not imported: see above)
APPLICATION_HEADER = "application"  # clipstream.services.client.APPLICATION_HEADER: what Serve's proxy routes by
POLL_S = 1.0
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
logger = logging.getLogger("ray.serve")


def add_health_service(_placeholder, server) -> None:
    server.add_passthrough_service(health.SERVICE_NAME)
    servicer = Health()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server._clipstream_health = asyncio.get_running_loop().create_task(servicer.watch())  # (kept referenced)


class Health(health_pb2_grpc.HealthServicer):
    """`apps`: every Serve application as last polled, {service: ready} for a running one of clipstream's (the
    server '' ready when all its services are), {} for any other."""

    def __init__(self):
        self.apps: dict[str, dict[str, bool]] = {}

    async def watch(self) -> None:
        while True:
            try:
                self.apps = await _ready()
            except Exception as exc:  # Serve's controller not answering: not serving, which is what we say
                logger.debug("health: not serving (%s)", exc)
                self.apps = {}
            await asyncio.sleep(POLL_S)

    def status(self, service: str, metadata) -> int:
        """The status of `service` in the application the metadata names, else in the only one, else in APP."""
        app = dict(metadata or ()).get(APPLICATION_HEADER) or (next(iter(self.apps)) if len(self.apps) == 1 else APP)
        return SERVING if self.apps.get(app, {}).get(service) else NOT_SERVING

    async def Check(self, request, context):
        if request.service not in ("", *SERVICES):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} here: ask for the server "
                                f"('') or one of {', '.join(SERVICES)}")
        return health_pb2.HealthCheckResponse(status=self.status(request.service, context.invocation_metadata()))

    async def Watch(self, request, context):
        """The status now, then each change (seen at the next poll); SERVICE_UNKNOWN for a service not here."""
        last = None
        while True:
            status = (self.status(request.service, context.invocation_metadata()) if request.service in ("", *SERVICES)
                      else health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await asyncio.sleep(POLL_S)


async def _ready() -> dict[str, dict[str, bool]]:
    """Health.apps, from Serve's controller and the Encoders of the running applications that have one."""
    from ray import serve

    async def ask(name: str) -> dict[str, bool]:
        return await asyncio.wait_for(serve.get_deployment_handle("Encoder", name).ready.remote(), timeout=10)

    statuses = await asyncio.to_thread(lambda: serve.status().applications)
    # deploying, deleting (draining), failed: not serving; an application without an Encoder is not ours
    ours = [name for name, s in statuses.items() if s.status == "RUNNING" and "Encoder" in s.deployments]
    answers = await asyncio.gather(*map(ask, ours), return_exceptions=True)
    apps: dict[str, dict[str, bool]] = {name: {} for name in statuses}
    for name, ready in zip(ours, answers):
        if isinstance(ready, BaseException):  # a replica gone, an answer too slow: not serving
            logger.debug("health: %s not serving (%s)", name, ready)
        else:
            apps[name] = {"": all(ready.values()), **ready}
    return apps
