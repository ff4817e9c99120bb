"""The Ray Serve application: deployments bound to Settings, and the gRPC proxy set-up (our services,
server reflection, the standard grpc.health.v1 service) so generic gRPC tools can discover and probe it."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from ray import serve
from ray.serve.config import gRPCOptions
from ray.serve.generated import serve_pb2, serve_pb2_grpc

from services.encoder import Encoder, Limits
from services.search import Search

APP = "clipstream"
SERVICES = ("clipstream.v1.Encoder", "clipstream.v1.Search")
GRPC_SERVICERS = ["clipstream.v1.encoder_pb2_grpc.add_EncoderServicer_to_server",
                  "clipstream.v1.search_pb2_grpc.add_SearchServicer_to_server", "services.app.add_health_service"]


def add_health_service(_placeholder, server) -> None:
    """Answered by the proxy itself (a passthrough service), like reflection: it is up when the proxy is."""
    server.add_passthrough_service(health.SERVICE_NAME)
    servicer = health.HealthServicer()
    for name in ("", *SERVICES):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


def build(settings, limits: Limits = Limits(), replicas: int = 1, batch_size: int = 32,
          cpus: tuple[float, float] = (0.5, 0.25)) -> serve.Application:
    """`cpus`: what an Encoder replica and the Search ingress reserve (0 shares the cores with training)."""
    encoder = Encoder.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus[0]}).bind(
        settings.mlflow_tracking_uri, settings.stream, str(settings.home / "cache"), limits, batch_size)
    return Search.options(ray_actor_options={"num_cpus": cpus[1]}).bind(encoder, settings)


def start(settings, timeout_s: float = 60.0, **build_args) -> None:
    """Start Serve's gRPC proxy on settings.grpc_port and deploy the application; returns once the
    proxy routes to it (the proxy learns new applications asynchronously after `serve.run`)."""
    serve.start(grpc_options=gRPCOptions(port=settings.grpc_port, grpc_servicer_functions=GRPC_SERVICERS,
                                         enable_reflection=True))
    serve.run(build(settings, **build_args), name=APP, route_prefix=f"/{APP}")
    with grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}") as channel:
        ask = serve_pb2_grpc.RayServeAPIServiceStub(channel).ListApplications
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if APP in ask(serve_pb2.ListApplicationsRequest(), timeout=timeout_s).application_names:
                    return
            except grpc.RpcError as exc:  # UNAVAILABLE "Route table is not populated yet."
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gRPC proxy on port {settings.grpc_port} did not route to {APP!r} in {timeout_s} s")
            time.sleep(0.1)
