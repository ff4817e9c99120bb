"""`clipstream bench methods`: the report from hand-made cells (ranks drawn at known hit rates), the CLI checks that
come before any training, and (full tier) a real run of 2 seeds x 2 methods x 2 tasks, stopped and continued."""

import math

import numpy as np
import pytest

from clipstream.benchmarks import cells, stats
from clipstream.benchmarks import continual_methods as bench
from clipstream.cli import main

TASKS = ["t0", "t1", "t2"]


def _cell(seed, hits, zero_shot, step_ms, sd=None, n=300):
    """A cell whose R[i][j] hit rate is hits[i][j] (both galleries), its held-out task's zero_shot[i]."""
    rng = np.random.default_rng(seed)
    draw = lambda h: tuple(np.where(rng.random(n) < h, 0, 40) for _ in range(2))  # noqa: E731
    rows = []
    for i, row in enumerate(hits):
        known = {TASKS[j]: draw(h) for j, h in enumerate(row)}
        rows.append({"known": known, "unknown": {t: (a + 5, b + 5) for t, (a, b) in known.items()},
                     "zero_shot": {"held": draw(zero_shot[i])}})
    return {"tasks": TASKS, "rows": rows, "step_ms": [100.0, step_ms, step_ms], "seconds": [60.0, 30.0, 30.0],
            "sd": [{}, *([sd] * 2 if sd else [{}, {}])]}


def _results():
    sd = {"sd/image_rotation_mean": 31.0, "sd/text_rotation_mean": 22.5, "sd/intermodal_deviation_mean": 9.25,
          "sd/imav_le5_pct": 80.0}
    seeds = (0, 1, 2)  # the benchmark's default: the paired differences' t intervals have 2 degrees of freedom
    return {"finetune": {s: _cell(s, [[0.8], [0.3, 0.8], [0.1, 0.2, 0.8]], [0.6, 0.4, 0.3], 200.0) for s in seeds},
            "ewc weight=100": {s: _cell(10 + s, [[0.8], [0.7, 0.8], [0.7, 0.7, 0.8]], [0.6, 0.6, 0.6], 300.0, sd)
                               for s in seeds}}


