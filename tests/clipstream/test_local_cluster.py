"""Cluster mode for real: a 2-node Ray cluster (`ray start`) and an MLflow server over HTTP on this machine,
training submitted through the Ray Jobs API with the entrypoints of the RayJobs `clipstream k8s stream`
renders, and serving deployed with `serve deploy` from the chart's RayService, all in the environment the
Helm chart gives its Ray pods."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(cluster_session):
    cluster_session.trained()
    client = cluster_session.cluster.jobs()
    return cluster_session.cluster, cluster_session.tasks, [client.get_job_logs(i) for i in cluster_session.job_ids]


def test_chained_jobs_train_across_both_nodes_and_register_on_the_mlflow_server(trained, tmp_path):
    cluster, tasks, logs = trained
    registry = MlflowClient(cluster.mlflow_uri)
    found = sorted(int(v.version) for v in registry.search_model_versions("name='clipstream'"))
    assert found == [1, 2]
    v1, v2 = (registry.get_model_version("clipstream", str(v)) for v in found)  # (search leaves aliases out)
    assert [v1.tags["task"], v2.tags["task"]] == [t.name for t in tasks]
    assert (v1.tags["parent_version"], v2.tags["parent_version"]) == ("", "1")
    assert v1.aliases == ["s-1"] and set(v2.aliases) == {"s-2", "candidate"}  # how the stream's jobs chain
    for version in (v1, v2):
        run = registry.get_run(version.run_id)
        assert run.info.artifact_uri.startswith("mlflow-artifacts:/")  # proxied: clients never see the store's path
        assert {"known/AA", "known/forgetting", "known/BWT", "train/samples_per_s"} <= set(run.data.metrics)
        nodes = run.data.tags["ray.worker_nodes"].split(",")
        assert len(nodes) == 2 and len(set(nodes)) == 2, f"both workers on one node: {nodes}"
    assert "registered version 2" in logs[1]

    # a process that has only the server's URL (not its artifact directory) downloads version 2 and loads it
    # with stock open_clip
    script = ("import open_clip\n"
              "from clipstream.registry import Registry\n"
              "from clipstream.settings import Settings\n"
              "version = Registry(Settings()).resolve('2')\n"
              "folder = version.folder\n"
              "print(*[e['task'] for e in version.lineage])\n"
              "model, _, _ = open_clip.create_model_and_transforms(f'local-dir:{folder}')\n"
              "print(sum(p.numel() for p in model.parameters()))\n")
    env = {**os.environ, "CLIPSTREAM_MLFLOW_TRACKING_URI": cluster.mlflow_uri, "CLIPSTREAM_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lineage, parameters = out.stdout.strip().splitlines()[-2:]
    assert lineage.split() == [t.name for t in tasks] and int(parameters) > 0


def _clipstream(cluster, *args: str, cwd) -> str:
    """`clipstream ARGS` as a user runs it against the cluster: the release's settings, and gates that let any
    version pass (a 1-epoch version's quality is not what these tests judge; test_promotion tests the gates)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CLIPSTREAM_")}, **cluster.pod_env(),
           "CLIPSTREAM_PROMOTE_MAX_AA_DROP": "100", "CLIPSTREAM_PROMOTE_MAX_FORGETTING": "100"}
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "clipstream"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"clipstream {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_charts_serve_config_serves_the_promoted_version_and_follows_the_alias(trained, cluster_session, tmp_path):
    """The rendered RayService's serveConfigV2, deployed with `serve deploy`, answers gRPC on the chart's port
    (with the API key of the chart's Secret); `clipstream index`/`promote` against the cluster put version 1
    in place; moving `production` with MLflow's own client switches the Encoder to version 2, and Search
    once `clipstream promote 2` put its gallery in place; no replica restarts."""
    import grpc

    from clipstream.services.client import Client
    from clipstream.services.health import SERVICES

    cluster, tasks, _ = trained
    chart = cluster_session.chart
    config = chart.serve_config
    assert config["applications"][0]["import_path"] == "clipstream.services.app:app"
    cluster.deploy_serve(config)
    try:
        port, key = config["grpc_options"]["port"], chart.pod_env()["CLIPSTREAM_API_KEY"]
        assert int(chart.pod_env()["CLIPSTREAM_GRPC_PORT"]) == port and key
        replicas = _replicas(cluster)
        _clipstream(cluster, "index", "--version", "1", "--task", str(tasks[0]), cwd=tmp_path)
        assert "production: none -> v1" in _clipstream(cluster, "promote", "1", cwd=tmp_path)
        caption = json.loads((tasks[0] / "test.jsonl").read_text().splitlines()[0])["caption"]
        with Client(f"127.0.0.1:{port}", api_key=key) as client:
            assert [client.health(s) for s in ("", *SERVICES)] == ["SERVING"] * 4
            hits = client.search(text=caption, k=5)
            assert {h["query_model_version"] for h in hits} == {"1"} and {h["model_version"] for h in hits} == {"1"}
            assert client.encode_text(["a red cube"])[1] == "1"
            with pytest.raises(grpc.RpcError) as refused:  # the chart's Secret holds the key: nobody else gets in
                Client(f"127.0.0.1:{port}", api_key="wrong").encode_text(["a red cube"])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

            # a registry user promotes version 2 with MLflow's own client: the Encoder follows the alias, Search
            # keeps encoding queries with version 1 until version 2's gallery is in place
            MlflowClient(cluster.mlflow_uri).set_registered_model_alias("clipstream", "production", "2")
            deadline = time.monotonic() + 60
            while client.encode_text(["a red cube"])[1] != "2":
                assert time.monotonic() < deadline, "the Encoder did not follow the alias to version 2"
                time.sleep(0.5)
            assert {h["query_model_version"] for h in client.search(text=caption, k=5)} == {"1"}
            status = client.status()
            assert not status["consistent"] and any("clipstream promote 2" in p for p in status["problems"])

            assert "production: v1 -> v2" in _clipstream(cluster, "promote", "2", cwd=tmp_path)
            hits = client.search(text=caption, k=48)
            assert {h["query_model_version"] for h in hits} == {"2"}
            assert {(h["task"], h["model_version"]) for h in hits} == {(tasks[0].name, "1"), (tasks[1].name, "2")}
            assert client.status()["consistent"]
        assert _replicas(cluster) == replicas  # the same replicas all along: no restart
        _survives_a_registry_outage_and_a_killed_replica(cluster, tasks[0], f"127.0.0.1:{port}", key)
    finally:
        cluster.shutdown_serve()  # its CPUs go back to the training jobs of the next test


