"""Ray start-up and loopback ports: what training, serving, the local cluster and the tests share.

Light on purpose (Ray is imported when `init_ray` runs): the cluster's and the tests' `free_port` must not pay
for it.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from clipstream import console
from clipstream.settings import Settings

logger = logging.getLogger(__name__)

GCS_PORT = "RAY_GCS_SERVER_PORT"


class RayStartError(RuntimeError):
    """The local Ray instance could not start (exit 1, one line: not the input's fault)."""


def init_ray(settings: Settings, num_cpus: int | None = None, setup_hook: Callable[[], None] | None = None) -> None:
    """Connect to `settings.ray_address`, or start a Ray instance of this process's own.

    The local instance never meets another Ray on the machine: its GCS on a free port of its own, its temp dir
    (sessions, sockets, worker logs) a new folder rather than the shared /tmp/ray, and RAY_ADDRESS set to it in
    every worker, so that what Ray itself looks up with address "auto" (Ray Train's placement-group cleaner, the
    state API) finds this instance instead of failing on "multiple active Ray instances". Quiet (clipstream.console),
    the workers' output stays in their log files under that temp dir instead of being forwarded here.

    `setup_hook`: run in every worker process of the local instance as it starts (Ray's
    `worker_process_setup_hook`); what serves passes `clipstream.services.binding.install`, which lets Serve's
    gRPC proxy bind the settings' interface with their TLS. A function of an importable module: Ray ships it by
    reference."""
    import ray
    import ray.data

    if ray.is_initialized():
        return
    ray.data.DataContext.get_current().enable_progress_bars = False
    forward = not console.is_quiet()
    if settings.ray_address:
        ray.init(address=settings.ray_address, log_to_driver=forward)
        return
    port = free_port()
    # short and of its own: Ray's unix sockets live under it, and a socket path may not pass 107 bytes
    temp = tempfile.mkdtemp(prefix="clipstream-ray-", dir="/tmp" if Path("/tmp").is_dir() else None)
    before = os.environ.get(GCS_PORT)
    os.environ[GCS_PORT] = str(port)  # (read by the head node Ray starts now; ray.init has no argument for it)
    runtime_env: dict = {"env_vars": {"RAY_ADDRESS": f"127.0.0.1:{port}"}}
    if setup_hook is not None:
        runtime_env["worker_process_setup_hook"] = setup_hook
    try:
        ray.init(num_cpus=num_cpus or os.cpu_count(), log_to_driver=forward, configure_logging=False,
                 _temp_dir=temp, runtime_env=runtime_env)
    except Exception as exc:
        raise RayStartError(f"could not start a local Ray instance ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:300]}); Ray's logs: {temp}/session_latest/logs") from exc
    finally:
        if before is None:
            os.environ.pop(GCS_PORT, None)
        else:
            os.environ[GCS_PORT] = before
    logger.info("local Ray instance at 127.0.0.1:%d, temp dir (worker logs) %s", port, temp)


def stop_on_sigterm() -> None:
    """SIGTERM (Kubernetes stopping a pod, a supervisor, `kill`) ends a long-running command as Ctrl-C does: as a
    KeyboardInterrupt in the main thread, so its own clean-up runs (what it started is stopped, and the local Ray
    instance shut down at exit) instead of the process dying with its children left behind."""
    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def free_port() -> int:
    """A loopback port nothing listens on now, from below the kernel's ephemeral range: a port may be bound long
    after it is chosen (Serve's proxies after training), and a port the kernel hands out itself is one any
    outgoing connection may take as its source port meanwhile. Only another listener choosing the same port can
    still collide."""
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low} after 100 tries")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
