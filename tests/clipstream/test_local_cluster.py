"""Cluster mode for real: a 2-node Ray cluster (`ray start`) and an MLflow server over HTTP on this machine,
training submitted through the Ray Jobs API with the entrypoints of the RayJobs `clipstream k8s stream`
renders, under the settings of the Helm chart's ConfigMap."""

import os
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


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


def test_a_node_lost_mid_training_fails_the_job_in_one_line_and_registers_nothing(trained, tmp_path):
    """The second node dies (SIGKILL to its raylet and workers) while a job trains with train.max_failures=0:
    the job fails with one line naming the cause, its MLflow run is FAILED, and no version appears. (Resuming
    on the head alone cannot work here: one CPU holds both workers and leaves none for Ray Data.)"""
    from ray.job_submission import JobStatus

    from tests.cluster import JOB_SETTINGS, rayjobs

    cluster, tasks, _ = trained
    settings = [*JOB_SETTINGS, "train.epochs=100"]  # far longer than the test waits
    (manifest,) = rayjobs("job", "--task", str(tasks[0]), "--name", "lost", settings=settings)
    client = cluster.jobs()
    job = client.submit_job(entrypoint=manifest["spec"]["entrypoint"])
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
    registry = MlflowClient(cluster.mlflow_uri)
    assert sorted(int(v.version) for v in registry.search_model_versions("name='clipstream'")) == [1, 2]
    (run,) = registry.search_runs([registry.get_experiment_by_name("clipstream").experiment_id],
                                  "attributes.status = 'FAILED'")
    assert run.data.tags["task"] == tasks[0].name


def test_stopping_the_cluster_leaves_no_process_behind(cluster_session):
    cluster = cluster_session.ready()
    groups = [p.popen.pid for p in cluster.processes]
    assert len(groups) == 3 and {"mlflow", "ray-head"} <= {p.name for p in cluster.processes if p.alive()}
    assert cluster_session.stop() == []
