"""The real checkov (`make setup` installs it in a venv of its own) over every render: the chart with its default,
dev and prod values, both kustomize overlays, and what `clipstream k8s job|stream` print. No finding but the checks
k8s/.checkov.yaml skips, each with its reason.

checkov reads the built-in kinds only: the Pods that KubeRay makes from the RayService's and the RayJobs' pod
templates are given to it as Pods (`as_pods`)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess

import pytest
import yaml
from k8s_checks import REPO, objects, run
from test_chart import helm_template

from clipstream.cli import main

CONFIG = REPO / "k8s/.checkov.yaml"
CHECKOV = REPO / ".venv/checkov/bin/checkov"
JOBS = {"k8s-job": ["job", "--task", "s3://b/t0"],
        "k8s-stream": ["stream", "--tasks", "s3://b/t0", "s3://b/t1", "--name", "s1"]}


def skips() -> dict[str, str]:
    """k8s/.checkov.yaml's skip-check entries -> the comment above them (one comment may serve several)."""
    out, reason, comment = {}, "", []
    lines = CONFIG.read_text().split("skip-check:", 1)[1].splitlines()
    for line in (line.strip() for line in lines):
        if line.startswith("#"):
            comment.append(line.lstrip("# "))
        elif line.startswith("- "):
            reason, comment = (" ".join(comment), []) if comment else (reason, comment)
            out[line[2:].split("#")[0].strip()] = reason
    return out


def as_pods(docs: list[dict]) -> list[dict]:
    """The pods KubeRay makes of each RayService, RayCluster and RayJob (head, worker groups, submitter)."""
    pods = []
    for doc in docs:
        spec = doc.get("spec", {})
        cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or (spec if doc["kind"] == "RayCluster"
                                                                                else None)
        if doc.get("apiVersion", "").split("/")[0] != "ray.io" or cluster is None:
            continue
        templates = {"head": cluster["headGroupSpec"]["template"],
                     **{g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])}}
        if "submitterPodTemplate" in spec:
            templates["submitter"] = spec["submitterPodTemplate"]
        for group, template in templates.items():
            metadata = {**template.get("metadata", {}), "name": f"{doc['metadata']['name']}-{group}"}
            if "namespace" in doc["metadata"]:
                metadata["namespace"] = doc["metadata"]["namespace"]
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
    return pods


def printed(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["k8s", *argv]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict[str, set[tuple[str, str]]]:
    """render -> {(check, resource)} that checkov finds, but for the checks k8s/.checkov.yaml skips."""
    renders = {"chart-default": helm_template(), "chart-dev": helm_template("-f", "charts/clipstream/ci/dev-values.yaml"),
               "chart-prod": helm_template("-f", "charts/clipstream/ci/prod-values.yaml"),
               **{f"kustomize-{o}": run("kubectl", "kustomize", f"k8s/overlays/{o}") for o in ("dev", "prod")},
               **{name: printed(argv) for name, argv in JOBS.items()}}
    folder = tmp_path_factory.mktemp("renders")
    for name, text in renders.items():
        docs = objects(text)
        (folder / f"{name}.yaml").write_text(yaml.safe_dump_all(docs + as_pods(docs), sort_keys=False))
    out = subprocess.run([str(CHECKOV), "--config-file", str(CONFIG), "-d", str(folder), "-o", "json"],
                         capture_output=True, text=True, cwd=folder,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(folder), "BC_SKIP_MAPPING": "TRUE"}, timeout=300)
    assert out.returncode in (0, 1), f"checkov failed ({out.returncode}): {out.stderr[-2000:]}"
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert [r["check_type"] for r in reports] == ["kubernetes"] and not reports[0]["summary"]["parsing_errors"]
    results = reports[0]["results"]
    analysed = {c["file_path"].rsplit("/", 1)[-1].removesuffix(".yaml") for c in results["passed_checks"]}
    assert analysed == set(renders), f"checkov analysed {sorted(analysed)} of {sorted(renders)}"
    found: dict[str, set[tuple[str, str]]] = {name: set() for name in renders}
    for check in results["failed_checks"]:
        found[check["file_path"].rsplit("/", 1)[-1].removesuffix(".yaml")].add((check["check_id"], check["resource"]))
    return found


def test_every_skipped_check_says_why():
    listed = skips()
    assert listed and all(re.fullmatch(r"CKV2?_K8S_\d+", check) for check in listed), listed
    assert all(len(reason) > 40 for reason in listed.values()), listed


@pytest.mark.component
def test_no_render_has_a_finding(findings):
    for name, found in findings.items():
        what = f"`clipstream k8s {JOBS[name][0]}`" if name in JOBS else name
        assert not found, f"checkov on {what}: {sorted(found)} (fix it, or skip it in k8s/.checkov.yaml with why)"
