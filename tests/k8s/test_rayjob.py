"""`clipstream k8s job|stream`: RayJobs that validate against KubeRay's RayJob schema, whose entrypoints are
real `clipstream train` commands, chained through aliases, and wired to what the Helm chart installs."""

import shlex
from importlib.metadata import version

import pytest
import yaml
from k8s_checks import objects, run, validate_all

from clipstream import k8s
from clipstream.cli import main
from clipstream.cli.parser import parser


def cli(capsys, *argv) -> list[dict]:
    assert main(["k8s", *argv]) == 0
    return objects(capsys.readouterr().out)


def pods(rayjob: dict) -> list[dict]:
    cluster = rayjob["spec"]["rayClusterSpec"]
    return [cluster["headGroupSpec"]["template"], *[g["template"] for g in cluster["workerGroupSpecs"]]]


def train_args(rayjob: dict):
    command = shlex.split(rayjob["spec"]["entrypoint"])
    assert command[:2] == ["clipstream", "train"]
    return parser().parse_args(command[1:])


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    """The chart as installed with its default values (secrets created), release clipstream."""
    return objects(run("helm", "template", "clipstream", "charts/clipstream", "--namespace", "clipstream"))


def test_job_validates_and_runs_clipstream_train(capsys):
    (rayjob,) = cli(capsys, "job", "--task", "s3://bucket/tasks/task-00-household", "--method", "ewc",
                    "--workers", "4", "--gpus-per-worker", "2", "--set", "train.epochs=3", "--parent", "production")
    validate_all([rayjob])
    assert rayjob["metadata"]["name"] == "clipstream-train-task-00-household"
    args = train_args(rayjob)
    assert (args.task, args.method, args.workers, args.gpus_per_worker, args.set, args.parent) == (
        "s3://bucket/tasks/task-00-household", "ewc", 4, 2.0, ["train.epochs=3"], "production")
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["submissionMode"] == "K8sJobMode"
    assert spec["ttlSecondsAfterFinished"] > 0 and spec["activeDeadlineSeconds"] > 0 and spec["backoffLimit"] == 0
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 4
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert spec["rayClusterSpec"]["rayVersion"] == version("ray")


def test_cpu_job_asks_for_no_gpu(capsys):
    (rayjob,) = cli(capsys, "job", "--task", "/mnt/data/task-01", "--gpus-per-worker", "0", "--variant", "cpu",
                    "--name", "t1", "--release", "cs", "--namespace", "ml")
    validate_all([rayjob])
    assert rayjob["metadata"] == {**rayjob["metadata"], "name": "cs-train-t1", "namespace": "ml"}
    for pod in pods(rayjob):
        (container,) = pod["spec"]["containers"]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert container["image"] == f"ghcr.io/clipstream/clipstream:{version('clipstream')}-cpu"
        assert container["envFrom"] == [{"configMapRef": {"name": "cs-settings"}},
                                        {"secretRef": {"name": "cs-object-store", "optional": True}}]
    assert train_args(rayjob).gpus_per_worker == 0