def _survives_a_registry_outage_and_a_killed_replica(cluster, task, target: str, key: str) -> None:
    """Clients under load (benchmarks/reliability.py `drive`; retries only from the shipped client's policy) see no
    failed call while the MLflow server is down (the Encoder keeps the production version it has, and follows the
    alias again once MLflow is back) nor when an Encoder replica is SIGKILLed (the proxies, started from the chart's
    serve config by plain `ray start` nodes with no setup hook, answer its requests UNAVAILABLE: retried)."""
    import signal

    from clipstream.benchmarks.reliability import drive
    from clipstream.services.client import Client
    from clipstream.training.data.task import Task

    rows = Task.load(task).check("test").rows
    texts, images = [r["caption"] for r in rows], [(task / r["image"]).read_bytes() for r in rows]

    def load(**events):
        return drive(lambda: Client(target, api_key=key), texts, images, clients=4, **events)

    cluster.stop_mlflow()
    try:
        outage = load(seconds=8.0)
    finally:
        cluster.start_mlflow()
    assert outage["requests"] and not outage["failures"], outage["failures"][:5]
    assert outage["versions"] == ["2"]
    MlflowClient(cluster.mlflow_uri).set_registered_model_alias("clipstream", "production", "1")
    with Client(target, api_key=key) as client:
        deadline = time.monotonic() + 90  # (the alias checks back off while MLflow is down)
        while client.encode_text(["a red cube"])[1] != "1":
            assert time.monotonic() < deadline, "the Encoder did not follow the alias once MLflow was back"
            time.sleep(0.5)

    pids = [r["pid"] for r in cluster.serve_applications()["clipstream"]["deployments"]["Encoder"]["replicas"]
            if r["state"] == "RUNNING"]
    assert len(pids) == 2, pids  # (the session's chart: settings.serve_replicas 2, one may die)

    def kill() -> str:
        os.kill(pids[0], signal.SIGKILL)
        return f"killed pid {pids[0]}"

    killed = load(seconds=6.0, events=[(1.0, "kill an Encoder replica", kill)])
    assert killed["events"][0][3].startswith("killed"), killed["events"]
    assert killed["requests"] and not killed["failures"], killed["failures"][:5]


