"""`clipstream bench stream-growth`: the report and its verdict from hand-made numbers, the equal-sized stream, the
CLI's checks, and (slow) one real 2-task stream."""

import json
import math

import pytest

from clipstream.benchmarks import stream_growth as bench
from clipstream.cli import main


def _task(t, rows, wall, eval_s, steps=2, step_ms=100.0, peak=1000.0, gallery=64, embedded=None, first_ms=None):
    """A job whose CPU time is its wall time, evaluation included; its first step takes `first_ms` (default: a step)."""
    first_ms = step_ms if first_ms is None else first_ms
    return {"task": f"task-{t:02d}", "rows": rows, "wall_s": wall, "cpu_s": wall, "eval_s": eval_s,
            "eval_cpu_s": eval_s, "steps": steps, "step_ms": (first_ms + step_ms * (steps - 1)) / steps,
            "first_step_ms": first_ms, "peak_mib": peak, "gallery": gallery * t, "embedded": embedded or gallery * t}


def _results():
    # finetune, flat: 10 s + t s of evaluation at task t; task 1 special (20 s)
    # er, bounded by 100 pairs: 64, 128, 164, 164 pairs; job time w/o evaluation 10, 12, 13, 13 s
    # joint, linear: 64 t pairs, 2 t steps of 100 ms after a first of 500 (the job's warm-up); job time w/o
    # evaluation 10 + 2 t s
    finetune = [_task(1, 64, 21.0, 1.0)] + [_task(t, 64, 10.0 + t, float(t)) for t in (2, 3, 4)]
    er = [_task(t, rows, base + t, float(t))
          for t, rows, base in ((1, 64, 10), (2, 128, 12), (3, 164, 13), (4, 164, 13))]
    joint = [_task(t, 64 * t, 10.0 + 2 * t + t, float(t), steps=2 * t, first_ms=500.0) for t in (1, 2, 3, 4)]
    return {"finetune": {"shape": "flat", "buffer": None, "pairs": 64, "tasks": finetune},
            "er": {"shape": "bounded", "buffer": 100, "pairs": 64, "tasks": er},
            "joint": {"shape": "linear", "buffer": None, "pairs": 64, "tasks": joint}}


def _checks(out):
    return {c["check"]: c for c in json.loads(out.with_suffix(".json").read_text())["checks"]}


def test_the_report_has_a_table_per_method_the_evaluation_the_targets_and_the_plot(tmp_path):
    out = tmp_path / "results" / "stream-growth.md"
    baseline = {"tasks": 4, "batch": 256, "before_pairs": 448, "now_pairs": 256, "before_s": 3.0, "now_s": 1.5,
                "before_cpu_s": 5.0, "now_cpu_s": 2.0}
    text = bench.growth_report(_results(), out, "clipstream bench stream-growth --tasks 4", "CPU (test)", 600.0,
                               baseline)
    assert out.read_text() == text
    assert "Reproduce: `clipstream bench stream-growth --tasks 4`" in text
    assert "Device: CPU (test). Wall time 10.0 min." in text
    assert "| " + " | ".join(bench.COLUMNS) + " |" in text
    assert "| 1 | 64 | 2 | 100 | 21.0 | 21.0 | 1.0 | 1.0 | 5% | 1000 | 64 | 64 |" in text  # finetune's task 1
    assert "| 4 | 256 | 8 | 150 | 22.0 | 22.0 | 4.0 | 4.0 | 18% | 1000 | 256 | 256 |" in text  # joint's task 4
    assert ("(448 pairs: task by task, the old tasks again with the parent) took 3.00 s (5.00 CPU s), the one-pass "
            "embedding (256 pairs) 1.50 s (2.00 CPU s): 2.0x less wall time, 2.5x less CPU.") in text
    checks = _checks(out)
    flat = checks["finetune (flat): job CPU s w/o evaluation, task 4 ÷ task 2"]
    assert (flat["value"], flat["target"], flat["ok"]) == ("1.00", "≤ 1.15", True)  # 10 s at every later task
    er = checks["er (bounded by the buffer): job CPU s w/o evaluation, task 4 ÷ task 2"]
    # fitted over tasks 2..4: 12, 13, 13 -> 12.17 .. 13.17: 1.08; its pairs grow 164/128 = 1.28x: target 1.15 x 1.28
    assert (er["value"], er["target"], er["ok"]) == ("1.08", "≤ 1.47", True)
    assert checks["er: most train pairs of a task"]["value"] == "164" and checks["er: most train pairs of a task"]["ok"]
    joint = checks["joint (linear): job CPU s w/o evaluation, task 4 ÷ task 2"]
    assert (joint["value"], joint["target"]) == ("1.29", "≤ 2.30")  # (10 + 2t) at 4 / at 2 = 18 / 14
    # 3, 5, 7 steps of 100 ms after the first: 2.33x; with the first step's 500 ms in, it would read 1.50 (not met)
    steps = checks["joint: time in training steps after the first, task 4 ÷ task 2"]
    assert (steps["value"], steps["target"], steps["ok"]) == ("2.33", "≥ 1.60", True)
    assert float(checks["joint: step ms, task 4 ÷ task 2"]["value"]) < 1  # the mean step falls as the warm-up spreads
    assert checks["pairs embedded per evaluation ÷ its union gallery (most over all jobs)"]["ok"]
    share = checks["evaluation's share of the last task's job CPU (most over methods)"]
    assert (share["value"], share["ok"]) == ("29%", False)  # finetune's: 4 / 14 -> the one target not met
    assert "## Targets" in text and "**not met**" in text
    assert "finetune 1.0 → 4.0 CPU s (29% of the job)" in text
    verdict = text.split("## Verdict")[1]
    assert ("- finetune: task 4 ÷ task 2 (fitted over 2..4): job CPU w/o evaluation ×1.00 (wall ×1.00), step "
            "×1.00, peak RSS ×1.00; expected flat (≤ 1.15x): as expected") in verdict
    assert "expected bounded by its buffer of 100 pairs (train pairs 128 → 164, at most 164; " in verdict
    assert ("expected linear (train pairs ×2.0; time in training steps after the first ×2.33, at least 0.8 × 4/2): "
            "as expected") in verdict
    assert "](stream-growth.png)" in text
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert bench.verdict_line(list(checks.values())) == (
        f"stream-growth: {len(checks) - 1}/{len(checks)} targets met; not met: "
        "evaluation's share of the last task's job CPU (most over methods)")


