"""The Helm chart charts/clipstream, rendered with the real `helm` (default values and each ci/ values file)
and checked for the wiring that breaks a deployment: schema validity (Kubernetes 1.35 + KubeRay v1.7.0),
the gRPC port path (Serve config -> Ray containers -> Service -> ConfigMap), Ray Serve's own config
schema, references to Secrets/ConfigMaps/PVCs, pod security, NetworkPolicy selectors, the Settings the
ConfigMap sets, image tags and values.schema.json.

The `check_*` functions are shared with test_kustomize.py (the kustomize overlays must pass the same).
"""

from __future__ import annotations

import ast
import fnmatch
import math
import os
import re
import subprocess

import pytest
import yaml
from k8s_checks import REPO, objects, run, tool, validate_all

CHART = "charts/clipstream"
RELEASE = "clipstream"
NAMESPACE = "clipstream"
IMAGE_REPO = "ghcr.io/clipstream/clipstream"


def project_version() -> str:
    """`[project] version` of pyproject.toml (tomllib is not in Python 3.10, which the package supports)."""
    text = (REPO / "pyproject.toml").read_text()
    table = re.search(r"^\[project\]\n(.*?)(?=^\[)", text, re.MULTILINE | re.DOTALL).group(1)
    return re.search(r'^version\s*=\s*"([^"]+)"', table, re.MULTILINE).group(1)


VERSION = project_version()
# The Secrets the chart documents (values.yaml, k8s/README.md): name -> keys.
SECRETS = {f"{RELEASE}-qdrant": {"api-key"}, f"{RELEASE}-api": {"api-key"}, f"{RELEASE}-postgres": {"password"},
           f"{RELEASE}-object-store": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}}
HOOK = "helm.sh/hook"


def app_constants() -> dict:
    """GRPC_SERVICERS and SERVE_ENV of services/app.py, read without importing Ray."""
    tree = ast.parse((REPO / "services" / "app.py").read_text())
    out = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id in ("GRPC_SERVICERS", "SERVE_ENV", "APP"):
            out[target.id] = ast.literal_eval(node.value)
    return out


def helm_template(*args: str, release: str = RELEASE) -> str:
    return run("helm", "template", release, CHART, "--namespace", NAMESPACE, *args)


def helm_fails(*args: str) -> str:
    """stderr of a `helm template` that must fail."""
    out = subprocess.run([tool("helm"), "template", RELEASE, CHART, "--namespace", NAMESPACE, *args],
                         capture_output=True, text=True, cwd=REPO, check=False)
    assert out.returncode != 0, f"helm template {' '.join(args)} should have failed"
    return out.stderr


# ---------------------------------------------------------------- accessors