def _replicas(cluster) -> dict:
    """{deployment: sorted replica ids} of the running application, from Serve's REST API."""
    app = cluster.serve_applications()["clipstream"]
    assert app["status"] == "RUNNING"
    return {name: sorted(r["replica_id"] for r in d["replicas"]) for name, d in app["deployments"].items()}


def test_the_stream_controller_trains_incoming_tasks_once_through_a_kill_and_skips_a_bad_one(trained, tmp_path):
    """`clipstream controller` on the Ray Jobs API (its local mode), as real processes: the stream's tasks are a list
    (a ConfigMap's, in Kubernetes); the session's two versions are its first two (given the aliases the controller's
    jobs set), then a task with a bad task.yaml and a new task appear. The first controller submits the new task's
    job; a second one waits for the lease; the first is killed mid-job (SIGKILL) and the second resumes: it waits
    for that job rather than submitting it again, version 3 registers on top of version 2, and the policy promotes
    it. The bad task is reported and skipped."""
    from clipstream import controller
    from clipstream.training.data.synth import synthesize
    from tests.cluster import JOB_SETTINGS

    cluster, tasks, _ = trained
    registry = MlflowClient(cluster.mlflow_uri)
    *_, new = synthesize(cluster.shared / "incoming", tasks=3, seed=5, train_pairs=512, test_per_task=8,
                         digits=False, held_out=False, progress=False)
    bad = cluster.shared / "incoming" / "bad"
    bad.mkdir()
    (bad / "task.yaml").write_text("name: [oops\n")
    listing = tmp_path / "tasks.txt"
    listing.write_text(f"{tasks[0]}\n{tasks[1]}\n")
    for task, version in zip(tasks, ("1", "2")):
        registry.set_registered_model_alias("clipstream", controller.alias("c", controller.Incoming(str(task))), version)

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CLIPSTREAM_")}, **cluster.pod_env(),
           **cluster.auth_env, "CLIPSTREAM_PROMOTE_MAX_AA_DROP": "100", "CLIPSTREAM_PROMOTE_MAX_FORGETTING": "100",
           "CLIPSTREAM_RAY_ADDRESS": cluster.address}  # (its promotion embeds the gallery on this cluster, no other)
    command = [os.path.join(os.path.dirname(sys.executable), "clipstream"), "controller", "--source", str(listing),
               "--name", "c", "--jobs-api", cluster.dashboard_url, "--gpus-per-worker", "0", "--interval", "2",
               "--promote", "auto", *[a for s in JOB_SETTINGS for a in ("--set", s)]]
    started = []

    def start(name: str):
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            started.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                            start_new_session=True))
        return log

    def wait_for(log, text: str, timeout_s: float = 300) -> str:
        deadline = time.monotonic() + timeout_s
        while text not in log.read_text():
            assert time.monotonic() < deadline, f"no {text!r} in {log.name}:\n{log.read_text()[-3000:]}"
            assert started[-1].poll() is None or text in log.read_text(), log.read_text()[-3000:]
            time.sleep(1)
        return log.read_text()

    try:
        first = start("first")
        wait_for(first, "all 2 tasks handled")  # the session's versions are the stream's: nothing to train
        listing.write_text(f"{tasks[0]}\n{tasks[1]}\n{bad}\n{new}\n")  # two tasks appear
        out = wait_for(first, "submitted clipstream-c-")
        assert f"task {new} on top of version 2" in out and out.count(f"task {bad} bad") == 1
        second = start("second")
        wait_for(second, "waiting for the lease held by")
        client = cluster.jobs()
        (job,) = [j for j in client.list_jobs() if (j.metadata or {}).get(controller.STREAM_LABEL) == "c"]
        assert not client.get_job_status(job.submission_id).is_terminal()
        os.killpg(started[0].pid, signal.SIGKILL)  # mid-job
        started[0].wait(30)
        out = wait_for(second, f"waiting for the job of task {new}", 120)
        assert "submitted" not in out and f"task {bad} bad" in out
        wait_for(second, "promoted version 3", 1200)
        assert "all 4 tasks handled" in wait_for(second, "all 4 tasks handled", 60)
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    # one job for the new task, none for the bad one; the versions in order
    assert [j.submission_id for j in client.list_jobs() if (j.metadata or {}).get(controller.STREAM_LABEL) == "c"] \
        == [job.submission_id]
    assert client.get_job_status(job.submission_id).value == "SUCCEEDED"
    # what it submitted is the entrypoint of the RayJob it creates in Kubernetes, which validates against the CRD
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "k8s"))
    from k8s_checks import validate_all

    plan = controller.Plan("c", resources=controller.k8s.Resources(gpus_per_worker=0), overrides=JOB_SETTINGS)
    manifest = plan.manifest(controller.Incoming(str(new)), "2", first=False)
    assert (manifest["metadata"]["name"], manifest["spec"]["entrypoint"]) == (job.submission_id, job.entrypoint)
    validate_all([manifest])
    assert sorted(int(v.version) for v in registry.search_model_versions("name='clipstream'")) == [1, 2, 3]
    v3 = registry.get_model_version("clipstream", "3")
    assert (v3.tags["task"], v3.tags["parent_version"]) == (new.name, "2")
    assert {controller.alias("c", controller.Incoming(str(new))), "production"} <= set(v3.aliases)


