"""The helpers every benchmark's results file shares, and `clipstream bench` dispatching to the scripts."""

import importlib
from pathlib import Path

import pytest

from clipstream.benchmarks import BENCHMARKS, report
from clipstream.cli import main


def test_table_formats_floats_and_keeps_formatted_cells():
    assert report.table(["a", "b"], [["x", 1.25], ["y", "1.00"]]) == ["| a | b |", "|---|---|", "| x | 1.2 |",
                                                                       "| y | 1.00 |"]


def test_write_makes_the_folder_and_ends_with_one_newline(tmp_path):
    out = tmp_path / "deep" / "r.json"
    assert report.write(out, ["{}", ""]) == "{}\n" == out.read_text()  # (not markdown: as given)


def test_every_markdown_results_file_names_the_commit_after_its_reproduce_line(tmp_path):
    code = f"Code: `{report.code_version()}`."
    assert report.write(tmp_path / "a.md", ["# t", "", "Reproduce: `x`", "", "y"]).splitlines() == [
        "# t", "", "Reproduce: `x`", "", code, "", "y"]
    assert report.write(tmp_path / "b.md", ["# t", "", "Device: d. Reproduce: `x`.", "R@K in percent.", ""]
                        ).splitlines() == ["# t", "", "Device: d. Reproduce: `x`.", "", code, "", "R@K in percent."]
    assert report.write(tmp_path / "c.md", ["# t", "", "x"]) == f"# t\n\n{code}\n\nx\n"  # none: after the title
    assert report.write(tmp_path / "d.md", ["# t", "Reproduce: `x`"]).splitlines()[-2:] == ["", code]


def test_the_code_version_is_the_checkouts_commit_or_else_the_packages_version(monkeypatch):
    import subprocess

    head = subprocess.run(["git", "-C", str(Path(report.__file__).parent), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    if head:  # a checkout: its commit, -dirty with changes
        assert head[:7] in report.code_version.__wrapped__()  # (describe: TAG-N-gHASH where tags exist)
    monkeypatch.setattr(report, "git", lambda folder, *args: None)  # no git, or not a checkout
    assert report.code_version.__wrapped__().startswith(("clipstream ", "unknown"))


def test_device_names_the_machine_and_the_details():
    line = report.device("2 Ray Train workers")
    assert line.endswith(", 2 Ray Train workers") and ("CPU (" in line or "GPU" in line)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_every_benchmark_is_a_script_the_cli_dispatches_to(name, capsys):
    module = importlib.import_module(f"clipstream.benchmarks.{BENCHMARKS[name]}")
    assert callable(module.main) and module.__file__.endswith(f"benchmarks/{BENCHMARKS[name]}.py")
    with pytest.raises(SystemExit) as done:
        main(["bench", name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    # (a module that imports DeepSpeed may log a line to stdout first: quiet, the CLI sends it to the log file)
    assert f"usage: clipstream bench {name}" in out and "--out" in out


def test_an_unknown_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "nope"])
    assert done.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_check_states_its_bound_and_whether_the_figure_meets_it():
    assert report.check("ratio", 0.93, at_least=0.9) == {"check": "ratio", "value": "0.93", "target": "≥ 0.90",
                                                         "ok": True, "why": ""}
    assert not report.check("p99 ms", 5.5, at_most=5.0, fmt="{:.1f}")["ok"]
    assert report.check("r", 1.0, at_least=0.5, at_most=2.0)["target"] == "≥ 0.50 and ≤ 2.00"
    # a miss that would read as its bound shows the digits that decide it; a figure on its bound meets it
    assert report.check("lwf", 1.2537, at_most=1.25)["value"] == "1.2537"
    assert report.check("r", 0.9461, at_least=0.9489)["value"] == "0.9461"
    assert report.check("lwf", 1.25, at_most=1.25) == {"check": "lwf", "value": "1.25", "target": "≤ 1.25", "ok": True,
                                                       "why": ""}


def test_targets_are_written_next_to_the_results_for_the_summary_and_as_a_table(tmp_path):
    import json

    checks = [report.check("a", 1.2, at_most=1.1, why="two extra forward passes"), report.check("b", 1.0, at_least=0.9)]
    lines = report.targets(tmp_path / "x.md", checks)
    assert json.loads((tmp_path / "x.json").read_text()) == {"checks": checks, "code": report.code_version()}
    assert lines[-2:] == ["| a | 1.20 | ≤ 1.10 | **not met** (two extra forward passes) |", "| b | 1.00 | ≥ 0.90 | met |"]


def test_every_results_file_the_readmes_link_or_show_is_committed():
    """README's Results and benchmarks/README.md quote the results files and show their plots: a renamed or dropped
    file would leave them pointing at nothing."""
    import re

    root = Path(__file__).resolve().parents[2]
    linked = set(re.findall(r"\((benchmarks/results/[^)\s#]+)", (root / "README.md").read_text()))
    linked |= {f"benchmarks/{p}" for p in re.findall(r"\((results/[^)\s#]+)", (root / "benchmarks/README.md").read_text())}
    assert {"benchmarks/results/summary.md", "benchmarks/results/search.png", "benchmarks/results/methods.md"} <= linked
    assert [p for p in sorted(linked) if not (root / p).is_file()] == []


# every benchmark that builds a model (all but the suite, first-run and reliability, which take none by name)
TAKE_ARCH = ["search", "indexing", "grpc-encode", "method-step", "train-throughput", "stream-growth", "methods",
             "languages", "index-policy", "gpu"]


class LookedUp(Exception):
    """Raised by the lookup under test once it has answered: the benchmark goes no further than its options."""


@pytest.mark.parametrize("name", TAKE_ARCH)
def test_every_benchmark_takes_an_open_clip_architecture_by_name_before_it_runs(name, settings, monkeypatch):
    from clipstream import models

    module = importlib.import_module(f"clipstream.benchmarks.{BENCHMARKS[name]}")
    found, lookup = [], models.architecture

    def looked_up(arch):
        found.append((arch, lookup(arch)["embed_dim"]))  # open_clip's own config of its built-in ViT-B-32
        raise LookedUp

    monkeypatch.setattr(models, "architecture", looked_up)
    with pytest.raises(LookedUp):
        module.main(["--arch", "ViT-B-32", "--out", str(settings.home / "out.md")])
    assert found == [("ViT-B-32", 512)]
    assert not (settings.home / "out.md").exists()


@pytest.mark.parametrize("name", TAKE_ARCH)
def test_an_unknown_architecture_is_one_line_exit_2_that_says_where_the_names_are(name, settings, capsys):
    out = settings.home / "out.md"
    assert main(["bench", name, "--arch", "no-such-arch", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists() and not out.with_suffix(".json").exists()
    last = err.strip().splitlines()[-1]
    assert last.startswith("clipstream: error: unknown architecture 'no-such-arch';")
    assert "open_clip.list_models()" in last