def test_a_cost_that_grows_where_it_should_not_is_not_met(tmp_path):
    results = _results()
    for t in results["finetune"]["tasks"][1:]:  # finetune's CPU growing like joint's, its wall time flat
        t["cpu_s"] += 5.0 * int(t["task"][-2:])
    results["joint"]["tasks"][-1]["embedded"] = 2 * results["joint"]["tasks"][-1]["gallery"]  # the parent's again
    text = bench.growth_report(results, tmp_path / "g.md", "cmd", "CPU")
    checks = _checks(tmp_path / "g.md")
    assert not checks["finetune (flat): job CPU s w/o evaluation, task 4 ÷ task 2"]["ok"]
    assert not checks["pairs embedded per evaluation ÷ its union gallery (most over all jobs)"]["ok"]
    assert "(wall ×1.00)" in text and "flat (≤ 1.15x): **not as expected**" in text


def test_two_tasks_have_their_rows_and_no_growth_checks(tmp_path):
    results = {"finetune": {"shape": "flat", "buffer": None, "pairs": 64,
                            "tasks": [_task(1, 64, 20.0, 1.0), _task(2, 64, 11.0, 2.0)]}}
    text = bench.growth_report(results, tmp_path / "g.md", "cmd", "CPU")
    assert "| 2 | 64 | 2 | 100 | 11.0 | 11.0 | 2.0 | 2.0 | 18% | 1000 | 128 | 128 |" in text
    checks = list(_checks(tmp_path / "g.md"))
    assert not any("÷ task 2" in c for c in checks) and len(checks) == 2
    assert "finetune: 2 tasks, no growth to measure" in text


def test_fit_ratio_and_the_expected_work():
    assert bench.fit_ratio([2, 3, 4], [10.0, 10.0, 10.0]) == pytest.approx(1.0)
    assert bench.fit_ratio([2, 3, 4, 5, 6, 7, 8], [2.0 * t for t in range(2, 9)]) == pytest.approx(4.0)
    assert bench.fit_ratio([2, 3, 4], [10.0, 30.0, 10.0]) == pytest.approx(1.0)  # one noisy task does not swing it
    assert math.isnan(bench.fit_ratio([2], [1.0])) and math.isnan(bench.fit_ratio([2, 3], [1.0, math.nan]))
    er = {"shape": "bounded", "buffer": 200, "pairs": 64, "tasks": [_task(t, 64, 10.0, 1.0) for t in range(1, 9)]}
    assert bench.growth(er)["work"] == pytest.approx(264 / 128)  # 64 + min(200, 64 (t - 1)): full from task 5
    assert bench.shape_of({"method": {"joint": {}}}, 8, 64) == ("linear", None)
    assert bench.shape_of({"method": {"ctp": {}, "er": {"buffer_pairs": 50, "buffer_fraction": None}}}, 8, 64) == \
        ("bounded", 50)
    # 1% of 8 tasks of 64 pairs: 5.12 pairs, each task's share rounded up or down
    assert bench.shape_of({"method": {"er": {"buffer_pairs": None, "buffer_fraction": 0.01}}}, 8, 64) == ("bounded", 14)
    assert bench.shape_of({"method": {}}, 8, 64) == ("flat", None)


