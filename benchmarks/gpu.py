"""On one GPU, clipstream's own layers side by side with the plain PyTorch / open_clip code a user would write, in one
process without Ray, MLflow or Qdrant; without CUDA, a results file that says it was skipped.

    clipstream bench gpu [--arch ViT-B-32] [--batch 256] [--steps 20] [--methods ctp,lwf,modx,ewc,mas] [--cpu] ...

(a) training: the engine's step (`clipstream.training.engine.train_step`, what a Ray Train worker runs: both towers,
    the CLIP loss, `engine.backward`, `engine.step`) on a DeepSpeed engine from `engine.deepspeed_config` (finetune
    preset, `train.precision=bf16`) against a plain PyTorch loop (open_clip's ClipLoss, torch's AdamW, the forward under
    torch.autocast bf16) on the same model and batches, the two taking turns step by step; samples/s and MFU
    (samples/s × FLOPs per sample, counted by torch's FlopCounterMode, ÷ the GPU's peak dense bf16 FLOP/s: H100/H200
    SXM 989 TFLOP/s, A100 312, ... by device name, or `--peak-tflops`);
(b) ZeRO 2 against ZeRO 3 on the one GPU (the same step, `train.zero_stage`);
(c) each method's step ×finetune's on the GPU in bf16, in the state of a second task (benchmarks/method_step.py's
    set-up and turn-taking);
(d) the Encoder's model path (`clipstream.services.encoding.ModelPath`, what an Encoder replica runs: images decoded
    and preprocessed per request, requests batched, the model on the GPU in `embed_precision=auto`) images/s and
    texts/s against a plain open_clip loop (preprocess, `encode_image`/`encode_text` in the same dtype);
(e) the evaluation/indexing embed path (`training.evaluate.embed_tasks` through `ClipBundle.embed_*`, the calls the
    indexing job makes per block) on a synthetic task against the same plain loop.
Input loading is not measured in (a)-(c): random or preprocessed batches already on the GPU.

On the team's GPU machine (Python 3.12, torch preinstalled, no Ray, no network), after `benchmarks/gpu_setup.sh` has
built the wheels here into build/gpu-wheels/ (git-ignored: the device tool carries it, `carry: ["build/gpu-wheels"]`),
one command line from the repository root, writing under the tool's $OUT (and not run from the root itself: there,
`python -m` would import the repository's `clipstream/` folder instead of the installed package):

    python3 -m pip install -q --no-index --no-deps build/gpu-wheels/*.whl && cd "$OUT" && python3 -m clipstream.cli bench gpu --out "$OUT/gpu.md"

then copy gpu.md and gpu.json into benchmarks/results/. Sized to finish in a few minutes on one H100/H200.

`--cpu` runs every part tiny on the CPU (tiny arch, 2 steps): the tests' proof that the code path works. Never a CI
requirement. Writes benchmarks/results/gpu.md (and gpu.json, its checks).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Sequence

from clipstream.benchmarks import report

SETUP = "pip install --no-index --no-deps build/gpu-wheels/*.whl"  # what benchmarks/gpu_setup.sh prepares
# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name(); the first
# match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0), ("GH200", 989.0),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0),
                    ("A10", 125.0), ("RTX 4090", 165.0)]
# the targets: clipstream's layer ÷ the plain loop (at least), a method's step ÷ finetune's (at most)
TRAIN_TARGET, EMBED_TARGET = 0.90, 0.95
METHOD_TARGETS = {"ctp": 1.25, "lwf": 1.20, "modx": 1.20, "ewc": 1.05, "mas": 1.05}
TINY = {"arch": "clipstream-vit-tiny", "batch": 4, "steps": 2, "warmup": 1, "method_batch": 4, "cycles": 2,
        "encode_batch": 8, "encode_images": 16, "encode_texts": 16, "eval_pairs": 16, "rounds": 1}


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


def random_batch(model, batch: int, device, dtype) -> dict:
    """Random pixels (in `dtype`: the towers take their input as is) and tokens, on `device`."""
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


def _free(device) -> None:
    """Give the caching allocator's blocks back between parts, so one part's engines do not crowd the next."""
    import gc

    import torch

    gc.collect()
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.empty_cache()


def synced(step: Callable[[dict], object], device) -> Callable[[dict], None]:
    """`step` followed by a device synchronisation, so that a timer around it sees the GPU's work."""
    def run(batch: dict) -> None:
        step(batch)
        _sync(device)
    return run


