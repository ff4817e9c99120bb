"""RayJob manifests for training on Kubernetes: `clipstream k8s job` (one task) and `clipstream k8s stream`
(one job per task, chained through MLflow aliases), for `kubectl apply -f -`.

They run in a release of the Helm chart (charts/clipstream) and use what it installs, by the names it gives
them: the image, the `RELEASE-settings` ConfigMap (Settings as `CLIPSTREAM_*`), the `RELEASE-qdrant` and
`RELEASE-api` Secrets, the service account, the shared Ray Train storage `RELEASE-runs` and the chart's
security settings (tests/k8s/test_rayjob.py renders both and compares).

A stream's jobs can be applied at once: job k registers its version with alias `NAME-k`, and job k+1 names
`@NAME-k` as its parent. Jobs 2..n are applied suspended (KubeRay's `spec.suspend`: no Ray cluster, no GPU is
taken); the stream controller (`clipstream controller`, clipstream/controller.py) resumes each once its parent's
version is registered.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Optional, Sequence

import yaml

RAY_VERSION = "2.60.0"  # the Ray of the image (k8s/images/Dockerfile); tests/k8s check they agree
REPOSITORY = "ghcr.io/clipstream/clipstream"
RUNS_MOUNT = "/mnt/clipstream/runs"
SECRET_ENV = {"CLIPSTREAM_QDRANT_API_KEY": ("qdrant", "api-key"), "CLIPSTREAM_API_KEY": ("api", "api-key")}


def package_version() -> str:
    try:
        return version("clipstream")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0"


def default_image(variant: str = "gpu") -> str:
    return f"{REPOSITORY}:{package_version()}-{variant}"


@dataclass
class Release:
    """Where the jobs run: the chart's release (its objects' name prefix), its namespace and image."""

    name: str = "clipstream"
    namespace: Optional[str] = None
    image: str = field(default_factory=default_image)

    def labels(self, component: str) -> dict:
        return {"app.kubernetes.io/name": "clipstream", "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "clipstream",
                "clipstream.io/qdrant-client": "true", "clipstream.io/mlflow-client": "true"}


@dataclass
class Resources:
    """One Ray Train worker pod (one worker each) and the head that runs the job's driver."""

    workers: int = 2
    gpus_per_worker: float = 1
    worker_cpus: int = 8
    worker_memory: str = "32Gi"
    head_cpus: int = 2
    head_memory: str = "8Gi"


