"""The kustomize tree k8s/: the base is the chart's render (never edited by hand), and each overlay renders
with the real `kubectl kustomize`, passes the same deployment checks as the chart, and equals the chart
rendered with its ci/ values file (so the two ways of installing never drift apart).
"""

from __future__ import annotations

import difflib

import pytest
import yaml
from k8s_checks import REPO, objects, run, validate_all
from test_chart import CHART, NAMESPACE, RELEASE, SECRETS, by_kind, check_all, helm_template

# The command `make k8s-base` runs (and k8s/base/kustomization.yaml names).
BASE_COMMAND = ("helm", "template", RELEASE, CHART, "--namespace", NAMESPACE, "-f", "k8s/base/values.yaml")
OVERLAYS = {  # overlay -> (image variant, GPUs per serve worker, Secrets rendered, the chart's equivalent values)
    "dev": ("cpu", 0, True, f"{CHART}/ci/dev-values.yaml"),
    "prod": ("gpu", 1, False, f"{CHART}/ci/prod-values.yaml"),
}
# Labels that only say which tool rendered which version; checksums of the ConfigMap the overlays patch.
VOLATILE_LABELS = {"helm.sh/chart", "app.kubernetes.io/version", "app.kubernetes.io/managed-by"}


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict]]:
    """Each overlay rendered once for the module."""
    return {name: objects(run("kubectl", "kustomize", f"k8s/overlays/{name}")) for name in OVERLAYS}


@pytest.mark.component
def test_base_is_the_chart_render():
    fresh = run(*BASE_COMMAND)
    stored = (REPO / "k8s" / "base" / "clipstream.yaml").read_text()
    if stored != fresh:
        diff = "\n".join(difflib.unified_diff(stored.splitlines(), fresh.splitlines(), "k8s/base/clipstream.yaml",
                                              "helm template", lineterm="", n=2))
        pytest.fail(f"k8s/base/clipstream.yaml is stale: run `make k8s-base`\n{diff[:4000]}")
    kustomization = (REPO / "k8s" / "base" / "kustomization.yaml").read_text()
    assert kustomization.startswith("#") and "make k8s-base" in kustomization.splitlines()[0]
    assert " ".join(BASE_COMMAND) in kustomization.splitlines()[0]
    spec = yaml.safe_load(kustomization)
    assert spec["namespace"] == NAMESPACE
    assert set(spec["resources"]) == {"namespace.yaml", "clipstream.yaml"}


@pytest.mark.component
def test_base_renders_and_references_secrets_only():
    docs = objects(run("kubectl", "kustomize", "k8s/base"))
    validate_all(docs)
    assert not by_kind(docs, "Secret")
    assert not [d for d in docs if d["kind"] == "Pod"]  # no helm test hook in a kustomize install
    assert all(d["metadata"].get("namespace") == NAMESPACE for d in docs if d["kind"] != "Namespace")


@pytest.mark.component
@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_overlay_is_deployable(overlays, overlay, monkeypatch, tmp_path):
    variant, gpus, secrets_rendered, _values = OVERLAYS[overlay]
    docs = overlays[overlay]
    check_all(docs, variant=variant, gpus=gpus, secrets_rendered=secrets_rendered, monkeypatch=monkeypatch,
              tmp_path=tmp_path)
    assert all(d["metadata"].get("namespace") == NAMESPACE for d in docs if d["kind"] != "Namespace")


@pytest.mark.component
def test_dev_generates_secrets_with_fixed_names(overlays):
    secrets = {d["metadata"]["name"]: d for d in by_kind(overlays["dev"], "Secret")}
    # No hash suffix: KubeRay's pod templates name them and kustomize does not rewrite CRD fields.
    assert set(secrets) == {f"{RELEASE}-qdrant", f"{RELEASE}-api", f"{RELEASE}-postgres", f"{RELEASE}-ray-auth"}
    for name, secret in secrets.items():
        assert set(secret["data"]) == SECRETS[name]
    assert not by_kind(overlays["prod"], "Secret")


def _normalised(docs: list[dict]) -> dict[tuple[str, str], dict]:
    """Objects by (kind, name), without what only differs by tool: volatile labels, checksum annotations,
    namespaces (kustomize sets them), Secrets (generated differently), the Namespace and helm test hooks."""

    def norm(value):
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if key == "namespace":
                    continue
                if key == "labels" and isinstance(item, dict):
                    item = {k: v for k, v in item.items() if k not in VOLATILE_LABELS}
                if key == "annotations" and isinstance(item, dict):
                    item = {k: v for k, v in item.items() if not k.startswith("checksum/")}
                    if not item:
                        continue
                out[key] = norm(item)
            return out
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    return {(d["kind"], d["metadata"]["name"]): norm(d) for d in docs
            if d["kind"] not in ("Secret", "Namespace") and "helm.sh/hook" not in d["metadata"].get("annotations", {})}


@pytest.mark.component
@pytest.mark.parametrize("overlay", list(OVERLAYS))
def test_overlay_equals_the_chart_with_its_values(overlays, overlay):
    chart = _normalised(objects(helm_template("-f", OVERLAYS[overlay][3])))
    kustomized = _normalised(overlays[overlay])
    assert sorted(chart) == sorted(kustomized)
    diffs = []
    for key in sorted(chart):
        if chart[key] != kustomized[key]:
            a = yaml.safe_dump(chart[key], sort_keys=True).splitlines()
            b = yaml.safe_dump(kustomized[key], sort_keys=True).splitlines()
            diffs.append("\n".join(difflib.unified_diff(a, b, f"chart {key}", f"k8s/overlays/{overlay} {key}",
                                                        lineterm="", n=1)))
    assert not diffs, "\n".join(diffs)