def test_the_stream_has_equal_tasks(tmp_path):
    dirs = bench.equal_tasks(tmp_path / "s", tasks=3, pairs=50, gallery=6, seed=1)
    assert [d.name for d in dirs] == ["task-00-household", "task-01-furnishing", "task-02-food"]
    for d in dirs:
        assert len((d / "train.jsonl").read_text().splitlines()) == 50
        assert len((d / "test.jsonl").read_text().splitlines()) == 6
    assert not (tmp_path / "s" / "zero-shot-toys").exists()


def test_help_and_bad_options_exit_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "stream-growth", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tasks", "--methods", "--pairs", "--gallery", "--workers", "--seed", "--set", "--out"):
        assert flag in out
    for argv, message in ((["--methods", "finetune,nope"], "unknown method preset"),
                          (["--tasks", "1"], "--tasks must be"), (["--pairs", "0"], "--pairs must be")):
        with pytest.raises(SystemExit) as exit_:
            bench.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_a_real_two_task_stream_reports_every_task(ray_cluster, settings, tmp_path):
    out = tmp_path / "results" / "stream-growth.md"
    text = bench.stream_growth(settings, ["finetune"], tasks=2, pairs=16, gallery=8, workers=1,
                               overrides=["train.micro_batch=8"], out=out)
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    cells = [dict(zip(bench.COLUMNS, (c.strip() for c in row.strip("|").split("|")))) for row in rows]
    assert [c["train pairs"] for c in cells] == ["16", "16"] and [c["steps"] for c in cells] == ["2", "2"]  # 16 / 8
    assert [c["gallery pairs"] for c in cells] == [c["embedded pairs"] for c in cells] == ["8", "16"]  # embedded once
    for c in cells:
        assert float(c["job s"]) > float(c["eval s"]) > 0 and float(c["job CPU s"]) > float(c["eval CPU s"]) > 0
        assert c["peak RSS MiB"] != "-" and float(c["peak RSS MiB"]) > 100  # the worker's peak RSS was sampled
    assert "--tasks 2 --methods finetune --pairs 16 --gallery 8 --workers 1 --seed 0 --set train.micro_batch=8" in text
    assert out.with_suffix(".png").exists() and out.with_suffix(".json").exists()


def test_the_report_shows_where_the_last_jobs_cpu_goes_by_process(tmp_path):
    results = _results()
    results["finetune"]["tasks"][-1]["cpu_by"] = {"RayTrainWorker": 8.0, "driver": 5.0, "TrainController": 3.0,
                                                  "PlacementGroupCleaner": 1.5, "SplitCoordinator": 0.5}
    results["er"]["tasks"][-1]["cpu_by"] = {"RayTrainWorker": 9.0, "driver": 6.0, "DatasetManager": 2.0,
                                            "Ray Data tasks": 1.0}  # work, not a helper actor
    text = bench.growth_report(results, tmp_path / "g.md", "cmd", "CPU (test)")
    section = text.split("## Where a job's CPU goes")[1].split("\n## ")[0]
    assert "| process | finetune | er | joint |" in section
    assert "| RayTrainWorker | 8.0 | 9.0 | 0.0 |" in section  # kinds ordered by their largest share
    assert "| PlacementGroupCleaner | 1.5 | 0.0 | 0.0 |" in section
    assert "| job | 18.0 | 18.0 | 0.0 |" in section and "| Ray Data tasks | 0.0 | 1.0 | 0.0 |" in section
    assert "finetune 2.0 s, er 2.0 s, joint 0.0 s, up to 11% of a job" in section  # the helper actors: 2 of 18 for er
    # a run recorded before the breakdown existed has no section
    assert "## Where a job's CPU goes" not in bench.growth_report(_results(), tmp_path / "h.md", "cmd", "CPU (test)")
