"""RayJob manifests for training on Kubernetes: `clipstream k8s job` (one task) and `clipstream k8s stream`
(one job per task, chained through MLflow aliases), for `kubectl apply -f -`.

They run in a release of the Helm chart (charts/clipstream) and use what it installs, by the names it gives
them: the image, the `RELEASE-settings` ConfigMap (Settings as `CLIPSTREAM_*`), the `RELEASE-qdrant` and
`RELEASE-api` Secrets, the service account, the shared Ray Train storage `RELEASE-runs` (unless runs_dir is an
object-store URI) and the chart's security settings (tests/k8s/test_rayjob.py renders both and compares).

Each RayJob's cluster (head and GPU workers) is deleted as soon as its job ends, succeeded or failed, through
KubeRay's `deletionStrategy.deletionRules` (feature gate RayJobDeletionPolicy, on by default since KubeRay
1.6); the RayJob itself (its status, its submitter's logs) is kept `keep_s` longer for inspection. KubeRay's
`ttlSecondsAfterFinished` would not do that: it delays the deletion of the whole cluster, GPUs included.

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
from pathlib import Path
from typing import Optional, Sequence

import yaml

from clipstream.settings import DISTRIBUTION, is_uri

RAY_VERSION = "2.60.0"  # the Ray of the image (k8s/images/Dockerfile); tests/k8s check they agree
REPOSITORY = "ghcr.io/clipstream/clipstream"
DASHBOARD_PORT = 8265  # Ray's dashboard and Jobs API on the head
RUNS_MOUNT = "/mnt/clipstream/runs"  # where the chart mounts the runs PVC (its ConfigMap's CLIPSTREAM_RUNS_DIR)
SECRET_ENV = {"CLIPSTREAM_QDRANT_API_KEY": ("qdrant", "api-key"), "CLIPSTREAM_API_KEY": ("api", "api-key")}
GPU = "nvidia.com/gpu"
# GPU operators taint GPU nodes with the resource's name, so that only pods asking for GPUs land there
GPU_TOLERATION = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # a source tree that was never installed
        return "0.0.0"


def default_image(variant: str = "gpu") -> str:
    return f"{REPOSITORY}:{package_version()}-{variant}"


# an image reference that names its version: repository[:tag][@sha256:digest], with a tag or a digest or both
_IMAGE = re.compile(r"^(?P<repo>[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?::[0-9]+)?(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*)"
                    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


def check_image(image: str) -> str:
    match = _IMAGE.match(image)
    if not match or not (match["tag"] or match["digest"]):
        raise ValueError(f"--image {image!r}: expected REPOSITORY:TAG or REPOSITORY@sha256:DIGEST (the release's "
                         "image: k8s/images/push.sh prints it)")
    return image


def release_image(values_files: Sequence[str | Path], variant: Optional[str] = None) -> str:
    """The image a release of the chart runs, read from the values files it was installed with (merged in order,
    as `helm -f`): what the chart's `clipstream.image` helper makes of them, repository:TAG where an empty tag is
    <appVersion>-<variant> (appVersion is this package's version); `variant` where the files set none."""
    image: dict = {}
    for path in values_files:
        try:
            values = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise FileNotFoundError(f"--release-values {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"--release-values {path}: not YAML ({' '.join(str(exc).split())})") from None
        if not isinstance(values, dict) or not isinstance(values.get("image", {}), dict):
            raise ValueError(f"--release-values {path}: expected the chart's values (a mapping; image: a mapping)")
        image.update(values.get("image") or {})
    variant = image.get("variant") or variant or "gpu"
    return check_image(f"{image.get('repository') or REPOSITORY}:{image.get('tag') or f'{package_version()}-{variant}'}")


@dataclass
class Extras:
    """What a user adds to every job: environment variables of the containers that run clipstream, and labels
    and annotations of the RayJob and its pods (e.g. a queue's label for Kueue)."""

    env: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    annotations: dict = field(default_factory=dict)


@dataclass
class Release:
    """Where the jobs run: the chart's release (its objects' name prefix), its namespace and image, and its Ray
    Train storage (`runs_dir`: a folder on the chart's runs PVC, or an object-store URI that every pod reaches, in
    which case no volume is mounted)."""

    name: str = "clipstream"
    namespace: Optional[str] = None
    image: str = field(default_factory=default_image)
    runs_dir: str = RUNS_MOUNT  # (runs_dir() checks a user's)
    ray_auth: bool = True  # Ray's token authentication (KubeRay authOptions), as the chart's RayService
    extras: Extras = field(default_factory=Extras)

    def labels(self, component: str) -> dict:
        return {"app.kubernetes.io/name": "clipstream", "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "clipstream",
                "clipstream.io/qdrant-client": "true", "clipstream.io/mlflow-client": "true"}


@dataclass
class Resources:
    """One Ray Train worker pod (one worker each) and the head that runs the job's driver; where the workers may
    be scheduled (a GPU pool's labels, taints and priority)."""

    workers: int = 2
    gpus_per_worker: float = 1
    worker_cpus: int = 8
    worker_memory: str = "32Gi"
    head_cpus: int = 2
    head_memory: str = "8Gi"
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)  # GPU workers also tolerate GPU_TOLERATION's taint
    affinity: dict = field(default_factory=dict)
    priority_class: Optional[str] = None  # every pod of the job: a preempted head ends the job as well

    def worker_placement(self) -> dict:
        tolerations = list(self.tolerations)
        if self.gpus_per_worker and not any(t.get("key") == GPU for t in tolerations):
            tolerations.append(dict(GPU_TOLERATION))
        placement = {"nodeSelector": dict(self.node_selector), "tolerations": tolerations,
                     "affinity": dict(self.affinity)}
        return {key: value for key, value in placement.items() if value}


def dns_name(text: str, limit: int = 40) -> str:
    """A DNS-1123 label from a task URI or name (KubeRay derives pod names from the job's, so keep it short)."""
    base = re.sub(r"[^a-z0-9-]+", "-", text.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")
    if not base:
        raise ValueError(f"{text!r}: cannot make a Kubernetes name from it; pass --name")
    return base[:limit].rstrip("-")


# Kubernetes' own rules for names: a label's or an annotation's key (an optional DNS prefix and a name), a label's
# value, an environment variable's name, a DNS subdomain (priority classes)
_NAME = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"^(?:[a-z0-9](?:[-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}$")
_LABEL_VALUE = re.compile(rf"^(?:{_NAME})?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SUBDOMAIN = re.compile(r"^[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?$")


def key_values(pairs: Sequence[str], flag: str, kind: str = "label") -> dict:
    """`K=V` pairs as a dict, each checked as a Kubernetes `kind` (label, annotation or env) would be."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        good_key = _ENV_NAME.match(key) if kind == "env" else _KEY.match(key)
        if not sep or not good_key:
            what = ("a variable name (letters, digits, '_', '-', '.'; no digit first)" if kind == "env"
                    else f"a Kubernetes {kind} key ([DNS-prefix/]name)")
            raise ValueError(f"{flag} {pair!r}: expected KEY=VALUE, KEY {what}")
        if kind == "label" and not _LABEL_VALUE.match(value):
            raise ValueError(f"{flag} {pair!r}: a label value is at most 63 letters, digits, '-', '_' or '.', "
                             "starting and ending with a letter or digit")
        out[key] = value
    return out


def extras(env: Sequence[str] = (), labels: Sequence[str] = (), annotations: Sequence[str] = ()) -> Extras:
    """--env, --label and --annotation values; what clipstream itself sets is refused (its labels select the pods
    for the NetworkPolicies and the stream's steps, its variables are the release's keys and storage)."""
    out = Extras(key_values(env, "--env", "env"), key_values(labels, "--label"),
                 key_values(annotations, "--annotation", "annotation"))
    for key in out.env:
        if key == "CLIPSTREAM_RUNS_DIR" or key in SECRET_ENV:
            source = "--runs-dir" if key == "CLIPSTREAM_RUNS_DIR" else "the release's Secret"
            raise ValueError(f"--env {key}: clipstream sets it (from {source}): leave it out")
    for key in out.labels:
        if key.startswith(("clipstream.io/", "app.kubernetes.io/")):
            raise ValueError(f"--label {key}: clipstream sets the clipstream.io/ and app.kubernetes.io/ labels")
    return out


def toleration(text: str) -> dict:
    """`KEY[=VALUE]:EFFECT` (or `KEY[=VALUE]` for every effect) as a toleration: Equal with a value, else Exists."""
    spec, _, effect = text.rpartition(":") if ":" in text else (text, "", "")
    key, sep, value = spec.partition("=")
    if not _KEY.match(key) or (effect and effect not in EFFECTS) or (sep and not _LABEL_VALUE.match(value)):
        raise ValueError(f"--toleration {text!r}: expected KEY[=VALUE][:EFFECT], EFFECT one of {', '.join(EFFECTS)}")
    out = {"key": key, "operator": "Equal", "value": value} if sep else {"key": key, "operator": "Exists"}
    return {**out, "effect": effect} if effect else out


def affinity(text: str) -> dict:
    """A pod's `affinity` given as YAML or JSON (nodeAffinity, podAffinity, podAntiAffinity)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, dict) or not value or set(value) - {"nodeAffinity", "podAffinity", "podAntiAffinity"}:
        raise ValueError("--affinity: expected a YAML or JSON mapping of nodeAffinity, podAffinity and/or "
                         "podAntiAffinity (as in a pod's spec.affinity)")
    return value


def priority_class(name: Optional[str]) -> Optional[str]:
    if name is not None and not _SUBDOMAIN.match(name):
        raise ValueError(f"--priority-class {name!r}: not a Kubernetes name (lower case letters, digits, '-', '.')")
    return name


VOLUMES = {"runs": None, "tmp": {"emptyDir": {}}, "cache": {"emptyDir": {}}, "dshm": {"emptyDir": {"medium": "Memory"}}}
MOUNTS = {"runs": RUNS_MOUNT, "tmp": "/tmp", "cache": "/home/ray/.cache", "dshm": "/dev/shm"}


def runs_dir(text: str) -> str:
    """The jobs' Ray Train storage: a folder on the release's runs volume (under RUNS_MOUNT), or an object-store
    URI (s3://, gs://, any filesystem pyarrow opens) that every pod of the job reaches by itself."""
    if is_uri(text):
        if text.startswith("file:"):
            raise ValueError(f"--runs-dir {text}: a file:// folder is each pod's own; give a folder under "
                             f"{RUNS_MOUNT} (the release's runs volume) or an object-store URI")
        return text
    path = Path(text)
    if not (path == Path(RUNS_MOUNT) or Path(RUNS_MOUNT) in path.parents) or ".." in path.parts:
        raise ValueError(f"--runs-dir {text}: give a folder under {RUNS_MOUNT} (the release's runs volume) or an "
                         "object-store URI such as s3://bucket/runs")
    return str(path)


def _pod(release: Release, name: str, cpus, memory: str, gpus: float = 0, volumes=tuple(VOLUMES),
         clients: bool = True, placement: Optional[dict] = None) -> dict:
    """A pod template as the chart writes Ray pods: Settings from the ConfigMap, keys from the Secrets,
    non-root with a read-only root filesystem (writable /tmp, ~/.cache, /dev/shm), requests = limits."""
    limits = {"cpu": str(cpus), "memory": memory}
    if gpus:
        limits[GPU] = f"{gpus:g}"
    if is_uri(release.runs_dir):  # storage every pod reaches by itself: no volume
        volumes = tuple(v for v in volumes if v != "runs")
    env = [{"name": env, "valueFrom": {"secretKeyRef": {"name": f"{release.name}-{secret}", "key": key}}}
           for env, (secret, key) in SECRET_ENV.items()]
    extras = release.extras
    if clients:  # the pods that run clipstream (the submitter only runs `ray job submit`)
        if release.runs_dir != RUNS_MOUNT:  # (an entry of `env` wins over the ConfigMap's)
            env.append({"name": "CLIPSTREAM_RUNS_DIR", "value": release.runs_dir})
        env += [{"name": key, "value": value} for key, value in extras.env.items()]
    container = {
        # by digest, a node's copy is the image; by tag, every pod asks the registry, so that a job's pods all run
        # what the tag names now, not what some node pulled before
        "name": name, "image": release.image, "imagePullPolicy": "IfNotPresent" if "@" in release.image else "Always",
        # object-store credentials for s3:// tasks and storage, when the release has them (the chart's name)
        "envFrom": [{"configMapRef": {"name": f"{release.name}-settings"}},
                    {"secretRef": {"name": f"{release.name}-object-store", "optional": True}}],
        "env": env,
        "resources": {"requests": {"cpu": str(cpus), "memory": memory}, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": v, "mountPath": MOUNTS[v]} for v in volumes],
    }
    labels = {**extras.labels, **release.labels("train")}
    if not clients:  # only pods that need Qdrant and MLflow carry the labels their NetworkPolicies admit
        labels = {k: v for k, v in labels.items() if not k.startswith("clipstream.io/")}
    metadata = {"labels": labels, **({"annotations": dict(extras.annotations)} if extras.annotations else {})}
    return {
        "metadata": metadata,
        "spec": {
            "serviceAccountName": release.name,  # the chart's ServiceAccount is named after the release
            "automountServiceAccountToken": False,  # (as the chart's ServiceAccount: no pod calls the API)
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            **(placement or {}),
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
           deadline_s: int = 24 * 3600, keep_s: int = 24 * 3600, backoff_limit: int = 0) -> dict:
    """One training task as a RayJob: its own Ray cluster (a CPU head for the driver, one worker pod per Ray
    Train worker), deleted as soon as the job ends; the finished RayJob is kept `keep_s` for inspection."""
    priority = {"priorityClassName": resources.priority_class} if resources.priority_class else {}
    head = _pod(release, "ray-head", resources.head_cpus, resources.head_memory, placement=priority)
    head["spec"]["containers"][0]["ports"] = [{"name": "gcs", "containerPort": 6379},
                                              {"name": "dashboard", "containerPort": DASHBOARD_PORT}]
    worker = _pod(release, "ray-worker", resources.worker_cpus, resources.worker_memory, resources.gpus_per_worker,
                  placement={**priority, **resources.worker_placement()})
    submitter = _pod(release, "ray-job-submitter", 1, "1Gi", volumes=("tmp",), clients=False, placement=priority)
    submitter["spec"]["restartPolicy"] = "Never"
    metadata = {"name": name, "labels": {**release.extras.labels, **release.labels("train")}}
    if release.extras.annotations:
        metadata["annotations"] = dict(release.extras.annotations)
    if release.namespace:
        metadata["namespace"] = release.namespace
    cluster = {"rayVersion": RAY_VERSION}
    if release.ray_auth:  # KubeRay makes the token's Secret and gives it to the Ray pods and the submitter
        cluster["authOptions"] = {"mode": "token"}
    # every way a job ends: the Ray job's own status, or a deployment failure (deadline, submitter, backoff)
    # that leaves the Ray job's status unfinished
    ends = ({"jobStatus": "SUCCEEDED"}, {"jobStatus": "FAILED"}, {"jobDeploymentStatus": "Failed"})
    return {
        "apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": metadata,
        "spec": {
            "entrypoint": shlex.join(command),
            # (KubeRay refuses deletionRules with shutdownAfterJobFinishes, and ttlSecondsAfterFinished without it)
            "shutdownAfterJobFinishes": False,
            "deletionStrategy": {"deletionRules": [
                {"policy": policy, "condition": {**end, "ttlSeconds": ttl}}
                for end in ends for policy, ttl in (("DeleteCluster", 0), ("DeleteSelf", keep_s))]},
            "activeDeadlineSeconds": deadline_s,
            # Ray Train already restarts failed workers from the last checkpoint (train.max_failures); a
            # resubmission resumes from the last epoch checkpoint (the run is named by what it trains, under the
            # shared runs_dir), or is refused once the task registered its version.
            "backoffLimit": backoff_limit,
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": submitter,
            "rayClusterSpec": {
                **cluster,
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
            manifest["metadata"].setdefault("annotations", {})["clipstream.io/parent"] = previous
            manifest["spec"]["suspend"] = True
        jobs.append(manifest)
    return jobs


def network_policy(release: Release) -> dict:
    """The training pods' ingress, as the chart's NetworkPolicies do for its own: the Ray ports only from the
    training pods of the release (Ray's GCS, object transfers, NCCL between workers, the submitter); the dashboard
    port from anywhere, as the KubeRay operator asks the head for the job's status there (Ray's token guards it).
    One object for all jobs of the release: every `kubectl apply` of a job applies the same."""
    selector = {k: v for k, v in release.labels("train").items() if not k.startswith("clipstream.io/")}
    metadata = {"name": f"{release.name}-train", "labels": selector}
    if release.namespace:
        metadata["namespace"] = release.namespace
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata,
        "spec": {"podSelector": {"matchLabels": dict(selector)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": dict(selector)}}]},
                             {"ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]}]},
    }


class _Dumper(yaml.SafeDumper):
    """Plain YAML: an object used twice is written twice, never as an anchor and alias (`&id001`, `*id001`),
    which kubectl reads but people, diffs and static analysers do not."""

    def ignore_aliases(self, data) -> bool:
        return True


def dump(manifests: Sequence[dict]) -> str:
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, width=1000)
