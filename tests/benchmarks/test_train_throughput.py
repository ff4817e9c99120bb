"""`clipstream bench train-throughput`: the report and verdict from hand-made numbers, ZeRO's model-state count,
each side's CPU by process."""

import json

import pytest

from clipstream.benchmarks import train_throughput as bench


def runs(ours=(250.0, 260.0), zero2_peaks=(900.0, 880.0)):
    return {"plain": [{"rate": 270.0, "step_ms": 110.0, "seconds": 25.0}, {"rate": 260.0, "step_ms": 114.0, "seconds": 27.0}],
            "clipstream": [{"rate": r, "step_ms": 112.0, "seconds": 50.0} for r in ours],
            "zero": {0: [{"rate": 300.0, "step_ms": 200.0, "peak_mib": [1000.0, 980.0], "seconds": 55.0},
                         {"rate": 310.0, "step_ms": 204.0, "peak_mib": [1010.0, 990.0], "seconds": 57.0}],
                     2: [{"rate": 270.0, "step_ms": 230.0, "peak_mib": list(zero2_peaks)},
                         {"rate": 290.0, "step_ms": 226.0, "peak_mib": list(zero2_peaks)}]}}


def test_the_report_has_the_plain_loop_the_job_and_each_zero_stage(tmp_path):
    out = tmp_path / "tt.md"
    text = bench.throughput_report(runs(), out, "clipstream bench train-throughput --out x", "CPU (x86_64, 2 cores)",
                                   "clipstream-vit-tiny", 32, 2000, 3, 2, 5_440_000, seconds=240.0)
    assert text == out.read_text() and "Reproduce: `clipstream bench train-throughput --out x`" in text
    assert "Wall time 4.0 min." in text
    # medians: plain 265, the job 255 (0.96); waiting = 1 - step / (batch / rate): 1 - 112 / 120.8
    assert "| plain PyTorch (DataLoader + AdamW + ClipLoss, 1 process) | 265.0 | 270, 260 | 1.00 | 112.0 | 7% | 26 |" in text
    assert "| clipstream (Ray Data → Ray Train, 1 DeepSpeed worker) | 255.0 | 250, 260 | 0.96 | 112.0 | 11% | 50 |" in text
    assert "## ZeRO stages on 2 workers" in text and "5.44 M parameters" in text
    assert "| 0 | 305.0 | 300, 310 | 1.00 | 202.0 | 1005 / 985 | +0 | 83.0 | 56 |" in text  # 16 B/param
    assert "| 2 | 280.0 | 270, 290 | 0.92 | 228.0 | 900 / 880 | -105 | 62.3 | - |" in text  # 4 + 16/2 B/param
    assert "| clipstream ÷ plain PyTorch samples/s, 1 worker | 0.96 | ≥ 0.95 | met |" in text
    assert json.loads((tmp_path / "tt.json").read_text())["checks"][0]["ok"]
    assert text.rstrip().endswith("Verdict: clipstream at 1 worker is 0.96× the plain loop (target ≥ 0.95: met). "
                                  "ZeRO 2 on 2 workers: 0.92× ZeRO 0's samples/s, peak 900 MiB vs 1005 MiB.")


def test_a_real_size_model_is_its_own_section_measured_as_is_and_the_target_stays_the_small_models(tmp_path):
    extra = {"arch": "ViT-B-32", "batch": 8, "pairs": 64, "epochs": 2, "params": 151_277_313,
             "runs": {"plain": [{"rate": 4.0, "step_ms": 1900.0, "seconds": 60.0}],
                      "clipstream": [{"rate": 3.0, "step_ms": 2100.0, "seconds": 140.0}]}}
    out = tmp_path / "tt.md"
    text = bench.throughput_report(runs(), out, "c", "d", "clipstream-vit-tiny", 32, 2000, 3, 2, 5_440_000, extra=extra)
    section = text.split("## ViT-B-32, batch 8, 64 pairs, last of 2 epochs")[1].split("## ZeRO stages")[0]
    assert "`ViT-B-32` (151 M parameters)" in section
    # waiting = 1 - step / (batch / rate): the loop 1 - 1.9 / 2.0, the job 1 - 2.1 / 2.67
    assert "| plain PyTorch (DataLoader + AdamW + ClipLoss, 1 process) | 4.0 | 4.0 | 1.00 | 1900.0 | 5% | 60 |" in section
    assert "| clipstream (Ray Data → Ray Train, 1 DeepSpeed worker) | 3.0 | 3.0 | 0.75 | 2100.0 | 21% | 140 |" in section
    checks = json.loads((tmp_path / "tt.json").read_text())["checks"]
    assert [c["value"] for c in checks] == ["0.96"]  # the small model's ratio is the one held to the target


