"""`clipstream bench all`: every cost benchmark in its own process, and the summary of their targets."""

import json

import pytest

from clipstream.benchmarks import report, suite
from clipstream.cli import main


def test_the_summary_lists_every_check_with_its_benchmark_and_names_a_failed_one(tmp_path):
    (tmp_path / "method-step.json").write_text(json.dumps({"checks": [
        report.check("ewc step ×finetune", 1.05, at_most=1.10), report.check("ctp step ×finetune", 1.5, at_most=1.35,
                                                                            why="see the profile")]}))
    text = suite.summary(tmp_path, [("method-step", 0, 90.0, "method-step"), ("search", 1, 30.0, "search"),
                                    ("gpu", 0, 6.0, "gpu")], quick=False)
    assert text == (tmp_path / "summary.md").read_text()
    assert "| method-step | 1.5 | ewc step ×finetune | 1.05 | ≤ 1.10 | met |" in text
    assert "|  |  | ctp step ×finetune | 1.50 | ≤ 1.35 | **not met** (see the profile) |" in text
    assert "| search | 0.5 | failed (exit 1): see logs/search.log |" in text
    assert "| gpu | 0.1 | (no target) |" in text and "Total 2.1 min." in text


def test_a_rerun_of_some_benchmarks_keeps_the_others_rows_from_their_last_run(tmp_path):
    for stem, value in (("method-step", 1.05), ("search", 0.99), ("indexing", 0.9)):
        (tmp_path / f"{stem}.json").write_text(json.dumps({"checks": [report.check(f"{stem} figure", value, at_most=2)]}))
    # indexing's checks are from before the suite recorded runs: kept, its minutes unknown
    suite.summary(tmp_path, suite.recorded(tmp_path, [("method-step", 0, 120.0, "method-step"),
                                                      ("search", 0, 60.0, "search")]), quick=False)
    text = suite.summary(tmp_path, suite.recorded(tmp_path, [("search", 0, 180.0, "search")]), quick=False,
                         ran=["search"])
    assert text == (tmp_path / "summary.md").read_text()
    assert "| method-step | 2.0 | method-step figure | 1.05 |" in text and "| search | 3.0 | search figure | 0.99 |" in text
    assert "| indexing | - | indexing figure | 0.90 |" in text
    assert "Total 5.0 min of those with minutes (indexing: results of runs the suite did not record)." in text
    assert "Last run: `clipstream bench all --only search`; the rows of method-step, indexing are from their own" in text
    assert json.loads((tmp_path / "suite.json").read_text())["search"] == {"rc": 0, "seconds": 180.0}
    # a run stopped part way leaves its finished benchmarks' results, unrecorded: --summarize runs nothing and
    # shows them with the rest
    (tmp_path / "method-step.json").write_text(json.dumps({"checks": [report.check("newer figure", 1.2, at_most=2)]}))
    assert suite.main(["--summarize", "--out", str(tmp_path)]) == (tmp_path / "summary.md").read_text()
    text = (tmp_path / "summary.md").read_text()
    assert "| method-step | 2.0 | newer figure | 1.20 |" in text and "| search | 3.0 | search figure |" in text
    assert not (tmp_path / "logs" / "search.log").exists()


def test_every_planned_benchmark_exists_and_quick_runs_are_kept_apart_from_the_results():
    from clipstream.benchmarks import BENCHMARKS

    assert set(suite.PLAN) <= set(BENCHMARKS) and "all" not in suite.PLAN


def test_an_unknown_benchmark_in_only_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "all", "--only", "method-step,nope"])
    assert done.value.code == 2 and "--only: unknown benchmark(s) nope" in capsys.readouterr().err
