"""The Ray Serve application: deployments bound to Settings, and the gRPC proxy set-up (our services,
server reflection, the standard grpc.health.v1 service) so generic gRPC tools can discover and probe it."""

from __future__ import annotations

import os
import time

import grpc
from ray import serve as ray_serve
from ray.serve.config import gRPCOptions
from ray.serve.generated import serve_pb2, serve_pb2_grpc

from clipstream import runtime
from clipstream.services import binding, client
from clipstream.services.encoder import BATCHES_AT_ONCE, MAX_ONGOING, Encoder
from clipstream.services.search import Search
from clipstream.settings import Settings, configure_process

APP = "clipstream"  # Settings.serve_app's default, and the name the chart's serveConfigV2 gives the application
# the first one is not a service: it makes the proxy say UNAVAILABLE for a dead replica (services/binding.py)
GRPC_SERVICERS = ["clipstream.services.binding.retry_dead_replicas",
                  "clipstream.v1.encoder_pb2_grpc.add_EncoderServiceServicer_to_server",
                  "clipstream.v1.search_pb2_grpc.add_SearchServiceServicer_to_server",
                  "clipstream.v1.admin_pb2_grpc.add_AdminServiceServicer_to_server", "clipstream.services.health.add_health_service"]


# Ray Serve's throughput settings (its RAY_SERVE_THROUGHPUT_OPTIMIZED mode, minus direct ingress, which
# would bypass the proxy that hosts reflection and health): user code on the replica's own event loop,
# routers in the caller's loop, gRPC between deployments, buffered access logs. They are read when Ray's
# processes start, so they go in the environment before `ray.init` (and in the RayService pod env).
# The message caps: the proxy refuses a request over MAX_REQUEST_BYTES itself (RESOURCE_EXHAUSTED; Ray's default
# is 2 GiB), and its hop to the replica allows that much plus framing (Ray's default, gRPC's 4 MiB, failed every
# image over 4 MiB with INTERNAL although the per-image limit, serve_max_image_bytes, is 8 MiB).
SERVE_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
             "RAY_SERVE_LOG_TO_STDERR": "0", "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": "67108864",  # MAX_REQUEST_BYTES
             "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": "68157440"}  # + 1 MiB (literals: the chart's tests read them)


def serving_environment() -> None:
    """Put SERVE_ENV and the process's MLflow set-up in this process's environment (values already set win), before
    Ray starts: the replicas of a local Ray inherit it."""
    configure_process()
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)


def build(settings) -> ray_serve.Application:
    """Replicas, reserved CPUs and GPUs, batch size, model cache and request limits all come from settings.serve_*.
    Only the Encoder asks for GPUs: Search holds no model (it encodes queries through the Encoder)."""
    search = Search.options(ray_actor_options={"num_cpus": settings.serve_search_cpus}).bind(settings)
    return Encoder.options(num_replicas=settings.serve_replicas,
                           max_ongoing_requests=max(MAX_ONGOING, BATCHES_AT_ONCE * settings.serve_batch_size),
                           ray_actor_options={"num_cpus": settings.serve_encoder_cpus,
                                              "num_gpus": settings.serve_encoder_gpus}).bind(search, settings)


def app(args: dict) -> ray_serve.Application:
    """The application by import path, `clipstream.services.app:app`, for `serve deploy`/`serve run` and a
    RayService's serveConfigV2: an application builder (Serve calls it with the config's `args`), so Settings
    are read from the replicas' environment (`CLIPSTREAM_*`) when the config is applied, not at import;
    `args` override Settings fields by name (`args: {serve_replicas: 2}`); an unknown name is an error."""
    return build(Settings(**(args or {})))


def ray_for_serving(settings, *, num_cpus: int | None = None) -> None:
    """Ray ready to serve as `clipstream serve` serves, nothing deployed yet (training may share it first): the
    listening settings checked (a refusal before Ray starts costs nothing), SERVE_ENV in the environment, and a local
    Ray started with the setup hook that binds Serve's gRPC proxy as the settings say (binding.install), of
    `num_cpus` (default all); nothing more when Ray is already up in this process, or joined at settings.ray_address."""
    binding.check(settings)
    serving_environment()
    runtime.init_ray(settings, num_cpus=num_cpus, setup_hook=binding.install)


def serve(settings, *, num_cpus: int | None = None, timeout_s: float = 60.0) -> str:
    """Serve as `clipstream serve` does (the demo, the benchmarks and the tests start it so too): Ray ready to serve
    (`ray_for_serving`), Serve's gRPC proxy started on settings.grpc_host:grpc_port (TLS when a certificate is
    configured) and the application deployed as settings.serve_app; returns the address clients dial once the proxy
    routes to it. On a Serve already running the application goes beside the others, on the proxy's port and with
    its host and TLS (other ones are a BindingError)."""
    ray_for_serving(settings, num_cpus=num_cpus)
    binding.publish(settings)
    ray_serve.start(grpc_options=gRPCOptions(port=settings.grpc_port, grpc_servicer_functions=GRPC_SERVICERS,
                                             enable_reflection=True))
    ray_serve.run(build(settings), name=settings.serve_app, route_prefix=f"/{settings.serve_app}")
    binding.confirm(settings)
    host = settings.grpc_host if settings.grpc_host.strip("[]") not in ("0.0.0.0", "::") else "127.0.0.1"
    target = binding.address(host, settings.grpc_port)
    wait_routed(client.channel(target, tls=settings.tls, ca_file=settings.tls_ca_file or settings.tls_cert_file),
                timeout_s, settings.serve_app)
    return target


def wait_routed(channel: grpc.Channel, timeout_s: float = 60.0, application: str = APP) -> None:
    """Return once the Serve gRPC proxy behind `channel` routes to `application`: the proxy learns new
    applications asynchronously after a deploy (`serve.run`, `serve deploy`, a RayService update)."""
    with channel:
        ask = serve_pb2_grpc.RayServeAPIServiceStub(channel).ListApplications
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if application in ask(serve_pb2.ListApplicationsRequest(), timeout=timeout_s).application_names:
                    return
            except grpc.RpcError as exc:  # UNAVAILABLE "Route table is not populated yet." or no proxy yet
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gRPC proxy did not route to {application!r} in {timeout_s:g} s")
            time.sleep(0.2)
