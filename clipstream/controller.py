"""The stream controller (`clipstream controller`): one training job per incoming task, one at a time.

It watches a task source (a prefix whose sub-folders with a `task.yaml` are tasks, in name order, or a file that
lists task URIs, one a line: a ConfigMap mounted in the pod), and for the first task not yet done it submits a
training job whose parent is the stream's newest version, waits for the job, applies the promotion policy to the
version it registered and goes on. It also resumes the suspended RayJobs of `clipstream k8s stream` once their
parent's version exists (KubeRay's `spec.suspend`: no Ray cluster exists before that).

It keeps no state of its own: everything is derived on every pass from MLflow (the version a task registered
carries the alias STREAM-KEY) and from the jobs (a RayJob, or a Ray Jobs API submission, named after the stream
and the task), so a controller restarted mid-job waits for that job instead of submitting it again, and two
controllers cannot both run a stream: a lease (a coordination.k8s.io Lease in Kubernetes, an exclusive lock on a
file in local mode) lets one act at a time, and a job's deterministic name makes a second submission fail anyway.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

from clipstream import k8s

log = logging.getLogger("clipstream.controller")

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"  # a job's state, from either backend
DONE, PENDING, BAD = "done", "pending", "bad"  # a task's state besides its job's
AUTO, CANDIDATE = "auto", "candidate"  # promotion policies
SKIP, STOP = "skip", "stop"  # failure policies
STREAM_LABEL, PARENT_ANNOTATION = "clipstream.io/stream", "clipstream.io/parent"


class SetupError(ValueError):
    """What the controller needs to reach its jobs is missing (a package, a Kubernetes configuration)."""


@dataclass(frozen=True)
class Incoming:
    """One task of the source: its URI, and why it cannot be trained when its task.yaml does not load."""

    uri: str
    problem: str = ""

    @property
    def key(self) -> str:
        """A short DNS label unique per URI: the task's part of its job name and of its version's alias."""
        return f"{k8s.dns_name(self.uri, limit=16)}-{hashlib.sha256(self.uri.encode()).hexdigest()[:6]}"


def read_source(source: str) -> list[Incoming]:
    """The tasks of `source`, in stream order: the URIs a list file names, one a line (# comments), or the
    sub-folders of a prefix (local path or fsspec URI) that hold a task.yaml, in name order. A task whose task.yaml
    does not load is returned with its problem (reported, and handled by the failure policy)."""
    from clipstream.training.data.task import DataError, Task, location

    root = location(source)
    if root.is_file():
        uris = [line.strip() for line in root.read_text().splitlines() if line.strip() and not line.startswith("#")]
    elif root.is_dir():
        uris = [str(p).rstrip("/") for p in sorted(root.iterdir(), key=lambda p: p.name)
                if p.is_dir() and (p / "task.yaml").is_file()]
    else:
        raise FileNotFoundError(f"{source}: the task source is neither a folder of tasks nor a file listing them")
    found = []
    for uri in uris:
        try:
            Task.load(uri)
            found.append(Incoming(uri))
        except DataError as exc:
            found.append(Incoming(uri, str(exc)))
    return found


@dataclass
class Step:
    task: Incoming
    state: str  # DONE, PENDING, BAD, or the job's RUNNING / FAILED (a SUCCEEDED job without its version is FAILED;
    # a version whose job still runs is RUNNING)
    version: str = ""
    detail: str = ""
    job: str = ""  # its job's state; none for a version registered otherwise (e.g. adopted into the stream)


def derive(stream: str, tasks: Sequence[Incoming], aliases: dict[str, str], jobs: dict[str, str],
           release: str = "clipstream") -> list[Step]:
    """Each task's state from what MLflow holds (`aliases`: alias -> version) and what the jobs are (`jobs`:
    job name -> RUNNING / SUCCEEDED / FAILED, absent when never submitted)."""
    steps = []
    for task in tasks:
        version = aliases.get(alias(stream, task))
        job = jobs.get(job_name(release, stream, task))
        if version and job == RUNNING:  # registered, its job still finishing: one job at a time, so it waits
            steps.append(Step(task, RUNNING, version, f"version {version} registered; its job is still running", job))
        elif version:
            steps.append(Step(task, DONE, version, job=job or ""))
        elif job == SUCCEEDED:
            steps.append(Step(task, FAILED, detail=f"its job succeeded but no version carries {alias(stream, task)}"))
        elif job:
            steps.append(Step(task, job, detail=f"job {job_name(release, stream, task)} {job}"))
        elif task.problem:
            steps.append(Step(task, BAD, detail=task.problem))
        else:
            steps.append(Step(task, PENDING))
    return steps


@dataclass
class Decision:
    """What one pass does: submit `submit` (on top of `parent`), or wait; `blocked` names a failed task that
    stops the stream (failure policy STOP)."""

    submit: Optional[Incoming] = None
    parent: Optional[str] = None
    running: Optional[Incoming] = None
    blocked: Optional[Step] = None
    newest: str = ""


def decide(steps: Sequence[Step], on_failure: str = SKIP, parent: Optional[str] = None) -> Decision:
    """One job at a time; the next task trains on the stream's newest version (`parent` before any); a failed or
    bad task is skipped, or stops the stream before the tasks after it."""
    done = [int(s.version) for s in steps if s.state == DONE]
    decision = Decision(newest=str(max(done)) if done else "")
    decision.parent = decision.newest or parent
    running = [s for s in steps if s.state == RUNNING]
    if running:
        decision.running = running[0].task
        return decision
    for step in steps:
        if step.state in (FAILED, BAD) and on_failure == STOP:
            decision.blocked = step
            return decision
        if step.state == PENDING:
            decision.submit = step.task
            return decision
    return decision


def alias(stream: str, task: Incoming) -> str:
    return f"{stream}-{task.key}"


def job_name(release: str, stream: str, task: Incoming) -> str:
    return f"{release}-{stream}-{task.key}"


@dataclass
class Plan:
    """What the controller's jobs train: the method, resources, overrides, held-out tasks, where they run."""

    stream: str
    method: str = "finetune"
    release: k8s.Release = field(default_factory=k8s.Release)
    resources: k8s.Resources = field(default_factory=k8s.Resources)
    overrides: Sequence[str] = ()
    zero_shot: Sequence[str] = ()

    def manifest(self, task: Incoming, parent: Optional[str], first: bool) -> dict:
        """The task's RayJob: `clipstream train` on top of `parent`, its version aliased STREAM-KEY; the held-out
        tasks go to the stream's first job (later versions inherit them)."""
        command = k8s.train_command(task.uri, self.method, self.resources, parent, aliases=[alias(self.stream, task)],
                                    overrides=self.overrides, zero_shot=self.zero_shot if first else ())
        manifest = k8s.rayjob(job_name(self.release.name, self.stream, task), command, self.release, self.resources)
        manifest["metadata"]["labels"][STREAM_LABEL] = self.stream
        return manifest


