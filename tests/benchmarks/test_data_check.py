"""`clipstream bench data-check`: both sides run on the same synthetic task and the file holds the per-core check."""

import json

from clipstream.benchmarks import data_check


def test_it_measures_both_sides_and_checks_the_per_core_target(tmp_path):
    out = tmp_path / "data-check.md"
    text = data_check.main(["--images", "40", "--size", "32", "--rounds", "1", "--out", str(out)])
    assert "| plain loop (open + verify + sha256, one thread) |" in text and "| clipstream (Task.check" in text
    (check,) = json.loads(out.with_suffix(".json").read_text())["checks"]
    assert check["target"] == "≥ 0.80" and float(check["value"]) > 0


def test_the_task_it_makes_is_a_valid_task(tmp_path):
    from clipstream.training.data.task import Task

    task = Task.load(data_check.make_task(tmp_path / "t", 5, 16))
    assert len(task.check("train").rows) == 5 and task.check("test").rows
