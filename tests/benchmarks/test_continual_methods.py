"""`clipstream bench methods`: the report from hand-made result matrices, and the CLI checks that come before
any training."""

import pytest

from clipstream.benchmarks import continual_methods as bench
from clipstream.cli import main
from clipstream.training.evaluate import ResultMatrix

TASKS = ["t0", "t1", "t2"]


def _results():
    # finetune: AA (10+20+60)/3 = 30.0; forgetting ((50-10) + (70-20))/2 = 45.0; BWT ((10-50) + (20-70))/2 = -45.0
    # ewc:      AA (40+50+60)/3 = 50.0; forgetting ((50-40) + (60-50))/2 = 10.0; BWT ((40-50) + (50-60))/2 = -10.0
    return {
        "finetune": {"known": ResultMatrix(TASKS, [[50], [30, 70], [10, 20, 60]]),
                     "unknown": ResultMatrix(TASKS, [[40], [20, 50], [5, 10, 45]]),  # AA 20.0
                     "step_ms": 200.0, "seconds": 120.0, "zero_shot": [40.0, 30.0, 25.5]},  # drop 14.5
        "ewc": {"known": ResultMatrix(TASKS, [[50], [45, 60], [40, 50, 60]]),
                "unknown": ResultMatrix(TASKS, [[40], [35, 45], [30, 33, 36]]),  # AA 33.0
                "step_ms": 300.0, "seconds": 150.0,
                "sd": {"sd/image_rotation_mean": 31.0, "sd/text_rotation_mean": 22.5,
                       "sd/intermodal_deviation_mean": 9.25, "sd/imav_le5_pct": 80.0}},
    }


def test_report_has_the_numbers_the_ratio_and_the_plot(tmp_path):
    out = tmp_path / "results" / "methods.md"
    text = bench.methods_report(_results(), out, "clipstream bench methods --tasks 2 --seed 0", "CPU (test)", "s")
    assert out.read_text() == text
    assert "Reproduce: `clipstream bench methods --tasks 2 --seed 0`" in text and "Device: CPU (test)" in text
    assert ("| method | AA | forgetting | BWT | final Rm (task-unknown AA) | zero-shot Rm | zero-shot drop "
            "| step time ×finetune | minutes |") in text
    assert "| finetune | 30.0 | 45.0 | -45.0 | 20.0 | 25.5 | 14.5 | 1.00 | 2.0 |" in text
    assert "| ewc | 50.0 | 10.0 | -10.0 | 33.0 | - | - | 1.50 | 2.5 |" in text  # (evaluated on no held-out task)
    assert "| ewc | 31.0 | 22.5 | 9.2 | 80.0 |" in text and text.count("| finetune |") == 1  # no SD for finetune
    png = out.with_suffix(".png")
    assert "](methods.png)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_report_without_finetune_has_no_ratio(tmp_path):
    results = _results()
    del results["finetune"]
    text = bench.methods_report(results, tmp_path / "m.md", "cmd", "CPU")
    assert "| ewc | 50.0 | 10.0 | -10.0 | 33.0 | - | - | - | 2.5 |" in text
    assert (tmp_path / "m.png").exists()


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "methods", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--tasks", "--seed", "--methods", "--workers", "--set", "--out"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["--methods", "finetune,nope"], "unknown method preset(s) 'nope'"),
    (["--methods", "finetune,finetune"], "given more than once: finetune"),
    (["--methods", "finetune", "--set", "train.nope=1"], "has no key 'train.nope'"),
    (["--methods", "finetune", "--workers", "0"], "workers must be >= 1"),
])
def test_bad_input_exits_2_before_any_training(argv, message, settings, monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise AssertionError("training or synthesis started")

    monkeypatch.setattr(bench, "synthesize", boom)
    monkeypatch.setattr(bench, "run_task", boom)
    assert main(["bench", "methods", *argv]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("clipstream: error: ") and message in last
    assert "Traceback" not in err
    assert not (settings.data_dir.exists() and any(settings.data_dir.iterdir()))
