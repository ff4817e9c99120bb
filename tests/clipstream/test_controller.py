"""The stream controller (clipstream/controller.py): the task source, each task's state derived from MLflow (a real
SQLite registry) and the jobs, the one-job-at-a-time and failure policies, the lease, and the RayJobs it submits
(validated against KubeRay's CRD). The real thing on the local two-node cluster: test_local_cluster.py."""

import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from clipstream import controller
from clipstream.controller import (
    BAD,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    SKIP,
    STOP,
    SUCCEEDED,
    Controller,
    FileLease,
    Incoming,
    Plan,
    decide,
    derive,
)
from clipstream.settings import Settings


def task_dir(root, name: str, good: bool = True):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"id": "0", "image": "a.png", "caption": "a cup"}\n')
    (folder / "task.yaml").write_text(f"name: {name}\nsplits:\n  train: train.jsonl\n" if good else "name: [oops\n")
    return folder


def test_a_prefix_lists_its_task_folders_in_name_order_and_a_bad_task_yaml_with_its_problem(tmp_path):
    task_dir(tmp_path, "t1")
    task_dir(tmp_path, "t0")
    task_dir(tmp_path, "t2", good=False)
    (tmp_path / "not-a-task").mkdir()
    found = controller.read_source(str(tmp_path))
    assert [t.uri.rsplit("/", 1)[-1] for t in found] == ["t0", "t1", "t2"]
    assert [bool(t.problem) for t in found] == [False, False, True] and "not valid YAML" in found[2].problem
    listing = tmp_path / "tasks.txt"  # a ConfigMap's list, in its own order
    listing.write_text(f"# the stream\n{tmp_path / 't1'}\n\n{tmp_path / 't0'}\n")
    assert [t.uri for t in controller.read_source(str(listing))] == [str(tmp_path / "t1"), str(tmp_path / "t0")]
    with pytest.raises(FileNotFoundError, match="neither a folder of tasks nor a file"):
        controller.read_source(str(tmp_path / "nowhere"))


def test_names_are_dns_labels_unique_per_task_and_short_enough_for_kuberay():
    a, b = Incoming("s3://bucket/tasks/task-00-household-very-long-name"), Incoming("s3://other/task-00-household-very-long-name")
    assert a.key != b.key and a.key == Incoming(a.uri).key  # deterministic: what a restarted controller finds again
    name = controller.job_name("clipstream", "stream12char", a)
    assert len(name) <= 47 and name == name.lower()  # (KubeRay's limit on RayJob names)


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    """One SQLite MLflow store for the module (creating one takes seconds); each test its own registered model."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def registry(tmp_path, database, request):
    settings = Settings(home=tmp_path / "home", mlflow_tracking_uri=database, stream=request.node.name[:40])
    client = MlflowClient(database, registry_uri=database)
    client.create_registered_model(settings.stream)
    return settings, client


def register(settings, client, alias: str) -> str:
    """A version of the stream as a finished job leaves it: registered, with the alias its task's job sets."""
    version = client.create_model_version(settings.stream, "file:///nowhere", tags={"task": alias}).version
    client.set_registered_model_alias(settings.stream, alias, version)
    return str(version)


class Jobs:
    """The jobs' side as the backend reports it (RayJob statuses or Jobs API submissions), and what was submitted."""

    def __init__(self):
        self.states, self.submitted, self.resumed = {}, [], []

    def jobs(self):
        return dict(self.states)

    def submit(self, manifest):
        self.submitted.append(manifest)
        self.states[manifest["metadata"]["name"]] = RUNNING

    def resume_ready(self, registry):
        return []


def make(tmp_path, settings, tasks, **kwargs):
    source = tmp_path / "tasks.txt"
    source.write_text("\n".join(str(t) for t in tasks))
    lines = []
    plan = Plan("s", resources=controller.k8s.Resources(gpus_per_worker=0), overrides=["train.epochs=1"],
                zero_shot=["s3://b/held"])
    return Controller(str(source), plan, Jobs(), settings, say=lines.append, **kwargs), lines


def test_one_job_at_a_time_each_on_the_streams_newest_version(tmp_path, registry):
    settings, client = registry
    tasks = [task_dir(tmp_path, f"t{k}") for k in range(3)]
    ctl, lines = make(tmp_path, settings, tasks, parent="production")
    jobs = ctl.backend
    incoming = [Incoming(str(t)) for t in tasks]

    assert ctl.once().submit == incoming[0]
    first = jobs.submitted[-1]
    assert "--parent production" in first["spec"]["entrypoint"] and "--zero-shot s3://b/held" in first["spec"]["entrypoint"]
    assert ctl.once().running == incoming[0] and len(jobs.submitted) == 1  # a running job: nothing else starts

    # the job registered its version: the next task trains on it (by number), without the held-out tasks
    jobs.states[first["metadata"]["name"]] = SUCCEEDED
    v1 = register(settings, client, controller.alias("s", incoming[0]))
    assert ctl.once().submit == incoming[1]
    second = jobs.submitted[-1]["spec"]["entrypoint"]
    assert f"--parent {v1}" in second and "--zero-shot" not in second
    assert f"--alias {controller.alias('s', incoming[1])}" in second

    # a controller that starts afresh (a restart, a second replica) derives the same state: no second submission
    again, _ = make(tmp_path, settings, tasks, parent="production")
    again.backend = jobs
    assert again.once().running == incoming[1] and len(jobs.submitted) == 2
    assert any("submitted clipstream-s-" in line for line in lines)


