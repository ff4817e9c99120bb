"""The application by import path (`clipstream.services.app:app`), as `serve deploy` and a RayService's
serveConfigV2 load it: Settings come from the replicas' environment when the config is applied, `args`
override them by name, and a wrong name is refused."""

import pytest
from pydantic import ValidationError
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as build_from_config

pytestmark = pytest.mark.component  # the session's served app

IMPORT_PATH = "clipstream.services.app:app"


def test_the_import_path_builds_the_app_from_the_environment(settings, monkeypatch):
    monkeypatch.setenv("CLIPSTREAM_SERVE_ENCODER_CPUS", "0.25")
    monkeypatch.setenv("CLIPSTREAM_SERVE_REPLICAS", "3")
    monkeypatch.setenv("CLIPSTREAM_SERVE_ENCODER_GPUS", "1")  # (the chart's ConfigMap key)
    app = build_from_config(import_attr(IMPORT_PATH), {})
    encoder = app._bound_deployment
    assert (encoder.name, encoder.num_replicas, encoder.ray_actor_options) == ("Encoder", 3, {"num_cpus": 0.25,
                                                                                               "num_gpus": 1.0})
    assert build_from_config(import_attr(IMPORT_PATH), {"serve_replicas": 2})._bound_deployment.num_replicas == 2


def test_a_replica_has_room_for_two_full_batches(settings):
    """The Encoder hands the next batch to its model thread while one runs: a replica takes requests enough for both
    (Serve warns, and the batches stay short, when max_ongoing_requests is under max_batch_size × batches at once)."""
    def most(batch: int) -> int:
        return build_from_config(import_attr(IMPORT_PATH), {"serve_batch_size": batch})._bound_deployment.max_ongoing_requests

    assert (most(32), most(100)) == (128, 200)


def test_the_charts_args_override_the_pods_settings(settings, monkeypatch):
    """A RayService's serveConfigV2 carries the serving settings as args: they win over the ConfigMap's variables
    the pods started with (an older release's), so a changed setting needs no new pods."""
    from clipstream.local_cluster import Chart

    chart = Chart.render({"settings": {"serve_batch_size": 8, "serve_replicas": 2, "serve_encoder_cpus": 0.25,
                                       "serve_encoder_gpus": 0, "serve_model_cache": 2}})
    (config,) = chart.serve_config["applications"]
    monkeypatch.setenv("CLIPSTREAM_SERVE_BATCH_SIZE", "32")  # what the pods' environment still says
    monkeypatch.setenv("CLIPSTREAM_SERVE_REPLICAS", "1")
    encoder = build_from_config(import_attr(config["import_path"]), config["args"])._bound_deployment
    (built,) = [a for a in encoder.init_args if hasattr(a, "serve_batch_size")]
    assert (built.serve_batch_size, built.serve_model_cache, built.serve_encoder_cpus) == (8, 2, 0.25)
    assert (encoder.num_replicas, encoder.ray_actor_options) == (2, {"num_cpus": 0.25, "num_gpus": 0.0})


def test_unknown_args_are_refused(settings):
    with pytest.raises(ValidationError, match="serve_replica"):
        build_from_config(import_attr(IMPORT_PATH), {"serve_replica": 2})


def test_the_proxys_servicer_functions_import_nothing_heavy():
    """Serve's gRPC proxies (one per node) import GRPC_SERVICERS by path: none of them may pull in torch."""
    import subprocess
    import sys

    from clipstream.services.app import GRPC_SERVICERS

    modules = sorted({path.rsplit(".", 1)[0] for path in GRPC_SERVICERS})
    code = f"import sys, {', '.join(modules)}; print(sorted(m for m in ('torch', 'open_clip', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_served_port_listens_on_loopback_only(served):
    """Ray Serve's proxy binds every interface; clipstream's setup hook makes it bind Settings.grpc_host
    (127.0.0.1 by default), and `app.serve` checked that the proxy acknowledged it."""
    import psutil

    port = served[0].grpc_port
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"}
    assert listening and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in listening), listening


