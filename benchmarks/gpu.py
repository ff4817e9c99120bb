"""On a GPU: bf16 DeepSpeed training throughput and model-FLOPs utilisation (MFU) of open_clip's ViT-B-32 at
batch 256 on 1 GPU, and the encoder's images/s; without CUDA, a results file that says it was skipped.

    clipstream bench gpu [--arch ViT-B-32] [--batch 256] [--steps 30] [--warmup 5] [--peak-tflops T]

Training runs clipstream's own step (`clipstream.training.engine.train_step`: both towers, the CLIP loss,
`engine.backward`, `engine.step`) on a DeepSpeed engine configured by `engine.deepspeed_config` from the
finetune preset with `train.precision=bf16` and `train.micro_batch=--batch`, on random pixels and
tokens already on the GPU (input loading is not measured). MFU = samples/s × model FLOPs per sample ÷
the GPU's peak dense bf16 FLOP/s; FLOPs per sample are counted with torch's FlopCounterMode over one
forward and backward of the model at the same batch (and the forward alone, for the usual 3× forward
estimate). Peak FLOP/s come from the device name for known GPUs (H100/H200 SXM 989 TFLOP/s, A100 312,
...) or `--peak-tflops`. The encoder is measured as the Encoder serves: `ClipBundle.embed_images`
(preprocessing on the CPU, encoding on the GPU) at `--encode-batch`, in fp32 and bf16, and the image tower
alone on preprocessed pixels. Never a CI requirement. Writes benchmarks/results/gpu.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

from clipstream.benchmarks import report

# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name(); the first
# match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0), ("GH200", 989.0),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
                    ("A10", 125.0), ("RTX 4090", 165.0)]


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The GPU's peak dense bf16 TFLOP/s: `override`, else the table's entry for `device_name`, else None."""
    if override:
        return override
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS if key.lower() in device_name.lower()), None)


def count_flops(model, images, texts) -> tuple[float, float]:
    """(forward FLOPs, forward + backward FLOPs) of one CLIP training step's model work on this batch: both
    towers and the CLIP loss, counted by torch's FlopCounterMode (a multiply-add is 2 FLOPs); gradients are
    left zeroed."""
    from torch.utils.flop_counter import FlopCounterMode

    from clipstream.training.losses import clip_loss
    from clipstream.training.methods.base import forward_features

    with FlopCounterMode(display=False) as counter:
        feats = forward_features(model, images, texts)
        loss = clip_loss(feats.image, feats.text, feats.logit_scale)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    backward = counter.get_total_flops()
    model.zero_grad(set_to_none=True)
    return float(forward), float(forward + backward)


def engine_for(arch: str, batch: int, precision: str, total_steps: int):
    """A DeepSpeed engine, the finetune method and its task context, built as a task job's worker builds them."""
    import deepspeed
    import torch

    from clipstream import models
    from clipstream.training import methods
    from clipstream.training.engine import deepspeed_config, param_groups, prepare_for_deepspeed
    from clipstream.training.methods.base import TaskContext
    from clipstream.training.methods.config import resolve

    config = resolve("finetune", [f"model.arch={arch}", f"train.micro_batch={batch}", f"train.precision={precision}"])
    train = config["train"]
    torch.manual_seed(train["seed"])
    method = methods.build(config)
    model = method.prepare_model(prepare_for_deepspeed(models.create(arch).model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, train["weight_decay"], train["lr"],
                                                                                 method.lr_scale),
                                      config=deepspeed_config(train, 1, total_steps))
    ctx = TaskContext(model=engine.module, task_index=0, rank=0, world_size=1, device=engine.device,
                      current={"task": "bench", "path": ""})
    method.before_task(ctx)
    return engine, method, ctx


def random_batch(model, batch: int, device, dtype) -> dict:
    """Random pixels (in the module's dtype: the towers take their input as is) and tokens, on `device`."""
    import torch

    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else int(size)
    context = getattr(model, "context_length", None) or model.positional_embedding.shape[0]
    vocab = getattr(model, "vocab_size", None) or model.token_embedding.num_embeddings
    generator = torch.Generator().manual_seed(0)
    return {"image": torch.randn(batch, 3, size, size, generator=generator).to(device=device, dtype=dtype),
            "text": torch.randint(0, vocab, (batch, context), generator=generator).to(device)}


