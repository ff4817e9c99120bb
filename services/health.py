"""grpc.health.v1 on the Serve gRPC proxy, in a module that imports nothing heavy: Serve's proxy actors (one
per node) import the servicer functions by path, and through `clipstream.services.app` each proxy process
would load torch and open_clip (~0.8 GB, ~8 s) only to add a health service."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVICES = ("clipstream.v1.Encoder", "clipstream.v1.Search", "clipstream.v1.Admin")


def add_health_service(_placeholder, server) -> None:
    """Answered by the proxy itself (a passthrough service), like reflection: it is up when the proxy is."""
    server.add_passthrough_service(health.SERVICE_NAME)
    servicer = health.HealthServicer()
    for name in ("", *SERVICES):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
