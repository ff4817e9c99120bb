"""A Ray cluster of two nodes and an MLflow server on this machine: the cluster half of clipstream, run for real.

What Kubernetes runs (charts/clipstream, `clipstream k8s job`) is, underneath, a Ray head and worker nodes
started with `ray start`, an `mlflow server` reached over HTTP that proxies artifacts, and jobs submitted
through the Ray Jobs API. `LocalCluster` starts exactly those on loopback:

- a Ray head and a second Ray node (`ray start --block`, own ports and temp dirs, `--num-cpus 1` each, so a
  2-worker training job spans both), with token authentication (a token of its own, never ~/.ray's);
- `mlflow server` with a SQLite backend and `--serve-artifacts`: clients see only its URL, never the
  artifact directory;
- the settings a release's ConfigMap gives its pods (`pod_env`), pointing at these, with Ray Train storage
  and the embedded Qdrant Edge index on a directory both nodes reach (the chart's Qdrant server cannot run
  here).

Every process it starts leads a process group of its own; `stop` ends exactly those groups (Ray's agents
and workers included) and never touches another Ray on the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        """Whether any process of its group is left (the leader may be gone while its children run on)."""
        try:
            os.killpg(self.popen.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:  # the group id was reused by someone else's processes: ours are gone
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the group (`ray start --block` then stops the node's processes itself), SIGKILL to
        what is left after `timeout_s`."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.popen.poll()
                if not self.alive():
                    return
                time.sleep(0.2)
        self.popen.poll()


@dataclass
class LocalCluster:
    """`with LocalCluster(root) as cluster:` a 2-node Ray cluster and an MLflow server under `root`."""

    root: Path
    nodes: int = 2
    cpus_per_node: int = 1
    pod_settings: dict = field(default_factory=dict)  # CLIPSTREAM_* as a release's ConfigMap has them
    # the environment its processes start from, taken when the cluster is made (not when a node starts, which
    # may be in another thread while the caller's environment changes)
    base_env: dict = field(default_factory=lambda: dict(os.environ))
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self):
        self.root = Path(self.root).absolute()
        self.shared = self.root / "shared"  # what every node mounts (a PVC or object storage in Kubernetes)
        # Ray's sockets live in its temp dir and a Unix socket path has ~100 characters: keep it short
        self.temp = Path(tempfile.mkdtemp(prefix="cs-ray-"))
        self.token = secrets.token_hex(32)
        self.gcs_port, self.dashboard_port, self.mlflow_port = free_port(), free_port(), free_port()

    # -- what clients use ------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://127.0.0.1:{self.mlflow_port}"

    @property
    def auth_env(self) -> dict[str, str]:
        """What a Ray client of this cluster (a node, a driver, the Jobs client) must have in its environment."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def jobs(self):
        """A Ray Jobs API client of this cluster (what a RayJob's submitter pod uses), with its token."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url, headers={"Authorization": f"Bearer {self.token}"})

    def pod_env(self) -> dict[str, str]:
        """The environment of the cluster's pods: the release's settings pointed at this cluster's services."""
        env = {k: v for k, v in self.pod_settings.items() if k != "CLIPSTREAM_QDRANT_URL"}
        env.update({"CLIPSTREAM_MLFLOW_TRACKING_URI": self.mlflow_uri, "CLIPSTREAM_RAY_ADDRESS": "auto",
                    "CLIPSTREAM_RUNS_DIR": str(self.shared / "runs"), "CLIPSTREAM_QDRANT_PATH": str(self.shared / "qdrant"),
                    "CLIPSTREAM_HOME": str(self.root / "pod-home")})
        return env

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> "LocalCluster":
        for path in (self.shared / "runs", self.shared / "qdrant", self.root / "logs", self.root / "pod-home"):
            path.mkdir(parents=True, exist_ok=True)
        self._start_mlflow()
        self._start_node(head=True)
        for i in range(1, self.nodes):
            self._start_node(head=False, index=i)
        self._wait(timeout_s)
        return self

    def stop(self) -> None:
        """Stop every process this cluster started, newest first (nodes before the head), by process group."""
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()
        shutil.rmtree(self.temp, ignore_errors=True)

    def kill_node(self, index: int) -> None:
        """Node `index` dies as a lost machine would: SIGKILL to its whole group, raylet and workers alike."""
        process = next(p for p in self.processes if p.name == f"ray-node-{index}")
        os.killpg(process.popen.pid, signal.SIGKILL)
        process.stop(timeout_s=10)

    # -- the parts ---------------------------------------------------------------------------------------
    def _spawn(self, name: str, command: list[str], env: dict) -> Process:
        log = self.root / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=self.root, start_new_session=True)
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def _node_env(self) -> dict[str, str]:
        # the entrypoint of a job runs in the head's environment: this interpreter's bin first on PATH
        env = {**self.base_env, **self.auth_env, **self.pod_env(),
               "PATH": f"{Path(sys.executable).parent}:{self.base_env.get('PATH', '')}",
               "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        return env

    def _start_node(self, head: bool, index: int = 0) -> None:
        ray = str(Path(sys.executable).parent / "ray")
        ports = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                 "--metrics-export-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                 "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
        common = ["start", "--block", "--num-cpus", str(self.cpus_per_node), "--node-ip-address", "127.0.0.1",
                  "--temp-dir", str(self.temp / f"n{index}"), "--disable-usage-stats", *ports]
        if head:
            command = [ray, *common, "--head", "--port", str(self.gcs_port), "--include-dashboard", "true",
                       "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                       "--ray-client-server-port", str(free_port())]
            self._spawn("ray-head", command, self._node_env())
            self._wait_for(lambda: self._dashboard("/api/version") is not None, 90, "the Ray head's dashboard")
        else:
            self._spawn(f"ray-node-{index}", [ray, *common, "--address", self.address], self._node_env())

    def _start_mlflow(self) -> None:
        mlflow = str(Path(sys.executable).parent / "mlflow")
        store = self.root / "mlflow"
        store.mkdir(exist_ok=True)
        command = [mlflow, "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port), "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--serve-artifacts",
                   "--artifacts-destination", str(store / "artifacts")]
        self._spawn("mlflow", command, dict(self.base_env))

    def _wait(self, timeout_s: float) -> None:
        self._wait_for(lambda: _http_ok(f"{self.mlflow_uri}/health"), timeout_s, "the MLflow server")
        self._wait_for(lambda: self._alive_nodes() >= self.nodes, timeout_s, f"{self.nodes} Ray nodes")

    def _dashboard(self, path: str):
        """The dashboard's JSON answer at `path`, None while it does not answer."""
        request = urllib.request.Request(self.dashboard_url + path, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return json.load(response)
        except Exception:
            return None

    def _alive_nodes(self) -> int:
        answer = self._dashboard("/nodes?view=summary") or {"data": {"summary": []}}
        return sum(1 for node in answer["data"]["summary"] if node.get("raylet", {}).get("state") == "ALIVE")

    def _wait_for(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p for p in self.processes if p.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                name = dead[0].name if dead else self.processes[-1].name
                log = (self.root / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{what} did not come up ({'exited' if dead else f'{timeout_s:g} s'}); "
                                   f"the end of {name}'s log:\n{log}")
            time.sleep(0.5)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except Exception:
        return False