def _sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def timed_steps(step: Callable[[], object], steps: int, warmup: int, device) -> list[float]:
    """Each of `steps` calls' ms after `warmup` calls, the device synchronised around each."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        step()
        _sync(device)
        times.append(1000 * (time.perf_counter() - tic))
    return times


def measure_training(arch: str, batch: int, steps: int, warmup: int, precision: str = "bf16") -> dict:
    """samples/s of clipstream's train step on one DeepSpeed engine, and the model's FLOPs per sample (counted on a
    separate copy of the model in the same dtype, so the engine's gradient hooks see only its own steps)."""
    import torch

    from clipstream import models
    from clipstream.training.engine import prepare_for_deepspeed, train_step

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    counted = prepare_for_deepspeed(models.create(arch).model).to(device=device, dtype=dtype).train()
    data = random_batch(counted, batch, device, dtype)
    forward, total = count_flops(counted, data["image"], data["text"])
    del counted
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    engine, method, ctx = engine_for(arch, batch, precision, steps + warmup + 1)
    module_dtype = next(engine.module.parameters()).dtype
    # the towers take pixels as they come: in the engine module's dtype (bf16 under DeepSpeed's bf16)
    data = {"image": data["image"].to(device=engine.device, dtype=module_dtype), "text": data["text"].to(engine.device)}
    times = timed_steps(lambda: train_step(engine, method, ctx, data), steps, warmup, engine.device)
    step_ms = statistics.median(times)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if engine.device.type == "cuda" else None
    return {"samples_per_s": 1000 * batch / step_ms, "step_ms": step_ms, "flops_per_sample": total / batch,
            "forward_flops_per_sample": forward / batch, "peak_gib": peak_gib,
            "params": sum(p.numel() for p in engine.module.parameters()), "dtype": str(module_dtype).replace("torch.", ""),
            "zero_stage": engine.zero_optimization_stage()}


def measure_encoding(arch: str, batch: int, images: int, device: str, dtype_name: str, rounds: int = 3) -> dict:
    """images/s of `ClipBundle.embed_images` (PIL images in, preprocessing included) at `batch`, and of the image
    tower alone on preprocessed pixels already on the device."""
    import numpy as np
    import torch
    from PIL import Image

    from clipstream import models

    dtype = getattr(torch, dtype_name)
    bundle = models.create(arch)
    bundle.model = bundle.model.to(device=device, dtype=dtype).eval()
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)) for _ in range(min(images, 64))]
    pictures = [pictures[i % len(pictures)] for i in range(images)]
    bundle.embed_images(pictures[:batch], batch_size=batch)  # warm-up: kernels, allocator
    embed = [images / max(_seconds(lambda: bundle.embed_images(pictures, batch_size=batch), device), 1e-9)
             for _ in range(rounds)]
    pixels = torch.stack([bundle.preprocess_val(p) for p in pictures[:batch]]).to(device=device, dtype=dtype)
    with torch.no_grad():
        tower = timed_steps(lambda: bundle.model.encode_image(pixels, normalize=True), 10, 3, torch.device(device))
    return {"embed_images_s": statistics.median(embed), "tower_images_s": 1000 * batch / statistics.median(tower)}


def _seconds(fn: Callable, device) -> float:
    import torch

    tic = time.perf_counter()
    fn()
    _sync(torch.device(device))
    return time.perf_counter() - tic


def skipped(out: Path, reason: str, command: str) -> str:
    """The results file of a run without a GPU: what would have been measured and why it was not."""
    return report.write(out, ["# GPU: bf16 DeepSpeed training throughput, MFU and encoder images/s", "",
                              f"Reproduce (on a machine with a CUDA GPU): `{command}`", "",
                              f"Device: {report.device()}.", "",
                              f"Skipped: {reason}. Nothing was measured; run it on a CUDA machine to fill this file."])


