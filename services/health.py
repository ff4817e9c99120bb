"""grpc.health.v1 on the Serve gRPC proxy, telling the truth: NOT_SERVING until the application answers with a
model and an index loaded, SERVING then, NOT_SERVING again while it is deployed anew or deleted (draining).

The proxy answers it itself (a passthrough service, like reflection), from statuses a background task refreshes
every POLL_S by asking the Encoder deployment (`Encoder.ready`, which asks Search) through a handle, and Serve's
controller for the application's state. A probe thus never waits on a replica.

The module imports nothing heavy: Serve's proxy actors (one per node) import the servicer functions by path,
and through `clipstream.services.app` each proxy process would load torch and open_clip (~0.8 GB, ~8 s) only
to add a health service.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICES = ("clipstream.v1.EncoderService", "clipstream.v1.SearchService", "clipstream.v1.AdminService")
APP = "clipstream"  # clipstream.services.app.APP (not imported: see above)
POLL_S = 1.0
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
logger = logging.getLogger("ray.serve")


def add_health_service(_placeholder, server) -> None:
    server.add_passthrough_service(health.SERVICE_NAME)
    servicer = health.HealthServicer()
    for name in ("", *SERVICES):
        servicer.set(name, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server._clipstream_health = asyncio.get_running_loop().create_task(_watch(servicer))  # (kept referenced)


async def _watch(servicer: health.HealthServicer) -> None:
    while True:
        try:
            ready = await _ready()
        except Exception as exc:  # the app not deployed yet, a replica gone: not serving, which is what we say
            logger.debug("health: not serving (%s)", exc)
            ready = {}
        for name in ("", *SERVICES):
            servicer.set(name, SERVING if ready.get(name) else NOT_SERVING)
        await asyncio.sleep(POLL_S)


async def _ready() -> dict[str, bool]:
    """{service: ready}, the server ('') only when all are; {} while the application is not running."""
    from ray import serve

    status = await asyncio.to_thread(lambda: serve.status().applications.get(APP))
    if status is None or status.status != "RUNNING":  # deploying, deleting (draining), failed
        return {}
    encoder = serve.get_deployment_handle("Encoder", APP)
    ready = await asyncio.wait_for(encoder.ready.remote(), timeout=10)
    return {"": all(ready.values()), **ready}
