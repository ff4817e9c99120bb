"""`clipstream bench gpu`: the skip path without CUDA, FLOP counting on a tiny arch on the CPU, and the report's
MFU from hand-made numbers."""

import pytest
import torch

from clipstream.benchmarks import gpu as bench


def test_without_cuda_it_writes_why_it_skipped_and_prints_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.md"
    text = bench.main(["--out", str(out)])
    assert text == out.read_text()
    assert "Skipped: torch.cuda.is_available() is False" in text and "Nothing was measured" in text
    assert "`clipstream bench gpu --arch ViT-B-32 --batch 256 " in text and "Device: CPU (" in text
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("gpu: skipped, ") and str(out) in printed[0]


def test_flops_are_counted_for_forward_and_backward_of_both_towers_and_the_loss():
    from clipstream import models

    torch.manual_seed(0)
    model = models.create("clipstream-vit-tiny").model.train()
    data = bench.random_batch(model, 2, torch.device("cpu"), torch.float32)
    assert data["image"].shape == (2, 3, 32, 32) and data["text"].shape == (2, 32)
    forward, total = bench.count_flops(model, data["image"], data["text"])
    assert 2.5 * forward < total < 3.5 * forward  # backward ≈ 2× forward
    assert all(p.grad is None for p in model.parameters())
    # per sample ~0.065 GFLOPs forward: the image tower's 65 tokens and the text tower's 32, 3 layers of width 96
    # each (~12·96² multiply-adds per token and layer), the projections and the attention
    assert 4e7 < forward / 2 < 1e8


@pytest.mark.parametrize("name, override, peak", [
    ("NVIDIA H200", None, 989.0), ("NVIDIA H100 80GB HBM3", None, 989.0), ("NVIDIA H100 PCIe", None, 756.0),
    ("NVIDIA A100-SXM4-80GB", None, 312.0), ("NVIDIA L4", None, 121.0), ("NVIDIA L40S", None, 362.0),
    ("Some Future GPU", None, None), ("Some Future GPU", 500.0, 500.0), ("NVIDIA H200", 900.0, 900.0)])
def test_peak_flops_come_from_the_device_name_or_the_override(name, override, peak):
    assert bench.peak_tflops(name, override) == peak


def test_the_report_gives_mfu_from_samples_per_second_flops_and_the_peak(tmp_path):
    train = {"samples_per_s": 2000.0, "step_ms": 128.0, "flops_per_sample": 26.4e9, "forward_flops_per_sample": 8.8e9,
             "peak_gib": 21.5, "params": 151_277_313, "dtype": "bfloat16", "zero_stage": 0}
    encode = {"float32": {"embed_images_s": 1500.0, "tower_images_s": 9000.0},
              "bfloat16": {"embed_images_s": 1700.0, "tower_images_s": 30000.0}}
    out = tmp_path / "gpu.md"
    text = bench.gpu_report(out, "clipstream bench gpu --out x", "NVIDIA H200 (1 GPU)", "ViT-B-32", 256, train, encode,
                            989.0, 1024)
    assert text == out.read_text() and "Device: NVIDIA H200 (1 GPU). Peak dense bf16: 989 TFLOP/s." in text
    # 2000 samples/s × 26.4 GFLOPs = 52.8 TFLOP/s = 5.3% of 989
    assert "| ViT-B-32 | 256 | 2000.0 | 128.0 | 26.40 | 52.8 | 5.3% | 5.3% | 21.5 |" in text
    assert "| bfloat16 | 1700.0 | 30000.0 |" in text and "151.3 M parameters" in text
    unknown = bench.gpu_report(out, "c", "X (1 GPU)", "ViT-B-32", 256, train, encode, None, 1024)
    assert "- (unknown GPU: pass --peak-tflops)" in unknown