def gpu_report(out: Path, command: str, device: str, arch: str, batch: int, train: dict, encode: dict[str, dict],
               peak: float | None, encode_batch: int) -> str:
    """The results file from the measurements (`train`: measure_training's dict; `encode`: dtype ->
    measure_encoding's dict; `peak`: the GPU's peak dense bf16 TFLOP/s, None if unknown)."""
    achieved = train["samples_per_s"] * train["flops_per_sample"] / 1e12
    estimate = train["samples_per_s"] * 3 * train["forward_flops_per_sample"] / 1e12
    mfu = f"{achieved / peak:.1%}" if peak else "- (unknown GPU: pass --peak-tflops)"
    mfu3 = f"{estimate / peak:.1%}" if peak else "-"
    lines = ["# GPU: bf16 DeepSpeed training throughput, MFU and encoder images/s", "",
             f"Reproduce: `{command}`", "",
             f"Device: {device}." + (f" Peak dense bf16: {peak:g} TFLOP/s." if peak else ""), "",
             f"Training: clipstream's train step on one DeepSpeed engine (finetune preset, precision bf16, ZeRO "
             f"{train.get('zero_stage', 0)}), {arch} ({train['params'] / 1e6:.1f} M parameters, {train['dtype']} on the engine), batch {batch}, "
             "random inputs already on the device (pixels in the engine module's dtype: the towers do not cast their "
             "input); median step. FLOPs per sample counted by torch's FlopCounterMode (forward + backward of both "
             "towers and the loss); MFU = samples/s × FLOPs per sample ÷ the peak.", "",
             *report.table(["arch", "batch", "samples/s", "step ms", "GFLOPs/sample (fwd+bwd)", "achieved TFLOP/s",
                            "MFU", "MFU (3× forward)", "peak memory GiB"],
                           [[arch, batch, train["samples_per_s"], train["step_ms"], f"{train['flops_per_sample'] / 1e9:.2f}",
                             f"{achieved:.3g}", mfu, mfu3, f"{train['peak_gib']:.1f}" if train.get("peak_gib") is not None else "-"]]),
             "", f"Encoder: `ClipBundle.embed_images` at batch {encode_batch} on PIL images (CPU preprocessing included, "
             "as the Encoder runs it), and the image tower alone on preprocessed pixels on the device.", "",
             *report.table(["dtype", "embed_images images/s", "image tower images/s"],
                           [[dtype, e["embed_images_s"], e["tower_images_s"]] for dtype, e in encode.items()])]
    return report.write(out, lines)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="ViT-B-32", help="the model, any open_clip architecture by name")
    p.add_argument("--batch", type=int, default=256, help="training micro batch (1 GPU)")
    p.add_argument("--steps", type=int, default=30, help="timed training steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--encode-batch", type=int, default=1024)
    p.add_argument("--encode-images", type=int, default=4096, help="images per embed_images round")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s (default: by name)")
    p.add_argument("--cpu", action="store_true",
                   help="run the same measurements on the CPU anyway (a smoke test of this script: use a small --arch)")
    p.add_argument("--out", default=str(report.RESULTS / "gpu.md"))
    args = p.parse_args(argv)
    from clipstream import models

    models.architecture(args.arch)  # an unknown name: one line, with a GPU or without
    command = (f"clipstream bench gpu --arch {args.arch} --batch {args.batch} --steps {args.steps} --warmup {args.warmup} "
               f"--encode-batch {args.encode_batch} --encode-images {args.encode_images}"
               + (f" --peak-tflops {args.peak_tflops:g}" if args.peak_tflops else "") + (" --cpu" if args.cpu else "")
               + f" --out {args.out}")

    import torch

    if not torch.cuda.is_available() and not args.cpu:
        reason = ("torch.cuda.is_available() is False (torch " + torch.__version__ +
                  (", built without CUDA" if torch.version.cuda is None else f", CUDA {torch.version.cuda}: no usable GPU or driver")
                  + ")")
        text = skipped(Path(args.out), reason, command)
        print(f"gpu: skipped, {reason}; wrote {args.out}")
        return text

    device = "cpu" if args.cpu else "cuda"
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29547")})
    import deepspeed

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")
    train = measure_training(args.arch, args.batch, args.steps, args.warmup, "bf16")
    print(f"[train] {train['samples_per_s']:.1f} samples/s, {train['step_ms']:.1f} ms/step", flush=True)
    encode = {dtype: measure_encoding(args.arch, args.encode_batch, args.encode_images, device, dtype)
              for dtype in ("float32", "bfloat16")}
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    peak = peak_tflops(name, args.peak_tflops) if device == "cuda" or args.peak_tflops else None
    text = gpu_report(Path(args.out), command, report.device(f"torch {torch.__version__}"), args.arch, args.batch, train,
                      encode, peak, args.encode_batch)
    print(text)
    achieved = train["samples_per_s"] * train["flops_per_sample"] / 1e12
    print(f"gpu: {train['samples_per_s']:.1f} samples/s, {achieved:.3g} TFLOP/s"
          + (f", MFU {achieved / peak:.1%}" if peak else ", MFU unknown (pass --peak-tflops)")
          + f", embed_images {encode['bfloat16']['embed_images_s']:.0f} images/s (bf16) on {name}")
    return text


if __name__ == "__main__":
    main()
