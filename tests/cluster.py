"""The local cluster (clipstream.local_cluster) and the training jobs submitted to it, started by the
`cluster_session` fixture for the module that uses it and stopped after it (tests/conftest.py). It does not start
at collection, as the method streams do, nor beside them: two Ray nodes, an MLflow server and two DeepSpeed jobs next
to other work oversubscribe 2 cores so far that Serve's proxies miss their 60 s start-up deadline (seen in CI).

The jobs are the entrypoints of the RayJobs that `clipstream k8s stream` renders for two tasks, submitted at
once through the Ray Jobs API (as `kubectl apply` of the stream starts them: the second waits for the first's
version), in the environment the Helm chart gives its Ray pods; the chart's RayService (same values) is what
the serving test deploys."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from clipstream.local_cluster import SMALL_NODES, Chart, LocalCluster, rayjobs, small_node_values

JOB_SETTINGS = ["train.epochs=1", "train.micro_batch=8", "train.log_every=1", "train.max_failures=0",
                "train.warmup_steps=1", *SMALL_NODES]


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
        if self._thread.ident is None:  # once
            self._thread.start()
        return self

    def _start(self) -> None:
        from clipstream.training.data.synth import synthesize

        try:
            values = small_node_values()
            values["settings"]["serve_replicas"] = 2  # (test_local_cluster kills one under load)
            self.chart = Chart.render(values)
            self.cluster = LocalCluster(self.root / "cluster", pod_settings=self.chart.pod_env(), base_env=self.env)
            self.cluster.start()
            self.tasks = synthesize(self.cluster.shared / "data", tasks=2, seed=3, train_pairs=256, test_per_task=24,
                                    digits=False, progress=False)
            self.manifests = rayjobs("stream", "--tasks", *map(str, self.tasks), "--name", "s", "--wait-parent", "900",
                                     overrides=JOB_SETTINGS, env=self.env, cwd=self.root)
            self.job_ids = self.cluster.submit(self.manifests)
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
        """The job ids once every job succeeded; an error with the end of its logs for one that did not."""
        self.ready().wait_for_jobs(self.job_ids, timeout_s)
        return self.job_ids

    def stop(self) -> list[str]:
        """Stop the cluster and remove its files; returns what was still running of it afterwards (nothing, or a
        bug)."""
        if self._thread.ident is not None:
            self._thread.join(120)
        left = []
        if self.cluster is not None:
            started = list(self.cluster.processes)
            self.cluster.stop()
            left = [p.name for p in started if p.alive()]
        shutil.rmtree(self.root, ignore_errors=True)
        return left