def engine_for(arch: str, batch: int, precision: str, total_steps: int, zero_stage: int = 0):
    """A DeepSpeed engine, the finetune method and its first task's context, built as a task job's worker builds them."""
    import deepspeed
    import torch

    from clipstream import models
    from clipstream.training import methods
    from clipstream.training.engine import deepspeed_config, param_groups, prepare_for_deepspeed
    from clipstream.training.methods.base import TaskContext
    from clipstream.training.methods.config import resolve

    config = resolve("finetune", [f"model.arch={arch}", f"train.micro_batch={batch}", f"train.precision={precision}",
                              f"train.zero_stage={zero_stage}"])
    train = config["train"]
    torch.manual_seed(train["seed"])
    built = methods.build(config)
    model = built.prepare_model(prepare_for_deepspeed(models.create(arch).model))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, train["weight_decay"], train["lr"],
                                                                                 built.lr_scale),
                                      config=deepspeed_config(train, 1, total_steps))
    ctx = TaskContext(model=engine.module, task_index=0, rank=0, world_size=1, device=engine.device,
                      current={"task": "bench", "path": ""})
    built.before_task(ctx)
    return engine, built, ctx


def _on(data: list[dict], device, dtype) -> list[dict]:
    """Batches moved to `device`, pixels in `dtype` (the towers do not cast their input)."""
    return [{k: v.to(device=device, dtype=dtype) if k == "image" else v.to(device) for k, v in b.items()} for b in data]


def device_profile(setups: dict, steps: int, top: int = 12) -> dict[str, dict]:
    """Where each setup's step (a synced step and its batches) spends its time, over `steps` steps under torch's
    profiler (CPU and the GPU's kernels): ms per step of the wall clock, of the device's own work (the kernels' self
    time, summed: wall ≫ device means the host, not the GPU, sets the pace), of each `train_step` phase (CPU time,
    method_step.PHASES), and the `top` ops by self device time (else self CPU time, without a GPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from clipstream.benchmarks import method_step

    def device_us(event) -> float:  # a kernel's own time; record_function ranges also show on the device's timeline
        annotation = event.key in method_step.PHASES or event.key.startswith("Optimizer.") or \
            getattr(event, "is_user_annotation", False)
        return 0 if annotation else getattr(event, "self_device_time_total", 0) or 0

    out = {}
    for name, (step, data) in setups.items():
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = method_step.timed(step, data, steps)
        events = prof.key_averages()
        ranked = sorted(events, key=lambda e: (device_us(e), e.self_cpu_time_total), reverse=True)[:top]
        out[name] = {"wall_ms": wall, "device_ms": busy_ms(events, steps),
                     "phases": phase_ms(prof.events(), steps),
                     "top": [{"op": e.key, "device_ms": device_us(e) / 1000 / steps,
                              "cpu_ms": e.self_cpu_time_total / 1000 / steps, "calls": e.count / steps}
                             for e in ranked]}
    return out


def busy_ms(events, steps: int) -> float:
    """ms per step the device spent in kernels and copies: the device's own events only. An op's self device time
    is its kernels' time again, so a sum over ops and kernels together counts each kernel twice."""
    return sum(e.self_device_time_total for e in events if str(e.device_type).endswith("CUDA")) / 1000 / steps


def phase_ms(events, steps: int) -> dict[str, float]:
    """ms per step of each `train_step` phase on the host (its record_function ranges, not their device copies)."""
    from clipstream.benchmarks import method_step

    totals: dict[str, float] = {}
    for e in events:
        if e.name in method_step.PHASES and str(getattr(e, "device_type", "CPU")).endswith("CPU"):
            totals[e.name] = totals.get(e.name, 0.0) + e.cpu_time_total / 1000 / steps
    return totals


