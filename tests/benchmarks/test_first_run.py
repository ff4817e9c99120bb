"""`clipstream bench first-run`: a terminal's view of the demo's output, and the report's verdicts."""

import json

import pytest

from clipstream.benchmarks import first_run as bench


def test_a_terminal_keeps_what_a_progress_bar_leaves_and_one_blank_line():
    printed = "== training\ntrain t0:  10%|#\rtrain t0:  90%|#########\r          \rtask 1/4 t0 version 1\n\n\n\nquery 'a'\n 1 0.9 t0\n\n"
    assert bench.screen(printed) == ["== training", "task 1/4 t0 version 1", "", "query 'a'", " 1 0.9 t0"]


def test_the_report_checks_lines_processes_and_that_the_searches_come_last(tmp_path):
    ok = {"rc": 0, "seconds": 300.0, "lines": ["== a", "query 'x', task-unknown", " #  score", " 1  0.9 t0"], "left": []}
    text = bench.first_run_report(ok, 3, tmp_path / "first-run.md", "cmd", "CPU")
    assert "| 0 | 5.0 min | 4 | yes | 0 |" in text
    assert all(c["ok"] for c in json.loads((tmp_path / "first-run.json").read_text())["checks"])
    noisy = dict(ok, lines=[f"(ray) line {i}" for i in range(100)] + ok["lines"] + ["Reporting training result"],
                 left=["123 raylet"])
    bench.first_run_report(noisy, 3, tmp_path / "noisy.md", "cmd", "CPU")
    verdicts = {c["check"]: c["ok"] for c in json.loads((tmp_path / "noisy.json").read_text())["checks"]}
    assert verdicts == {"lines printed": False, "processes left behind": False,
                        "ends with the searches (1 = yes)": False, "exit status": True}


@pytest.mark.component
def test_a_process_that_exits_on_its_own_soon_after_is_not_left_behind_one_that_stays_is():
    import os
    import subprocess
    import sys
    import uuid

    marker = f"CLIPSTREAM_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1]}
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"], env=env)
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        left = bench.still_running(marker + "\0", grace_s=0.5, most_s=6)
        assert left == [f"{stays.pid} {sys.executable} -c import time; time.sleep(60) "], left
        assert late.poll() == 0
    finally:
        stays.kill()
        stays.wait()
        late.wait()


@pytest.mark.slow
def test_the_demo_is_quiet_ends_with_its_searches_and_leaves_no_process(tmp_path):
    """The first run a newcomer makes, shortened (one domain task + digits, one epoch of two steps): fewer than 80
    lines on the terminal, the searches last, every process it started gone (`clipstream bench first-run` times the
    full one)."""
    result = bench.run_demo(1, tmp_path, ["--set", "train.epochs=1", "--set", "train.max_steps=2"])
    shown = "\n".join(result["lines"])
    assert result["rc"] == 0, shown[-3000:]
    assert len(result["lines"]) < bench.MOST_LINES, shown
    assert bench.searches_last(result["lines"]), shown[-2000:]
    assert result["left"] == []
    for noise in ("Reporting training result", "(RayTrainWorker", "DeepSpeed info", "Traceback", "WARNING"):
        assert noise not in shown
    assert sum(line.startswith("task ") and " version " in line for line in result["lines"]) == 2  # a line per task