def test_derive_reads_versions_and_jobs():
    a, b, c, d, e, f = (Incoming(f"/t/{x}") for x in "abcdef")
    bad = Incoming("/t/g", "task.yaml: missing required key 'splits'")
    name = lambda t: controller.job_name("clipstream", "s", t)  # noqa: E731
    steps = derive("s", [a, b, c, d, e, f, bad], {controller.alias("s", a): "4", "production": "4"},
                   {name(a): SUCCEEDED, name(b): SUCCEEDED, name(c): FAILED, name(d): RUNNING})
    assert [s.state for s in steps] == [DONE, FAILED, FAILED, RUNNING, PENDING, PENDING, BAD]
    assert steps[0].version == "4" and "no version carries" in steps[1].detail and "splits" in steps[6].detail
    assert steps[0].job == SUCCEEDED  # a version of the stream's own job (the promotion policy is for those)
    assert derive("s", [a], {controller.alias("s", a): "1"}, {})[0].job == ""  # registered otherwise
    # its version registered, its job not yet ended: the task still runs, the next waits and nothing is promoted
    finishing = derive("s", [a, b], {controller.alias("s", a): "5"}, {name(a): RUNNING})
    assert [(s.state, s.version) for s in finishing] == [(RUNNING, "5"), (PENDING, "")]
    assert decide(finishing, SKIP).running == a and decide(finishing, SKIP).submit is None


def test_a_failed_or_bad_task_is_skipped_or_stops_the_stream():
    a, b, c = (Incoming(f"/t/{x}") for x in "abc")
    steps = [controller.Step(a, DONE, "7"), controller.Step(b, FAILED, detail="job failed"), controller.Step(c, PENDING)]
    skipped = decide(steps, SKIP, parent="production")
    assert (skipped.submit, skipped.parent, skipped.blocked) == (c, "7", None)
    stopped = decide(steps, STOP)
    assert stopped.submit is None and stopped.blocked.task == b
    assert decide([controller.Step(a, PENDING)], SKIP, parent=None).parent is None  # the preset's model
    assert decide([controller.Step(a, BAD, detail="x"), controller.Step(b, PENDING)], SKIP).submit == b


def test_a_bad_task_is_reported_once_and_skipped(tmp_path, registry):
    settings, _ = registry
    tasks = [task_dir(tmp_path, "t0", good=False), task_dir(tmp_path, "t1")]
    ctl, lines = make(tmp_path, settings, tasks)
    assert ctl.once().submit == Incoming(str(tasks[1]))
    ctl.once()
    reported = [line for line in lines if str(tasks[0]) in line]
    assert len(reported) == 1 and "bad" in reported[0] and "skipped" in reported[0]
    stopping, lines = make(tmp_path, settings, tasks, on_failure=STOP)
    assert stopping.once().blocked.task.uri == str(tasks[0]) and not stopping.backend.submitted
    assert "the stream stops here" in lines[0]


def test_the_submitted_rayjobs_validate_against_the_crd(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "k8s"))
    from k8s_checks import validate_all

    plan = Plan("s", overrides=["train.epochs=1"])
    manifests = [plan.manifest(Incoming("s3://b/t0"), None, True), plan.manifest(Incoming("s3://b/t1"), "3", False)]
    validate_all(manifests)
    assert manifests[1]["metadata"]["labels"][controller.STREAM_LABEL] == "s"
    assert "suspend" not in manifests[1]["spec"]  # the controller creates a job only once its parent exists


@pytest.mark.component
def test_the_file_lease_is_exclusive_and_freed_when_its_holder_dies(tmp_path):
    path = tmp_path / "controller.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom clipstream.controller import FileLease\n"
                               f"lease = FileLease({str(path)!r}, 'the other')\nassert lease.acquire()\n"
                               "print('held', flush=True)\n"
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = FileLease(path, "me")
        assert not mine.acquire() and mine.held_by() == "the other"
        holder.kill()  # SIGKILL: nothing of the holder's runs to release it
        holder.wait(10)
        deadline = time.monotonic() + 10
        while not mine.acquire():
            assert time.monotonic() < deadline, "the lease of a dead holder was not freed"
            time.sleep(0.1)
        assert mine.held_by() == "me" and not FileLease(path, "third").acquire()
    finally:
        holder.kill()
        holder.wait(10)


def test_bad_input_and_a_missing_kubernetes_api_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from clipstream.cli import main

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("CLIPSTREAM_HOME", str(tmp_path / "home"))
    assert main(["controller", "--source", str(tmp_path), "--name", "s", "--once"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("clipstream: error: ") and "--jobs-api" in err
    assert main(["controller", "--source", str(tmp_path), "--name", "s", "--method", "nope"]) == 2
    assert "unknown method preset 'nope'" in capsys.readouterr().err
