"""Offline validation of rendered Kubernetes manifests, with the real tools.

Built-in kinds validate against the Kubernetes OpenAPI schemas of the kubectl we ship with
(`kubernetes-validate`, strict: unknown fields are errors); RayJob, RayService and RayCluster against the
KubeRay v1.7.0 CRD schemas in schemas/ (and the chart's optional GRPCRoute, PodMonitor and ServiceMonitor
against the Gateway API and Prometheus operator CRDs there), made strict the same way (every object schema
that lists its properties rejects others, unless the CRD itself preserves unknown fields). Usable from the
tests and by hand:

    helm template charts/clipstream | python tests/k8s/k8s_checks.py -
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

from clipstream.local_cluster import tool  # the real binary, the venv's first (never a skip)

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = "1.35.0"  # the API version of the kubectl that `make setup` installs
KUBERAY = "kuberay-v1.7.0"
GATEWAY_API = "gateway-api-v1.6.1"
PROMETHEUS_OPERATOR = "prometheus-operator-v0.93.0"
CRDS = {"RayJob": (KUBERAY, "ray.io_rayjobs.yaml"), "RayService": (KUBERAY, "ray.io_rayservices.yaml"),
        "RayCluster": (KUBERAY, "ray.io_rayclusters.yaml"),
        "GRPCRoute": (GATEWAY_API, "gateway.networking.k8s.io_grpcroutes.yaml"),
        "PodMonitor": (PROMETHEUS_OPERATOR, "monitoring.coreos.com_podmonitors.yaml"),
        "ServiceMonitor": (PROMETHEUS_OPERATOR, "monitoring.coreos.com_servicemonitors.yaml")}


def schemas_dir() -> Path:
    """The KubeRay CRDs kept next to this file (schemas/README.md), or CLIPSTREAM_K8S_SCHEMAS."""
    folder = Path(os.environ.get("CLIPSTREAM_K8S_SCHEMAS") or Path(__file__).with_name("schemas"))
    if not (folder / KUBERAY).is_dir():
        raise FileNotFoundError(f"{folder / KUBERAY}: the KubeRay CRD schemas are missing")
    return folder


def run(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run([tool(args[0]), *args[1:]], input=stdin, capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
    return out.stdout


def objects(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _strict(schema):
    """Reject unknown fields wherever the CRD lists an object's fields (what `kubectl apply
    --validate=strict` does against the live CRD)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd(kind: str) -> dict:
    folder, name = CRDS[kind]
    return yaml.safe_load((schemas_dir() / folder / name).read_text())


@functools.cache
def crd_validator(kind: str, version: str = "v1") -> jsonschema.protocols.Validator:
    (entry,) = [v for v in crd(kind)["spec"]["versions"] if v["name"] == version]
    schema = _strict(copy.deepcopy(entry["schema"]["openAPIV3Schema"]))
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)


def validate(obj: dict) -> None:
    """Raise AssertionError naming the object and every schema violation."""
    kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
    if kind in CRDS:
        group, _, version = obj["apiVersion"].partition("/")
        want = crd(kind)["spec"]["group"]
        assert group == want, f"{kind}/{name}: apiVersion {obj['apiVersion']} is not {want}"
        errors = sorted(crd_validator(kind, version).iter_errors(obj), key=lambda e: list(e.path))
        assert not errors, f"{kind}/{name}: " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
        return
    try:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{kind}/{name}: {'.'.join(map(str, exc.path))}: {exc.message}") from None
    except kubernetes_validate.SchemaNotFoundError as exc:
        raise AssertionError(f"{kind}/{name}: no Kubernetes {KUBERNETES} schema for {obj.get('apiVersion')}: "
                             f"{exc}") from None


def validate_all(docs: list[dict]) -> None:
    problems = []
    for obj in docs:
        try:
            validate(obj)
        except AssertionError as exc:
            problems.append(str(exc))
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    text = sys.stdin.read() if sys.argv[1:] in ([], ["-"]) else Path(sys.argv[1]).read_text()
    docs = objects(text)
    validate_all(docs)
    print(f"{len(docs)} objects valid ({', '.join(sorted({d['kind'] for d in docs}))})")
