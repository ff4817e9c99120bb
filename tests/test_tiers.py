"""The test pyramid's rules: `make test` is every test not marked `slow`, `make test-all` (what CI runs) is every test,
and a test that starts Ray, Serve, a training job, a cluster or a CLI process says its tier (tests/conftest.py)."""

import re
from pathlib import Path

from tests.conftest import COSTLY, TIERS, tier_problem

ROOT = Path(__file__).resolve().parents[1]


def test_a_costly_fixture_without_a_tier_marker_is_refused_with_what_to_add():
    problem = tier_problem("t::a", {"tmp_path", "served"}, {"parametrize"})
    assert "t::a uses `served`" in problem and "add @pytest.mark.component / e2e / slow" in problem
    assert tier_problem("t::b", {"tmp_path", "served"}, {"component"}) is None
    assert tier_problem("t::c", {"tmp_path"}, set()) is None  # a unit test needs no marker


def test_the_full_tier_fixtures_refuse_the_quick_tier_and_one_tier_per_test():
    assert "belongs to tier slow, not component" in tier_problem("t", {"trained_stream"}, {"component"})
    assert "belongs to tier slow, not e2e" in tier_problem("t", {"cluster_session"}, {"e2e"})
    assert "belongs to tier e2e / slow, not component" in tier_problem("t", {"two_tasks"}, {"component"})
    assert tier_problem("t", {"two_tasks"}, {"e2e"}) is None and tier_problem("t", {"two_tasks"}, {"slow"}) is None
    assert "several tier markers" in tier_problem("t", set(), {"component", "slow"})
    assert set(TIERS) >= {t for tiers in COSTLY.values() for t in tiers}


def test_make_test_deselects_only_the_slow_tier_and_ci_runs_every_test():
    make = (ROOT / "Makefile").read_text()
    recipe = lambda target: re.search(rf"^{target}: setup\n\t(.+)$", make, re.M).group(1)  # noqa: E731
    assert recipe("test") == '$(PY) -m pytest -m "not slow" tests'
    assert recipe("test-all") == "$(PY) -m pytest tests"
    assert re.search(r"^time make test-all$", (ROOT / ".ci/run").read_text(), re.M)


def test_only_the_end_to_end_path_carries_the_e2e_marker():
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^(@|pytestmark = )pytest\.mark\.e2e", p.read_text(), re.M)}
    assert marked == {"tests/test_end_to_end.py", "tests/training/test_job.py"}