# ---- where jobs run ------------------------------------------------------------------------------------------
def _jobs_api_state(status: str) -> str:
    return {"SUCCEEDED": SUCCEEDED, "FAILED": FAILED, "STOPPED": FAILED}.get(status, RUNNING)


class RayJobs:
    """Jobs through the Ray Jobs API (a local cluster, tests): the submission id is the RayJob's name, as KubeRay
    submits it, so the API itself refuses a second submission of a task."""

    def __init__(self, address: str, stream: str):
        from ray.job_submission import JobSubmissionClient

        token = os.environ.get("RAY_AUTH_TOKEN")
        self.client = JobSubmissionClient(address, headers={"Authorization": f"Bearer {token}"} if token else None)
        self.stream = stream

    def jobs(self) -> dict[str, str]:
        return {j.submission_id: _jobs_api_state(j.status.value) for j in self.client.list_jobs()
                if (j.metadata or {}).get(STREAM_LABEL) == self.stream and j.submission_id}

    def submit(self, manifest: dict) -> None:
        name = manifest["metadata"]["name"]
        try:
            self.client.submit_job(entrypoint=manifest["spec"]["entrypoint"], submission_id=name,
                                   metadata={STREAM_LABEL: self.stream})
        except RuntimeError as exc:
            if "already exists" not in str(exc):
                raise
            log.warning("job %s was submitted already (another controller?): waiting for it", name)

    def resume_ready(self, registry) -> list[str]:
        return []  # (the Jobs API has no suspended jobs: `clipstream k8s stream`'s are KubeRay's)

    def lease(self, holder: str, settings) -> "FileLease":
        return FileLease(settings.home / f"controller-{self.stream}.lock", holder)


