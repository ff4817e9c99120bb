"""`clipstream bench first-run`: a terminal's view of the demo's output, and the report's verdicts."""

import json

import pytest

from clipstream.benchmarks import first_run as bench
from clipstream.cli.demo import FALLBACK


def test_a_terminal_keeps_what_a_progress_bar_leaves_and_one_blank_line():
    printed = "== training\ntrain t0:  10%|#\rtrain t0:  90%|#########\r          \rtask 1/4 t0 version 1\n\n\n\nquery 'a'\n 1 0.9 t0\n\n"
    assert bench.screen(printed) == ["== training", "task 1/4 t0 version 1", "", "query 'a'", " 1 0.9 t0"]


def test_the_report_checks_lines_processes_and_that_the_searches_come_last(tmp_path):
    ok = {"rc": 0, "seconds": 300.0, "lines": ["== a", "query 'x', task-unknown", " #  score", " 1  0.9 t0"], "left": []}
    text = bench.first_run_report(ok, "3 synthetic domain tasks", tmp_path / "first-run.md", "cmd", "CPU")
    assert "| 0 | 5.0 min | 4 | yes | 0 |" in text
    assert all(c["ok"] for c in json.loads((tmp_path / "first-run.json").read_text())["checks"])
    noisy = dict(ok, lines=[f"(ray) line {i}" for i in range(100)] + ok["lines"] + ["Reporting training result"],
                 left=["123 raylet"])
    bench.first_run_report(noisy, "3 synthetic domain tasks", tmp_path / "noisy.md", "cmd", "CPU")
    verdicts = {c["check"]: c["ok"] for c in json.loads((tmp_path / "noisy.json").read_text())["checks"]}
    assert verdicts == {"lines printed": False, "processes left behind": False,
                        "ends with the searches (1 = yes)": False, "exit status": True}


def _searches(hits: dict[str, list[str]]) -> list[str]:
    """The lines the emoji demo prints for its searches (`format_hits` with names)."""
    lines = []
    for query, names in hits.items():
        lines += ["", f"query {query!r}, task-known (demo-emoji-v2), encoded by version 2",
                  " #  score  task                 item                         ver gen  name"]
        lines += [f"{i:>2}  0.900  demo-emoji-v2        {i:07d}                        2   1  {n}"
                  for i, n in enumerate(names, 1)]
    return lines


def test_the_report_reads_each_named_search_and_wants_its_emoji_in_the_top_5(tmp_path):
    from clipstream.training.data.emoji import DEMO_SEARCHES

    good = {q: ["green apple", "flag: Japan", name, "a", "b"] for q, name in DEMO_SEARCHES.items()}
    lines = ["== training", "task 2/2 emoji-demo-01-en version 2", *_searches(good)]
    assert bench.searched(lines) == good and bench.missed(lines) == []
    bad = dict(good, **{"roter Apfel": ["a", "b", "c", "d", "e", "red apple"]})
    assert bench.missed(["x", *_searches(bad)]) == ["'roter Apfel' (wants 'red apple', got ['a', 'b', 'c', 'd', 'e'])"]
    ok = {"rc": 0, "seconds": 200.0, "lines": ["x", *_searches(bad)], "left": []}
    text = bench.first_run_report(ok, "emoji: Twemoji", tmp_path / "first-run.md", "cmd", "CPU")
    assert "- 'roter Apfel' (wants 'red apple'" in text
    verdicts = {c["check"]: c["ok"] for c in json.loads((tmp_path / "first-run.json").read_text())["checks"]}
    assert verdicts["named searches without their emoji in the top 5"] is False
    fallback = dict(ok, lines=[f"clipstream demo: the npm registry cannot be reached; {FALLBACK}", *ok["lines"]])
    bench.first_run_report(fallback, "emoji: Twemoji", tmp_path / "offline.md", "cmd", "CPU")
    assert "named searches" not in (tmp_path / "offline.md").read_text()  # the synthetic world searched instead


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
def test_the_demo_is_quiet_finds_the_emoji_it_searches_for_and_leaves_no_process(tmp_path):
    """The first run a newcomer makes (`make demo`), whole: its training cannot be shortened, since its searches must
    find what they name. A new HOME, so the emoji are fetched from the npm registry, as on a first run (with no
    registry in reach it says so in one line and runs the synthetic world: that is checked instead). Fewer than 80
    lines on the terminal, the searches last, each named emoji in its query's top 5, every process it started gone
    (`clipstream bench first-run` times it)."""
    from clipstream.training.data.emoji import DEMO_SEARCHES

    result = bench.run_demo(tmp_path)
    shown = "\n".join(result["lines"])
    assert result["rc"] == 0, shown[-3000:]
    assert len(result["lines"]) < bench.MOST_LINES, shown
    assert bench.searches_last(result["lines"]), shown[-2000:]
    assert result["left"] == []
    for noise in ("Reporting training result", "(RayTrainWorker", "DeepSpeed info", "Traceback", "WARNING"):
        assert noise not in shown
    tasks = [line for line in result["lines"] if line.startswith("task ") and " version " in line]  # a line per task
    offline = [line for line in result["lines"] if FALLBACK in line]
    if offline:  # the registry out of reach: one line, then the synthetic world, whole
        assert len(offline) == 1 and offline[0].startswith("clipstream demo: "), shown[:2000]
        assert len(tasks) == 4 and "== synthesising 3 domain tasks" in shown
        return
    assert [t.split()[2] for t in tasks] == ["emoji-demo-00-de", "emoji-demo-01-en"]
    assert list(bench.searched(result["lines"])) == list(DEMO_SEARCHES)
    assert bench.missed(result["lines"]) == [], shown[-4000:]
