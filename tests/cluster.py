"""The session's local cluster (clipstream.local_cluster) and the training jobs submitted to it, started in a
thread right after collection when a collected test carries the `cluster` marker: the cluster's processes and
its jobs then run while the other tests do, and the cluster tests run last (tests/conftest.py).

The jobs are the entrypoints of the RayJobs that `clipstream k8s stream` renders for two tasks, submitted at
once through the Ray Jobs API (as `kubectl apply` of the stream starts them: the second waits for the first's
version), in the environment the Helm chart gives its Ray pods; the chart's RayService (same values) is what
the serving test deploys."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from clipstream.local_cluster import Chart, LocalCluster, free_port

# each node has one CPU, half of it a training worker's: Ray Data's tasks get a quarter each
JOB_SETTINGS = ["train.epochs=1", "train.micro_batch=8", "train.log_every=1", "train.max_failures=0",
                "train.warmup_steps=1", "train.data_cpus=0.25"]


def chart_values() -> dict:
    """The release's values: one CPU per node holds an Encoder (half) and Search (a quarter) replica; the gRPC
    port is a free one (Service R-grpc's port in Kubernetes, the proxies' port here)."""
    return {"settings": {"grpc_port": free_port(), "serve_encoder_cpus": 0.5, "serve_search_cpus": 0.25}}


def rayjobs(*args: str, settings=JOB_SETTINGS, env: dict | None = None) -> list[dict]:
    """What `clipstream k8s ARGS` prints (CPU workers), as a user pipes it to kubectl."""
    command = [str(Path(sys.executable).parent / "clipstream"), "k8s", *args, "--gpus-per-worker", "0"]
    done = subprocess.run(command + [a for item in settings for a in ("--set", item)], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(done.args)}` exited {done.returncode}: {done.stderr[-2000:]}")
    return list(yaml.safe_load_all(done.stdout))


class ClusterSession:
    """`start()` returns at once; `trained()` waits for the cluster and its jobs; `stop()` ends everything."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="clipstream-cluster-"))
        self.cluster: LocalCluster | None = None
        self.chart: Chart | None = None
        self.tasks: list[Path] = []
        self.manifests: list[dict] = []
        self.job_ids: list[str] = []
        self.error: BaseException | None = None
        # the tests change the environment while the thread starts the cluster: it uses the session's
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CLIPSTREAM_")}
        self._thread = threading.Thread(target=self._start, name="local-cluster", daemon=True)

    def start(self) -> ClusterSession:
        self._thread.start()
        return self

    def _start(self) -> None:
        from clipstream.training.data.synth import synthesize

        try:
            self.chart = Chart.render(chart_values())
            self.cluster = LocalCluster(self.root / "cluster", pod_settings=self.chart.pod_env(), base_env=self.env)
            self.cluster.start()
            self.tasks = synthesize(self.cluster.shared / "data", tasks=2, seed=3, train_pairs=256, test_per_task=24,
                                    digits=False, progress=False)
            self.manifests = rayjobs("stream", "--tasks", *map(str, self.tasks), "--name", "s", "--wait-parent", "900",
                                     env=self.env)
            client = self.cluster.jobs()
            self.job_ids = [client.submit_job(entrypoint=m["spec"]["entrypoint"], submission_id=m["metadata"]["name"])
                            for m in self.manifests]
        except BaseException as exc:  # noqa: BLE001  (reported by `ready`, in the test that needs the cluster)
            self.error = exc

    def ready(self, timeout_s: float = 300) -> LocalCluster:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the local cluster did not start in {timeout_s:g} s")
        if self.error:
            raise RuntimeError(f"the local cluster did not start: {self.error}") from self.error
        return self.cluster

    def trained(self, timeout_s: float = 1200) -> list[str]:
        """The job ids once every job ended; an error with the end of its logs for a job that did not succeed."""
        from ray.job_submission import JobStatus

        client = self.ready().jobs()
        deadline = time.monotonic() + timeout_s
        while not all(client.get_job_status(i).is_terminal() for i in self.job_ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs {self.job_ids} still running after {timeout_s:g} s")
            time.sleep(2)
        for i in self.job_ids:
            if client.get_job_status(i) != JobStatus.SUCCEEDED:
                raise RuntimeError(f"job {i}: {client.get_job_status(i)}\n{client.get_job_logs(i)[-5000:]}")
        return self.job_ids

    def stop(self) -> list[str]:
        """Stop the cluster and remove its files; returns what was still running of it afterwards (nothing, or a
        bug)."""
        self._thread.join(120)
        left = []
        if self.cluster is not None:
            started = list(self.cluster.processes)
            self.cluster.stop()
            left = [p.name for p in started if p.alive()]
        shutil.rmtree(self.root, ignore_errors=True)
        return left