class KubeRayJobs:
    """RayJobs through the Kubernetes API, in the release's namespace (the pod's service account, or kubectl's
    configuration outside a cluster)."""

    GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"

    def __init__(self, namespace: Optional[str], stream: str, release: str):
        try:
            import kubernetes
        except ImportError as exc:
            raise SetupError("the Kubernetes mode needs the `kubernetes` package (pip install 'clipstream-continual[cluster]'); "
                             "or give --jobs-api to submit through the Ray Jobs API") from exc
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            try:
                kubernetes.config.load_kube_config()
            except (kubernetes.config.ConfigException, FileNotFoundError) as exc:
                raise SetupError(f"no Kubernetes API to talk to ({exc}): run the controller in the cluster (the chart's "
                                 "controller.enabled), with a kubeconfig, or with --jobs-api") from exc
        self.kubernetes = kubernetes
        self.namespace = namespace or _pod_namespace()
        self.api = kubernetes.client.CustomObjectsApi()
        self.stream, self.release = stream, release

    def _list(self, selector: str) -> list[dict]:
        return self.api.list_namespaced_custom_object(self.GROUP, self.VERSION, self.namespace, self.PLURAL,
                                                      label_selector=selector)["items"]

    def jobs(self) -> dict[str, str]:
        return {j["metadata"]["name"]: _rayjob_state(j) for j in self._list(f"{STREAM_LABEL}={self.stream}")}

    def submit(self, manifest: dict) -> None:
        try:
            self.api.create_namespaced_custom_object(self.GROUP, self.VERSION, self.namespace, self.PLURAL, manifest)
        except self.kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            log.warning("RayJob %s exists already (another controller?): waiting for it", manifest["metadata"]["name"])

    def resume_ready(self, registry) -> list[str]:
        """Resume every suspended RayJob of a `clipstream k8s stream` of this release whose parent is registered."""
        resumed = []
        for job in self._list(f"app.kubernetes.io/instance={self.release},{STREAM_LABEL}"):
            parent = job["metadata"].get("annotations", {}).get(PARENT_ANNOTATION)
            if job["spec"].get("suspend") and parent and _exists(registry, parent):
                self.api.patch_namespaced_custom_object(self.GROUP, self.VERSION, self.namespace, self.PLURAL,
                                                        job["metadata"]["name"], {"spec": {"suspend": False}})
                resumed.append(job["metadata"]["name"])
        return resumed

    def lease(self, holder: str, settings) -> "KubeLease":
        return KubeLease(self.kubernetes, self.namespace, f"{self.release}-controller-{self.stream}", holder)


def _rayjob_state(job: dict) -> str:
    status = job.get("status") or {}
    if status.get("jobDeploymentStatus") == "Failed" or status.get("jobStatus") in ("FAILED", "STOPPED"):
        return FAILED
    return SUCCEEDED if status.get("jobStatus") == "SUCCEEDED" else RUNNING


def _pod_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.is_file() else "default"


def _exists(registry, ref: str) -> bool:
    from clipstream.registry import NoSuchVersion

    try:
        registry.resolve(ref, download=False)
        return True
    except NoSuchVersion:
        return False


# ---- leases ---------------------------------------------------------------------------------------------------
class FileLease:
    """An exclusive lock on a file: the kernel releases it when its process dies, however it dies."""

    def __init__(self, path: Path, holder: str):
        self.path, self.holder, self._file = Path(path), holder, None

    def acquire(self) -> bool:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = open(self.path, "a+")
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                file.close()
                return False
            file.truncate(0)
            file.write(self.holder)
            file.flush()
            self._file = file
        return True

    def held_by(self) -> str:
        return self.path.read_text().strip() if self.path.is_file() else ""


class KubeLease:
    """A coordination.k8s.io Lease: taken when free or expired, renewed on every pass; a write that lost a race
    (resourceVersion conflict) means another controller holds it."""

    def __init__(self, kubernetes, namespace: str, name: str, holder: str, duration_s: int = 120):
        self.k, self.api = kubernetes, kubernetes.client.CoordinationV1Api()
        self.namespace, self.name, self.holder, self.duration_s = namespace, name, holder, duration_s

    def acquire(self) -> bool:
        client = self.k.client
        now = datetime.now(timezone.utc)
        spec = client.V1LeaseSpec(holder_identity=self.holder, lease_duration_seconds=self.duration_s, renew_time=now)
        try:
            lease = self.api.read_namespaced_lease(self.name, self.namespace)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            return self._write(lambda: self.api.create_namespaced_lease(
                self.namespace, client.V1Lease(metadata=client.V1ObjectMeta(name=self.name), spec=spec)))
        held = lease.spec
        renewed = held.renew_time or held.acquire_time
        expired = renewed is None or (now - renewed).total_seconds() > (held.lease_duration_seconds or 0)
        if held.holder_identity not in (None, "", self.holder) and not expired:
            return False
        metadata = client.V1ObjectMeta(name=self.name, resource_version=lease.metadata.resource_version)
        return self._write(lambda: self.api.replace_namespaced_lease(self.name, self.namespace,
                                                                     client.V1Lease(metadata=metadata, spec=spec)))

    def _write(self, call) -> bool:
        try:
            call()
            return True
        except self.k.client.ApiException as exc:
            if exc.status in (409, 422):
                return False
            raise

    def held_by(self) -> str:
        try:
            return self.api.read_namespaced_lease(self.name, self.namespace).spec.holder_identity or ""
        except self.k.client.ApiException:
            return ""


