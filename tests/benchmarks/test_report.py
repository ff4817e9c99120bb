"""The helpers every benchmark's results file shares, and `clipstream bench` dispatching to the scripts."""

import importlib

import pytest

from clipstream.benchmarks import BENCHMARKS, report
from clipstream.cli import main


def test_table_formats_floats_and_keeps_formatted_cells():
    assert report.table(["a", "b"], [["x", 1.25], ["y", "1.00"]]) == ["| a | b |", "|---|---|", "| x | 1.2 |",
                                                                       "| y | 1.00 |"]


def test_write_makes_the_folder_and_ends_with_one_newline(tmp_path):
    out = tmp_path / "deep" / "r.md"
    assert report.write(out, ["# t", "", "x", ""]) == "# t\n\nx\n" == out.read_text()


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
    assert out.startswith(f"usage: clipstream bench {name}") and "--out" in out


def test_an_unknown_benchmark_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "nope"])
    assert done.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err
