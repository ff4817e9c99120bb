"""The Helm chart charts/clipstream, rendered with the real `helm` (default values and each ci/ values file)
and checked for the wiring that breaks a deployment: schema validity (Kubernetes 1.35 + KubeRay v1.7.0, and
the Gateway API / Prometheus operator CRDs of the optional objects), the gRPC port path (Serve config -> Ray
containers -> KubeRay's serve Service -> Ingress / GRPCRoute -> ConfigMap), Ray Serve's own config schema,
Ray token auth, references to Secrets/ConfigMaps/PVCs, pod security, NetworkPolicy selectors and who they
let reach which port, the runs storage, the Settings the ConfigMap sets, image tags and values.schema.json.

The `check_*` functions are shared with test_kustomize.py (the kustomize overlays must pass the same).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

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
           f"{RELEASE}-ray-auth": {"auth_token"},
           f"{RELEASE}-object-store": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}}
RUNS_MOUNT = "/mnt/clipstream/runs"
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
            rc = {"RayService": lambda s: s["rayClusterConfig"], "RayJob": lambda s: s["rayClusterSpec"],
                  "RayCluster": lambda s: s}[d["kind"]](d["spec"])
            if "submitterPodTemplate" in d["spec"]:
                t = d["spec"]["submitterPodTemplate"]
                out.append((f"{where}[submitter]", t.get("metadata", {}), t["spec"]))
            groups = [("head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc.get("workerGroupSpecs", [])]
            for name, g in groups:
                out.append((f"{where}[{name}]", g["template"].get("metadata", {}), g["template"]["spec"]))
    return out


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def ray_container(spec: dict) -> dict:
    """The Ray container of a Ray pod (KubeRay's: the first); sidecars follow it."""
    c = spec["containers"][0]
    assert c["name"] in ("ray-head", "ray-worker"), c["name"]
    return c


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

    # R-grpc is KubeRay's serve Service (spec.serveService): KubeRay selects the pods of the one cluster that
    # serves (ray.io/cluster and ray.io/serve) and switches it at once during an upgrade. A Service of the chart's
    # own would select the pods of both clusters and reach a head whose application is not running yet.
    (rs,) = by_kind(docs, "RayService")
    assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == f"{RELEASE}-grpc" and "selector" not in svc["spec"]
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port == {"name": "serve-grpc", "port": port, "targetPort": port, "protocol": "TCP",
                        "appProtocol": "kubernetes.io/h2c"}
    assert not [s for s in by_kind(docs, "Service") if s["spec"].get("selector", {}).get(
        "app.kubernetes.io/component") == "serve"], "the serve pods' Service is KubeRay's"
    assert settings_map(docs)["CLIPSTREAM_GRPC_PORT"] == str(port)

    head, workers = ray_groups(docs)
    head_c = ray_container(head["template"]["spec"])
    assert head_c["name"] == "ray-head"
    # KubeRay builds the serve Service's ports from the head container's ports named serve or serve-*
    head_ports = {p["name"]: p["containerPort"] for p in head_c["ports"]}
    assert {n: p for n, p in head_ports.items() if n == "serve" or n.startswith("serve-")} == {
        "serve": 8000, "serve-grpc": port}
    assert "nvidia.com/gpu" not in head_c["resources"].get("limits", {})
    assert [g["groupName"] for g in workers] == ["gpu"]
    for group in workers:
        c = ray_container(group["template"]["spec"])
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["serve-grpc"] == port
        assert c["readinessProbe"]["grpc"]["port"] == port
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # the Ingress passes what the Serve proxy accepts (nginx's default body limit is 1 MiB)
    serve_limit = {e["name"]: e.get("value") for e in head_c["env"]}["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]
    assert serve_limit == consts["SERVE_ENV"]["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"]
    assert int(serve_limit) >= 8 * 1024 * 1024  # at least one image of the default serve_max_image_bytes
    for ingress in by_kind(docs, "Ingress"):
        assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-body-size"] == serve_limit
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {"name": f"{RELEASE}-grpc", "port": {"name": "serve-grpc"}}
    for route in by_kind(docs, "GRPCRoute"):
        for rule in route["spec"]["rules"]:
            assert rule["backendRefs"] == [{"name": f"{RELEASE}-grpc", "port": port}]


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
        c = ray_container(spec)
        assert c["envFrom"][0] == {"configMapRef": {"name": f"{RELEASE}-settings"}}
        env = {e["name"]: e for e in c["env"]}
        assert env["CLIPSTREAM_QDRANT_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-qdrant",
                                                                                 "key": "api-key"}
        assert env["CLIPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-api", "key": "api-key"}
        assert {k: env[k]["value"] for k in consts["SERVE_ENV"] if k in env} == consts["SERVE_ENV"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        # serving loads model versions from MLflow: the training runs storage is not theirs to mount
        assert RUNS_MOUNT not in mounts and not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert "emptyDir" in volumes[mounts["/tmp"]] and "emptyDir" in volumes[mounts["/home/ray/.cache"]]
        check_log_sidecar(spec, volumes, mounts)
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
    # the serve workers hold GPUs only when the Encoder asks for them: one setting drives both
    asked = float(settings_map(docs)["CLIPSTREAM_SERVE_ENCODER_GPUS"])
    assert math.ceil(asked) == gpus
    for group in workers:
        c = ray_container(group["template"]["spec"])
        limits = c["resources"]["limits"]
        if gpus:
            assert limits["nvidia.com/gpu"] == gpus and group["rayStartParams"]["num-gpus"] == str(gpus)
        else:
            assert "nvidia.com/gpu" not in limits and "nvidia.com/gpu" not in c["resources"]["requests"]
            assert "num-gpus" not in group["rayStartParams"]
    sa = one(docs, "ServiceAccount", RELEASE)
    assert sa["automountServiceAccountToken"] is False
    # Ray's control plane asks for KubeRay's token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN from the Secret's
    # auth_token, the names clipstream's local cluster uses too)
    (rs,) = by_kind(docs, "RayService")
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": f"{RELEASE}-ray-auth"}


def check_log_sidecar(spec: dict, volumes: dict, mounts: dict) -> None:
    """Ray's log files (/tmp/ray of the Ray container) reach stdout through the ray-logs sidecar."""
    ray, *sidecars = spec["containers"]
    (side,) = sidecars
    assert side["name"] == "ray-logs"
    side_mounts = {m["mountPath"]: m for m in side["volumeMounts"]}
    assert side_mounts["/tmp"]["name"] == mounts["/tmp"] and side_mounts["/tmp"]["readOnly"] is True
    conf_mount = [m for m in side["volumeMounts"] if m["name"] != mounts["/tmp"]][0]
    assert f"--config={conf_mount['mountPath']}/fluent-bit.conf" in side["command"]
    config = volumes[conf_mount["name"]]["configMap"]["name"]
    assert config == f"{RELEASE}-ray-logs"


def check_qdrant(docs: list[dict]) -> None:
    """Qdrant's snapshots outlive its pod: a volumeClaimTemplate of their own (the default)."""
    for sts in by_kind(docs, "StatefulSet"):
        if sts["metadata"]["name"] == f"{RELEASE}-qdrant":
            (c,) = sts["spec"]["template"]["spec"]["containers"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            claims = {v["metadata"]["name"] for v in sts["spec"]["volumeClaimTemplates"]}
            assert mounts["/qdrant/snapshots"] in claims and mounts["/qdrant/storage"] in claims


def check_runs(docs: list[dict]) -> None:
    """The runs storage is an object store (no PVC) or R-runs / an existing claim, never in serving pods."""
    runs_dir = settings_map(docs)["CLIPSTREAM_RUNS_DIR"]
    pvcs = [d for d in by_kind(docs, "PersistentVolumeClaim") if d["metadata"]["name"] == f"{RELEASE}-runs"]
    if "://" in runs_dir:
        assert not pvcs
    else:
        assert runs_dir == RUNS_MOUNT
    for pvc in pvcs:
        assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def referenced(docs: list[dict]) -> dict[str, dict[str, list[tuple[str, str | None, bool]]]]:
    """kind -> name -> [(where, key or None, optional)] of every Secret, ConfigMap and PVC a pod uses."""
    refs: dict[str, dict[str, list]] = {"Secret": {}, "ConfigMap": {}, "PersistentVolumeClaim": {}}

    def add(kind, name, where, key=None, optional=False):
        refs[kind].setdefault(name, []).append((where, key, bool(optional)))

    for rs in by_kind(docs, "RayService"):  # KubeRay gives the Ray containers its auth_token
        auth = rs["spec"]["rayClusterConfig"].get("authOptions", {})
        if auth.get("secretName"):
            add("Secret", auth["secretName"], f"RayService/{rs['metadata']['name']}", "auth_token")
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
    assert refs["ConfigMap"] and refs["Secret"]
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


def training_jobs() -> list[dict]:
    """The RayJobs `clipstream k8s job` renders for this release (its pods are the train NetworkPolicy's)."""
    from clipstream import k8s

    return [k8s.job("s3://bucket/tasks/task-00", "finetune", k8s.Release(name=RELEASE), k8s.Resources())]


# Labels of the pods that are not in a render: the release's own gRPC clients (the helm test pod, yours).
CLIENT_LABELS = {"clipstream.io/grpc-client"}


def check_selectors(docs: list[dict]) -> None:
    """NetworkPolicies and Services select pods that the render (or `clipstream k8s job`) creates."""
    labels = [meta.get("labels", {}) for _, meta, _ in pod_templates(docs + training_jobs())]
    policies = by_kind(docs, "NetworkPolicy")
    for np in policies:
        name = np["metadata"]["name"]
        selector = np["spec"]["podSelector"]["matchLabels"]
        assert selector and any(matches(selector, lab) for lab in labels), f"NetworkPolicy {name} selects no pod"
        # (the helm test pod's admits nothing on purpose: nothing calls it)
        assert np["spec"]["ingress"] or name == f"{RELEASE}-test", f"NetworkPolicy {name} admits nothing"
        for rule in np["spec"]["ingress"]:
            for peer in rule["from"]:
                if "namespaceSelector" in peer or "podSelector" not in peer:
                    continue  # other namespaces' pods (the operator, the ingress controller, Prometheus)
                peer_sel = peer["podSelector"]["matchLabels"]
                if CLIENT_LABELS & set(peer_sel):
                    continue
                assert any(matches(peer_sel, lab) for lab in labels), f"NetworkPolicy {name}: no pod matches {peer_sel}"
    for svc in by_kind(docs, "Service"):
        sel = {k: v for k, v in svc["spec"].get("selector", {}).items() if k != "ray.io/serve"}
        assert sel and any(matches(sel, lab) for lab in labels), f"Service {svc['metadata']['name']} selects no pod"
    for sts in by_kind(docs, "StatefulSet") + by_kind(docs, "Deployment"):
        assert matches(sts["spec"]["selector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])


OWN_NAMESPACE = {"kubernetes.io/metadata.name": NAMESPACE}


def admitted(docs: list[dict], source: dict, target: dict, port: int, source_namespace: dict = OWN_NAMESPACE) -> bool:
    """Whether the render's NetworkPolicies let a pod labelled `source` (in a namespace labelled
    `source_namespace`) reach a pod of this namespace labelled `target` on TCP `port`, by Kubernetes' rules:
    a pod no policy selects accepts everything; else some rule of a policy selecting it must admit the peer
    and the port."""
    policies = [np for np in by_kind(docs, "NetworkPolicy")
                if matches(np["spec"]["podSelector"].get("matchLabels", {}), target)]
    if not policies:
        return True

    def peer_admits(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            if not matches(peer["namespaceSelector"].get("matchLabels", {}), source_namespace):
                return False
        elif source_namespace != OWN_NAMESPACE or "podSelector" not in peer:
            return False
        return matches(peer.get("podSelector", {}).get("matchLabels", {}), source)

    for np in policies:
        for rule in np["spec"].get("ingress", []):
            if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule or any(peer_admits(peer) for peer in rule["from"]):
                return True
    return False


def check_network_access(docs: list[dict]) -> None:
    """Ray's control plane (GCS, dashboard and Jobs API, client, raylets) is closed to everything but the Ray
    pods of the same component and, for the dashboard, the KubeRay operator; gRPC only from the release's
    clients; metrics only from the configured scrapers."""
    (job,) = training_jobs()
    pods = {where: meta["labels"] for where, meta, _ in pod_templates(docs + [job])}
    serve = [labels for where, labels in pods.items() if where.startswith("RayService/")]
    train = [labels for where, labels in pods.items() if where.startswith("RayJob/") and "submitter" not in where]
    port = serve_config(docs)["grpc_options"]["port"]
    intruder = {"app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": "intruder",
                "clipstream.io/qdrant-client": "true", "clipstream.io/mlflow-client": "true"}
    operator = ({"app.kubernetes.io/name": "kuberay-operator"}, {"kubernetes.io/metadata.name": "ray-system"})
    client = {"app.kubernetes.io/instance": RELEASE, "clipstream.io/grpc-client": "true"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    metrics = bool(by_kind(docs, "PodMonitor"))
    for target in serve:
        for p in (6379, 8265, 10001, 8000, port, 8080, 52365):
            assert not admitted(docs, intruder, target, p), f"any pod reaches the serve pods on {p}"
            assert not admitted(docs, train[0], target, p), f"training pods reach the serve pods on {p}"
        for p in (6379, 8265, 10001, 12345):
            assert admitted(docs, serve[0], target, p), f"serve pods do not reach each other on {p}"
        # the operator reads Serve's status (dashboard) and checks the head's proxy (Serve's HTTP port)
        assert admitted(docs, operator[0], target, 8265, operator[1])
        assert admitted(docs, operator[0], target, 8000, operator[1])
        assert not admitted(docs, operator[0], target, 6379, operator[1])
        assert admitted(docs, client, target, port) and not admitted(docs, client, target, 8265)
        assert admitted(docs, {}, target, 8080, monitoring) == metrics
        assert not admitted(docs, {}, target, 8265, monitoring)
    for target in train:
        for p in (6379, 8265, 10001, 12345):
            assert admitted(docs, train[0], target, p) and not admitted(docs, serve[0], target, p)
            assert not admitted(docs, intruder, target, p)
    for component, p in (("mlflow", 5000), ("qdrant", 6333)):
        selected = [labels for labels in pods.values() if labels.get("app.kubernetes.io/component") == component]
        for target in selected:
            assert admitted(docs, {}, target, p, monitoring) == metrics


def check_settings(docs: list[dict], monkeypatch, tmp_path) -> None:
    """The ConfigMap's keys are Settings fields and Settings accepts their values."""
    from clipstream.settings import Settings

    data = settings_map(docs)
    fields = {f"CLIPSTREAM_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= fields, f"not Settings fields: {sorted(set(data) - fields)}"
    assert data["CLIPSTREAM_RAY_ADDRESS"] == "auto"
    assert data["CLIPSTREAM_HOME"] == "/tmp/clipstream"
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
    if "://" not in data["CLIPSTREAM_RUNS_DIR"]:
        assert str(settings.runs_dir) == data["CLIPSTREAM_RUNS_DIR"] == RUNS_MOUNT
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
            # the password never sits in the URI or the arguments: libpq reads PGPASSWORD from the Secret
            # the driver the image installs (psycopg2), not SQLAlchemy's default (psycopg 3 since SQLAlchemy 2.1)
            assert backend.startswith("postgresql+psycopg2://")
            assert ":" not in backend.split("://", 1)[1].split("@")[0]
            assert not [a for a in c["args"] if "PASSWORD" in a.upper() or "PGPASS" in a.upper()]
            (init,) = [i for i in dep["spec"]["template"]["spec"]["initContainers"] if i["name"] == "db-upgrade"]
            assert init["command"] == ["mlflow", "db", "upgrade", backend]
            for container in (c, init):
                env = {e["name"]: e for e in container["env"]}
                assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-postgres",
                                                                         "key": "password"}
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
    check_runs(docs)
    check_network_access(docs)
    check_qdrant(docs)


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


@pytest.mark.component
@pytest.mark.parametrize("config", list(CONFIGS))
def test_configuration_is_deployable(renders, config, monkeypatch, tmp_path):
    _args, variant, gpus, secrets_rendered = CONFIGS[config]
    check_all(renders[config], variant=variant, gpus=gpus, secrets_rendered=secrets_rendered,
              monkeypatch=monkeypatch, tmp_path=tmp_path)


@pytest.mark.component
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


@pytest.mark.component
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
    # kind / EBS / PD default classes offer no RWX: dev's runs PVC is ReadWriteOnce, prod's runs are on S3
    assert one(dev, "PersistentVolumeClaim", f"{RELEASE}-runs")["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert settings_map(prod)["CLIPSTREAM_RUNS_DIR"] == "s3://clipstream-prod/runs"
    assert not [d for d in by_kind(prod, "PersistentVolumeClaim") if d["metadata"]["name"].endswith("-runs")]
    _head, (worker,) = ray_groups(prod)
    assert worker["replicas"] > 1
    _head, (worker,) = ray_groups(dev)
    assert worker["replicas"] == 1


@pytest.mark.component
def test_generated_secrets(renders):
    for name in ("default", "dev"):
        secrets = {d["metadata"]["name"]: d for d in by_kind(renders[name], "Secret")}
        assert set(secrets) == {f"{RELEASE}-qdrant", f"{RELEASE}-api", f"{RELEASE}-postgres", f"{RELEASE}-ray-auth"}
        for s in secrets.values():
            assert all(len(v) >= 40 for v in s["data"].values())  # 32 random characters, base64
            # kept on uninstall: a reinstall finds them (lookup) and the kept PostgreSQL volume its password
            assert s["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


@pytest.mark.component
def test_helm_test_pod(renders):
    (pod,) = [d for d in renders["default"] if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"][HOOK] == "test"
    assert pod["metadata"]["labels"]["clipstream.io/grpc-client"] == "true"  # admitted to the gRPC port
    (c,) = pod["spec"]["containers"]
    port = serve_config(renders["default"])["grpc_options"]["port"]
    assert c["command"] == ["clipstream", "health", "--address", f"{RELEASE}-grpc:{port}"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env == {"CLIPSTREAM_API_KEY": {"name": f"{RELEASE}-api", "key": "api-key"}}
    assert pod["spec"]["restartPolicy"] == "Never"


@pytest.mark.component
def test_names_and_port_follow_the_release_and_values(monkeypatch, tmp_path):
    """Another release name, another gRPC port, secrets from existing Secrets: every reference follows."""
    text = helm_template("--set", "settings.grpc_port=9100", "--set", "secrets.api.existingSecret=my-api",
                         release="other")
    docs = objects(text)
    validate_all(docs)
    assert one(docs, "ConfigMap", "other-settings")["data"]["CLIPSTREAM_GRPC_PORT"] == "9100"
    rs = one(docs, "RayService", "other-serve")
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == "other-grpc" and svc["spec"]["ports"][0]["port"] == 9100
    assert rs["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "other-ray-auth"
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["grpc_options"]["port"] == 9100
    assert "my-api" not in {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    head, _ = ray_groups(docs)
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["CLIPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "my-api"
    assert env["CLIPSTREAM_QDRANT_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "other-qdrant"
    (pod,) = by_kind(docs, "Pod")
    assert pod["spec"]["containers"][0]["command"][-1] == "other-grpc:9100"
    assert "other-mlflow:5000" in one(docs, "Deployment", "other-mlflow")["spec"]["template"]["spec"]["containers"][0][
        "args"][-1]


@pytest.mark.component
def test_external_services(monkeypatch, tmp_path):
    """External MLflow and Qdrant: no bundled workloads, no policies for absent pods, URIs passed on."""
    docs = objects(helm_template("--set", "mlflow.enabled=false",
                                 "--set", "mlflow.external.trackingUri=https://mlflow.example.com",
                                 "--set", "qdrant.enabled=false", "--set", "qdrant.external.url=https://q.example.com:6333"))
    validate_all(docs)
    data = settings_map(docs)
    assert data["CLIPSTREAM_MLFLOW_TRACKING_URI"] == "https://mlflow.example.com"
    assert data["CLIPSTREAM_QDRANT_URL"] == "https://q.example.com:6333"
    assert not by_kind(docs, "StatefulSet") and not by_kind(docs, "Deployment")
    assert {np["metadata"]["name"] for np in by_kind(docs, "NetworkPolicy")} == {f"{RELEASE}-ray-serve",
                                                                                 f"{RELEASE}-ray-train"}
    check_references(docs, secrets_rendered=True)
    check_selectors(docs)
    check_security(docs)


@pytest.mark.component
@pytest.mark.parametrize("asked, pod_gpus", [("0", 0), ("0.5", 1), ("2", 2)])
def test_serve_workers_request_the_gpus_the_encoder_asks_for(asked, pod_gpus, monkeypatch, tmp_path):
    docs = objects(helm_template("--set-json", f"settings.serve_encoder_gpus={asked}"))
    check_ray_pods(docs, pod_gpus)
    check_settings(docs, monkeypatch, tmp_path)


@pytest.mark.component
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


@pytest.mark.component
def test_no_pod_mounts_a_service_account_token_but_the_head_of_an_autoscaled_rayservice(renders):
    """No clipstream container calls the Kubernetes API; KubeRay's autoscaler (a container of the RayService's head
    when autoscaling is on) does, with the head's ServiceAccount, which KubeRay binds to its Role."""
    for config, docs in renders.items():
        autoscaled = config == "prod"
        mounted = [where for where, _meta, spec in pod_templates(docs) if spec.get("automountServiceAccountToken")]
        assert mounted == ([f"RayService/{RELEASE}-serve[head]"] if autoscaled else []), config
        assert all("automountServiceAccountToken" in spec for _where, _meta, spec in pod_templates(docs)), config


@pytest.mark.component
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


@pytest.mark.component
def test_values_schema_rejects_wrong_values():
    assert "serve/replicas" in helm_fails("--set", "serve.replicas=abc")
    assert "additional properties" in helm_fails("--set", "serve.replica=2")
    assert "additional properties" in helm_fails("--set", "settings.qdrant_url=http://elsewhere")  # set by the chart
    helm_fails("--set", "settings.grpc_port=70000")
    helm_fails("--set", "image.variant=tpu")
    helm_fails("--set", "serve.head.resources.limits=null")
    assert "runs/accessMode" in helm_fails("--set", "runs.accessMode=RWX")
    assert "serve/upgradeStrategy" in helm_fails("--set", "serve.upgradeStrategy=Incremental")


@pytest.mark.component
def test_inconsistent_values_fail():
    assert "mlflow.external.trackingUri" in helm_fails("--set", "mlflow.enabled=false")
    assert "qdrant.external.url" in helm_fails("--set", "qdrant.enabled=false")
    assert "objectStore" in helm_fails("--set", "mlflow.replicas=2")
    assert "ingress.host" in helm_fails("--set", "ingress.enabled=true")
    assert "runs.existingClaim" in helm_fails("--set", "runs.uri=s3://b/runs", "--set", "runs.existingClaim=mine")
    assert "serve.autoscaling.minReplicas" in helm_fails("--set", "serve.autoscaling.enabled=true",
                                                         "--set", "settings.serve_replicas=2")


def test_values_schema_knows_every_setting_the_chart_does_not_set_itself():
    """values.schema.json's `settings` are Settings' fields, less those the chart computes: a new Settings
    field must be settable through the chart (and a removed one must not be)."""
    from clipstream.settings import Settings

    schema = json.loads((REPO / CHART / "values.schema.json").read_text())
    computed = {"home", "runs_dir", "ray_address", "mlflow_tracking_uri", "qdrant_url", "qdrant_api_key", "api_key",
                "mlflow_artifact_root", "qdrant_path", "api_key_file", "qdrant_api_key_file"}
    # `clipstream serve`'s listener (services/binding.py, a setup hook of the Ray it starts): a RayService's proxy
    # listens on the pod's interfaces, always behind the release's API key; TLS ends at the cluster's ingress
    computed |= {"grpc_host", "grpc_allow_unauthenticated", "tls_cert_file", "tls_key_file", "tls_ca_file"}
    # the RayService's serveConfigV2 names its application itself (services/app.py APP, checked above); a value here
    # would reach the pods' settings while the app keeps its name, and `clipstream health` would ask for another
    computed |= {"serve_app"}
    assert set(schema["properties"]["settings"]["properties"]) == set(Settings.model_fields) - computed


@pytest.mark.component
def test_a_list_setting_reaches_the_pods_as_json_that_settings_parse(monkeypatch):
    from clipstream.settings import Settings

    docs = objects(helm_template("--set-json", 'settings.image_roots=["s3://bucket/images","/data/laion"]'))
    value = one(docs, "ConfigMap", f"{RELEASE}-settings")["data"]["CLIPSTREAM_IMAGE_ROOTS"]
    monkeypatch.setenv("CLIPSTREAM_IMAGE_ROOTS", value)
    assert Settings().image_roots == ["s3://bucket/images", "/data/laion"]


@pytest.mark.component
def test_a_map_setting_reaches_the_pods_as_json_and_catalogues_live_on_the_runs_object_store(monkeypatch):
    from clipstream.settings import Settings

    docs = objects(helm_template("--set-json", 'settings.index_fields={"brand":"keyword","price":"float"}',
                                 "--set", "runs.uri=s3://bucket/runs/"))
    data = one(docs, "ConfigMap", f"{RELEASE}-settings")["data"]
    monkeypatch.setenv("CLIPSTREAM_INDEX_FIELDS", data["CLIPSTREAM_INDEX_FIELDS"])
    monkeypatch.setenv("CLIPSTREAM_CATALOGUE_DIR", data["CLIPSTREAM_CATALOGUE_DIR"])
    assert Settings().index_fields == {"brand": "keyword", "price": "float"}
    assert Settings().catalogue_dir == "s3://bucket/runs/catalogues"
    # with the runs on a PVC (not mounted where serving runs) catalogues stay in each pod's HOME unless set
    assert "CLIPSTREAM_CATALOGUE_DIR" not in one(objects(helm_template()), "ConfigMap", f"{RELEASE}-settings")["data"]
    with pytest.raises(Exception, match="index_fields"):
        helm_template("--set-json", 'settings.index_fields={"brand":"text"}')


def secret_value(docs: list[dict], name: str, key: str) -> str:
    import base64

    return base64.b64decode(one(docs, "Secret", name)["data"][key]).decode()


def secret_env(docs: list[dict], container: dict) -> dict[str, str]:
    """The variables a container gets from the rendered Secrets, as the kubelet resolves them."""
    return {e["name"]: secret_value(docs, e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}


@pytest.mark.component
def test_ray_token_auth_is_on_by_default_and_can_use_an_existing_secret():
    (rs,) = by_kind(objects(helm_template("--set", "secrets.rayAuth.existingSecret=my-ray-token")), "RayService")
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "my-ray-token"}
    docs = objects(helm_template("--set", "secrets.rayAuth.token=fixed-token-0123456789"))
    assert secret_value(docs, f"{RELEASE}-ray-auth", "auth_token") == "fixed-token-0123456789"
    docs = objects(helm_template("--set", "ray.auth.enabled=false"))
    (rs,) = by_kind(docs, "RayService")
    assert "authOptions" not in rs["spec"]["rayClusterConfig"]
    assert f"{RELEASE}-ray-auth" not in {d["metadata"]["name"] for d in by_kind(docs, "Secret")}


@pytest.mark.component
def test_postgres_password_of_any_characters_never_reaches_the_arguments(tmp_path):
    """A password with URL delimiters: the Secret holds it verbatim, MLflow's URI and arguments never."""
    from sqlalchemy.engine import make_url

    password = "p@ss:w/o%rd#1"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"secrets": {"postgres": {"password": password}}}))
    docs = objects(helm_template("-f", str(values)))
    validate_all(docs)
    assert secret_value(docs, f"{RELEASE}-postgres", "password") == password
    pod = one(docs, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"]["spec"]
    for c in containers(pod):
        assert not [a for a in c.get("command", []) + c.get("args", []) if "p@ss" in a or "PASSWORD" in a]
    (server,) = pod["containers"]
    uri = dict(a.split("=", 1) for a in server["args"] if a.startswith("--backend-store-uri="))["--backend-store-uri"]
    url = make_url(uri)
    assert url.password is None and url.username == "mlflow" and url.database == "mlflow"
    assert (url.host, url.port) == (f"{RELEASE}-postgres", 5432)
    # PostgreSQL itself is initialised with the same Secret key
    (pg,) = one(docs, "StatefulSet", f"{RELEASE}-postgres")["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e for e in pg["env"]}["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{RELEASE}-postgres", "key": "password"}


@pytest.mark.component
def test_mlflow_migrates_its_pinned_version_and_has_a_pdb_only_with_replicas():
    from test_images import arg_defaults

    values = yaml.safe_load((REPO / CHART / "values.yaml").read_text())
    assert values["mlflow"]["version"] == arg_defaults()["MLFLOW_VERSION"], "the chart migrates to the image's MLflow"
    docs = objects(helm_template())
    pod = one(docs, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"]
    assert pod["metadata"]["annotations"]["clipstream.io/mlflow-version"] == values["mlflow"]["version"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["wait-for-postgres", "db-upgrade"]
    assert not by_kind(docs, "PodDisruptionBudget")  # one replica: a PDB would only block node drains
    docs = objects(helm_template("--set", "mlflow.replicas=2",
                                 "--set", "mlflow.artifacts.objectStore.uri=s3://bucket/mlflow"))
    validate_all(docs)
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert matches(pdb["spec"]["selector"]["matchLabels"],
                   one(docs, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("args, runs_dir, claim, mode", [
    ((), RUNS_MOUNT, f"{RELEASE}-runs", "ReadWriteMany"),
    (("--set", "runs.accessMode=ReadWriteOnce"), RUNS_MOUNT, f"{RELEASE}-runs", "ReadWriteOnce"),
    (("--set", "runs.existingClaim=shared-runs"), RUNS_MOUNT, None, None),
    (("--set", "runs.uri=s3://bucket/runs"), "s3://bucket/runs", None, None),
])
@pytest.mark.component
def test_runs_storage_is_a_choice(args, runs_dir, claim, mode):
    docs = objects(helm_template(*args))
    validate_all(docs)
    check_runs(docs)
    assert settings_map(docs)["CLIPSTREAM_RUNS_DIR"] == runs_dir
    pvcs = {d["metadata"]["name"]: d for d in by_kind(docs, "PersistentVolumeClaim")}
    assert {n for n in pvcs if n.endswith("-runs")} == ({claim} if claim else set())
    if mode:
        assert pvcs[claim]["spec"]["accessModes"] == [mode]
    if "://" in runs_dir:  # the object store's credentials reach the Ray pods
        head, _ = ray_groups(docs)
        assert {"secretRef": {"name": f"{RELEASE}-object-store", "optional": True}} in ray_container(
            head["template"]["spec"])["envFrom"]


@pytest.mark.component
def test_grpc_route_is_the_gateway_api_alternative():
    parent = {"name": "public", "namespace": "gateways", "sectionName": "grpc"}
    docs = objects(helm_template("--set", "grpcRoute.enabled=true", "--set-json",
                                 f"grpcRoute.parentRefs={json.dumps([parent])}",
                                 "--set-json", 'grpcRoute.hostnames=["grpc.example.com"]'))
    validate_all(docs)  # against the Gateway API v1 CRD
    (route,) = by_kind(docs, "GRPCRoute")
    assert route["spec"]["parentRefs"] == [parent] and route["spec"]["hostnames"] == ["grpc.example.com"]
    check_serve_wiring(docs)
    assert "grpcRoute.parentRefs" in helm_fails("--set", "grpcRoute.enabled=true")


@pytest.mark.component
def test_metrics_monitors_and_their_network_access(monkeypatch, tmp_path):
    docs = objects(helm_template("--set", "metrics.enabled=true", "--set-json", 'metrics.labels={"release":"prom"}'))
    check_all(docs, variant="gpu", gpus=1, secrets_rendered=True, monkeypatch=monkeypatch, tmp_path=tmp_path)
    (pm,) = by_kind(docs, "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "prom"
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for where, meta, spec in pod_templates(docs + training_jobs()):
        if meta["labels"].get("app.kubernetes.io/instance") == RELEASE and where.startswith("RayService/"):
            assert {"containerPort": 8080, "name": "metrics"} in ray_container(spec)["ports"]
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    monitors = {m["metadata"]["name"]: m for m in by_kind(docs, "ServiceMonitor")}
    assert set(monitors) == {f"{RELEASE}-mlflow", f"{RELEASE}-qdrant"}
    for name, monitor in monitors.items():
        svc = services[name]
        assert matches(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert monitors[f"{RELEASE}-qdrant"]["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": f"{RELEASE}-qdrant", "key": "api-key"}
    (mlflow,) = one(docs, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"]["spec"]["containers"]
    assert "--expose-prometheus=/tmp/prometheus" in mlflow["args"]
    # Prometheus scrapes the pod's address: MLflow's host check admits it (Kubernetes expands $(POD_IP))
    allowed = [a for a in mlflow["args"] if a.startswith("--allowed-hosts=")][0].split("=", 1)[1].split(",")
    assert "$(POD_IP):5000" in allowed
    assert {e["name"]: e for e in mlflow["env"]}["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert "metrics.scrapeFrom" in helm_fails("--set", "metrics.enabled=true", "--set-json", "metrics.scrapeFrom=[]")


@pytest.mark.component
def test_qdrant_snapshots_on_an_empty_dir_when_asked():
    docs = objects(helm_template("--set", "qdrant.snapshots.persistence=false"))
    sts = one(docs, "StatefulSet", f"{RELEASE}-qdrant")
    assert [v["metadata"]["name"] for v in sts["spec"]["volumeClaimTemplates"]] == ["storage"]
    assert {"name": "snapshots", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]


@pytest.mark.component
def test_ray_logs_sidecar_can_be_left_out():
    docs = objects(helm_template("--set", "ray.logs.sidecar.enabled=false"))
    assert f"{RELEASE}-ray-logs" not in {d["metadata"]["name"] for d in by_kind(docs, "ConfigMap")}
    for group in [ray_groups(docs)[0], *ray_groups(docs)[1]]:
        assert [c["name"] for c in group["template"]["spec"]["containers"]] in (["ray-head"], ["ray-worker"])


@pytest.mark.component
def test_every_pod_takes_the_extension_points(tmp_path):
    """The same fields on each component reach its pod (one helper renders them for all)."""
    def extras(name: str) -> dict:
        return {
            "nodeSelector": {"pool": name}, "priorityClassName": f"{name}-priority",
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": name, "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": [name]}]}]}}},
            "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                           "whenUnsatisfiable": "ScheduleAnyway"}],
            "podLabels": {"team": name}, "podAnnotations": {"note": name},
            "extraEnv": [{"name": "EXTRA", "value": name}],
            "extraVolumes": [{"name": "ca", "configMap": {"name": "ca-bundle"}}],
            "extraVolumeMounts": [{"name": "ca", "mountPath": "/etc/ca", "readOnly": True}],
        }

    components = {"head": ("serve", "head"), "worker": ("serve", "worker"), "mlflow": ("mlflow",),
                  "qdrant": ("qdrant",), "postgres": ("postgres",)}
    values: dict = {}
    for name, path in components.items():
        node = values
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = extras(name)
    file = tmp_path / "values.yaml"
    file.write_text(yaml.safe_dump(values))
    docs = objects(helm_template("-f", str(file)))
    validate_all(docs)
    head, (worker,) = ray_groups(docs)
    pods = {"head": head["template"], "worker": worker["template"],
            "mlflow": one(docs, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"],
            "qdrant": one(docs, "StatefulSet", f"{RELEASE}-qdrant")["spec"]["template"],
            "postgres": one(docs, "StatefulSet", f"{RELEASE}-postgres")["spec"]["template"]}
    for name, pod in pods.items():
        want, spec = extras(name), pod["spec"]
        for field in ("nodeSelector", "priorityClassName", "tolerations", "affinity", "topologySpreadConstraints"):
            assert spec[field] == want[field], (name, field)
        assert pod["metadata"]["labels"]["team"] == name and pod["metadata"]["annotations"]["note"] == name
        main = spec["containers"][0]
        assert {"name": "EXTRA", "value": name} in main["env"]
        assert want["extraVolumeMounts"][0] in main["volumeMounts"] and want["extraVolumes"][0] in spec["volumes"]



@pytest.fixture
def postgres_server():
    """A real PostgreSQL on a loopback port, user and database as the chart's defaults, for one test:
    start(password) -> its port. Runs as `nobody` where the tests run as root (PostgreSQL refuses root)."""
    from clipstream.runtime import free_port

    root = Path(tempfile.mkdtemp(prefix="clipstream-pg-"))
    as_root = os.geteuid() == 0
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if as_root else []
    procs = []

    def start(password: str) -> int:
        (root / "pw").write_text(password)
        os.chmod(root, 0o755)
        if as_root:
            shutil.chown(root, 65534, 65534)
            shutil.chown(root / "pw", 65534, 65534)
        subprocess.run([*drop, tool("initdb"), "-D", str(root / "data"), "-U", "mlflow", "--pwfile", str(root / "pw"),
                        "--auth=scram-sha-256", "-E", "UTF8"], check=True, capture_output=True, timeout=120)
        port = free_port()
        log = open(root / "postgres.log", "w")
        procs.append(subprocess.Popen([*drop, tool("postgres"), "-D", str(root / "data"), "-p", str(port), "-k",
                                       str(root), "-c", "listen_addresses=127.0.0.1"], stdout=log, stderr=log,
                                      start_new_session=True))
        env = {**os.environ, "PGPASSWORD": password}
        for _ in range(120):
            done = subprocess.run([tool("psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "-d", "postgres",
                                   "-c", "CREATE DATABASE mlflow"], env=env, capture_output=True, text=True)
            if done.returncode == 0:
                return port
            time.sleep(0.5)
        raise AssertionError(f"PostgreSQL did not start: {(root / 'postgres.log').read_text()[-2000:]}")

    try:
        yield start
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
def test_mlflow_migrates_and_reaches_a_real_postgres_whose_password_has_url_delimiters(postgres_server, tmp_path,
                                                                                      monkeypatch):
    """The chart's MLflow against a real PostgreSQL initialised with a password of URL delimiters: the rendered
    `mlflow db upgrade` init container creates MLflow's schema, and the server's backend store opens it, with the
    password from PGPASSWORD (the Secret) only."""
    from sqlalchemy.engine import make_url

    password = "p@ss:w/o%rd#1"
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"secrets": {"postgres": {"password": password}}}))
    docs = objects(helm_template("-f", str(values)))
    pod = one(docs, "Deployment", f"{RELEASE}-mlflow")["spec"]["template"]["spec"]
    (init,) = [c for c in pod["initContainers"] if c["name"] == "db-upgrade"]
    (server,) = pod["containers"]
    backend = dict(a.split("=", 1) for a in server["args"] if "=" in a)["--backend-store-uri"]
    port = postgres_server(secret_value(docs, f"{RELEASE}-postgres", "password"))
    # the same URI, pointed at this PostgreSQL instead of Service R-postgres
    local = make_url(backend).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    command = [*init["command"][:-1], local]
    assert init["command"][-1] == backend and command[:3] == ["mlflow", "db", "upgrade"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    # the server asks for the password (a wrong one is refused), so the migration below authenticated with it
    refused = subprocess.run([tool("psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "mlflow", "-d", "mlflow", "-c",
                              "SELECT 1"], env={**env, "PGPASSWORD": "wrong"}, capture_output=True, text=True)
    assert refused.returncode != 0 and "password authentication failed" in refused.stderr
    # each container with the environment the chart gives it, and nothing else of PostgreSQL's
    done = subprocess.run([tool(command[0]), *command[1:]], env={**env, **secret_env(docs, init)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in [k for k in os.environ if k.startswith("PG")]:
        monkeypatch.delenv(name)
    for name, value in secret_env(docs, server).items():
        monkeypatch.setenv(name, value)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(local, str(tmp_path / "artifacts"))
    assert [e.name for e in store.search_experiments()] == ["Default"]
    store.engine.dispose()


@pytest.mark.component
def test_the_stream_controller_is_off_by_default_and_least_privileged_when_on(renders, monkeypatch, tmp_path):
    """The controller (values `controller:`): its own ServiceAccount (the chart's mounts no token), a Role allowed
    RayJobs and its one Lease, and a command that `clipstream controller` parses, with the values given."""
    from clipstream.cli.parser import parser

    assert not [d for d in renders["default"] if "controller" in d["metadata"]["name"]]
    docs = objects(helm_template("--set", "controller.enabled=true", "--set", "controller.name=news",
                                 "--set", "controller.tasks={s3://b/t0,s3://b/t1}", "--set", "controller.promote=auto",
                                 "--set", "controller.set={train.epochs=2}"))
    check_all(docs, variant="gpu", gpus=1, secrets_rendered=True, monkeypatch=monkeypatch, tmp_path=tmp_path)
    name = f"{RELEASE}-controller"
    assert one(docs, "ServiceAccount", RELEASE)["automountServiceAccountToken"] is False
    assert one(docs, "ServiceAccount", name)["automountServiceAccountToken"] is True
    rules = one(docs, "Role", name)["rules"]
    assert {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"]), tuple(r.get("resourceNames", ())))
            for r in rules} == {(("ray.io",), ("rayjobs",), ("get", "list", "create", "patch"), ()),
                                (("coordination.k8s.io",), ("leases",), ("create",), ()),
                                (("coordination.k8s.io",), ("leases",), ("get", "update"), (f"{name}-news",))}
    binding = one(docs, "RoleBinding", name)
    assert binding["roleRef"]["name"] == name and binding["subjects"] == [
        {"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]
    pod = one(docs, "Deployment", name)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name
    (container,) = pod["containers"]
    args = parser().parse_args(container["command"][1:])
    assert (args.command, args.name, args.promote, args.release, args.namespace, args.set) == (
        "controller", "news", "auto", RELEASE, NAMESPACE, ["train.epochs=2"])
    # its lease is the one the Role names: KubeRayJobs.lease names it RELEASE-controller-STREAM
    tasks = one(docs, "ConfigMap", f"{name}-tasks")["data"]["tasks.txt"]
    assert tasks.splitlines() == ["s3://b/t0", "s3://b/t1"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tasks"]
    assert args.source == f"{mount['mountPath']}/tasks.txt"
    with_source = objects(helm_template("--set", "controller.enabled=true", "--set", "controller.source=s3://b/tasks"))
    assert not by_kind([d for d in with_source if "controller" in d["metadata"]["name"]], "ConfigMap")
    assert "--source s3://b/tasks" in " ".join(one(with_source, "Deployment", name)["spec"]["template"]["spec"]
                                               ["containers"][0]["command"])
    assert "does not match pattern" in helm_fails("--set", "controller.enabled=true", "--set", "controller.name=Bad_1")