def test_the_report_has_intervals_paired_differences_recall_and_the_plots(tmp_path):
    results = _results()
    streams = cells.streams(results)
    tables = bench.statistics(3, stats.modes(streams))
    summary = stats.bootstrap(streams, [st for t in tables.values() for st in t], "finetune", resamples=200)
    versus = stats.bootstrap(streams, bench.compared(tables), "ewc weight=100", resamples=200)
    out = tmp_path / "results" / "methods.md"
    text = bench.methods_report(summary, results, tables, out, "clipstream bench methods --seeds 0,1,2", "CPU (test)",
                                "s", versus)
    assert out.read_text() == text
    assert "Reproduce: `clipstream bench methods --seeds 0,1,2`" in text and "Device: CPU (test). Stream: s." in text
    assert "Seeds 0, 1, 2; test pairs per task: 300." in text and "hierarchical bootstrap of 200 resamples" in text
    assert "Student t interval on their differences (2 degrees of freedom" in text
    assert ("| method | AA | forgetting (lower is better) | BWT | final Rm (task-unknown AA) | zero-shot Rm "
            "| zero-shot drop (lower is better) | zero-shot top-1 % (seeds' range) | step time ×finetune | minutes |") \
        in text
    ft, ewc = summary.estimates["finetune"], summary.estimates["ewc weight=100"]
    row = next(line for line in text.splitlines() if line.startswith("| ewc weight=100 | "))
    assert row.startswith(f"| ewc weight=100 | {ewc['AA'].format()} | {ewc['forgetting'].format()} |")
    assert row.endswith("| - | 1.50 | 2.0 |")  # (these cells record no zero-shot accuracy)
    # AA (.7 + .7 + .8) / 3 against (.1 + .2 + .8) / 3; forgetting (10 + 10) / 2 against (70 + 60) / 2
    assert 70 < ewc["AA"].point < 77 and 33 < ft["AA"].point < 40
    assert 5 < ewc["forgetting"].point < 15 and 58 < ft["forgetting"].point < 72
    assert "| task-known R@1 | task-known R@5 | task-known R@10 | task-unknown R@1 |" in text
    # R@1 of the unknown gallery: every rank moved down by 5, nothing left at rank 0
    assert summary.estimates["ewc weight=100"]["task-unknown R@1"].point == 0
    assert ewc["task-unknown R@10"].point == pytest.approx(ewc["task-known R@1"].point)
    # --against: the same differences seen from the other row, finetune's now worse on what ewc beat it on
    against = text.split("## Paired difference against ewc weight=100")[1]
    ft_diff = next(line for line in against.splitlines() if line.startswith("| finetune | "))
    assert ft_diff.endswith("| - | AA, forgetting, BWT, final Rm (task-unknown AA), zero-shot Rm, zero-shot drop |")
    assert "Δ forgetting (ewc weight=100 − method: > 0 = lower)" in against
    section = text.split("## Paired difference against finetune")[1].split("## Paired difference against")[0]
    assert "Δ forgetting (finetune − method: > 0 = lower)" in section and "Δ AA (method − finetune)" in section
    # one method × the 7 compared statistics, task-unknown R@1 among them (0 for both: p 1, counted all the same)
    assert "Holm-adjusted over this table's 7 comparisons" in section and "beats finetune on (Holm CI > 0)" in section
    ewc_diff = next(line for line in section.splitlines() if line.startswith("| ewc weight=100 | "))
    assert ewc_diff.endswith("| AA, forgetting, BWT, final Rm (task-unknown AA), zero-shot Rm, zero-shot drop | - |")
    assert "| ewc weight=100 | 31.0 | 22.5 | 9.2 | 80.0 |" in text and "| finetune | 31.0" not in text
    assert "## Every gallery mode" not in text  # task-known and task-unknown only: the tables above have them
    for png in (out.with_suffix(".png"), out.with_name("methods-forest.png")):
        assert png.name in text and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_a_report_without_finetune_has_no_differences_or_ratio(tmp_path):
    results = _results()
    del results["finetune"]
    streams = cells.streams(results)
    tables = bench.statistics(3)
    summary = stats.bootstrap(streams, [st for t in tables.values() for st in t], None, resamples=20)
    text = bench.methods_report(summary, results, tables, tmp_path / "m.md", "cmd", "CPU")
    assert "## Paired difference" not in text and not (tmp_path / "m-forest.png").exists()
    assert next(line for line in text.splitlines() if line.startswith("| ewc weight=100 | ")).endswith("| - | 2.0 |")


