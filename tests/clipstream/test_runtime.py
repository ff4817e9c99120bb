"""Ray start-up and loopback ports (clipstream.runtime)."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from clipstream import runtime
from clipstream.cli import main
from clipstream.settings import Settings


def test_free_port_is_a_loopback_port_below_the_ephemeral_range_nothing_listens_on():
    low = runtime._ephemeral_low()
    ports = {runtime.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


# what ray.init raises when the local GCS cannot start (its port taken), after a minute of Ray's own waiting
GCS_FAILED = ("Failed to start GCS. Last 1 lines of error files:\n[gcs_server] grpc_server.cc:134: An unexpected "
              "system state has occurred. " + "x" * 400)


@pytest.fixture
def ray_cannot_start(monkeypatch):
    """`ray.init` failing at once as it does when the local GCS cannot start; yields what it was given, with the GCS
    port variable as it saw it (`gcs_port`). The temp dir init_ray made for it is removed after the test."""
    import ray

    seen = {}

    def init(**options):
        seen.update(options, gcs_port=os.environ.get(runtime.GCS_PORT))
        raise RuntimeError(GCS_FAILED)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # (the test session's own Ray, if another test started it)
    monkeypatch.setattr(ray, "init", init)
    yield seen
    if "_temp_dir" in seen:
        shutil.rmtree(seen["_temp_dir"], ignore_errors=True)


@pytest.mark.parametrize("port_before", [None, "6379"])
def test_a_local_ray_that_cannot_start_is_one_line_naming_its_cause_and_logs(ray_cannot_start, monkeypatch,
                                                                             port_before):
    if port_before is None:
        monkeypatch.delenv(runtime.GCS_PORT, raising=False)
    else:
        monkeypatch.setenv(runtime.GCS_PORT, port_before)
    with pytest.raises(runtime.RayStartError) as raised:
        runtime.init_ray(Settings(ray_address=None))
    message, temp = str(raised.value), ray_cannot_start["_temp_dir"]
    assert message.startswith("could not start a local Ray instance (RuntimeError: Failed to start GCS. Last 1 lines "
                              "of error files: [gcs_server] grpc_server.cc:134: ")  # (Ray's lines joined into one)
    assert message.endswith(f"); Ray's logs: {temp}/session_latest/logs") and "\n" not in message
    assert "x" * 300 not in message  # the cause cut short: the line stays readable
    assert os.path.basename(temp).startswith("clipstream-ray-") and os.path.isdir(temp)  # a folder of its own
    assert isinstance(raised.value.__cause__, RuntimeError)
    # the GCS was given a port of its own, which the workers' RAY_ADDRESS names, and the variable is as it was
    port = int(ray_cannot_start["gcs_port"])
    assert ray_cannot_start["runtime_env"]["env_vars"]["RAY_ADDRESS"] == f"127.0.0.1:{port}"
    assert os.environ.get(runtime.GCS_PORT) == port_before


def test_train_reports_a_local_ray_that_cannot_start_in_one_line_exit_1_and_registers_nothing(ray_cannot_start,
                                                                                              settings, stream, capsys):
    from clipstream.registry import Registry

    assert main(["train", "--task", str(stream[0]), "--workers", "1"]) == 1  # not the input's fault
    err = capsys.readouterr().err.strip()
    assert err.startswith("clipstream: error: could not start a local Ray instance (RuntimeError: Failed to start GCS")
    assert err.endswith(f"Ray's logs: {ray_cannot_start['_temp_dir']}/session_latest/logs") and "\n" not in err, err
    assert Registry(settings).versions() == []


# the process boundary itself: the console script, quiet, shows its log file's line and the error's, nothing else
RAY_CANNOT_START = """
import sys
import ray
from clipstream.cli import main
def init(**_):  # as when the local GCS cannot start, without Ray's minute of waiting for it
    raise RuntimeError("Failed to start GCS. Last 1 lines of error files:\\n[gcs_server] grpc_server.cc:134: ...")
ray.init = init
sys.exit(main(["train", "--task", sys.argv[1], "--workers", "1"]))
"""


@pytest.mark.slow
def test_a_local_ray_that_cannot_start_is_two_lines_on_the_console_scripts_stderr(stream, tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("CLIPSTREAM_", "RAY_"))},
           "CLIPSTREAM_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", RAY_CANNOT_START, str(stream[0])], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300, check=False)
    assert done.returncode == 1  # not the input's fault
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("clipstream: Ray, DeepSpeed and MLflow log to ")  # (quiet: the libraries' lines go there)
    assert len(lines) == 2 and lines[1].startswith("clipstream: error: could not start a local Ray instance (")
    assert "Ray's logs: /tmp/clipstream-ray-" in lines[1] and "Traceback" not in done.stderr + done.stdout
    shutil.rmtree(lines[1].split("Ray's logs: ")[1].removesuffix("/session_latest/logs"), ignore_errors=True)


HOOKED = """
import sys
import ray
from clipstream import runtime
from clipstream.services import binding
from clipstream.settings import Settings
runtime.init_ray(Settings(ray_address=None), num_cpus=1, setup_hook=binding.install)
print(ray.get(ray.remote(lambda: any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)).remote()))
"""


@pytest.mark.slow
def test_the_setup_hook_is_a_function_every_worker_runs(tmp_path):
    """What serves passes `binding.install` itself (an import the layer test sees, not a string name)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLIPSTREAM_", "RAY_"))}
    done = subprocess.run([sys.executable, "-c", HOOKED], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"