def test_the_verdict_fails_below_the_target_and_a_run_without_zero_has_no_zero_table(tmp_path):
    slow = runs(ours=(240.0, 245.0))
    verdict = bench.verdict(slow)
    assert not verdict["pass"] and verdict["ratio"] == pytest.approx(242.5 / 265)
    assert verdict["zero"][2]["vs_zero0"] == pytest.approx(280 / 305)
    del slow["zero"]
    text = bench.throughput_report(slow, tmp_path / "tt.md", "c", "d", "a", 32, 2000, 3, 2, 1000)
    assert "ZeRO" not in text and "(target ≥ 0.95: NOT met)." in text and "| 0.92 | ≥ 0.95 | **not met** |" in text


def test_zero_counts_model_states_per_worker():
    assert bench.model_state_mib(1 << 20, 0, 2) == 16.0
    assert bench.model_state_mib(1 << 20, 2, 2) == 12.0  # whole fp32 params + (master, grads, moments) / 2
    assert bench.model_state_mib(1 << 20, 2, 4) == 8.0
    assert bench.model_state_mib(1 << 20, 3, 4) == 4.0


def test_each_sides_cpu_per_pair_is_reported_by_process_and_explains_a_miss(tmp_path):
    slow = runs(ours=(200.0, 210.0))
    for r in slow["plain"]:
        r["cpu_by"] = {"the loop's process": 60.0, "DataLoader worker": 8.0}
    for r, extra in zip(slow["clipstream"], (0.0, 4.0)):
        r["cpu_by"] = {"RayTrainWorker": 62.0 + extra, "Ray Data tasks": 14.0, "driver": 6.0}
    cpu = bench.cpu_per_pair(slow, 4000)
    assert cpu["plain"] == {"the loop's process": 15.0, "DataLoader worker": 2.0, "all": 17.0}
    assert cpu["clipstream"]["RayTrainWorker"] == 16.0 and cpu["clipstream"]["all"] == pytest.approx(21.0)
    text = bench.throughput_report(slow, tmp_path / "tt.md", "c", "d", "a", 32, 2000, 2, 2, 1000)
    section = text.split("## Where each side's CPU goes")[1].split("## Targets")[0]
    assert "(2000 pairs × 2 epochs)" in section
    assert "| plain | DataLoader worker | 2.00 |" in section and "| clipstream | Ray Data tasks | 3.50 |" in section
    assert "| clipstream | **all** | **21.00** |" in section
    assert "**not met** (the job's step 112 ms, the loop's 112 ms; waiting for input 28% of the job's epoch, 7% of" in text
    assert "CPU per pair trained: the job 21.0 ms, the loop 17.0 ms (the table above)" in text
    # a run recorded before the breakdown: no section, no reason
    assert "CPU goes" not in bench.throughput_report(runs(ours=(200.0, 210.0)), tmp_path / "t2.md", "c", "d", "a", 32,
                                                     2000, 2, 2, 1000)


def test_the_plain_loop_counts_its_own_and_its_dataloader_workers_cpu(tmp_path):
    from clipstream.training.data.synth import synthesize
    from clipstream.training.data.task import Task

    task = Task.load(synthesize(tmp_path, tasks=1, seed=0, train_pairs=64, test_per_task=8, digits=False, progress=False)[0])
    result = bench.plain_pytorch(task, "clipstream-vit-tiny", 16, 1, 1e-3)
    assert result["rate"] > 0 and result["step_ms"] > 0
    # the worker decoded and augmented 64 images in its own process, reaped when the loop ended
    assert result["cpu_by"]["DataLoader worker"] > 0.05 and result["cpu_by"]["the loop's process"] > 0.5