def test_a_node_lost_mid_training_fails_the_job_in_one_line_and_registers_nothing(trained, tmp_path):
    """The second node dies (SIGKILL to its raylet and workers) while a job trains with train.max_failures=0:
    the job fails with one line naming the cause, its MLflow run is FAILED, and no version appears. (Resuming
    on the head alone cannot work here: one CPU holds both workers and leaves none for Ray Data.)"""
    from ray.job_submission import JobStatus

    from clipstream.local_cluster import rayjobs
    from tests.cluster import JOB_SETTINGS

    cluster, tasks, _ = trained
    registry = MlflowClient(cluster.mlflow_uri)
    versions = sorted(int(v.version) for v in registry.search_model_versions("name='clipstream'"))
    settings = [*JOB_SETTINGS, "train.epochs=100"]  # far longer than the test waits
    (manifest,) = rayjobs("job", "--task", str(tasks[0]), "--name", "lost", overrides=settings, cwd=tmp_path)
    client = cluster.jobs()
    # the task registered version 1 already (the stream's first job): training it again is asked for
    job = client.submit_job(entrypoint=manifest["spec"]["entrypoint"] + " --retrain")
    deadline = time.monotonic() + 300
    while "[train] step 2 " not in client.get_job_logs(job):
        assert not client.get_job_status(job).is_terminal(), client.get_job_logs(job)[-3000:]
        assert time.monotonic() < deadline, "the job did not start training"
        time.sleep(1)
    cluster.kill_node(1)
    while not client.get_job_status(job).is_terminal():
        assert time.monotonic() < deadline + 300, "the job did not end after its node was lost"
        time.sleep(2)
    logs = client.get_job_logs(job)
    assert client.get_job_status(job) == JobStatus.FAILED
    (line,) = [x for x in logs.splitlines() if x.startswith("clipstream: error:")]
    assert "training failed after train.max_failures=0 restarts" in line and "no version was registered" in line
    assert sorted(int(v.version) for v in registry.search_model_versions("name='clipstream'")) == versions
    (run,) = registry.search_runs([registry.get_experiment_by_name("clipstream").experiment_id],
                                  "attributes.status = 'FAILED'")
    assert run.data.tags["task"] == tasks[0].name


def test_stopping_the_cluster_leaves_no_process_behind(cluster_session):
    cluster = cluster_session.ready()
    groups = [p.popen.pid for p in cluster.processes]
    assert len(groups) == 3 and {"mlflow", "ray-head"} <= {p.name for p in cluster.processes if p.alive()}
    assert cluster_session.stop() == []
