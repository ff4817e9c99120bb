"""`clipstream ui`: `mlflow ui` on the settings' store, run and stopped as a process group of its own."""

from __future__ import annotations

import os
import time

from clipstream import console
from clipstream.settings import Settings


def _ui(args) -> None:
    """`mlflow ui` on the settings' store, on loopback, until Ctrl-C (or the process is told to stop)."""
    import signal
    import subprocess

    from clipstream.local_cluster import http_get, tool
    from clipstream.runtime import free_port, stop_on_sigterm

    settings = Settings()
    uri = settings.mlflow_tracking_uri
    if uri.startswith(("http://", "https://")):
        print(f"MLflow UI: {uri} (the tracking server of these settings serves it)")
        return
    port = args.port or free_port()
    command = [tool("mlflow"), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)  # (its output: the log)
    url = f"http://127.0.0.1:{port}"

    stop_on_sigterm()
    try:
        deadline = time.monotonic() + args.timeout
        while http_get(f"{url}/health") is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`mlflow ui` did not come up on {url} ("
                                   f"{'exited ' + str(server.returncode) if server.poll() is not None else 'timed out'}"
                                   f"; its output is in {console.log_path() or 'the terminal'})")
            time.sleep(0.5)
        print(f"MLflow UI: {url} (experiment {settings.stream!r}: a run per task with its R-matrix heatmap, recall "
              f"curve and loss curves under Artifacts > plots; registered model {settings.stream!r}). Ctrl-C stops it.",
              flush=True)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # its group: the server and the workers it started
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
