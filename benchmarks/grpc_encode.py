"""gRPC encoding through the Ray Serve app vs the same model called in-process, under concurrency,
measured side by side in one run.

    clipstream bench grpc-encode [--clients 8] [--per-request 8] [--requests 128] [--rounds 3]

Both sides get the same workload: `--clients` threads, each sending requests of `--per-request` items
(texts, or PNG bytes that are decoded and preprocessed on both sides) until `--requests` are done. The
in-process side calls the model directly from those threads (the best a user embedding the library
gets without writing a batcher); the gRPC side goes client → Serve proxy → the Encoder ingress
(@serve.batch) and back. Both use every core: the Encoder replica reserves them all. Sides alternate
for `--rounds` rounds; medians are compared. Writes benchmarks/results/grpc-encode.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from clipstream import models
from clipstream.benchmarks import report
from clipstream.registry import MANIFEST, PRODUCTION, Registry
from clipstream.services import app
from clipstream.services.client import Client
from clipstream.settings import Settings
from clipstream.training.job import init_ray
from clipstream.training.methods.state import STATE_FILE, save_state


def register(settings: Settings, arch: str) -> str:
    """A real open_clip model of `arch`, exported and registered as the production version."""
    torch.manual_seed(0)
    folder = settings.home / "export" / "checkpoint"
    models.export(models.create(arch), folder)
    save_state({}, folder / STATE_FILE)
    (folder / MANIFEST).write_text(json.dumps({"lineage": [], "matrix": {}}))
    registry = Registry(settings)
    with registry.run("bench-grpc-encode", {}):
        version = registry.register(folder, {"task": "bench", "task_index": 0, "method": "none"})
    registry.set_alias(PRODUCTION, version)
    return version


def workload(modality: str, n: int, per_request: int) -> list[list]:
    rng = np.random.default_rng(0)
    if modality == "text":
        words = "a small large red blue green striped dotted cup lamp chair bird on the left right top".split()
        return [[" ".join(rng.choice(words, 8)) for _ in range(per_request)] for _ in range(n)]
    requests = []
    for _ in range(n):
        batch = []
        for _ in range(per_request):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
            batch.append(buf.getvalue())
        requests.append(batch)
    return requests


def run_concurrently(fn, requests: list[list], clients: int) -> float:
    """items/s for `fn(request)` called from `clients` threads over every request."""
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(fn, requests[:4 * clients]))  # warm-up: model loads, connections, caches
        tic = time.perf_counter()
        list(pool.map(fn, requests))
        return sum(len(r) for r in requests) / (time.perf_counter() - tic)


def in_process(bundle, modality: str):
    """The in-process side: the model bundle's own embed path, as the Encoder runs it."""
    embed = bundle.embed_texts if modality == "text" else bundle.embed_images
    return lambda items: embed(items, batch_size=len(items))


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-request", type=int, default=8)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arch", default="clipstream-vit-small")
    p.add_argument("--out", default=str(report.RESULTS / "grpc-encode.md"))
    args = p.parse_args(argv)
    cpus = os.cpu_count()
    torch.set_num_threads(cpus)

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp) / "home", serve_encoder_cpus=cpus, serve_search_cpus=0,
                            serve_batch_size=args.clients, serve_max_items=max(256, args.per_request)).ensure_dirs()
        version = register(settings, args.arch)
        bundle = Registry(settings).load(version)
        app.serving_environment()
        init_ray(settings, num_cpus=cpus)
        app.start(settings)
        rows = []
        with Client(f"127.0.0.1:{settings.grpc_port}", timeout_s=120) as client:
            for modality in ("text", "image"):
                requests = workload(modality, args.requests, args.per_request)
                remote = client.encode_text if modality == "text" else client.encode_image
                local, served = [], []
                for r in range(args.rounds):
                    local.append(run_concurrently(in_process(bundle, modality), requests, args.clients))
                    served.append(run_concurrently(lambda items: remote(items, batch_size=len(items), progress=False),
                                                   requests, args.clients))
                    print(f"[{modality} round {r}] in-process {local[-1]:.1f} items/s, gRPC {served[-1]:.1f} items/s",
                          flush=True)
                rows.append((modality, statistics.median(local), statistics.median(served), local, served))

    text = report.write(args.out, [
        f"# gRPC encoding vs in-process, {args.arch}, {args.clients} concurrent clients × {args.per_request} "
        f"items per request, {args.requests} requests per round", "",
        f"Device: {report.device()}. Command: `clipstream bench grpc-encode --clients {args.clients} --per-request "
        f"{args.per_request} --requests {args.requests} --rounds {args.rounds} --arch {args.arch}`", "",
        *report.table(["modality", "in-process items/s (median)", "gRPC items/s (median)", "rounds in-process",
                       "rounds gRPC", "ratio"],
                      [[m, a, b, ", ".join(f"{x:.0f}" for x in la), ", ".join(f"{x:.0f}" for x in lb), f"{b / a:.2f}"]
                       for m, a, b, la, lb in rows])])
    print(text)
    print(json.dumps({m: {"in_process": a, "grpc": b, "ratio": b / a} for m, a, b, _, _ in rows}))
    return text


if __name__ == "__main__":
    main()