def test_stream_chains_each_job_to_its_parents_alias(capsys):
    jobs = cli(capsys, "stream", "--tasks", "s3://b/t0", "s3://b/t1", "gs://b/t2", "--method", "finetune",
               "--name", "run7", "--parent", "production", "--wait-parent", "600", "--zero-shot", "s3://b/held")
    validate_all(jobs)
    assert [j["metadata"]["name"] for j in jobs] == [f"clipstream-train-run7-{k}" for k in (1, 2, 3)]
    args = [train_args(j) for j in jobs]
    assert [a.task for a in args] == ["s3://b/t0", "s3://b/t1", "gs://b/t2"]
    assert [a.alias for a in args] == [["run7-1"], ["run7-2"], ["run7-3"]]
    assert [a.parent for a in args] == ["production", "@run7-1", "@run7-2"]
    assert [a.wait_parent for a in args] == [0, 600, 600]  # the first one's parent must exist already
    assert [a.zero_shot for a in args] == [["s3://b/held"], [], []]  # the later versions inherit it
    # a job that waits for its parent gets that much more time before its deadline
    assert jobs[1]["spec"]["activeDeadlineSeconds"] == jobs[0]["spec"]["activeDeadlineSeconds"] + 600
    # jobs 2..n hold no Ray cluster until the controller resumes them, once the parent their annotation names exists
    assert [j["spec"].get("suspend", False) for j in jobs] == [False, True, True]
    assert [j["metadata"].get("annotations", {}).get("clipstream.io/parent") for j in jobs] == [None, "@run7-1", "@run7-2"]
    # by default nothing waits: a suspended job starts only once its parent is registered
    plain = cli(capsys, "stream", "--tasks", "s3://b/t0", "s3://b/t1", "--name", "run8")
    assert [train_args(j).wait_parent for j in plain] == [0, 0]
    assert plain[1]["spec"]["activeDeadlineSeconds"] == plain[0]["spec"]["activeDeadlineSeconds"]


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["k8s", "job", "--task", "s3://b/t", "--method", "nope"]) == 2
    assert "unknown method preset 'nope'" in capsys.readouterr().err
    assert main(["k8s", "job", "--task", "s3://b/t", "--set", "train.nope=1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["k8s", "job", "--task", "s3://b/___/"]) == 2
    assert "pass --name" in capsys.readouterr().err


def test_job_uses_what_the_chart_installs(capsys, chart):
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0")
    service = next(o for o in chart if o["kind"] == "RayService")
    serve_pod = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    config_maps = {o["metadata"]["name"] for o in chart if o["kind"] == "ConfigMap"}
    secrets = {o["metadata"]["name"]: {**o.get("data", {}), **o.get("stringData", {})}
               for o in chart if o["kind"] == "Secret"}
    claims = {o["metadata"]["name"] for o in chart if o["kind"] == "PersistentVolumeClaim"}
    accounts = {o["metadata"]["name"] for o in chart if o["kind"] == "ServiceAccount"}
    for pod in pods(rayjob) + [rayjob["spec"]["submitterPodTemplate"]]:
        spec = pod["spec"]
        assert spec["serviceAccountName"] in accounts
        assert spec["securityContext"] == serve_pod["spec"]["securityContext"]
        for volume in spec["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in spec["containers"]:
            assert container["image"] == serve_pod["spec"]["containers"][0]["image"]
            assert container["securityContext"] == serve_pod["spec"]["containers"][0]["securityContext"]
            for ref in container.get("envFrom", []):
                assert ref["configMapRef"]["name"] in config_maps if "configMapRef" in ref else ref["secretRef"]["optional"]
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], f"{ref} is not in the chart's Secrets"
    # the same Settings reach the serving pods and the training pods
    serve_env = serve_pod["spec"]["containers"][0]
    job_env = pods(rayjob)[0]["spec"]["containers"][0]
    assert [r for r in job_env["envFrom"] if "configMapRef" in r] == [r for r in serve_env["envFrom"] if "configMapRef" in r]
    assert {e["name"] for e in job_env["env"]} <= {e["name"] for e in serve_env["env"]}


def test_renderer_and_image_agree_on_ray():
    from test_images import arg_defaults

    assert k8s.RAY_VERSION == arg_defaults()["RAY_VERSION"] == version("ray")


def test_dump_is_plain_yaml():
    text = k8s.dump([{"a": "x: y"}, {"b": 1}])
    assert list(yaml.safe_load_all(text)) == [{"a": "x: y"}, {"b": 1}]


def test_the_committed_job_template_is_what_the_cli_prints(capsys):
    """k8s/jobs/train-task.yaml (the RayJob template of k8s/) is regenerated by `make k8s-base`."""
    from k8s_checks import REPO

    header, _, body = (REPO / "k8s/jobs/train-task.yaml").read_text().partition("\napiVersion")
    command = shlex.split(header.splitlines()[0].lstrip("# ").split("  (")[0])
    assert main(command[1:]) == 0
    assert "apiVersion" + body == capsys.readouterr().out, "k8s/jobs/train-task.yaml is stale: run `make k8s-base`"
