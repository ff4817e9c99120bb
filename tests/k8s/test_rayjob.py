"""`clipstream k8s job|stream`: RayJobs that validate against KubeRay's RayJob schema, whose entrypoints are
real `clipstream train` commands, chained through aliases, and wired to what the Helm chart installs."""

import json
import shlex
from importlib.metadata import version

import pytest
import yaml
from k8s_checks import objects, run, validate_all

from clipstream import k8s
from clipstream.cli import main
from clipstream.cli.parser import parser


def printed(capsys, *argv) -> list[dict]:
    assert main(["k8s", *argv]) == 0
    return objects(capsys.readouterr().out)


def cli(capsys, *argv) -> list[dict]:
    """The RayJobs printed (after the training pods' NetworkPolicy)."""
    docs = printed(capsys, *argv)
    assert [d["kind"] for d in docs] == ["NetworkPolicy"] + ["RayJob"] * (len(docs) - 1)
    return docs[1:]


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
    assert spec["submissionMode"] == "K8sJobMode" and spec["activeDeadlineSeconds"] > 0 and spec["backoffLimit"] == 0
    (workers,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 4
    assert workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert spec["rayClusterSpec"]["rayVersion"] == version("ray")


def test_the_cluster_goes_when_the_job_ends_and_the_rayjob_a_day_later(capsys):
    """KubeRay's deletionRules (not ttlSecondsAfterFinished, which keeps the whole cluster, GPUs included, until
    it expires): however the job ends, its RayCluster is deleted at once and the RayJob (status, submitter logs)
    kept for a day, in the order KubeRay's validation requires."""
    for rayjob in cli(capsys, "job", "--task", "s3://b/t0") + cli(capsys, "stream", "--tasks", "s3://b/t0", "s3://b/t1"):
        spec = rayjob["spec"]
        # KubeRay refuses deletionRules with shutdownAfterJobFinishes, and a TTL without it
        assert spec["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in spec
        rules = {}
        for rule in spec["deletionStrategy"]["deletionRules"]:
            condition = dict(rule["condition"])
            ttl = condition.pop("ttlSeconds")
            assert (tuple(condition.items()), rule["policy"]) not in rules  # one rule per end and policy
            rules[tuple(condition.items()), rule["policy"]] = ttl
        ends = {(("jobStatus", "SUCCEEDED"),), (("jobStatus", "FAILED"),), (("jobDeploymentStatus", "Failed"),)}
        assert {end for end, _ in rules} == ends  # a deadline or a failed submitter too, not only the Ray job
        for end in ends:
            assert rules[end, "DeleteCluster"] == 0 and rules[end, "DeleteSelf"] == 24 * 3600
    validate_all([rayjob])


def test_job_token_auth_as_the_release(capsys):
    """The job's Ray cluster requires Ray's token (KubeRay makes the Secret and hands it to the Ray pods and the
    submitter; KubeRay needs Ray >= 2.52 for it); --no-ray-auth turns it off."""
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0")
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert tuple(map(int, cluster["rayVersion"].split("."))) >= (2, 52)
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--no-ray-auth")
    assert "authOptions" not in rayjob["spec"]["rayClusterSpec"]


def test_workers_go_where_they_are_told_and_tolerate_the_gpu_taint(capsys):
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu.type", "operator": "In", "values": ["h100", "h200"]}]}]}}}
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--node-selector", "pool=train",
                    "--node-selector", "nvidia.com/gpu.present=true", "--toleration", "dedicated=train:NoSchedule",
                    "--toleration", "spot:NoExecute", "--toleration", "maintenance", "--priority-class", "train-high",
                    "--affinity", json.dumps(affinity))
    validate_all([rayjob])
    head, worker = pods(rayjob)
    assert worker["spec"]["nodeSelector"] == {"pool": "train", "nvidia.com/gpu.present": "true"}
    assert worker["spec"]["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "train", "effect": "NoSchedule"},
        {"key": "spot", "operator": "Exists", "effect": "NoExecute"}, {"key": "maintenance", "operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]  # added: the GPU operator's taint
    assert worker["spec"]["affinity"] == affinity
    # every pod has the priority (a preempted head or submitter ends the job too); only the workers need GPU nodes
    for pod in (head, worker, rayjob["spec"]["submitterPodTemplate"]):
        assert pod["spec"]["priorityClassName"] == "train-high"
    for pod in (head, rayjob["spec"]["submitterPodTemplate"]):
        assert not {"nodeSelector", "tolerations", "affinity"} & set(pod["spec"])

    # GPU workers tolerate the GPU taint by default; CPU workers have nothing to tolerate
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0")
    assert pods(rayjob)[1]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                                       "effect": "NoSchedule"}]
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--gpus-per-worker", "0")
    assert not {"nodeSelector", "tolerations", "affinity", "priorityClassName"} & set(pods(rayjob)[1]["spec"])


def test_env_labels_and_annotations_reach_the_rayjob_and_its_pods(capsys):
    jobs = cli(capsys, "stream", "--tasks", "s3://b/t0", "s3://b/t1", "--name", "s", "--env", "NCCL_DEBUG=INFO",
               "--env", "HF_HUB_OFFLINE=1", "--label", "kueue.x-k8s.io/queue-name=gpu", "--label", "team=ml",
               "--annotation", "example.com/owner=ml team <ml@example.com>")
    validate_all(jobs)
    for rayjob in jobs:
        submitter = rayjob["spec"]["submitterPodTemplate"]
        for meta in [rayjob["metadata"]] + [p["metadata"] for p in pods(rayjob) + [submitter]]:
            assert {"kueue.x-k8s.io/queue-name": "gpu", "team": "ml"}.items() <= meta["labels"].items()
            assert meta["annotations"] == {"example.com/owner": "ml team <ml@example.com>",
                                           **({"clipstream.io/parent": "@s-1"} if meta is rayjob["metadata"]
                                              and rayjob["spec"].get("suspend") else {})}
        assert rayjob["metadata"]["labels"]["clipstream.io/step"] in ("1", "2")  # the stream's labels stay
        for pod in pods(rayjob):
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env["NCCL_DEBUG"] == "INFO" and env["HF_HUB_OFFLINE"] == "1"
        assert "NCCL_DEBUG" not in {e["name"] for e in submitter["spec"]["containers"][0]["env"]}


def test_runs_dir_on_the_volume_or_an_object_store(capsys):
    """The runs PVC is mounted only where runs_dir is on it; a URI reaches the pods' Settings unchanged."""
    def runs(rayjob):
        out = []
        for pod in pods(rayjob):
            (container,) = pod["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            claims = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            out.append((env.get("CLIPSTREAM_RUNS_DIR"), len(claims), k8s.RUNS_MOUNT in mounts))
        return set(out)

    assert runs(cli(capsys, "job", "--task", "s3://b/t0")[0]) == {(None, 1, True)}  # the ConfigMap's runs_dir
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--runs-dir", "/mnt/clipstream/runs/exp-1")
    assert runs(rayjob) == {("/mnt/clipstream/runs/exp-1", 1, True)}
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--runs-dir", "s3://bucket/runs")
    validate_all([rayjob])
    assert runs(rayjob) == {("s3://bucket/runs", 0, False)}
    for pod in pods(rayjob):
        assert "runs" not in {v["name"] for v in pod["spec"]["volumes"]}


@pytest.mark.component
def test_jobs_run_the_image_the_release_runs(capsys, tmp_path):
    """From the values files the release was installed with (as push.sh writes them: the tag pinned to a
    digest), the job's image is the one the chart renders for the RayService; or an --image by tag or digest."""
    digest = "sha256:" + "ab" * 32
    values = tmp_path / "gpu.values.yaml"
    values.write_text(f"image:\n  repository: registry.example.com/ml/clipstream\n  tag: \"0.1.0-gpu@{digest}\"\n")
    cpu = tmp_path / "cpu.yaml"
    cpu.write_text("image:\n  variant: cpu\n")
    for files in ([values], [cpu], [values, cpu]):
        args = [a for f in files for a in ("--release-values", str(f))]
        (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", *args)
        chart = objects(run("helm", "template", "clipstream", "charts/clipstream",
                            *[a for f in files for a in ("-f", str(f))]))
        serve = next(o for o in chart if o["kind"] == "RayService")
        image = serve["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
        assert {c["image"] for p in pods(rayjob) for c in p["spec"]["containers"]} == {image}
    assert image == f"registry.example.com/ml/clipstream:0.1.0-gpu@{digest}"  # (a later file's variant: its tag wins)
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--image", f"ghcr.io/org/clipstream@{digest}")
    assert pods(rayjob)[0]["spec"]["containers"][0]["image"] == f"ghcr.io/org/clipstream@{digest}"
    # a digest is the image wherever a node has it; a tag is asked of the registry by every pod
    assert {c["imagePullPolicy"] for p in pods(rayjob) for c in p["spec"]["containers"]} == {"IfNotPresent"}
    (rayjob,) = cli(capsys, "job", "--task", "s3://b/t0", "--image", "ghcr.io/org/clipstream:0.1.0-gpu")
    assert {c["imagePullPolicy"] for p in pods(rayjob) for c in p["spec"]["containers"]} == {"Always"}


def selects(selector: dict, labels: dict) -> bool:
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.component
def test_training_pods_take_ray_traffic_only_from_each_other(capsys, chart):
    """The NetworkPolicy printed with the jobs: every pod of a job is selected; the Ray ports admit the training
    pods of the release only (not serving's, not another release's); the dashboard is open to the operator."""
    policy, *jobs = printed(capsys, "stream", "--tasks", "s3://b/t0", "s3://b/t1", "--release", "cs", "--namespace", "ml")
    validate_all([policy])
    assert policy["metadata"] == {**policy["metadata"], "name": "cs-train", "namespace": "ml"}
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    peers_rule, dashboard_rule = spec["ingress"]
    (peers,) = peers_rule["from"]
    assert "ports" not in peers_rule and dashboard_rule == {"ports": [{"protocol": "TCP", "port": 8265}]}
    for rayjob in jobs:
        for pod in pods(rayjob) + [rayjob["spec"]["submitterPodTemplate"]]:
            labels = pod["metadata"]["labels"]
            assert selects(spec["podSelector"], labels) and selects(peers["podSelector"], labels)
    (other,) = cli(capsys, "job", "--task", "s3://b/t0")  # release clipstream
    serving = [o for o in chart if o["kind"] == "RayService"][0]["spec"]["rayClusterConfig"]["headGroupSpec"]
    for outsider in (pods(other)[0], serving["template"]):
        assert not selects(peers["podSelector"], outsider["metadata"]["labels"])


@pytest.mark.parametrize("argv, message", [
    (["--toleration", "dedicated=train:Sometimes"], "--toleration 'dedicated=train:Sometimes': expected"),
    (["--toleration", "bad key:NoSchedule"], "--toleration 'bad key:NoSchedule'"),
    (["--node-selector", "pool"], "--node-selector 'pool': expected KEY=VALUE"),
    (["--node-selector", "pool=a b"], "a label value is at most 63"),
    (["--priority-class", "High_Priority"], "--priority-class 'High_Priority': not a Kubernetes name"),
    (["--affinity", "[1, 2]"], "--affinity: expected a YAML or JSON mapping"),
    (["--affinity", "{nodeAffinty: {}}"], "--affinity: expected a YAML or JSON mapping"),
    (["--env", "1X=y"], "--env '1X=y': expected KEY=VALUE"),
    (["--env", "CLIPSTREAM_RUNS_DIR=s3://b/r"], "--env CLIPSTREAM_RUNS_DIR: clipstream sets it (from --runs-dir)"),
    (["--env", "CLIPSTREAM_API_KEY=x"], "clipstream sets it (from the release's Secret)"),
    (["--label", "app.kubernetes.io/instance=x"], "--label app.kubernetes.io/instance: clipstream sets"),
    (["--annotation", "=x"], "--annotation '=x': expected KEY=VALUE"),
    (["--image", "ghcr.io/org/clipstream"], "--image 'ghcr.io/org/clipstream': expected REPOSITORY:TAG"),
    (["--image", "ghcr.io/org/clipstream@sha256:abc"], "expected REPOSITORY:TAG or REPOSITORY@sha256:DIGEST"),
    (["--image", "ghcr.io/o/c:1", "--variant", "cpu"], "--image names the image: leave out --release-values"),
    (["--release-values", "no/such/values.yaml"], "--release-values no/such/values.yaml: No such file"),
    (["--runs-dir", "/data/runs"], "--runs-dir /data/runs: give a folder under /mnt/clipstream/runs"),
    (["--runs-dir", "/mnt/clipstream/runs/../../etc"], "give a folder under /mnt/clipstream/runs"),
    (["--runs-dir", "file:///tmp/runs"], "a file:// folder is each pod's own"),
])
def test_bad_kubernetes_values_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["k8s", "job", "--task", "s3://b/t", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cpu_job_asks_for_no_gpu(capsys):
    (rayjob,) = cli(capsys, "job", "--task", "/mnt/data/task-01", "--gpus-per-worker", "0", "--variant", "cpu",
                    "--name", "t1", "--release", "cs", "--namespace", "ml")
    validate_all([rayjob])
    assert rayjob["metadata"] == {**rayjob["metadata"], "name": "cs-train-t1", "namespace": "ml"}
    for pod in pods(rayjob):
        (container,) = pod["spec"]["containers"]
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert container["image"] == f"ghcr.io/clipstream/clipstream:{version('clipstream-continual')}-cpu"
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


@pytest.mark.component
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


def test_dump_is_plain_yaml_without_anchors(capsys):
    text = k8s.dump([{"a": "x: y"}, {"b": 1}])
    assert list(yaml.safe_load_all(text)) == [{"a": "x: y"}, {"b": 1}]
    shared = {"key": "nvidia.com/gpu"}  # one object in two places is written twice, not as &id001 / *id001
    text = k8s.dump([{"a": [shared], "b": [shared]}])
    assert "&id" not in text and "*id" not in text and yaml.safe_load(text) == {"a": [shared], "b": [shared]}
    for argv in (["job", "--task", "s3://b/t0", "--toleration", "a:NoSchedule", "--label", "q=x", "--annotation",
                  "q=x", "--node-selector", "q=x"], ["stream", "--tasks", "s3://b/t0", "s3://b/t1", "--label", "q=x"]):
        assert main(["k8s", *argv]) == 0
        out = capsys.readouterr().out
        assert "&id" not in out and "*id" not in out


def test_the_committed_job_template_is_what_the_cli_prints(capsys):
    """k8s/jobs/train-task.yaml (the RayJob template of k8s/) is regenerated by `make k8s-base`."""
    from k8s_checks import REPO

    header, _, body = (REPO / "k8s/jobs/train-task.yaml").read_text().partition("\napiVersion")
    command = shlex.split(header.splitlines()[0].lstrip("# ").split("  (")[0])
    assert main(command[1:]) == 0
    assert "apiVersion" + body == capsys.readouterr().out, "k8s/jobs/train-task.yaml is stale: run `make k8s-base`"
