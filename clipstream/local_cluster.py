"""A Ray cluster of two nodes and an MLflow server on this machine: the cluster half of clipstream, run for real.

What Kubernetes runs (charts/clipstream, `clipstream k8s job`) is, underneath, a Ray head and worker nodes
started with `ray start`, an `mlflow server` reached over HTTP that proxies artifacts, and jobs submitted
through the Ray Jobs API. `LocalCluster` starts exactly those on loopback:

- a Ray head and a second Ray node (`ray start --block`, own ports and temp dirs, `--num-cpus 1` each, so a
  2-worker training job spans both), with token authentication (a token of its own, never ~/.ray's);
- `mlflow server` with a SQLite backend and `--serve-artifacts`: clients see only its URL, never the
  artifact directory;
- the environment the Helm chart gives its Ray pods (`Chart`: the ConfigMap's settings, the RayService
  containers' variables and Secrets), pointing at these, with Ray Train storage and the embedded Qdrant Edge
  index on a directory both nodes reach (the chart's Qdrant server cannot run here);
- the chart's RayService `serveConfigV2`, deployed with `serve deploy` (Serve's REST API, what KubeRay does
  with it), each node's Serve proxy on ports of its own.

Every process it starts leads a process group of its own; `stop` ends exactly those groups (Ray's agents
and workers included) and never touches another Ray on the machine.

`demo` (`clipstream demo --cluster`, `make cluster-demo`) runs the whole cluster path once: chained RayJobs
through the Jobs API, the chart's serveConfigV2 deployed, promotion, gRPC searches.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from clipstream import console
from clipstream.runtime import free_port

CHART = Path(__file__).resolve().parents[1] / "charts" / "clipstream"
# Training settings for nodes of one CPU: a worker holds half of it, Ray Data's read and preprocessing tasks
# a quarter each (at the default of one CPU they would never be scheduled next to a worker)
SMALL_NODES = ["train.data_cpus=0.25"]


def small_node_values() -> dict:
    """Chart values for nodes of one CPU and no GPU: an Encoder replica (half of one CPU, no GPU: the chart's default
    asks one) and Search (a quarter) fit on one; the gRPC port a free one (Service R-grpc's in Kubernetes, every
    proxy's here)."""
    return {"settings": {"grpc_port": free_port(), "serve_encoder_cpus": 0.5, "serve_encoder_gpus": 0,
                         "serve_search_cpus": 0.25}}


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


def tool(name: str) -> str:
    """A command-line tool: this interpreter's environment first (`make setup` puts helm there), then PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH: run `make setup`")
    return found


@dataclass
class Chart:
    """A release of charts/clipstream rendered by the real `helm template`, read the way Kubernetes reads it."""

    objects: list[dict]
    release: str = "clipstream"

    @classmethod
    def render(cls, values: dict | None = None, release: str = "clipstream") -> Chart:
        """`helm template RELEASE charts/clipstream -f VALUES` (a values file, as users keep theirs: `--set`
        would turn 0.5 into a string)."""
        if not CHART.is_dir():
            raise FileNotFoundError(f"{CHART}: the Helm chart is not there (run this from a clipstream checkout)")
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
            yaml.safe_dump(values or {}, file)
            file.flush()
            done = subprocess.run([tool("helm"), "template", release, str(CHART), "-f", file.name],
                                  capture_output=True, text=True, cwd=CHART, check=False)
        if done.returncode:
            raise RuntimeError(f"helm template failed ({done.returncode}): {done.stderr.strip()}")
        return cls([d for d in yaml.safe_load_all(done.stdout) if d], release)

    def find(self, kind: str, name: str) -> dict:
        (found,) = [d for d in self.objects if d["kind"] == kind and d["metadata"]["name"] == name]
        return found

    @property
    def service(self) -> dict:
        return self.find("RayService", f"{self.release}-serve")["spec"]

    @property
    def serve_config(self) -> dict:
        """The RayService's serveConfigV2: what KubeRay hands to Serve's REST API."""
        return yaml.safe_load(self.service["serveConfigV2"])

    def pod_env(self) -> dict[str, str]:
        """The environment of the RayService's Ray containers: `envFrom` ConfigMaps, then `env` (literal values,
        and Secret keys as the rendered Secrets hold them), as the kubelet composes it."""
        container = self.service["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                env.update(self.find("ConfigMap", source["configMapRef"]["name"])["data"])
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = str(var["value"])
            elif "secretKeyRef" in var.get("valueFrom", {}):
                ref = var["valueFrom"]["secretKeyRef"]
                secret = self.find("Secret", ref["name"])
                env[var["name"]] = (secret.get("stringData", {}).get(ref["key"])
                                    or base64.b64decode(secret["data"][ref["key"]]).decode())
        return env


@dataclass
class LocalCluster:
    """`with LocalCluster(root) as cluster:` a 2-node Ray cluster and an MLflow server under `root`."""

    root: Path
    nodes: int = 2
    cpus_per_node: int = 1
    pod_settings: dict = field(default_factory=dict)  # a release's pod environment (Chart.pod_env)
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
        # Serve's proxies: the head's HTTP port (gRPC's is the serve config's), every other node's own pair
        self.http_port = free_port()
        self.proxy_ports = {i: (free_port(), free_port()) for i in range(1, self.nodes)}

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

    def submit(self, rayjobs: list[dict]) -> list[str]:
        """Submit RayJobs as KubeRay does: each one's entrypoint through the Jobs API, its name the submission id."""
        client = self.jobs()
        return [client.submit_job(entrypoint=job["spec"]["entrypoint"], submission_id=job["metadata"]["name"])
                for job in rayjobs]

    def wait_for_jobs(self, job_ids: list[str], timeout_s: float = 1800, done=None) -> None:
        """Return once every job succeeded (calling `done(job_id)` as each ends); a job that failed raises with the
        end of its logs."""
        from ray.job_submission import JobStatus

        client, pending = self.jobs(), list(job_ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            for job in [j for j in pending if client.get_job_status(j).is_terminal()]:
                status = client.get_job_status(job)
                if status != JobStatus.SUCCEEDED:
                    raise RuntimeError(f"job {job}: {status.value}; the end of its logs:\n{client.get_job_logs(job)[-5000:]}")
                pending.remove(job)
                if done:
                    done(job)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"jobs {pending} still running after {timeout_s:g} s")
            time.sleep(2)

    def pod_env(self) -> dict[str, str]:
        """The environment of the cluster's pods: the release's settings pointed at this cluster's services."""
        env = {k: v for k, v in self.pod_settings.items() if k not in ("CLIPSTREAM_QDRANT_URL", "CLIPSTREAM_QDRANT_API_KEY")}
        env.update({"CLIPSTREAM_MLFLOW_TRACKING_URI": self.mlflow_uri, "CLIPSTREAM_RAY_ADDRESS": "auto",
                    "CLIPSTREAM_RUNS_DIR": str(self.shared / "runs"), "CLIPSTREAM_QDRANT_PATH": str(self.shared / "qdrant"),
                    "CLIPSTREAM_HOME": str(self.root / "pod-home")})
        return env

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 120.0) -> LocalCluster:
        for path in (self.shared / "runs", self.shared / "qdrant", self.root / "logs", self.root / "pod-home"):
            path.mkdir(parents=True, exist_ok=True)
        self.start_mlflow(wait_s=0)  # (waited for with the nodes)
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

    def deploy_serve(self, config: dict, timeout_s: float = 300.0) -> None:
        """`serve deploy` a serveConfigV2 (Serve's REST API, as KubeRay does), then wait until the head's gRPC
        proxy routes to the application. Its HTTP proxy listens on loopback only, on a port of this cluster's."""
        path = self.root / "serve-config.yaml"
        path.write_text(yaml.safe_dump({**config, "http_options": {"host": "127.0.0.1", "port": self.http_port}}))
        self._serve_cli("deploy", str(path))
        import grpc

        from clipstream.services.app import wait_routed

        def running() -> bool:
            apps = self.serve_applications()
            failed = [f"{name}: {app.get('message', '')}" for name, app in apps.items() if app["status"] == "DEPLOY_FAILED"]
            if failed:
                raise RuntimeError(f"serve deploy failed: {'; '.join(failed)}")
            return bool(apps) and all(app["status"] == "RUNNING" for app in apps.values())

        self._wait_for(running, timeout_s, "the Serve applications")
        wait_routed(grpc.insecure_channel(f"127.0.0.1:{config['grpc_options']['port']}"), timeout_s)

    def serve_applications(self) -> dict:
        """Serve's REST API view of the applications (status, deployments, replicas), {} before any deploy."""
        return (self.dashboard("/api/serve/applications/") or {}).get("applications") or {}

    def shutdown_serve(self) -> None:
        """`serve shutdown`: the applications, their replicas and the proxies go; the nodes stay."""
        self._serve_cli("shutdown", "--yes")

    def _serve_cli(self, *args: str) -> None:
        env = {**self.base_env, **self.auth_env}
        env.pop("RAY_ADDRESS", None)
        done = subprocess.run([tool("serve"), args[0], "--address", self.dashboard_url, *args[1:]],
                              capture_output=True, text=True, env=env, cwd=self.root, timeout=120, check=False)
        if done.returncode:
            raise RuntimeError(f"serve {args[0]} exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")

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

    def _node_env(self, index: int) -> dict[str, str]:
        # the entrypoint of a job runs in the head's environment: this interpreter's bin first on PATH.
        # Serve's proxies bind without SO_REUSEPORT, on ports of their own: pods have a network each, nodes on
        # one machine do not, and a port shared by reuse would take requests meant for another Ray's proxy.
        env = {**self.base_env, **self.auth_env, **self.pod_env(),
               "PATH": f"{Path(sys.executable).parent}:{self.base_env.get('PATH', '')}",
               "RAY_USAGE_STATS_ENABLED": "0", "SERVE_SOCKET_REUSE_PORT_ENABLED": "0"}
        if index in self.proxy_ports:
            env["RAY_SERVE_WORKER_PROXY_HTTP_PORT"], env["RAY_SERVE_WORKER_PROXY_GRPC_PORT"] = map(str, self.proxy_ports[index])
        env.pop("RAY_ADDRESS", None)
        return env

    def _start_node(self, head: bool, index: int = 0) -> None:
        ray = tool("ray")
        ports = ["--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
                 "--metrics-export-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
                 "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port())]
        common = ["start", "--block", "--num-cpus", str(self.cpus_per_node), "--node-ip-address", "127.0.0.1",
                  "--temp-dir", str(self.temp / f"n{index}"), "--disable-usage-stats", *ports]
        if head:
            command = [ray, *common, "--head", "--port", str(self.gcs_port), "--include-dashboard", "true",
                       "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                       "--ray-client-server-port", str(free_port())]
            self._spawn("ray-head", command, self._node_env(index))
            self._wait_for(lambda: self.dashboard("/api/version") is not None, 90, "the Ray head's dashboard")
        else:
            self._spawn(f"ray-node-{index}", [ray, *common, "--address", self.address], self._node_env(index))

    def stop_mlflow(self) -> None:
        """The MLflow server goes away (an outage of the registry); `start_mlflow` brings it back on the same port
        and store."""
        process = next(p for p in self.processes if p.name == "mlflow")
        process.stop()
        self.processes.remove(process)

    def start_mlflow(self, wait_s: float = 120.0) -> None:
        mlflow = tool("mlflow")
        store = self.root / "mlflow"
        store.mkdir(exist_ok=True)
        command = [mlflow, "server", "--host", "127.0.0.1", "--port", str(self.mlflow_port), "--workers", "1",
                   "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}", "--serve-artifacts",
                   "--artifacts-destination", str(store / "artifacts")]
        self._spawn("mlflow", command, dict(self.base_env))
        if wait_s:
            self._wait_for(lambda: http_get(f"{self.mlflow_uri}/health") is not None, wait_s, "the MLflow server")

    def _wait(self, timeout_s: float) -> None:
        self._wait_for(lambda: http_get(f"{self.mlflow_uri}/health") is not None, timeout_s, "the MLflow server")
        self._wait_for(lambda: self._alive_nodes() >= self.nodes, timeout_s, f"{self.nodes} Ray nodes")

    def dashboard(self, path: str):
        """The dashboard's JSON answer at `path`, None while it does not answer."""
        body = http_get(self.dashboard_url + path, {"Authorization": f"Bearer {self.token}"})
        return None if body is None else json.loads(body)

    def _alive_nodes(self) -> int:
        answer = self.dashboard("/nodes?view=summary") or {"data": {"summary": []}}
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


def http_get(url: str, headers: dict | None = None) -> bytes | None:
    """The body of a 200 answer to GET `url`; None while nothing (or an error) answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as response:
            return response.read() if response.status == 200 else None
    except Exception:
        return None


def rayjobs(*args: str, overrides=(), env: dict | None = None, cwd: Path | None = None) -> list[dict]:
    """The RayJobs `clipstream k8s ARGS --gpus-per-worker 0 --set ...` prints (CPU workers), as a user pipes them to
    kubectl. `cwd`: where it runs (a thread must not rely on the process's working directory, which others may change)."""
    command = [tool("clipstream"), "k8s", *args, "--gpus-per-worker", "0"]
    done = subprocess.run(command + [a for item in overrides for a in ("--set", item)], capture_output=True, text=True,
                          env=env, cwd=cwd, check=False)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(done.args)}` exited {done.returncode}: {done.stderr[-2000:]}")
    # (the RayJobs; the training pods' NetworkPolicy printed with them has no meaning here)
    return [d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "RayJob"]


def demo(out: Path, method: str = "finetune", tasks: int = 2, seed: int = 0, overrides=(), zero_shot=()) -> None:
    """The cluster path once, on this machine: a stream trained by RayJobs through the Jobs API on two nodes,
    registered on the MLflow server, served from the chart's RayService config, promoted and searched. The
    synthetic held-out task and `zero_shot` are evaluated with every version."""
    from clipstream.cli.render import format_hits
    from clipstream.services.client import Client
    from clipstream.training.data.synth import held_out_task, synthesize
    from clipstream.training.data.task import Task

    chart = Chart.render(small_node_values())
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLIPSTREAM_")}
    with LocalCluster(Path(out).absolute() / "cluster", pod_settings=chart.pod_env(), base_env=base) as cluster:
        print(f"== a Ray cluster of {cluster.nodes} nodes (`ray start`, dashboard {cluster.dashboard_url}) and "
              f"`mlflow server` at {cluster.mlflow_uri}, under {cluster.root}")
        dirs = synthesize(cluster.shared / "data", tasks=tasks, seed=seed, digits=False, progress=False)
        held_out = [arg for task in (*zero_shot, held_out_task(cluster.shared / "data"))
                    for arg in ("--zero-shot", str(task))]
        # (submitted at once: the Jobs API knows no suspended job, so each waits for its parent's version itself)
        jobs = rayjobs("stream", "--tasks", *map(str, dirs), "--name", "demo", "--method", method, *held_out,
                       "--wait-parent", "3600", overrides=[*SMALL_NODES, *overrides], env=base, cwd=cluster.root)
        print(f"\n== training {len(dirs)} tasks: the RayJobs of `clipstream k8s stream` ({method}), submitted through "
              "the Ray Jobs API at once; each waits for its parent's version")
        with console.bar(total=len(jobs), unit="job") as bar:
            cluster.wait_for_jobs(cluster.submit(jobs), done=lambda job: bar.update())
        last = str(len(dirs))
        print("\n== serving: the chart's RayService serveConfigV2, `serve deploy`ed")
        cluster.deploy_serve(chart.serve_config)
        env = {**base, **cluster.pod_env()}
        print(f"\n== `clipstream promote {last} --force` against the cluster (a gate that fails is shown, not enforced)")
        promoted = subprocess.run([tool("clipstream"), "promote", last, "--force"], env=env, cwd=cluster.root,
                                  capture_output=True, text=True, check=False)
        if promoted.returncode:  # searching an index nothing was promoted into would only show empty answers
            raise RuntimeError(f"clipstream promote {last} exited {promoted.returncode}: {promoted.stderr.strip()[-2000:]}")
        print(promoted.stdout.strip())
        first = Task.load(dirs[0]).check("test").rows[0]
        port = chart.serve_config["grpc_options"]["port"]
        with Client(f"127.0.0.1:{port}", api_key=chart.pod_env().get("CLIPSTREAM_API_KEY")) as client:
            for task in (dirs[0].name, None):
                print()
                print(format_hits(client.search(text=first["caption"], task=task or "", k=5), first["caption"], task))
        cluster.shutdown_serve()
        print(f"\nstopping the cluster; its files stay under {cluster.root}")