def profile_lines(profiled: dict[str, dict]) -> list[str]:
    """The report's section for `device_profile`'s result."""
    from clipstream.benchmarks import method_step

    names = list(profiled)
    lines = ["### Where the step's time goes (torch profiler, ms per step)", "",
             *report.table(["", *names], [["wall clock", *(f"{profiled[n]['wall_ms']:.1f}" for n in names)],
                                          ["device busy (kernels' self time)", *(f"{profiled[n]['device_ms']:.1f}"
                                                                                 for n in names)],
                                          *[[f"phase {p} (CPU)", *(f"{profiled[n]['phases'].get(p, 0):.1f}" for n in names)]
                                            for p in method_step.PHASES if any(p in profiled[n]["phases"] for n in names)]])]
    for name in names:
        lines += ["", f"Top ops of `{name}` by self device time:", "",
                  *report.table(["op", "device ms", "self CPU ms", "calls"],
                                [[t["op"][:70], f"{t['device_ms']:.2f}", f"{t['cpu_ms']:.2f}", f"{t['calls']:g}"]
                                 for t in profiled[name]["top"]])]
    return lines


def measure_training(arch: str, batch: int, steps: int, warmup: int, device, precision: str = "bf16",
                     profile_steps: int = 0) -> dict:
    """(a): the engine's step against the plain autocast loop on the same model and batches, taking turns step by
    step; the model's FLOPs per sample (counted on a separate copy, so the engine's hooks see only its own steps);
    with `profile_steps`, where each step's time goes (`device_profile`)."""
    import torch

    from clipstream import models
    from clipstream.benchmarks import method_step
    from clipstream.training.engine import prepare_for_deepspeed, train_step

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    counted = prepare_for_deepspeed(models.create(arch).model).to(device=device, dtype=dtype).train()
    data = [random_batch(counted, batch, "cpu", torch.float32)]
    forward, total = count_flops(counted, data[0]["image"].to(device, dtype), data[0]["text"].to(device))
    del counted
    _free(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine, method, ctx = engine_for(arch, batch, precision, 2 * (steps + warmup) + 1)
    module_dtype = next(engine.module.parameters()).dtype
    torch.manual_seed(0)
    plain = method_step.plain_step(models.create(arch).model.to(device), autocast=dtype if dtype != torch.float32 else None)
    setups = {"engine": (synced(functools.partial(train_step, engine, method, ctx), device), _on(data, device, module_dtype)),
              "plain": (synced(plain, device), _on(data, device, torch.float32))}
    for step, batches in setups.values():
        method_step.timed(step, batches, warmup)
    times = method_step.interleaved(setups, steps)
    profiled = device_profile(setups, profile_steps) if profile_steps else None
    step_ms = statistics.median(times["engine"])
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    out = {"samples_per_s": 1000 * batch / step_ms, "step_ms": step_ms, "flops_per_sample": total / batch,
           "plain_samples_per_s": 1000 * batch / statistics.median(times["plain"]),
           "vs_plain": 1 / method_step.paired_ratio(times["engine"], times["plain"]),
           "forward_flops_per_sample": forward / batch, "peak_gib": peak_gib,
           "params": sum(p.numel() for p in engine.module.parameters()), "dtype": str(module_dtype).replace("torch.", ""),
           "zero_stage": engine.zero_optimization_stage(), "optimizer": type(engine.optimizer).__name__,
           "profile": profiled}
    del engine, method, ctx, plain, setups
    _free(device)
    return out


def measure_zero(arch: str, batch: int, steps: int, warmup: int, device, stages=(2, 3),
                 profile_steps: int = 0) -> dict[int, dict]:
    """(b): samples/s of the same step under each ZeRO stage on this one device; a stage that fails says why; with
    `profile_steps`, where each stage's step spends its time (`device_profile`, under "profile")."""
    import torch

    from clipstream import models
    from clipstream.training.engine import train_step

    data = [random_batch(models.create(arch).model, batch, device, torch.bfloat16)]  # (ZeRO 3 partitions the engine's)
    out = {}
    for stage in stages:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            engine, method, ctx = engine_for(arch, batch, "bf16", steps + warmup + 1, zero_stage=stage)
            times = []
            step = functools.partial(train_step, engine, method, ctx)
            for i in range(warmup + steps):
                tic = time.perf_counter()
                step(data[0])
                _sync(device)
                times.append(1000 * (time.perf_counter() - tic))
            ms = statistics.median(times[warmup:])
            out[stage] = {"samples_per_s": 1000 * batch / ms, "step_ms": ms,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
            if profile_steps:
                name = f"ZeRO {stage}"
                out[stage]["profile"] = device_profile({name: (synced(step, device), data)}, profile_steps, top=8)[name]
            del engine, method, ctx, step
        except Exception as exc:  # noqa: BLE001 (a stage that cannot run is a result: the report names the error)
            out[stage] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
        _free(device)
    return out


def measure_methods(arch: str, batch: int, cycles: int, device, names: Sequence[str], workdir: Path,
                    profile_steps: int = 0) -> dict:
    """(c): each method's step ÷ finetune's in the same cycle (median over cycles), bf16 on `device`, every method in
    the state of its second task (benchmarks/method_step.py's set-up); with `profile_steps`, where each method's step
    spends its time (`device_profile`, under "profile")."""
    import torch

    from clipstream import models
    from clipstream.benchmarks import method_step
    from clipstream.training.data.synth import synthesize
    from clipstream.training.data.task import Task
    from clipstream.training.engine import train_step

    task = Task.load(synthesize(workdir / "data", tasks=1, digits=False, held_out=False, train_pairs=max(40, batch * 4),
                                progress=False)[0])
    cpu_batches = method_step.batches(task, models.create(arch), batch, 4)
    setups, failed = {}, {}
    for name in ["finetune", *[n for n in names if n != "finetune"]]:
        try:
            data = _on(cpu_batches, device, torch.bfloat16)
            engine, method, ctx, data = method_step.second_task(name, task, data, batch, workdir / "models",
                                                                [f"model.arch={arch}", "train.precision=bf16"])
            setup = (synced(functools.partial(train_step, engine, method, ctx), device), data)
            method_step.timed(*setup, 1)  # warm-up
            setups[name] = setup
        except Exception as exc:  # noqa: BLE001 (a method that cannot step in bf16 is a result: the report says why)
            if name == "finetune":
                raise
            failed[name] = f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            _free(device)
    times = method_step.interleaved(setups, cycles)
    out = {name: method_step.paired_ratio(times[name], times["finetune"]) for name in setups if name != "finetune"}
    out.update(failed)
    out["finetune_ms"] = statistics.median(times["finetune"])
    out["profile"] = device_profile(setups, profile_steps, top=8) if profile_steps else None
    del setups
    _free(device)
    return out


def _images(count: int, size: int = 256) -> list[bytes]:
    """`count` JPEG-encoded random pictures (at most 64 distinct), as requests carry them."""
    import numpy as np
    from PIL import Image

    rng, encoded = np.random.default_rng(0), []
    for _ in range(min(count, 64)):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, format="JPEG", quality=90)
        encoded.append(buffer.getvalue())
    return [encoded[i % len(encoded)] for i in range(count)]


def plain_encoder(arch: str, device, dtype):
    """What an open_clip user writes to embed: the model on the device in `dtype`, open_clip's eval transform and
    tokenizer, `encode_image`/`encode_text(normalize=True)`, vectors back as float32 numpy."""
    import open_clip
    import torch
    from PIL import Image

    model, _, preprocess = open_clip.create_model_and_transforms(arch)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = open_clip.get_tokenizer(arch)

    @torch.no_grad()
    def images(chunk: Sequence[bytes | Path]):  # encoded images, or their files
        pixels = torch.stack([preprocess(Image.open(io.BytesIO(b) if isinstance(b, bytes) else b).convert("RGB"))
                              for b in chunk])
        return model.encode_image(pixels.to(device=device, dtype=dtype), normalize=True).float().cpu().numpy()

    @torch.no_grad()
    def texts(chunk: Sequence[str]):
        return model.encode_text(tokenizer(chunk).to(device), normalize=True).float().cpu().numpy()
    return images, texts


def _rates(runs: dict[str, tuple[int, Callable[[], object]]], device, rounds: int) -> dict[str, float]:
    """items/s of each `runs` entry (items, fn), the best of `rounds` taking turns round by round (after one warm-up
    call each): one side measured after the other drifted with the host's state by ±15% on the GPU machine."""
    for _, fn in runs.values():
        fn()
        _sync(device)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, (_, fn) in runs.items():
            tic = time.perf_counter()
            fn()
            _sync(device)
            best[name] = min(best[name], time.perf_counter() - tic)
    return {name: items / max(best[name], 1e-9) for name, (items, _) in runs.items()}


def measure_encoder(arch: str, batch: int, n_images: int, n_texts: int, device, rounds: int) -> dict:
    """(d): images/s and texts/s of the Encoder's model path, requests of `batch // 8` items batched 8 at a time as
    @serve.batch gathers them, against the plain loop at `batch`."""
    from clipstream import models
    from clipstream.services.encoding import ModelPath

    path = ModelPath("auto", gpu=device.type == "cuda")
    bundle = path.place(models.create(arch))
    plain_images, plain_texts = plain_encoder(arch, path.device, path.dtype)
    pictures, captions = _images(n_images), [f"a photo of item {i} on a table" for i in range(n_texts)]
    per_request = max(1, batch // 8)

    def served(items: list, modality: str) -> None:
        for s in range(0, len(items), batch):
            chunk = items[s:s + batch]
            requests = [("1", modality, path.prepare(bundle, chunk[r:r + per_request]) if modality == "image"
                         else chunk[r:r + per_request]) for r in range(0, len(chunk), per_request)]
            ModelPath.encode(requests, {"1": bundle})

    def plain(items: list, encode: Callable) -> None:
        for s in range(0, len(items), batch):
            encode(items[s:s + batch])

    out = {"dtype": str(path.dtype).replace("torch.", ""),
           **_rates({"images_s": (n_images, lambda: served(pictures, "image")),
                     "plain_images_s": (n_images, lambda: plain(pictures, plain_images))}, device, rounds),
           **_rates({"texts_s": (n_texts, lambda: served(captions, "text")),
                     "plain_texts_s": (n_texts, lambda: plain(captions, plain_texts))}, device, rounds)}
    _free(device)
    return out


def measure_embed(arch: str, pairs: int, batch: int, device, rounds: int, workdir: Path) -> dict:
    """(e): pairs/s of the evaluation's `embed_tasks` (images and captions of a synthetic task's test split, each
    through `ClipBundle.embed_*` as the indexing job's blocks go) on the device in `embed_precision=auto`, against
    the plain loop on the same files."""
    from clipstream import models
    from clipstream.training import evaluate
    from clipstream.training.data.synth import synthesize
    from clipstream.training.data.task import Task

    task = Task.load(synthesize(workdir / "embed", tasks=1, digits=False, held_out=False, train_pairs=40,
                                test_per_task=pairs, image_size=128, progress=False)[0])
    bundle = models.create(arch).to(*models.placement("auto", gpu=device.type == "cuda"))
    rows = task.check("test").rows
    files = [Path(task.image(r)) for r in rows]
    captions = [str(r["caption"]) for r in rows]
    plain_images, plain_texts = plain_encoder(arch, bundle.device, bundle.dtype)

    def plain() -> None:
        for s in range(0, len(rows), batch):
            plain_images(files[s:s + batch])
        for s in range(0, len(rows), batch):
            plain_texts(captions[s:s + batch])

    def ours() -> None:
        evaluate.embed_tasks(bundle, [task], batch_size=batch)

    out = {"pairs": len(rows), **_rates({"pairs_s": (len(rows), ours), "plain_pairs_s": (len(rows), plain)}, device,
                                        rounds)}
    _free(device)
    return out


def skipped(out: Path, reason: str, command: str) -> str:
    """The results file of a run without a GPU: what would have been measured and why it was not."""
    return report.write(out, ["# GPU: clipstream's layers against plain PyTorch / open_clip on one GPU", "",
                              f"Reproduce (on a machine with a CUDA GPU, the wheels built by "
                              f"`benchmarks/gpu_setup.sh`): `{SETUP} && {command}`", "",
                              f"Device: {report.device()}.", "",
                              f"Skipped: {reason}. Nothing was measured; run it on a CUDA machine to fill this file."])


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def checks(train: dict, methods: dict, encode: dict, embed: dict) -> list[dict]:
    """The issue's targets against the measurements."""
    out = [report.check("engine step ÷ plain bf16 loop (samples/s)", train["vs_plain"], at_least=TRAIN_TARGET)]
    out += [report.check(f"{name} step ×finetune", methods[name], at_most=METHOD_TARGETS[name])
            if not isinstance(methods[name], str) else
            {"check": f"{name} step ×finetune", "value": "-", "target": f"≤ {METHOD_TARGETS[name]:.2f}", "ok": False,
             "why": methods[name]} for name in METHOD_TARGETS if name in methods]
    out += [report.check(f"Encoder model path ÷ plain open_clip ({kind}/s)", encode[f"{kind}_s"] / encode[f"plain_{kind}_s"],
                         at_least=EMBED_TARGET) for kind in ("images", "texts")]
    out.append(report.check("eval/indexing embed path ÷ plain open_clip (pairs/s)", embed["pairs_s"] / embed["plain_pairs_s"],
                            at_least=EMBED_TARGET))
    return out


def gpu_report(out: Path, command: str, device: str, versions: str, arch: str, batch: int, train: dict,
               zero: dict[int, dict], methods: dict, encode: dict, embed: dict, peak: float | None,
               sizes: dict) -> str:
    """The results file from the measurements (each part's dict as its measure_* returns it; `peak`: the GPU's peak
    dense bf16 TFLOP/s, None if unknown; `sizes`: the batch sizes the parts ran at)."""
    achieved = train["samples_per_s"] * train["flops_per_sample"] / 1e12
    estimate = train["samples_per_s"] * 3 * train["forward_flops_per_sample"] / 1e12
    mfu = f"{achieved / peak:.1%}" if peak else "- (unknown GPU: pass --peak-tflops)"
    mfu3 = f"{estimate / peak:.1%}" if peak else "-"
    lines = ["# GPU: clipstream's layers against plain PyTorch / open_clip on one GPU", "",
             f"Reproduce: `{SETUP} && {command}` (wheels: `benchmarks/gpu_setup.sh`)", "",
             f"Device: {device}." + (f" Peak dense bf16: {peak:g} TFLOP/s." if peak else ""), "", f"Versions: {versions}.", "",
             f"## (a) Training step, {arch} ({train['params'] / 1e6:.1f} M parameters), batch {batch}, bf16", "",
             "clipstream's step (`train_step` on a DeepSpeed engine from `deepspeed_config`, finetune preset, "
             f"ZeRO {train['zero_stage']}, DeepSpeed's {train.get('optimizer', '-')}, {train['dtype']} module) against a plain PyTorch loop (open_clip's ClipLoss, "
             "torch's AdamW, forward under torch.autocast bf16) on the same model and random batches already on the "
             "device, taking turns step by step; median step. FLOPs per sample by torch's FlopCounterMode (forward + "
             "backward of both towers and the loss); MFU = samples/s × FLOPs per sample ÷ the peak.", "",
             *report.table(["step", "samples/s", "step ms", "GFLOPs/sample (fwd+bwd)", "achieved TFLOP/s", "MFU",
                            "MFU (3× forward)", "peak memory GiB"],
                           [["engine (DeepSpeed)", train["samples_per_s"], train["step_ms"],
                             f"{train['flops_per_sample'] / 1e9:.2f}", f"{achieved:.3g}", mfu, mfu3, _fmt(train.get("peak_gib"))],
                            ["plain PyTorch (autocast)", train["plain_samples_per_s"], 1000 * batch / train["plain_samples_per_s"],
                             "", "", "", "", ""]]),
             "", f"Engine ÷ plain (median over cycles of the paired step ratio): {train['vs_plain']:.2f}×.", "",
             *(profile_lines(train["profile"]) + [""] if train.get("profile") else []),
             f"## (b) ZeRO 2 against ZeRO 3 on one GPU ({arch}, batch {batch}, bf16)", "",
             *report.table(["ZeRO stage", "samples/s", "step ms", "peak memory GiB"],
                           [[stage, _fmt(z.get("samples_per_s")), _fmt(z.get("step_ms")), _fmt(z.get("peak_gib"))]
                            if "error" not in z else [stage, f"failed: {z['error']}", "", ""] for stage, z in zero.items()]),
             *([""] + profile_lines({f"ZeRO {stage}": z["profile"] for stage, z in zero.items() if z.get("profile")})
               if any(z.get("profile") for z in zero.values()) else []),
             "", f"## (c) Method step ×finetune ({arch}, batch {sizes['method_batch']}, bf16, second task's state)", "",
             f"finetune's step: {methods['finetune_ms']:.1f} ms.", "",
             *report.table(["method", "×finetune"], [[n, r if isinstance(r, str) else f"{r:.2f}"]
                                                     for n, r in methods.items() if n not in ("finetune_ms", "profile")]),
             *([""] + profile_lines(methods["profile"]) if methods.get("profile") else []),
             "", f"## (d) Encoder model path ({encode['dtype']}, batch {sizes['encode_batch']})", "",
             "`ModelPath` as an Encoder replica runs it (each request's JPEGs decoded and preprocessed on the CPU, "
             "8 requests batched, one model call per batch, unit float32 vectors split back) against a plain open_clip "
             "loop (the same decoding and transform, `encode_image`/`encode_text(normalize=True)` in the same dtype).", "",
             *report.table(["input", "Encoder path /s", "plain open_clip /s", "ratio"],
                           [[kind, encode[f"{kind}_s"], encode[f"plain_{kind}_s"],
                             f"{encode[f'{kind}_s'] / encode[f'plain_{kind}_s']:.2f}"] for kind in ("images", "texts")]),
             "", f"## (e) Evaluation / indexing embed path ({embed['pairs']} test pairs of a synthetic task)", "",
             *report.table(["path", "pairs/s"], [["evaluate.embed_tasks (ClipBundle.embed_*)", embed["pairs_s"]],
                                                  ["plain open_clip", embed["plain_pairs_s"]]]),
             "", *report.targets(out, checks(train, methods, encode, embed))]
    return report.write(out, lines)


def versions() -> str:
    """torch, CUDA, DeepSpeed and open_clip as this process has them."""
    import deepspeed
    import open_clip
    import torch

    return (f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, DeepSpeed {deepspeed.__version__}, "
            f"open_clip {open_clip.__version__}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="ViT-B-32", help="the model, any open_clip architecture by name")
    p.add_argument("--batch", type=int, default=256, help="training micro batch, (a) and (b)")
    p.add_argument("--steps", type=int, default=20, help="timed training steps of each side, (a) and (b)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHOD_TARGETS), help="(c): comma-separated presets")
    p.add_argument("--method-batch", type=int, default=128)
    p.add_argument("--cycles", type=int, default=10, help="(c): steps of every method, taking turns")
    p.add_argument("--encode-batch", type=int, default=256)
    p.add_argument("--encode-images", type=int, default=1024, help="(d): images per round")
    p.add_argument("--encode-texts", type=int, default=8192, help="(d): texts per round")
    p.add_argument("--eval-pairs", type=int, default=1024, help="(e): test pairs of the synthetic task")
    p.add_argument("--rounds", type=int, default=2, help="(d), (e): timed rounds, the best kept")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="(a)-(c): also profile this many steps of each side, ZeRO stage and method (torch "
                   "profiler): where each step's time goes")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s (default: by name)")
    p.add_argument("--cpu", action="store_true", help="run every part tiny on the CPU (tiny arch, 2 steps): a smoke "
                   "test of this script")
    p.add_argument("--out", default=str(report.RESULTS / "gpu.md"))
    if "--cpu" in (sys.argv[1:] if argv is None else argv):  # the tiny sizes, unless given on the command line
        p.set_defaults(**TINY)
    args = report.parse(p, argv)
    from clipstream import models

    models.architecture(args.arch)  # an unknown name: one line, with a GPU or without
    command = (f"clipstream bench gpu --arch {args.arch} --batch {args.batch} --steps {args.steps} --warmup {args.warmup} "
               f"--methods {args.methods} --method-batch {args.method_batch} --cycles {args.cycles} "
               f"--encode-batch {args.encode_batch} --encode-images {args.encode_images} --encode-texts {args.encode_texts} "
               f"--eval-pairs {args.eval_pairs} --rounds {args.rounds}"
               + (f" --profile {args.profile}" if args.profile else "")
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

    device = torch.device("cpu" if args.cpu else "cuda")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29547")})
    import deepspeed

    from clipstream import models

    models.keep_freed_memory()
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if args.cpu else "nccl")
    tic = time.perf_counter()

    parts_file, done, failed = Path(args.out).with_suffix(".parts.json"), {}, {}

    def part(name: str, fn: Callable, *a):
        """One part's measurements, kept in `parts_file` as they come: a GPU lease is minutes long, and a part
        that fails must not take the others' numbers with it (the rest still run; the run fails at the end)."""
        start = time.perf_counter()
        try:
            done[name] = fn(*a)
        except Exception:  # noqa: BLE001 (reported with its traceback, and the run fails below)
            failed[name] = traceback.format_exc()
            print(f"[gpu] {name} failed:\n{failed[name]}", flush=True)
            _free(device)
        print(f"[gpu] {name}: {time.perf_counter() - start:.0f} s", flush=True)
        report.write(parts_file, [json.dumps({"done": done, "failed": failed}, indent=1, default=str)])
        return done.get(name)

    with tempfile.TemporaryDirectory() as tmp:
        train = part("(a) training step", measure_training, args.arch, args.batch, args.steps, args.warmup, device,
                     "bf16", args.profile)
        zero = part("(b) ZeRO 2 / 3", measure_zero, args.arch, args.batch, args.steps, args.warmup, device, (2, 3),
                    args.profile)
        methods = part("(c) method steps", measure_methods, args.arch, args.method_batch, args.cycles, device,
                       [m for m in args.methods.split(",") if m], Path(tmp), args.profile)
        encode = part("(d) Encoder path", measure_encoder, args.arch, args.encode_batch, args.encode_images,
                      args.encode_texts, device, args.rounds)
        embed = part("(e) embed path", measure_embed, args.arch, args.eval_pairs, args.encode_batch, device, args.rounds,
                     Path(tmp))
    if failed:
        raise SystemExit(f"gpu: {len(failed)} part(s) failed ({', '.join(failed)}); the others' numbers are in {parts_file}")
    parts_file.unlink()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    peak = peak_tflops(name, args.peak_tflops) if device.type == "cuda" or args.peak_tflops else None
    text = gpu_report(Path(args.out), command, report.device(), versions(), args.arch, args.batch, train, zero, methods,
                      encode, embed, peak, {"method_batch": args.method_batch, "encode_batch": args.encode_batch})
    print(text)
    print(f"gpu: all parts in {time.perf_counter() - tic:.0f} s on {name}; wrote {args.out}")
    return text


if __name__ == "__main__":
    main()