def dns_name(text: str, limit: int = 40) -> str:
    """A DNS-1123 label from a task URI or name (KubeRay derives pod names from the job's, so keep it short)."""
    base = re.sub(r"[^a-z0-9-]+", "-", text.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")
    if not base:
        raise ValueError(f"{text!r}: cannot make a Kubernetes name from it; pass --name")
    return base[:limit].rstrip("-")


VOLUMES = {"runs": None, "tmp": {"emptyDir": {}}, "cache": {"emptyDir": {}}, "dshm": {"emptyDir": {"medium": "Memory"}}}
MOUNTS = {"runs": RUNS_MOUNT, "tmp": "/tmp", "cache": "/home/ray/.cache", "dshm": "/dev/shm"}


def _pod(release: Release, name: str, cpus, memory: str, gpus: float = 0, volumes=tuple(VOLUMES),
         clients: bool = True) -> dict:
    """A pod template as the chart writes Ray pods: Settings from the ConfigMap, keys from the Secrets,
    non-root with a read-only root filesystem (writable /tmp, ~/.cache, /dev/shm), requests = limits."""
    limits = {"cpu": str(cpus), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = f"{gpus:g}"
    container = {
        "name": name, "image": release.image, "imagePullPolicy": "IfNotPresent",
        # object-store credentials for s3:// tasks and storage, when the release has them (the chart's name)
        "envFrom": [{"configMapRef": {"name": f"{release.name}-settings"}},
                    {"secretRef": {"name": f"{release.name}-object-store", "optional": True}}],
        "env": [{"name": env, "valueFrom": {"secretKeyRef": {"name": f"{release.name}-{secret}", "key": key}}}
                for env, (secret, key) in SECRET_ENV.items()],
        "resources": {"requests": {"cpu": str(cpus), "memory": memory}, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": v, "mountPath": MOUNTS[v]} for v in volumes],
    }
    labels = release.labels("train")
    if not clients:  # only pods that need Qdrant and MLflow carry the labels their NetworkPolicies admit
        labels = {k: v for k, v in labels.items() if not k.startswith("clipstream.io/")}
    return {
        "metadata": {"labels": labels},
        "spec": {
            "serviceAccountName": release.name,  # the chart's ServiceAccount is named after the release
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": [{"name": v, **(VOLUMES[v] or {"persistentVolumeClaim": {"claimName": f"{release.name}-runs"}})}
                        for v in volumes],
        },
    }


def train_command(task: str, method: str, resources: Resources, parent: Optional[str] = None,
                  wait_parent_s: float = 0, aliases: Sequence[str] = (), overrides: Sequence[str] = (),
                  zero_shot: Sequence[str] = ()) -> list[str]:
    command = ["clipstream", "train", "--task", task, "--method", method, "--workers", str(resources.workers),
               "--gpus-per-worker", f"{resources.gpus_per_worker:g}"]
    if parent:
        command += ["--parent", parent] + (["--wait-parent", f"{wait_parent_s:g}"] if wait_parent_s else [])
    for alias in aliases:
        command += ["--alias", alias]
    for override in overrides:
        command += ["--set", override]
    for held_out in zero_shot:
        command += ["--zero-shot", held_out]
    return command


def rayjob(name: str, command: list[str], release: Release, resources: Resources, *,
           deadline_s: int = 24 * 3600, ttl_s: int = 24 * 3600, backoff_limit: int = 0) -> dict:
    """One training task as a RayJob: its own Ray cluster (a CPU head for the driver, one worker pod per Ray
    Train worker), deleted when the job ends; `ttl_s` keeps the finished RayJob for inspection."""
    head = _pod(release, "ray-head", resources.head_cpus, resources.head_memory)
    head["spec"]["containers"][0]["ports"] = [{"name": "gcs", "containerPort": 6379},
                                              {"name": "dashboard", "containerPort": 8265}]
    worker = _pod(release, "ray-worker", resources.worker_cpus, resources.worker_memory, resources.gpus_per_worker)
    submitter = _pod(release, "ray-job-submitter", 1, "1Gi", volumes=("tmp",), clients=False)
    submitter["spec"]["restartPolicy"] = "Never"
    metadata = {"name": name, "labels": release.labels("train")}
    if release.namespace:
        metadata["namespace"] = release.namespace
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": metadata,
        "spec": {
            "entrypoint": shlex.join(command),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": ttl_s,
            "activeDeadlineSeconds": deadline_s,
            # Ray Train already restarts failed workers from the last checkpoint (train.max_failures); a
            # resubmission resumes from the last epoch checkpoint (the run is named by what it trains, under the
            # shared runs_dir), or is refused once the task registered its version.
            "backoffLimit": backoff_limit,
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": submitter,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},  # the driver only; training on workers
                                  "template": head},
                "workerGroupSpecs": [{"groupName": "train", "replicas": resources.workers,
                                      "minReplicas": resources.workers, "maxReplicas": resources.workers,
                                      "rayStartParams": {}, "template": worker}],
            },
        },
    }


def job(task: str, method: str, release: Release, resources: Resources, *, parent: Optional[str] = None,
        overrides: Sequence[str] = (), name: Optional[str] = None, zero_shot: Sequence[str] = ()) -> dict:
    command = train_command(task, method, resources, parent, overrides=overrides, zero_shot=zero_shot)
    return rayjob(f"{release.name}-train-{name or dns_name(task)}", command, release, resources)


def stream(tasks: Sequence[str], method: str, release: Release, resources: Resources, *, name: str,
           parent: Optional[str] = None, overrides: Sequence[str] = (), wait_parent_s: float = 0,
           zero_shot: Sequence[str] = ()) -> list[dict]:
    """One RayJob per task; job k sets alias NAME-k on its version, job k+1 trains on it (`@NAME-k`: an alias of
    the stream the pods' Settings name). Jobs 2..n are suspended until their parent is registered (the controller
    resumes them: their annotation names the parent), so no job holds a Ray cluster while it waits; `wait_parent_s`
    lets a job that is started anyway (the Ray Jobs API knows no suspend) wait that long for its parent. The
    held-out `zero_shot` tasks are given to the first job; the later versions inherit them from their parent."""
    name = dns_name(name, limit=30)
    jobs = []
    for k, task in enumerate(tasks, start=1):
        previous = f"@{name}-{k - 1}" if k > 1 else parent
        command = train_command(task, method, resources, previous, wait_parent_s if k > 1 else 0,
                                aliases=[f"{name}-{k}"], overrides=overrides, zero_shot=zero_shot if k == 1 else ())
        manifest = rayjob(f"{release.name}-train-{name}-{k}", command, release, resources,
                          deadline_s=int(wait_parent_s) * (k > 1) + 24 * 3600)
        manifest["metadata"]["labels"].update({"clipstream.io/stream": name, "clipstream.io/step": str(k)})
        if k > 1:
            manifest["metadata"]["annotations"] = {"clipstream.io/parent": previous}
            manifest["spec"]["suspend"] = True
        jobs.append(manifest)
    return jobs


def dump(manifests: Sequence[dict]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False, width=1000)