def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_templates(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(where, pod metadata, pod spec) of every pod the render creates, RayService groups included."""
    out = []
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = d["spec"]["template"]
            out.append((where, t.get("metadata", {}), t["spec"]))
        elif d["kind"] == "Pod":
            out.append((where, d["metadata"], d["spec"]))
        elif d["kind"] in ("RayService", "RayCluster", "RayJob"):
            rc = d["spec"]["rayClusterConfig"] if d["kind"] != "RayCluster" else d["spec"]
            groups = [("head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc.get("workerGroupSpecs", [])]
            for name, g in groups:
                out.append((f"{where}[{name}]", g["template"].get("metadata", {}), g["template"]["spec"]))
    return out


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def ray_groups(docs: list[dict]) -> tuple[dict, list[dict]]:
    (rs,) = by_kind(docs, "RayService")
    rc = rs["spec"]["rayClusterConfig"]
    return rc["headGroupSpec"], rc["workerGroupSpecs"]


def settings_map(docs: list[dict]) -> dict:
    return one(docs, "ConfigMap", f"{RELEASE}-settings")["data"]


def serve_config(docs: list[dict]) -> dict:
    (rs,) = by_kind(docs, "RayService")
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------- shared checks

def check_valid(docs: list[dict]) -> None:
    assert docs
    validate_all(docs)


def check_serve_wiring(docs: list[dict]) -> None:
    """One gRPC port end to end, and a serveConfigV2 that Ray itself accepts."""
    from ray.serve.schema import ServeDeploySchema

    consts = app_constants()
    config = serve_config(docs)
    ServeDeploySchema.model_validate(config)
    port = config["grpc_options"]["port"]
    assert config["grpc_options"]["grpc_servicer_functions"] == consts["GRPC_SERVICERS"]
    assert config["grpc_options"]["enable_reflection"] is True
    assert config["proxy_location"] == "EveryNode"
    (app,) = config["applications"]
    assert app["import_path"] == "clipstream.services.app:app"
    assert app["name"] == consts["APP"] and app["route_prefix"] == f"/{consts['APP']}"
    # the serving settings reach the application builder as args (applied in place), the same as the ConfigMap's
    serving = {k.removeprefix("CLIPSTREAM_").lower(): v for k, v in settings_map(docs).items()
               if k.startswith("CLIPSTREAM_SERVE_")}
    assert serving and {k: str(v) for k, v in app["args"].items()} == serving
    rc = one(docs, "RayService", f"{RELEASE}-serve")["spec"]["rayClusterConfig"]
    scaled = {d["name"]: d for d in app.get("deployments", [])}
    assert set(scaled) <= {"Encoder"} and rc.get("enableInTreeAutoscaling", False) == bool(scaled)
    if scaled:  # Serve scales the Encoder from settings.serve_replicas; the autoscaler follows with pods
        scaling = scaled["Encoder"]["autoscaling_config"]
        assert scaled["Encoder"]["num_replicas"] == "auto" and rc["autoscalerOptions"]
        assert scaling["min_replicas"] <= scaling["initial_replicas"] == int(serving["serve_replicas"]) <= \
            scaling["max_replicas"]

    svc = one(docs, "Service", f"{RELEASE}-grpc")
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["name"] == "grpc" and svc_port["appProtocol"] == "kubernetes.io/h2c"
    assert svc_port["port"] == port and svc_port["targetPort"] == port
    assert svc["spec"]["selector"] == {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": "serve",
                                       "ray.io/serve": "true"}
    assert settings_map(docs)["CLIPSTREAM_GRPC_PORT"] == str(port)

    head, workers = ray_groups(docs)
    (head_c,) = head["template"]["spec"]["containers"]
    assert head_c["name"] == "ray-head"
    assert {p["name"]: p["containerPort"] for p in head_c["ports"]}["grpc"] == port
    assert "nvidia.com/gpu" not in head_c["resources"].get("limits", {})
    assert [g["groupName"] for g in workers] == ["gpu"]
    for group in workers:
        (c,) = group["template"]["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == port
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # KubeRay adds ray.io/serve to healthy pods; the rest of the selector must already be on them.
    base_selector = {k: v for k, v in svc["spec"]["selector"].items() if k != "ray.io/serve"}
    for group in [head, *workers]:
        assert matches(base_selector, group["template"]["metadata"]["labels"])
    for ingress in by_kind(docs, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {"name": f"{RELEASE}-grpc", "port": {"name": "grpc"}}


def check_ray_pods(docs: list[dict], gpus: int) -> None:
    """The contract `clipstream k8s job` relies on too: env, secrets, volumes, labels, service account."""
    consts = app_constants()
    head, workers = ray_groups(docs)
    for group in [head, *workers]:
        meta, spec = group["template"]["metadata"], group["template"]["spec"]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "clipstream"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] == "serve"
        assert labels["clipstream.io/qdrant-client"] == "true" and labels["clipstream.io/mlflow-client"] == "true"
        assert spec["serviceAccountName"] == RELEASE
        assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                                           "seccompProfile": {"type": "RuntimeDefault"}}
        (c,) = spec["containers"]
        assert c["envFrom"][0] == {"configMapRef": {"name": f"{RELEASE}-settings"}}
        env = {e["name"]: e for e in c["env"]}
        assert env["CLIPSTREAM_QDRANT_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-qdrant",
                                                                                 "key": "api-key"}
        assert env["CLIPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-api", "key": "api-key"}
        assert {k: env[k]["value"] for k in consts["SERVE_ENV"] if k in env} == consts["SERVE_ENV"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts["/mnt/clipstream/runs"]]["persistentVolumeClaim"]["claimName"] == f"{RELEASE}-runs"
        assert "emptyDir" in volumes[mounts["/tmp"]] and "emptyDir" in volumes[mounts["/home/ray/.cache"]]
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
    # the serve workers hold GPUs only when the Encoder asks for them: one setting drives both
    asked = float(settings_map(docs)["CLIPSTREAM_SERVE_ENCODER_GPUS"])
    assert math.ceil(asked) == gpus
    for group in workers:
        (c,) = group["template"]["spec"]["containers"]
        limits = c["resources"]["limits"]
        if gpus:
            assert limits["nvidia.com/gpu"] == gpus and group["rayStartParams"]["num-gpus"] == str(gpus)
        else:
            assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in c["resources"]["requests"]
            assert "num-gpus" not in group["rayStartParams"]
    sa = one(docs, "ServiceAccount", RELEASE)
    assert sa["automountServiceAccountToken"] is False
    runs = one(docs, "PersistentVolumeClaim", f"{RELEASE}-runs")
    assert runs["spec"]["accessModes"] == ["ReadWriteMany"]


def referenced(docs: list[dict]) -> dict[str, dict[str, list[tuple[str, str | None, bool]]]]:
    """kind -> name -> [(where, key or None, optional)] of every Secret, ConfigMap and PVC a pod uses."""
    refs: dict[str, dict[str, list]] = {"Secret": {}, "ConfigMap": {}, "PersistentVolumeClaim": {}}

    def add(kind, name, where, key=None, optional=False):
        refs[kind].setdefault(name, []).append((where, key, bool(optional)))

    for where, _meta, spec in pod_templates(docs):
        for c in containers(spec):
            for src in c.get("envFrom", []):
                if "secretRef" in src:
                    add("Secret", src["secretRef"]["name"], where, None, src["secretRef"].get("optional"))
                if "configMapRef" in src:
                    add("ConfigMap", src["configMapRef"]["name"], where, None, src["configMapRef"].get("optional"))
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    r = ref["secretKeyRef"]
                    add("Secret", r["name"], where, r["key"], r.get("optional"))
                if "configMapKeyRef" in ref:
                    r = ref["configMapKeyRef"]
                    add("ConfigMap", r["name"], where, r["key"], r.get("optional"))
        for s in spec.get("imagePullSecrets", []):
            add("Secret", s["name"], where)
        for v in spec.get("volumes", []):
            if "secret" in v:
                add("Secret", v["secret"]["secretName"], where, None, v["secret"].get("optional"))
            if "configMap" in v:
                add("ConfigMap", v["configMap"]["name"], where, None, v["configMap"].get("optional"))
            if "persistentVolumeClaim" in v:
                add("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"], where)
            for src in v.get("projected", {}).get("sources", []):
                if "secret" in src:
                    add("Secret", src["secret"]["name"], where, None, src["secret"].get("optional"))
                if "configMap" in src:
                    add("ConfigMap", src["configMap"]["name"], where, None, src["configMap"].get("optional"))
    return refs


def check_references(docs: list[dict], secrets_rendered: bool) -> None:
    """Everything a pod names exists in the render (Secrets: only where the render creates them)."""
    refs = referenced(docs)
    assert refs["ConfigMap"] and refs["Secret"] and refs["PersistentVolumeClaim"]
    for kind in ("ConfigMap", "PersistentVolumeClaim"):
        present = {d["metadata"]["name"]: d for d in by_kind(docs, kind)}
        for name, uses in refs[kind].items():
            assert name in present, f"{kind} {name} (used by {uses[0][0]}) is not in the render"
            for where, key, _ in uses:
                assert key is None or key in present[name].get("data", {}), f"{where}: {kind} {name} has no {key}"
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}
    for name, uses in refs["Secret"].items():
        assert name in SECRETS, f"{uses[0][0]} uses Secret {name}, not one the chart documents ({sorted(SECRETS)})"
        for where, key, optional in uses:
            assert key is None or key in SECRETS[name], f"{where}: {name} documents no key {key}"
            if secrets_rendered and not optional:
                assert name in secrets, f"{where}: Secret {name} is not in the render"
                assert key is None or key in {**secrets[name].get("data", {}), **secrets[name].get("stringData", {})}
    if not secrets_rendered:
        assert not secrets, f"Secrets must only be referenced here, yet {sorted(secrets)} are rendered"


def check_security(docs: list[dict]) -> None:
    """Every container: non-root, a non-zero uid, no privilege escalation, read-only root, no capabilities,
    seccomp RuntimeDefault, cpu and memory requests and limits."""
    pods = pod_templates(docs)
    assert pods
    for where, _meta, spec in pods:
        pod_sc = spec.get("securityContext", {})
        for c in containers(spec):
            sc = c.get("securityContext", {})
            name = f"{where}/{c['name']}"
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, name
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) > 0, name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert sc.get("readOnlyRootFilesystem") is True, name
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
            assert sc.get("privileged") in (None, False), name
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", name
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(part, {})), f"{name}: {part}"


def check_selectors(docs: list[dict]) -> None:
    """NetworkPolicies and Services select pods that the render creates."""
    labels = [meta.get("labels", {}) for _, meta, _ in pod_templates(docs)]
    policies = by_kind(docs, "NetworkPolicy")
    for np in policies:
        name = np["metadata"]["name"]
        selector = np["spec"]["podSelector"]["matchLabels"]
        assert selector and any(matches(selector, lab) for lab in labels), f"NetworkPolicy {name} selects no pod"
        assert np["spec"]["ingress"], f"NetworkPolicy {name} admits nothing"
        for rule in np["spec"]["ingress"]:
            for peer in rule["from"]:
                peer_sel = peer["podSelector"]["matchLabels"]
                assert any(matches(peer_sel, lab) for lab in labels), f"NetworkPolicy {name}: no pod matches {peer_sel}"
    for svc in by_kind(docs, "Service"):
        sel = {k: v for k, v in svc["spec"].get("selector", {}).items() if k != "ray.io/serve"}
        assert sel and any(matches(sel, lab) for lab in labels), f"Service {svc['metadata']['name']} selects no pod"
    for sts in by_kind(docs, "StatefulSet") + by_kind(docs, "Deployment"):
        assert matches(sts["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])


def check_settings(docs: list[dict], monkeypatch, tmp_path) -> None:
    """The ConfigMap's keys are Settings fields and Settings accepts their values."""
    from clipstream.settings import Settings

    data = settings_map(docs)
    fields = {f"CLIPSTREAM_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= fields, f"not Settings fields: {sorted(set(data) - fields)}"
    assert data["CLIPSTREAM_RAY_ADDRESS"] == "auto"
    assert data["CLIPSTREAM_HOME"] == "/tmp/clipstream" and data["CLIPSTREAM_RUNS_DIR"] == "/mnt/clipstream/runs"
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("CLIPSTREAM_"):
            monkeypatch.delenv(name)
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CLIPSTREAM_HOME", str(tmp_path / "home"))
    settings = Settings()
    assert settings.grpc_port == int(data["CLIPSTREAM_GRPC_PORT"])
    assert settings.ray_address == "auto"
    assert str(settings.runs_dir) == "/mnt/clipstream/runs"
    assert not settings.embedded_registry


def check_services(docs: list[dict]) -> None:
    """The URIs in the ConfigMap point at Services of the render (when bundled), on the right ports."""
    data = settings_map(docs)
    services = {d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]} for d in by_kind(docs, "Service")}
    for key, port in (("CLIPSTREAM_MLFLOW_TRACKING_URI", 5000), ("CLIPSTREAM_QDRANT_URL", 6333)):
        host = data[key].split("://", 1)[1].split(":")[0]
        if host.startswith(RELEASE + "-"):
            assert port in services.get(host, set()), f"{key}={data[key]}: no Service {host} with port {port}"
    for dep in by_kind(docs, "Deployment"):
        if dep["metadata"]["name"] == f"{RELEASE}-mlflow":
            (c,) = dep["spec"]["template"]["spec"]["containers"]
            args = dict(a.removeprefix("--").split("=", 1) for a in c["args"] if "=" in a)
            assert "--serve-artifacts" in c["args"]
            backend = args["backend-store-uri"]
            assert backend.startswith("postgresql://") and "$(POSTGRES_PASSWORD)" in backend
            assert "POSTGRES_PASSWORD" in {e["name"] for e in c["env"]}
            pg_host = backend.rsplit("@", 1)[1].split(":")[0]
            if pg_host.startswith(RELEASE + "-"):
                assert 5432 in services[pg_host]
            hosts = args["allowed-hosts"].split(",")
            for host in (f"{RELEASE}-mlflow", f"{RELEASE}-mlflow:5000", "localhost:5000",
                         f"{RELEASE}-mlflow.{NAMESPACE}.svc.cluster.local:5000"):
                assert any(fnmatch.fnmatch(host, h) for h in hosts), host


