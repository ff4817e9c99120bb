"""Ray start-up and loopback ports (clipstream.runtime)."""

import socket
import subprocess
import sys

import pytest

from clipstream import runtime


def test_free_port_is_a_loopback_port_below_the_ephemeral_range_nothing_listens_on():
    low = runtime._ephemeral_low()
    ports = {runtime.free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports) and len(ports) > 1
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


RAY_CANNOT_START = """
import socket, sys
from clipstream import runtime
from clipstream.cli import main
taken = socket.socket()
taken.bind(("0.0.0.0", 0))
taken.listen()
runtime.free_port = lambda: taken.getsockname()[1]  # the port the local Ray's GCS is given is taken: it cannot start
sys.exit(main(["train", "--task", sys.argv[1], "--workers", "1"]))
"""


@pytest.mark.slow
def test_a_local_ray_that_cannot_start_is_one_line_naming_its_logs(stream, tmp_path):
    import os

    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("CLIPSTREAM_", "RAY_"))},
           "CLIPSTREAM_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", RAY_CANNOT_START, str(stream[0])], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300, check=False)
    assert done.returncode == 1  # not the input's fault
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("clipstream: Ray, DeepSpeed and MLflow log to ")  # (quiet: Ray's own lines go there)
    assert len(lines) == 2 and lines[1].startswith("clipstream: error: could not start a local Ray instance (")
    assert "Ray's logs: /tmp/clipstream-ray-" in lines[1] and "Traceback" not in done.stderr + done.stdout


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
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLIPSTREAM_", "RAY_"))}
    done = subprocess.run([sys.executable, "-c", HOOKED], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"