# ---- the loop --------------------------------------------------------------------------------------------------
@dataclass
class Controller:
    source: str
    plan: Plan
    backend: object  # RayJobs or KubeRayJobs
    settings: object  # clipstream.settings.Settings
    parent: Optional[str] = None  # the first task's parent (default: the preset's model)
    promote: str = CANDIDATE
    on_failure: str = SKIP
    say: Callable[[str], None] = print
    _said: set = field(default_factory=set)
    _promoted: set = field(default_factory=set)

    def __post_init__(self):
        from clipstream.registry import Registry

        self.registry = Registry(self.settings)

    def once(self) -> Decision:
        """One pass: derive every task's state, then submit the next job (or wait), and apply the policies."""
        for name in self.backend.resume_ready(self.registry):
            self.say(f"resumed RayJob {name}: its parent's version is registered")
        steps = derive(self.plan.stream, read_source(self.source), self._aliases(), self.backend.jobs(),
                       self.plan.release.name)
        for step in steps:
            if step.state in (FAILED, BAD):
                self._say_once(f"task {step.task.uri} {step.state}: {step.detail} "
                               + ("(skipped; the stream goes on)" if self.on_failure == SKIP else
                                  "(the stream stops here: fix the task and delete its job, or set the failure policy "
                                  "to skip)"))
        decision = decide(steps, self.on_failure, self.parent)
        newest = next((s for s in steps if s.state == DONE and s.version == decision.newest), None)
        if newest and newest.job:  # (the policy is for the versions the stream's jobs register)
            self._apply_promotion(newest.version)
        if decision.submit:
            first = not decision.newest
            manifest = self.plan.manifest(decision.submit, decision.parent, first)
            self.backend.submit(manifest)
            self.say(f"submitted {manifest['metadata']['name']}: task {decision.submit.uri} on top of "
                     f"{decision.parent and f'version {decision.parent}' or 'the preset model'}")
        elif decision.running:
            self._say_once(f"waiting for the job of task {decision.running.uri}")
        elif not decision.blocked:
            self._say_once(f"all {len(steps)} tasks handled; waiting for new tasks in {self.source}")
        return decision

    def run(self, interval_s: float = 30.0, lease=None, stop=None) -> None:
        """Pass after pass while this process holds the lease (waiting for it otherwise); a failing pass (MLflow or
        the cluster unreachable) is reported and retried."""
        import threading

        stop = stop or threading.Event()
        holder = f"{socket.gethostname()}/{os.getpid()}"
        lease = lease or self.backend.lease(holder, self.settings)
        while True:
            try:
                if lease.acquire():
                    self.once()
                else:
                    self._say_once(f"waiting for the lease held by {lease.held_by() or 'another controller'}")
            except Exception as exc:  # a dependency down: the next pass tries again
                self.say(f"pass failed, retrying in {interval_s:g} s: {' '.join(str(exc).split())}")
            if stop.wait(interval_s):
                return

    def _aliases(self) -> dict[str, str]:
        from mlflow.exceptions import MlflowException

        try:
            return {a: str(v) for a, v in self.registry.client.get_registered_model(self.registry.name).aliases.items()}
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # nothing registered yet
                return {}
            raise

    def _apply_promotion(self, version: str) -> None:
        """Policy AUTO: promote the stream's newest version once its gates pass (tried once per version in this
        process; a refusal leaves it `candidate`)."""
        if self.promote != AUTO or version in self._promoted:
            return
        self._promoted.add(version)
        from clipstream.promotion import PromotionError, promote
        from clipstream.registry import PRODUCTION, RegistryError

        try:
            if self.registry.number(PRODUCTION) == version:
                return
        except RegistryError:
            pass
        try:
            result = promote(self.settings, version)
            self.say(f"promoted version {version} to production (from {result['from_version'] or 'none'})")
        except PromotionError as exc:
            self.say(f"version {version} stays candidate: {exc}")

    def _say_once(self, line: str) -> None:
        """A state that lasts many passes is reported when it is reached, not on every pass."""
        if line not in self._said:
            self._said.add(line)
            self.say(line)
