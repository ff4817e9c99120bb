"""The test pyramid's rules: `make test` is every test not marked `slow`, `make test-all` (what CI runs) is every test,
and a test that starts Ray, Serve, a training job, a cluster or a CLI process says its tier (tests/conftest.py)."""

import re
from pathlib import Path

import pytest

from tests.conftest import COSTLY, TIERS, tier_problem

ROOT = Path(__file__).resolve().parents[1]


def test_a_costly_fixture_without_a_tier_marker_is_refused_with_what_to_add():
    problem = tier_problem("t::a", {"tmp_path", "served"}, {"parametrize"})
    assert "t::a uses `served`" in problem and "add @pytest.mark.component / e2e / slow" in problem
    assert tier_problem("t::b", {"tmp_path", "served"}, {"component"}) is None
    assert tier_problem("t::c", {"tmp_path"}, set()) is None  # a unit test needs no marker


def test_the_full_tier_fixtures_refuse_the_quick_tier_and_one_tier_per_test():
    assert "belongs to tier slow, not component" in tier_problem("t", {"trained_stream"}, {"component"})
    assert "belongs to tier slow, not e2e" in tier_problem("t", {"two_tasks", "cluster_session"}, {"e2e"})
    assert "belongs to tier e2e / slow, not component" in tier_problem("t", {"two_tasks"}, {"component"})
    assert tier_problem("t", {"two_tasks"}, {"e2e"}) is None and tier_problem("t", {"two_tasks"}, {"slow"}) is None
    assert "several tier markers" in tier_problem("t", set(), {"component", "slow"})
    assert set(TIERS) >= {t for tiers in COSTLY.values() for t in tiers}


@pytest.mark.component  # (make and bash processes)
def test_make_test_deselects_only_the_slow_tier_and_ci_runs_every_test(tmp_path):
    """What make runs for each tier (its dry run, set-up up to date), and what CI's script asks make for (with a
    `make` on the PATH that records its arguments)."""
    import os
    import subprocess

    def recipe(target: str) -> str:
        done = subprocess.run(["make", "-n", "-s", target, "VENV=.venv", "-o", "setup"], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        return done.stdout.strip().splitlines()[-1]
    assert recipe("test") == '.venv/bin/python -m pytest -m "not slow" tests'
    assert recipe("test-all") == ".venv/bin/python -m pytest tests"
    (tmp_path / "make").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'asked'}\n")
    (tmp_path / "make").chmod(0o755)
    subprocess.run(["bash", str(ROOT / ".ci/run")], env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
                   capture_output=True, check=True)
    assert (tmp_path / "asked").read_text().split() == ["test-all"]


def test_the_e2e_tier_is_the_checks_on_the_one_trained_world():
    assert "marked e2e without using `two_tasks`" in tier_problem("t::a", {"tmp_path"}, {"e2e"})
    assert tier_problem("t::b", {"two_tasks", "stream"}, {"e2e"}) is None


def test_a_test_that_starts_a_costly_process_without_a_tier_is_refused():
    from tests.conftest import costly_program, guard_problem

    assert costly_program(["/work/.venv/bin/python3.11", "-m", "clipstream.cli"]) == "python3.11"
    assert costly_program("/usr/bin/helm") == "helm" and costly_program([b"kubectl", "apply"]) == "kubectl"
    assert costly_program(["git", "rev-parse"]) is None and costly_program(["/sbin/ldconfig", "-p"]) is None
    assert costly_program([]) is None
    assert "t::a started helm, python without a tier marker: add @pytest.mark.component" in \
        guard_problem("t::a", False, False, ["python", "helm", "python"])
    assert "t::b started Ray without a tier marker" in guard_problem("t::b", False, True, [])
    assert guard_problem("t::c", True, True, ["python"]) is None and guard_problem("t::d", False, False, []) is None


@pytest.mark.component  # (it starts two interpreters: so it is in a tier itself)
def test_the_guard_sees_a_process_started_through_any_helper_and_a_multiprocessing_spawn(_tier_guard):
    """What tests/conftest.py records of the running test (the list `_tier_guard` checks after it)."""
    import multiprocessing
    import subprocess
    import sys

    subprocess.run(["git", "--version"], capture_output=True, check=False)
    assert _tier_guard == []  # (a cheap program)
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    process = multiprocessing.get_context("spawn").Process(target=print)
    process.start()
    process.join()
    # (the spawn start may add multiprocessing's resource tracker, an interpreter too)
    assert set(_tier_guard) == {Path(sys.executable).name, "python (multiprocessing)"}