def test_a_gallery_mode_beyond_the_two_gets_its_own_table(tmp_path):
    results = _results()
    for by_seed in results.values():
        for cell in by_seed.values():
            for row in cell["rows"]:
                row["no-reindex"] = row["unknown"]
    streams = cells.streams(results)
    tables = bench.statistics(3, stats.modes(streams))
    summary = stats.bootstrap(streams, [st for t in tables.values() for st in t], "finetune", resamples=20)
    text = bench.methods_report(summary, results, tables, tmp_path / "m.md", "cmd", "CPU")
    assert "| method | known AA | known forgetting | no-reindex AA | no-reindex forgetting | unknown AA |" in text
    assert math.isclose(summary.estimates["finetune"]["no-reindex AA"].point,
                        summary.estimates["finetune"]["final Rm (task-unknown AA)"].point)


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "methods", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tasks", "--seeds", "--methods", "--workers", "--set", "--out", "--test-per-task", "--vary",
                 "--fresh", "--cache", "--resamples", "--start-with", "--against", "ewc weight=100"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--methods", "finetune,nope"], "unknown method preset(s) 'nope'"),
    (["--methods", "finetune,finetune"], "given more than once: finetune"),
    (["--methods", "finetune", "--set", "train.nope=1"], "has no key 'train.nope'"),
    (["--methods", "finetune", "--workers", "0"], "workers must be >= 1"),
    (["--methods", "finetune", "--seeds", ""], "--seeds: give at least one seed"),
    (["--methods", "finetune", "--seeds", "1,1"], "seed(s) 1 given more than once"),
    (["--methods", "finetune", "--test-per-task", "0"], "--test-per-task must be between 1 and 1500, got 0"),
    (["--methods", "finetune", "--test-per-task", "1501"], "--test-per-task must be between 1 and 1500"),
    (["--methods", "finetune,ewc", "--vary", "nope=1,2"], "--vary nope: none of ewc has that key"),
    (["--methods", "finetune,ewc", "--vary", "weight"], "--vary weight: must look like KEY=V1,V2"),
    (["--methods", "finetune", "--resamples", "5"], "--resamples must be >= 10"),
    (["--methods", "finetune,ewc", "--vary", "weight=1,2", "--against", "ewc"],
     "--against 'ewc': no such row; the rows are 'finetune', 'ewc weight=1', 'ewc weight=2'"),
])
def test_bad_input_exits_2_before_any_training(argv, message, settings, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise AssertionError("training or synthesis started")

    monkeypatch.setattr(bench, "synthesize", boom)
    monkeypatch.setattr(cells, "train_task", boom)
    assert main(["bench", "methods", *argv]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("clipstream: error: ") and message in last
    assert "Traceback" not in err
    assert not (settings.data_dir.exists() and any(settings.data_dir.iterdir()))


@pytest.mark.slow
def test_a_real_run_of_two_methods_two_tasks_continued_with_a_second_seed(ray_cluster, settings, tmp_path,
                                                                          monkeypatch, capsys):
    """The benchmark family's one real run, on a tiny stream (small tasks, each job capped at one step): the start
    trained once per seed and shared by the methods, every version's ranks cached, the report's intervals; a second
    run of one method with one more seed trains only that seed's start and cell."""
    from functools import partial

    from clipstream.training.data.synth import synthesize

    tiny = ["train.epochs=1", "train.micro_batch=16", "train.max_steps=1"]
    out = tmp_path / "results" / "methods.md"
    jobs = []
    real = cells.train_task
    monkeypatch.setattr(cells, "train_task", lambda *a, **k: jobs.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(bench, "synthesize", partial(synthesize, train_pairs=200))
    options = dict(tasks=1, names=["finetune", "lwf"], workers=1, overrides=tiny, out=out, start_with="finetune",
                   test_per_task=40, resamples=100)
    first = bench.methods(settings, seeds=[0], **options)
    assert jobs == ["finetune", "finetune", "lwf"]  # the shared start, then each method's task 2
    text = bench.methods(settings, seeds=[0, 1], **{**options, "names": ["lwf"]})
    assert jobs[3:] == ["finetune", "lwf"] and capsys.readouterr().out.count("finished before") == 1
    assert "--seeds 0,1 --test-per-task 40 --methods lwf --workers 1" in text
    assert "Seeds 0, 1; test pairs per task: 40." in text
    for label, report in (("finetune", first), ("lwf", first), ("lwf", text)):
        row = next(line for line in report.splitlines() if line.startswith(f"| {label} | "))
        aa = row.split(" | ")[1]  # "54.3 [50.1, 58.0]"
        point, lo, hi = float(aa.split(" [")[0]), *map(float, aa.split(" [")[1].rstrip("]").split(", "))
        assert 0 < lo <= point <= hi <= 100
    assert out.with_name("methods-forest.png").exists()


def test_the_zero_shot_accuracy_column_is_the_seeds_mean_and_range_or_a_dash():
    from clipstream.benchmarks.continual_methods import accuracy_cell

    assert accuracy_cell([{"zero_shot_accuracy": [20.0, 31.0]}, {"zero_shot_accuracy": [18.0, 25.0]},
                          {"zero_shot_accuracy": [22.0, 28.0]}]) == "28.0 [25.0, 31.0]"  # the last version's
    assert accuracy_cell([{"zero_shot_accuracy": [30.0]}, {}]) == "-"  # a cell from before it was recorded
    assert accuracy_cell([{"zero_shot_accuracy": []}]) == "-"  # no labelled held-out task
