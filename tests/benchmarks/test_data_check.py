"""`clipstream bench data-check`: both sides run on the same synthetic task and the file holds the per-core check."""

import json

import pytest

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


@pytest.mark.slow
def test_the_time_before_the_first_step_comes_from_a_real_train_job_capped_at_two_steps(tmp_path):
    """--first-step: a `clipstream train` process, a real job whose run logs its seconds before the first step (the
    driver's clock to rank 0's), capped at 2 steps by train.max_steps (48 pairs fill 3 steps of 2 workers x 8)."""
    out = tmp_path / "data-check.md"
    text = data_check.main(["--images", "48", "--size", "32", "--rounds", "1", "--first-step", "48", "--out", str(out)])
    assert "## Time before the first training step" in text and "--first-step 48" in text
    (row,) = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| 48 ")]
    pairs, first, check_hash, wall, steps = row
    assert 0 <= float(check_hash) < float(first) < float(wall) and steps == "2"