def check_images(docs: list[dict], variant: str) -> None:
    want = f"{IMAGE_REPO}:{VERSION}-{variant}"
    seen = 0
    for where, _meta, spec in pod_templates(docs):
        for c in containers(spec):
            image = c["image"]
            if image.startswith(IMAGE_REPO + ":"):
                assert image == want, f"{where}/{c['name']}: {image} != {want}"
                seen += 1
            else:  # third-party images are pinned to a version tag
                assert ":" in image and not image.endswith(":latest"), f"{where}/{c['name']}: {image}"
    assert seen >= 3  # Ray head, Ray worker, MLflow (and its init container)


def check_all(docs: list[dict], *, variant: str, gpus: int, secrets_rendered: bool, monkeypatch, tmp_path) -> None:
    check_valid(docs)
    check_serve_wiring(docs)
    check_ray_pods(docs, gpus)
    check_references(docs, secrets_rendered)
    check_security(docs)
    check_selectors(docs)
    check_settings(docs, monkeypatch, tmp_path)
    check_services(docs)
    check_images(docs, variant)


# ---------------------------------------------------------------- the chart's configurations

CONFIGS = {  # name -> (helm args, image variant, GPUs per serve worker, Secrets rendered)
    "default": ((), "gpu", 1, True),
    "dev": (("-f", f"{CHART}/ci/dev-values.yaml"), "cpu", 0, True),
    "prod": (("-f", f"{CHART}/ci/prod-values.yaml"), "gpu", 1, False),
}


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    """Each configuration rendered once for the module."""
    return {name: objects(helm_template(*args)) for name, (args, *_rest) in CONFIGS.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_configuration_is_deployable(renders, config, monkeypatch, tmp_path):
    _args, variant, gpus, secrets_rendered = CONFIGS[config]
    check_all(renders[config], variant=variant, gpus=gpus, secrets_rendered=secrets_rendered,
              monkeypatch=monkeypatch, tmp_path=tmp_path)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_lint_strict_is_clean(config):
    args, *_ = CONFIGS[config]
    out = run("helm", "lint", "--strict", CHART, *args)
    assert "0 chart(s) failed" in out
    problems = [line for line in out.splitlines() if line.startswith("[")]
    assert not problems, problems


def test_app_version_is_the_package_version():
    chart = yaml.safe_load((REPO / CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "clipstream"
    assert chart["appVersion"] == VERSION
    assert chart["version"] == "0.1.0"


def test_dev_is_cpu_only_and_prod_is_gpu_with_object_store_and_ingress(renders):
    dev, prod = renders["dev"], renders["prod"]
    assert not by_kind(dev, "Ingress")
    assert one(dev, "PersistentVolumeClaim", f"{RELEASE}-mlflow-artifacts")
    (ingress,) = by_kind(prod, "Ingress")
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPC"
    assert ingress["spec"]["tls"]
    assert not [d for d in by_kind(prod, "PersistentVolumeClaim") if d["metadata"]["name"].endswith("-mlflow-artifacts")]
    mlflow = one(prod, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"]["spec"]["containers"][0]
    assert "--artifacts-destination=s3://clipstream-prod/mlflow" in mlflow["args"]
    assert {"secretRef": {"name": f"{RELEASE}-object-store"}} in mlflow["envFrom"]
    assert one(prod, "PersistentVolumeClaim", f"{RELEASE}-runs")["spec"]["storageClassName"]
    _head, (worker,) = ray_groups(prod)
    assert worker["replicas"] > 1
    _head, (worker,) = ray_groups(dev)
    assert worker["replicas"] == 1


def test_generated_secrets(renders):
    for name in ("default", "dev"):
        secrets = {d["metadata"]["name"]: d for d in by_kind(renders[name], "Secret")}
        assert set(secrets) == {f"{RELEASE}-qdrant", f"{RELEASE}-api", f"{RELEASE}-postgres"}
        for s in secrets.values():
            assert all(len(v) >= 40 for v in s["data"].values())  # 32 random characters, base64


def test_helm_test_pod(renders):
    (pod,) = [d for d in renders["default"] if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"][HOOK] == "test"
    (c,) = pod["spec"]["containers"]
    port = serve_config(renders["default"])["grpc_options"]["port"]
    assert c["command"] == ["clipstream", "health", "--address", f"{RELEASE}-grpc:{port}"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env == {"CLIPSTREAM_API_KEY": {"name": f"{RELEASE}-api", "key": "api-key"}}
    assert pod["spec"]["restartPolicy"] == "Never"


def test_names_and_port_follow_the_release_and_values(monkeypatch, tmp_path):
    """Another release name, another gRPC port, secrets from existing Secrets: every reference follows."""
    text = helm_template("--set", "settings.grpc_port=9100", "--set", "secrets.api.existingSecret=my-api",
                         release="other")
    docs = objects(text)
    validate_all(docs)
    assert one(docs, "ConfigMap", "other-settings")["data"]["CLIPSTREAM_GRPC_PORT"] == "9100"
    svc = one(docs, "Service", "other-grpc")
    assert svc["spec"]["ports"][0]["port"] == 9100 and svc["spec"]["selector"]["app.kubernetes.io/instance"] == "other"
    assert yaml.safe_load(one(docs, "RayService", "other-serve")["spec"]["serveConfigV2"])["grpc_options"]["port"] == 9100
    assert "my-api" not in {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    head, _ = ray_groups(docs)
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["CLIPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "my-api"
    assert env["CLIPSTREAM_QDRANT_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "other-qdrant"
    (pod,) = by_kind(docs, "Pod")
    assert pod["spec"]["containers"][0]["command"][-1] == "other-grpc:9100"
    assert "other-mlflow:5000" in one(docs, "Deployment", "other-mlflow")["spec"]["template"]["spec"]["containers"][0][
        "args"][-1]


def test_external_services(monkeypatch, tmp_path):
    """External MLflow and Qdrant: no bundled workloads, no policies for absent pods, URIs passed on."""
    docs = objects(helm_template("--set", "mlflow.enabled=false",
                                 "--set", "mlflow.external.trackingUri=https://mlflow.example.com",
                                 "--set", "qdrant.enabled=false", "--set", "qdrant.external.url=https://q.example.com:6333"))
    validate_all(docs)
    data = settings_map(docs)
    assert data["CLIPSTREAM_MLFLOW_TRACKING_URI"] == "https://mlflow.example.com"
    assert data["CLIPSTREAM_QDRANT_URL"] == "https://q.example.com:6333"
    assert not by_kind(docs, "StatefulSet") and not by_kind(docs, "Deployment") and not by_kind(docs, "NetworkPolicy")
    check_references(docs, secrets_rendered=True)
    check_selectors(docs)
    check_security(docs)


@pytest.mark.parametrize("asked, pod_gpus", [("0", 0), ("0.5", 1), ("2", 2)])
def test_serve_workers_request_the_gpus_the_encoder_asks_for(asked, pod_gpus, monkeypatch, tmp_path):
    docs = objects(helm_template("--set-json", f"settings.serve_encoder_gpus={asked}"))
    check_ray_pods(docs, pod_gpus)
    check_settings(docs, monkeypatch, tmp_path)


def test_default_replicas_are_fixed_and_prod_autoscales(renders):
    app = serve_config(renders["default"])["applications"][0]
    assert "deployments" not in app and app["args"]["serve_replicas"] == 1
    rc = one(renders["default"], "RayService", f"{RELEASE}-serve")["spec"]["rayClusterConfig"]
    assert "enableInTreeAutoscaling" not in rc and "autoscalerOptions" not in rc
    (encoder,) = serve_config(renders["prod"])["applications"][0]["deployments"]
    assert encoder == {"name": "Encoder", "num_replicas": "auto", "autoscaling_config": {
        "min_replicas": 2, "max_replicas": 8, "initial_replicas": 4, "target_ongoing_requests": 32}}
    rc = one(renders["prod"], "RayService", f"{RELEASE}-serve")["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True and rc["autoscalerOptions"]["idleTimeoutSeconds"] == 60
    _head, (worker,) = ray_groups(renders["prod"])
    assert (worker["minReplicas"], worker["maxReplicas"]) == (2, 8)  # the pods' bounds: one GPU replica each


def test_a_serving_setting_changes_only_the_serve_config_and_others_roll_the_pods():
    """KubeRay applies a changed serveConfigV2 to the running cluster; any other change of the RayService (a pod
    annotation included) makes it a new cluster. A serving setting (settings.serve_*) changes only the former."""
    def rayservice(*args):
        return one(objects(helm_template(*args)), "RayService", f"{RELEASE}-serve")["spec"]

    before = rayservice()
    after = rayservice("--set", "settings.serve_batch_size=64", "--set", "settings.serve_model_cache=5")
    assert yaml.safe_load(after.pop("serveConfigV2"))["applications"][0]["args"]["serve_batch_size"] == 64
    assert yaml.safe_load(before.pop("serveConfigV2"))["applications"][0]["args"]["serve_batch_size"] == 32
    assert after == before
    # a setting the pods read from the ConfigMap when they start (here the registered model's name) rolls them
    rolled = rayservice("--set", "settings.stream=other")
    assert rolled["rayClusterConfig"] != before["rayClusterConfig"]
    for spec in (rolled, before):
        spec["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["annotations"].pop("checksum/settings")
        spec["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["metadata"]["annotations"].pop("checksum/settings")
    assert rolled["rayClusterConfig"] == before["rayClusterConfig"]


def test_values_schema_rejects_wrong_values():
    assert "serve/replicas" in helm_fails("--set", "serve.replicas=abc")
    assert "additional properties" in helm_fails("--set", "serve.replica=2")
    assert "additional properties" in helm_fails("--set", "settings.qdrant_url=http://elsewhere")  # set by the chart
    helm_fails("--set", "settings.grpc_port=70000")
    helm_fails("--set", "image.variant=tpu")
    helm_fails("--set", "serve.head.resources.limits=null")


def test_inconsistent_values_fail():
    assert "mlflow.external.trackingUri" in helm_fails("--set", "mlflow.enabled=false")
    assert "qdrant.external.url" in helm_fails("--set", "qdrant.enabled=false")
    assert "objectStore" in helm_fails("--set", "mlflow.replicas=2")
    assert "ingress.host" in helm_fails("--set", "ingress.enabled=true")
    assert "serve.autoscaling.minReplicas" in helm_fails("--set", "serve.autoscaling.enabled=true",
                                                         "--set", "settings.serve_replicas=2")


def test_values_schema_knows_every_setting_the_chart_does_not_set_itself():
    """values.schema.json's `settings` are Settings' fields, less those the chart computes: a new Settings
    field must be settable through the chart (and a removed one must not be)."""
    import json

    from clipstream.settings import Settings

    schema = json.loads((REPO / CHART / "values.schema.json").read_text())
    computed = {"home", "runs_dir", "ray_address", "mlflow_tracking_uri", "qdrant_url", "qdrant_api_key", "api_key",
                "mlflow_artifact_root", "qdrant_path", "api_key_file", "qdrant_api_key_file"}
    # `clipstream serve`'s listener (services/binding.py, a setup hook of the Ray it starts): a RayService's proxy
    # listens on the pod's interfaces, always behind the release's API key; TLS ends at the cluster's ingress
    computed |= {"grpc_host", "grpc_allow_unauthenticated", "tls_cert_file", "tls_key_file", "tls_ca_file"}
    assert set(schema["properties"]["settings"]["properties"]) == set(Settings.model_fields) - computed