def test_the_setup_hook_patches_only_when_serve_is_imported():
    """Every Ray worker runs the hook: importing Serve there (~2 s) for training and Ray Data tasks would be waste."""
    import subprocess
    import sys

    code = ("import sys; from clipstream.services import binding; binding.install(); "
            "print('ray.serve' in sys.modules); from ray.serve._private import default_impl; "
            "print(getattr(default_impl.add_grpc_address, 'clipstream', False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_the_first_servicer_function_makes_a_dead_replica_retryable():
    """What Serve's proxy does with GRPC_SERVICERS (grpc_util.start_grpc_server), on a real gRPC server: the first
    function patches the proxy's status of a dead replica's request and the handlers the later services get."""
    from unittest.mock import Mock  # (the servicer Serve passes: its methods are replaced by the proxy's)

    import grpc
    from ray._common.utils import import_attr
    from ray.exceptions import RayActorError
    from ray.serve._private import proxy
    from ray.serve._private.grpc_util import gRPCGenericServer

    from clipstream.services.app import GRPC_SERVICERS

    made = []
    server = gRPCGenericServer(lambda service_method, streaming_type: made.append(service_method) or service_method)
    first, encoder = (import_attr(path) for path in GRPC_SERVICERS[:2])
    first(Mock(), server)
    encoder(Mock(), server)
    assert made and all(m.startswith("/clipstream.v1.EncoderService/") for m in made)
    unary = server.generic_rpc_handlers[0][0]._method_handlers["/clipstream.v1.EncoderService/EncodeText"].unary_unary
    assert unary.__qualname__.startswith("_aborting.")  # ours: aborts (trailers-only), which the client retries
    status = proxy.get_grpc_response_status(RayActorError(), 10.0, "request-id")
    assert status.code == grpc.StatusCode.UNAVAILABLE and status.is_error


def test_the_message_caps_match_the_clients_request_limit():
    from clipstream.services.app import SERVE_ENV
    from clipstream.services.client import MAX_REQUEST_BYTES

    assert int(SERVE_ENV["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]) == MAX_REQUEST_BYTES
    assert int(SERVE_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > MAX_REQUEST_BYTES  # room for framing


def test_serve_is_the_one_start_up_and_checks_the_listener_before_ray_starts(settings, monkeypatch):
    """`clipstream serve` starts through app.serve (the demo, the benchmarks and the tests too); Ray is started as
    serving needs it, SERVE_ENV in the environment before and the proxy's setup hook given, and not at all when the
    settings would listen beyond loopback without a key."""
    import os

    from clipstream import runtime
    from clipstream.cli import main
    from clipstream.services import app, binding

    for key in app.SERVE_ENV:
        monkeypatch.delenv(key, raising=False)
    started = []
    monkeypatch.setattr(runtime, "init_ray", lambda *args, **kwargs: started.append(
        (args, kwargs, {k: os.environ.get(k) for k in app.SERVE_ENV})))
    app.ray_for_serving(settings, num_cpus=3)
    assert started == [((settings,), {"num_cpus": 3, "setup_hook": binding.install}, app.SERVE_ENV)]
    with pytest.raises(binding.BindingError, match="without an API key"):
        app.ray_for_serving(settings.model_copy(update={"grpc_host": "0.0.0.0"}))
    assert len(started) == 1

    served = []

    def serve(settings, **options):
        served.append(settings)
        raise ValueError("stop here")  # (bad input: exit 2, and nothing after it runs)

    monkeypatch.setattr(app, "serve", serve)
    assert main(["serve", "--replicas", "3", "--no-follow"]) == 2
    assert [s.serve_replicas for s in served] == [3]


def test_the_default_application_is_the_one_health_and_the_chart_name():
    from clipstream.services import app, health
    from clipstream.settings import Settings

    assert Settings.model_fields["serve_app"].default == app.APP == health.APP
