"""gRPC encoding through the Ray Serve app vs the same model called in-process, under concurrency,
measured side by side in one run.

    python benchmarks/grpc_encode.py [--clients 8] [--per-request 8] [--requests 64] [--rounds 3]

Both sides get the same workload: `--clients` threads, each sending requests of `--per-request` items
(texts, or PNG bytes that are decoded and preprocessed on both sides) until `--requests` are done. The
in-process side calls the model directly from those threads (the best a user embedding the library
gets without writing a batcher); the gRPC side goes client → Serve proxy → Search ingress → Encoder
(@serve.batch) and back. Both use every core: the Encoder replica reserves them all. Sides alternate
for `--rounds` rounds; medians are compared. Writes benchmarks/results/grpc-encode.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import numpy as np
import torch
from PIL import Image

from clipstream.settings import Settings
from services import app
from services.client import Client
from services.versions import VersionStore
from training import models
from training.job import init_ray
from training.registry import MANIFEST, Registry


def register(settings: Settings, arch: str) -> str:
    """A real open_clip model of `arch`, exported and registered as the production version."""
    torch.manual_seed(0)
    folder = settings.home / "export" / "checkpoint"
    models.export(models.create(arch), folder)
    torch.save({}, folder / "method_state.pt")
    (folder / MANIFEST).write_text(json.dumps({"lineage": [], "matrix": {}}))
    registry = Registry(settings)
    with registry.run("bench-grpc-encode", {}):
        version = registry.register(folder, {"task": "bench", "task_index": 0, "method": "none"})
    registry.client.set_registered_model_alias(registry.name, "production", version)
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
    def encode(items: list):
        with torch.no_grad():
            if modality == "text":
                return bundle.model.encode_text(bundle.tokenizer(items), normalize=True).numpy()
            pixels = [bundle.preprocess_val(Image.open(io.BytesIO(b)).convert("RGB")) for b in items]
            return bundle.model.encode_image(torch.stack(pixels), normalize=True).numpy()
    return encode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-request", type=int, default=8)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arch", default="clipstream-vit-small")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "grpc-encode.md"))
    args = p.parse_args()
    cpus = os.cpu_count()
    torch.set_num_threads(cpus)

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp) / "home", serve_encoder_cpus=cpus, serve_search_cpus=0,
                            serve_batch_size=args.clients, serve_max_items=max(256, args.per_request)).ensure_dirs()
        mlflow.set_tracking_uri(settings.mlflow_tracking_uri)
        version = register(settings, args.arch)
        bundle = VersionStore(settings.mlflow_tracking_uri, settings.stream, settings.home / "cache").load(version)
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

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"CPU ({platform.processor() or platform.machine()}, {cpus} cores)"
    table = (f"# gRPC encoding vs in-process, {args.arch}, {args.clients} concurrent clients × {args.per_request} "
             f"items per request, {args.requests} requests per round\n\n"
             f"Device: {device}. Command: `python benchmarks/grpc_encode.py --clients {args.clients} --per-request "
             f"{args.per_request} --requests {args.requests} --rounds {args.rounds} --arch {args.arch}`\n\n"
             "| modality | in-process items/s (median) | gRPC items/s (median) | rounds in-process | rounds gRPC | ratio |\n"
             "|---|---|---|---|---|---|\n")
    table += "".join(f"| {m} | {a:.1f} | {b:.1f} | {', '.join(f'{x:.0f}' for x in la)} | "
                     f"{', '.join(f'{x:.0f}' for x in lb)} | {b / a:.2f} |\n" for m, a, b, la, lb in rows)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    print(json.dumps({m: {"in_process": a, "grpc": b, "ratio": b / a} for m, a, b, _, _ in rows}))


if __name__ == "__main__":
    main()
