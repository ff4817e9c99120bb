"""`clipstream bench gpu`: the skip path without CUDA, the import closure the GPU machine needs (no Ray, MLflow or
Qdrant there), every part run tiny on the CPU, FLOP counting, and the report's MFU and targets from hand-made numbers."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from clipstream.benchmarks import gpu as bench

# What the GPU machine lacks and cannot be brought (benchmarks/gpu_setup.sh), made unimportable in a subprocess
ABSENT = ("ray", "mlflow", "qdrant_client", "qdrant_edge", "matplotlib", "sklearn", "webdataset", "upath")
# (a None in sys.modules: `import` fails as for a missing package, and importlib.util.find_spec answers None)
BLOCK = f"import sys\nsys.modules.update(dict.fromkeys({ABSENT!r}))\n"


def without_ray(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_without_cuda_it_writes_why_it_skipped_and_prints_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.md"
    text = bench.main(["--out", str(out)])
    assert text == out.read_text()
    assert "Skipped: torch.cuda.is_available() is False" in text and "Nothing was measured" in text
    assert "`pip install --no-index --no-deps build/gpu-wheels/*.whl && clipstream bench gpu --arch ViT-B-32 " in text
    assert "Device: CPU (" in text
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("gpu: skipped, ") and str(out) in printed[0]


@pytest.mark.component
def test_what_it_measures_imports_without_ray_mlflow_or_qdrant():
    """The benchmark and every layer it measures (the engine's step, the methods, the Encoder's model path, the
    evaluation's embed path) import where Ray, MLflow and Qdrant are not installed, as on the GPU machine."""
    done = without_ray("""
        import clipstream.cli, clipstream.benchmarks.gpu, clipstream.benchmarks.method_step
        import clipstream.training.engine, clipstream.training.evaluate, clipstream.training.methods
        import clipstream.services.encoding
        print(sorted(m for m, mod in sys.modules.items() if mod and m.split(".")[0] in ("ray", "mlflow", "qdrant_client")))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow
def test_every_part_runs_tiny_on_the_cpu_without_ray(tmp_path):
    """`--cpu`: (a)-(e) on the tiny architecture, 2 steps each, in a process where Ray, MLflow and Qdrant cannot be
    imported: the results file has every part and its targets (the CPU's figures mean nothing)."""
    out = tmp_path / "gpu.md"
    done = without_ray(f"""
        sys.argv = ["clipstream", "bench", "gpu", "--cpu", "--out", {str(out)!r}]
        from clipstream.cli import main
        sys.exit(main(sys.argv[1:]))
    """, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    for part in ("## (a) Training step, clipstream-vit-tiny", "## (b) ZeRO 2 against ZeRO 3", "## (c) Method step",
                 "## (d) Encoder model path (float32, batch 8)", "## (e) Evaluation / indexing embed path (16 test pairs",
                 "## Targets", "Versions: torch "):
        assert part in text, part
    assert "| engine (DeepSpeed) |" in text and "| plain PyTorch (autocast) |" in text
    assert "| 2 | " in text and "| 3 | " in text
    for method in ("lwf", "modx", "ewc", "mas", "ctp"):
        assert f"| {method} | " in text, method
    checks = {c["check"]: c for c in json.loads(out.with_suffix(".json").read_text())["checks"]}
    assert set(checks) == {"engine step ÷ plain bf16 loop (samples/s)", "ctp step ×finetune", "lwf step ×finetune",
                           "modx step ×finetune", "ewc step ×finetune", "mas step ×finetune",
                           "Encoder model path ÷ plain open_clip (images/s)", "Encoder model path ÷ plain open_clip (texts/s)",
                           "eval/indexing embed path ÷ plain open_clip (pairs/s)"}
    assert "gpu: all parts in " in done.stdout


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


def test_the_report_gives_mfu_the_ratios_and_every_target(tmp_path):
    train = {"samples_per_s": 2000.0, "step_ms": 128.0, "flops_per_sample": 26.4e9, "forward_flops_per_sample": 8.8e9,
             "plain_samples_per_s": 2100.0, "vs_plain": 0.95, "peak_gib": 21.5, "params": 151_277_313,
             "dtype": "bfloat16", "zero_stage": 0}
    profiled = {name: {"wall_ms": 61.0, "device_ms": 58.0, "phases": {"step: method terms": 3.0},
                       "top": [{"op": "aten::mm", "device_ms": 12.5, "cpu_ms": 1.0, "calls": 228}]}
                for name in ("finetune", "ctp")}
    methods = {"ctp": 1.3, "lwf": 1.1, "modx": 1.15, "ewc": "failed: RuntimeError: x", "mas": 1.02, "finetune_ms": 60.0,
               "profile": profiled}
    zero = {2: {"samples_per_s": 1900.0, "step_ms": 134.7, "peak_gib": 18.0, "profile": profiled["ctp"]},
            3: {"error": "RuntimeError: boom"}}
    encode = {"dtype": "bfloat16", "images_s": 1900.0, "plain_images_s": 2000.0, "texts_s": 9000.0, "plain_texts_s": 9100.0}
    embed = {"pairs": 1024, "pairs_s": 800.0, "plain_pairs_s": 1000.0}
    out = tmp_path / "gpu.md"
    text = bench.gpu_report(out, "clipstream bench gpu --out x", "NVIDIA H200 (1 GPU)", "torch 2.11.0, CUDA 12.8", "ViT-B-32",
                            256, train, zero, methods, encode, embed, 989.0, {"method_batch": 128, "encode_batch": 256})
    assert text == out.read_text() and "Device: NVIDIA H200 (1 GPU). Peak dense bf16: 989 TFLOP/s." in text
    # 2000 samples/s × 26.4 GFLOPs = 52.8 TFLOP/s = 5.3% of 989
    assert "| engine (DeepSpeed) | 2000.0 | 128.0 | 26.40 | 52.8 | 5.3% | 5.3% | 21.5 |" in text
    assert "Engine ÷ plain (median over cycles of the paired step ratio): 0.95×." in text
    assert "| 3 | failed: RuntimeError: boom |" in text and "| ewc | failed: RuntimeError: x |" in text
    assert "| images | 1900.0 | 2000.0 | 0.95 |" in text and "151.3 M parameters" in text
    # (c)'s profile: a column per method, its phases and its top ops; not a row of the ratios table
    assert "| phase step: method terms (CPU) | 3.0 | 3.0 |" in text and "Top ops of `ctp` by self device time:" in text
    assert "| profile |" not in text and "Top ops of `ZeRO 2` by self device time:" in text
    verdicts = {c["check"]: c["ok"] for c in json.loads(out.with_suffix(".json").read_text())["checks"]}
    assert verdicts == {"engine step ÷ plain bf16 loop (samples/s)": True, "ctp step ×finetune": False,
                        "lwf step ×finetune": True, "modx step ×finetune": True, "ewc step ×finetune": False,
                        "mas step ×finetune": True, "Encoder model path ÷ plain open_clip (images/s)": True,
                        "Encoder model path ÷ plain open_clip (texts/s)": True,
                        "eval/indexing embed path ÷ plain open_clip (pairs/s)": False}
    unknown = bench.gpu_report(out, "c", "X (1 GPU)", "v", "ViT-B-32", 256, train, zero, methods, encode, embed, None,
                               {"method_batch": 128, "encode_batch": 256})
    assert "- (unknown GPU: pass --peak-tflops)" in unknown


def test_device_busy_time_counts_each_kernel_once():
    """An op's self device time is its kernels' time: busy time sums the device's own events (kernels, copies) alone."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    events = [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=12_000),
              SimpleNamespace(key="nvjet_sm90_gemm", device_type=DeviceType.CUDA, self_device_time_total=12_000),
              SimpleNamespace(key="Memcpy DtoD", device_type=DeviceType.CUDA, self_device_time_total=2_000)]
    assert bench.busy_ms(events, steps=2) == 7.0
