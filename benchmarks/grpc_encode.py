"""gRPC encoding through the Ray Serve app (dynamic batching) vs the same model called in-process vs the
app with batching off (`max_batch_size=1`), at 1, 4, 16 and 64 concurrent clients, measured side by side in
one run.

    clipstream bench grpc-encode [--clients 1,4,16,64] [--per-request 8] [--requests 96] [--rounds 3]
                                 [--modalities text,image] [--arch clipstream-vit-small] [--no-batching-baseline]

Every side gets the same workload at each concurrency: N client threads, each sending requests of
`--per-request` items (texts, or PNG bytes that are decoded and preprocessed on every side) until the
round's requests are done (`--requests`, at least 2 per client). The in-process side calls the model
bundle's own embed path from those threads (what a library user gets without writing a batcher); the
gRPC side goes client → Serve proxy → the Encoder ingress (its dynamic batching, settings.serve_batch_size) and
back; the third side is the same app redeployed with serve_batch_size=1. The Encoder replica reserves
every core. In-process and gRPC alternate for `--rounds` rounds (medians compared); the max_batch_size=1
app then runs its rounds. Latency is per request (p50/p99 over every round's requests). Each side's CPU
time per item (this process and the Ray cluster it starts) is recorded too: what it costs, whatever share
of the cores other work on the machine leaves it. Ray starts its workers (the replica, the proxy) 15 nice
levels below the driver; here they run at the driver's priority (RAY_worker_niceness=0), so that on a busy
machine both sides compete on equal terms. Target: gRPC ≥ 0.90× in-process at 16 and 64 clients.
Writes benchmarks/results/grpc-encode.md, grpc-encode.png (items/s and p99 against clients) and
grpc-encode.json (the checks).
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
from typing import Callable, Sequence

import numpy as np

from clipstream.benchmarks import report

SIDES = {"in-process": "in-process (N threads → model)", "grpc": "gRPC, dynamic batching",
         "grpc-b1": "gRPC, max_batch_size=1"}
WORKER_NICENESS = "RAY_worker_niceness"  # Ray starts its workers this much nicer than the raylet (default 15)
TARGET = 0.90  # gRPC ≥ 0.90× in-process ...
TARGET_CLIENTS = (16, 64)  # ... at these concurrencies
ONE_CLIENT_TARGET = 0.80  # one AsyncClient encoding a large input ≥ 0.80× one in-process caller


# What profiling the replica found (py-spy, 64 clients sending images, 2 cores), for the results file.
PROFILE_NOTE = (
    "Profile (py-spy on the Encoder replica, 64 clients × 8 images, 2 cores): with the model run inside the "
    "`@serve.batch` method on the replica's event loop, the replica stopped taking requests while it computed, and on a "
    "machine busy with other work (load average ~30) it spent ~36 ms of CPU per image against ~8 in-process. The "
    "model now runs on a thread of its own (services/encoder.py: `run_in_executor` inside the `@serve.batch` method), "
    "so the loop keeps receiving, validating and queueing requests while it computes: the CPU per item is the "
    "in-process one or lower (the CPU ms/item column). On CPU a request of 8 items is already a batch, so batching "
    "buys little in throughput here (the max_batch_size=1 column); it matters where a model call has a high fixed "
    "cost (a GPU). At 16 clients sending images (py-spy, 15 s on the replica and 10 s on the proxy): the model thread "
    "sat idle in 28% of the samples, waiting for the next batch (1-2 requests each), the proxy mostly idle too; the "
    "hops' latency, not their CPU, leaves the replica short of work at that concurrency. Decoding and preprocessing "
    "images on threads of their own, before batching (`ClipBundle.pixels`), left that ratio where it was (0.78). "
    "One AsyncClient encoding 10k captions (the replica's threads' CPU and context switches from /proc, py-spy): the "
    "model thread was inside the forward ≥90% of the time but on a core 76% (its OpenMP worker 62%), against ~90% for "
    "both in-process, with ~3× their context switches; the event loop held the GIL ~5% of the time, some of it in "
    "Ray's metrics (Gauge.set for the registry-staleness gauge, on every request). The next batch now waits on the "
    "model thread's queue while one runs (`max_concurrent_batches=2`) and the gauge is written on change only.")


def register(settings, arch: str) -> str:
    """A real open_clip model of `arch`, exported and registered as the production version."""
    import torch

    from clipstream import models
    from clipstream.registry import MANIFEST, PRODUCTION, Registry
    from clipstream.training.methods.state import STATE_FILE, save_state

    torch.manual_seed(0)
    folder = settings.home / "export" / "checkpoint"
    models.export(models.create(arch), folder)
    save_state({}, folder / STATE_FILE)
    (folder / MANIFEST).write_text(json.dumps({"lineage": [], "matrix": {}}))
    registry = Registry(settings)
    with registry.run("bench-grpc-encode", {}) as run_id:
        version = registry.register(folder, {"task": "bench", "task_index": 0, "method": "none"}, run_id=run_id)
    registry.set_alias(PRODUCTION, version)
    return version


def workload(modality: str, n: int, per_request: int) -> list[list]:
    rng = np.random.default_rng(0)
    if modality == "text":
        words = "a small large red blue green striped dotted cup lamp chair bird on the left right top".split()
        return [[" ".join(rng.choice(words, 8)) for _ in range(per_request)] for _ in range(n)]
    from PIL import Image

    requests = []
    for _ in range(n):
        batch = []
        for _ in range(per_request):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
            batch.append(buf.getvalue())
        requests.append(batch)
    return requests


def run_concurrently(fn: Callable, requests: list[list], clients: int,
                     cpu: Callable[[], float] = lambda: 0.0) -> tuple[float, list[float], float]:
    """(items/s, each request's latency in ms, CPU seconds `cpu()` counted meanwhile) for `fn(request)` called from
    `clients` threads over every request."""
    def timed(items):
        tic = time.perf_counter()
        fn(items)
        return 1000 * (time.perf_counter() - tic)

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(fn, requests[:min(clients, 4)]))  # warm-up: connections, allocator (the model is warm already)
        used, tic = cpu(), time.perf_counter()
        latencies = list(pool.map(timed, requests))
        seconds = time.perf_counter() - tic
        return sum(len(r) for r in requests) / seconds, latencies, cpu() - used


def tree_cpu() -> float:
    """CPU seconds (user + system) this process and its descendants (the Ray cluster it started: proxy, replica,
    raylet...) have used so far: what a side costs, whatever share of the cores other work on the machine takes."""
    import psutil

    total = 0.0
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def in_process(bundle, modality: str) -> Callable:
    """The in-process side: the model bundle's own embed path, as the Encoder runs it."""
    embed = bundle.embed_texts if modality == "text" else bundle.embed_images
    return lambda items: embed(items, batch_size=len(items))


def remote(client, modality: str) -> Callable:
    call = client.encode_text if modality == "text" else client.encode_image
    return lambda items: call(items, batch_size=len(items), progress=False)


def one_client(bundle, address: str, n: int, batch: int, in_flight: int, rounds: int) -> dict:
    """One caller encoding `n` captions for `rounds` rounds, both sides back to back in each round, which goes first
    alternating: in-process (the bundle's embed, `batch` at a time, as a library user would call it) against one
    AsyncClient (chunks of `batch`, up to `in_flight` on the wire at once); items/s of each round. Compared round by
    round (`one_client_ratio`): a machine whose speed drifts between rounds moves both sides of a round alike."""
    import asyncio

    from clipstream.services.client import AsyncClient

    captions = [text for request in workload("text", -(-n // 8), 8) for text in request][:n]

    async def remote() -> None:
        async with AsyncClient(address, timeout_s=600, in_flight=in_flight) as client:
            await client.encode_text(captions, batch_size=batch)

    sides = {"in-process": lambda: bundle.embed_texts(captions, batch_size=batch),
             "async client": lambda: asyncio.run(remote())}
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            tic = time.perf_counter()
            sides[side]()
            rates[side].append(n / (time.perf_counter() - tic))
        print(f"[one client, {n} captions, round {r + 1}/{rounds}] " +
              ", ".join(f"{k} {v[-1]:.0f} items/s" for k, v in rates.items()), flush=True)
    return {"captions": n, "batch": batch, "in_flight": in_flight, "rates": rates}


def batches_for(sizes: list[int], requests: int) -> int:
    """How many of the Encoder's latest batches (its `batches_seen`, newest last) held the last `requests` requests."""
    total, count = 0, 0
    for size in reversed(sizes):
        if total >= requests:
            break
        total, count = total + size, count + 1
    return max(count, 1)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    from clipstream.settings import Settings

    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated concurrencies")
    p.add_argument("--per-request", type=int, default=8, help="items per request")
    p.add_argument("--requests", type=int, default=96, help="requests per side per round (at least 2 per client)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modalities", default="text,image")
    p.add_argument("--arch", default="clipstream-vit-small", help="the model, any open_clip architecture by name")
    p.add_argument("--batch-size", type=int, default=Settings.model_fields["serve_batch_size"].default,
                   help="the app's serve_batch_size (most requests one model call gathers)")
    p.add_argument("--batching-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the app with max_batch_size=1 (--no-batching-baseline: skip it, saving a redeploy)")
    p.add_argument("--one-client", type=int, default=10000, metavar="N",
                   help="also: one AsyncClient encoding N captions against one in-process caller (0: skip)")
    p.add_argument("--one-client-batch", type=int, default=64, help="--one-client's chunk / batch size")
    p.add_argument("--one-client-rounds", type=int, default=7,
                   help="--one-client's rounds (each: both sides back to back; the ratio's median over them)")
    p.add_argument("--out", default=str(report.RESULTS / "grpc-encode.md"), help="the markdown; the plot goes next to it (.png)")
    args = report.parse(p, argv)
    from clipstream import models

    models.architecture(args.arch)  # an unknown name: one line, before anything runs
    levels = [int(c) for c in args.clients.split(",")]
    modalities = args.modalities.split(",")

    import torch
    from ray import serve

    from clipstream.registry import Registry
    from clipstream.runtime import free_port
    from clipstream.services import app
    from clipstream.services.client import Client

    wall = time.perf_counter()
    cpus = os.cpu_count()
    torch.set_num_threads(cpus)
    results: dict = {m: {side: {c: {"rates": [], "latencies": [], "batch": [], "cpu_ms": []} for c in levels}
                         for side in SIDES} for m in modalities}
    load, single = os.getloadavg()[0], None
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(home=Path(tmp) / "home", grpc_port=free_port(), serve_encoder_cpus=cpus, serve_search_cpus=0,
                            serve_batch_size=args.batch_size, serve_max_items=max(256, args.per_request)).ensure_dirs()
        version = register(settings, args.arch)
        bundle = Registry(settings).load(version)
        work = {m: {c: workload(m, max(args.requests, 2 * c), args.per_request) for c in levels} for m in modalities}
        os.environ.setdefault(WORKER_NICENESS, "0")  # the replica and proxy at this process's priority (see the doc)
        try:
            for side in ("grpc", "grpc-b1") if args.batching_baseline else ("grpc",):
                served = settings if side == "grpc" else settings.model_copy(update={"serve_batch_size": 1})
                target = app.serve(served, num_cpus=cpus)  # (Ray started by the first side, reused by the second)
                handle = serve.get_deployment_handle("Encoder", served.serve_app)
                with Client(target, timeout_s=300) as client:
                    for m in modalities:
                        for c in levels:
                            for r in range(args.rounds):
                                pairs = [("in-process", in_process(bundle, m))] if side == "grpc" else []
                                for name, fn in pairs + [(side, remote(client, m))]:
                                    rate, lat, used = run_concurrently(fn, work[m][c], c, tree_cpu)
                                    cell = results[m][name][c]
                                    cell["rates"].append(rate)
                                    cell["latencies"] += lat
                                    cell["cpu_ms"].append(1000 * used / sum(len(x) for x in work[m][c]))
                                    if name != "in-process":
                                        cell["batch"].append(len(work[m][c]) / batches_for(handle.BatchSizes.remote().result(),
                                                                                           len(work[m][c])))
                                print(f"[{m} {c} clients round {r + 1}/{args.rounds}] " + ", ".join(
                                    f"{n} {results[m][n][c]['rates'][-1]:.0f} items/s" for n, _ in pairs + [(side, None)]),
                                      flush=True)
                    if side == "grpc" and args.one_client:
                        single = one_client(bundle, target, args.one_client, args.one_client_batch, 8,
                                            args.one_client_rounds)
                serve.delete(served.serve_app)
        finally:
            serve.shutdown()
    seconds = time.perf_counter() - wall
    command = (f"clipstream bench grpc-encode --clients {args.clients} --per-request {args.per_request} --requests "
               f"{args.requests} --rounds {args.rounds} --modalities {args.modalities} --arch {args.arch} "
               f"--batch-size {args.batch_size}{'' if args.batching_baseline else ' --no-batching-baseline'} "
               f"--one-client {args.one_client} --one-client-batch {args.one_client_batch} "
               f"--one-client-rounds {args.one_client_rounds} --out {args.out}")
    device = report.device(f"{torch.get_num_threads()} torch threads",
                           f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    text = encode_report(results, Path(args.out), command, device, args.arch, args.per_request, args.batch_size,
                         seconds, PROFILE_NOTE, single)
    print(text)
    print(json.dumps(verdict(results)))
    return text


def summarize(results: dict) -> dict:
    """modality -> side -> clients -> {items_s (median over rounds), p50, p99 (ms, every request), batch (mean
    requests per model call, gRPC sides)}."""
    out: dict = {}
    for m, sides in results.items():
        for side, levels in sides.items():
            for c, cell in levels.items():
                if not cell["rates"]:
                    continue
                out.setdefault(m, {}).setdefault(side, {})[c] = {
                    "items_s": statistics.median(cell["rates"]), "p50": percentile(cell["latencies"], 50),
                    "p99": percentile(cell["latencies"], 99), "rounds": list(cell["rates"]),
                    "cpu_ms": statistics.median(cell["cpu_ms"]) if cell.get("cpu_ms") else None,
                    "batch": statistics.mean(cell["batch"]) if cell.get("batch") else None}
    return out


def verdict(results: dict) -> dict:
    """Per modality and concurrency: gRPC ÷ in-process and gRPC ÷ gRPC max_batch_size=1 items/s; `pass`: every
    TARGET_CLIENTS ratio ≥ TARGET."""
    s = summarize(results)
    ratios = {m: {c: {"grpc_vs_in_process": s[m]["grpc"][c]["items_s"] / s[m]["in-process"][c]["items_s"],
                      **({"batching_gain": s[m]["grpc"][c]["items_s"] / s[m]["grpc-b1"][c]["items_s"]}
                         if c in s[m].get("grpc-b1", {}) else {})}
                  for c in s[m]["grpc"] if c in s[m].get("in-process", {})} for m in s}
    checked = [r["grpc_vs_in_process"] for m in ratios for c, r in ratios[m].items() if c in TARGET_CLIENTS]
    return {"ratios": ratios, "target": f"gRPC >= {TARGET:.2f}x in-process at {', '.join(map(str, TARGET_CLIENTS))} clients",
            "pass": bool(checked) and all(r >= TARGET for r in checked)}


def checks(results: dict, single: dict | None = None) -> list[dict]:
    """gRPC ÷ in-process items/s at each TARGET_CLIENTS concurrency against TARGET; a miss says whether the gRPC side
    spent more CPU per item (its own cost) or the same (the sides got different shares of the cores); with `single`
    (`one_client`'s), one AsyncClient ÷ one in-process caller against ONE_CLIENT_TARGET."""
    s, found = summarize(results), []
    if single:
        found.append(report.check(f"text: one AsyncClient ÷ one in-process caller items/s, {single['captions']} captions",
                                  one_client_ratio(single), at_least=ONE_CLIENT_TARGET))
    for m, sides in s.items():
        for c in TARGET_CLIENTS:
            g, local = sides.get("grpc", {}).get(c), sides.get("in-process", {}).get(c)
            if not g or not local:
                continue
            why = ""
            if g["items_s"] < TARGET * local["items_s"] and g.get("cpu_ms") and local.get("cpu_ms"):
                cost = g["cpu_ms"] / local["cpu_ms"]
                why = (f"gRPC spent {cost:.2f}× the in-process CPU per item" if cost > 1.1 else
                       f"same CPU per item ({g['cpu_ms']:.1f} vs {local['cpu_ms']:.1f} ms): the gRPC side got less of "
                       "the cores")
            found.append(report.check(f"{m}: gRPC ÷ in-process items/s, {c} clients", g["items_s"] / local["items_s"],
                                      at_least=TARGET, why=why))
    return found


def round_ratios(single: dict) -> list[float]:
    """AsyncClient ÷ in-process items/s of each round (`one_client`'s rounds)."""
    return [a / b for a, b in zip(single["rates"]["async client"], single["rates"]["in-process"])]


def one_client_ratio(single: dict) -> float:
    """The median over rounds of each round's AsyncClient ÷ in-process."""
    return statistics.median(round_ratios(single))


def encode_report(results: dict, out: Path, command: str, device: str, arch: str, per_request: int, batch_size: int,
                  seconds: float | None = None, note: str = "", single: dict | None = None) -> str:
    """The tables (one per modality) to `out` and items/s and p99 against clients to `out`.png; returns the markdown.
    `results`: modality -> side (SIDES) -> clients -> {"rates": items/s per round, "latencies": ms per request,
    "batch": mean requests per model call per round (gRPC sides), "cpu_ms": CPU ms per item per round}."""
    out = Path(out)
    s, v = summarize(results), verdict(results)
    lines = [f"# gRPC encoding vs in-process, {arch}, {per_request} items per request, 1 to "
             f"{max(c for m in s for c in s[m]['grpc'])} concurrent clients", "",
             f"Reproduce: `{command}`", "",
             f"Device: {device}." + (f" Wall time {seconds / 60:.1f} min." if seconds else ""), "",
             "items/s: median over rounds; p50/p99: per-request latency in ms over every round's requests. Sides: "
             "in-process = N threads calling the model bundle's embed (what a library user gets); gRPC = client → "
             f"Serve proxy → Encoder ingress with dynamic batching (max_batch_size={batch_size}, 5 ms wait); "
             "max_batch_size=1 = the same app with batching off. Batch = mean requests per model call. CPU ms/item = "
             "CPU time of this process and the Ray cluster it started (proxy, replica, raylet...) during the side's "
             "rounds ÷ items (median over rounds): the side's cost, whatever share of the cores other work took. "
             f"Target: gRPC ≥ {TARGET:.2f}× in-process at {' and '.join(map(str, TARGET_CLIENTS))} clients.", ""]
    for m, sides in s.items():
        lines += [f"## {m}", ""]
        rows, latency = [], []
        for c, g in sides["grpc"].items():
            local, b1 = sides.get("in-process", {}).get(c), sides.get("grpc-b1", {}).get(c)
            ratio = v["ratios"][m].get(c, {})
            rows.append([c, local["items_s"] if local else "-", g["items_s"],
                         f"{ratio['grpc_vs_in_process']:.2f}" if "grpc_vs_in_process" in ratio else "-",
                         b1["items_s"] if b1 else "-", f"{ratio['batching_gain']:.2f}" if "batching_gain" in ratio else "-",
                         f"{g['batch']:.1f}" if g["batch"] else "-", f"{b1['batch']:.1f}" if b1 and b1["batch"] else "-",
                         " / ".join(_cpu(x) for x in (local, g, b1)), ", ".join(f"{x:.0f}" for x in g["rounds"])])
            latency.append([c, _lat(local), _lat(g), _lat(b1)])
        lines += report.table(["clients", "in-process items/s", "gRPC items/s", "gRPC ÷ in-process",
                               "max_batch_size=1 items/s", "batching gain", "batch", "batch (max 1)",
                               "CPU ms/item: in-process / gRPC / max 1", "gRPC rounds items/s"], rows)
        lines += ["", *report.table(["clients", "in-process p50 / p99 ms", "gRPC p50 / p99 ms",
                                     "max_batch_size=1 p50 / p99 ms"], latency), ""]
    if single:
        rates, ratios = single["rates"], round_ratios(single)
        lines += [f"## One client, {single['captions']} captions", "",
                  f"One caller with a large input: the model bundle's embed in this process, {single['batch']} captions "
                  f"a call, against one `AsyncClient.encode_text` sending chunks of {single['batch']} with up to "
                  f"{single['in_flight']} on the wire at once (grpc.aio), both back to back in each round (which goes first "
                  "alternating); items/s, median over rounds. The ratio is taken round by round, then its median over "
                  f"rounds (Target: ≥ {ONE_CLIENT_TARGET:.2f}×).", "",
                  *report.table(["side", "items/s", "rounds items/s"],
                                [[side, statistics.median(r), ", ".join(f"{x:.0f}" for x in r)] for side, r in rates.items()]
                                + [["AsyncClient ÷ in-process", f"{statistics.median(ratios):.2f}",
                                    ", ".join(f"{x:.2f}" for x in ratios)]]),
                  "", f"AsyncClient ÷ in-process: {statistics.median(ratios):.2f}× (median of the rounds' ratios, "
                  f"{min(ratios):.2f}-{max(ratios):.2f}).", ""]
    if note:
        lines += [note, ""]
    png = plot(s, out.with_suffix(".png"))
    lines += [f"![items/s and p99 latency against concurrent clients]({png.name})", "",
              *report.targets(out, checks(results, single))]
    return report.write(out, lines)


def _cpu(cell: dict | None) -> str:
    return f"{cell['cpu_ms']:.1f}" if cell and cell.get("cpu_ms") is not None else "-"


def _lat(cell: dict | None) -> str:
    return f"{cell['p50']:.0f} / {cell['p99']:.0f}" if cell else "-"


def plot(summary: dict, path: Path) -> Path:
    """items/s (left) and p99 latency (right) against clients, one line per side and modality (bare Figure, Agg)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    rate_ax, p99_ax = fig.subplots(1, 2)
    colours = {"in-process": "tab:blue", "grpc": "tab:orange", "grpc-b1": "tab:grey"}
    for k, (m, sides) in enumerate(summary.items()):
        for side, levels in sides.items():
            xs = sorted(levels)
            style = dict(color=colours[side], marker="os^"[k % 3], linestyle=["-", "--", ":"][k % 3],
                         label=f"{m}: {SIDES[side]}")
            rate_ax.plot(xs, [levels[c]["items_s"] for c in xs], **style)
            p99_ax.plot(xs, [levels[c]["p99"] for c in xs], **style)
    for ax, ylabel in ((rate_ax, "items/s (median over rounds)"), (p99_ax, "p99 request latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    p99_ax.set_yscale("log")
    rate_ax.legend(fontsize=7)
    fig.suptitle("Encoding: in-process vs gRPC (dynamic batching) vs gRPC max_batch_size=1")
    return report.save_figure(fig, path)


if __name__ == "__main__":
    from clipstream.settings import configure_process

    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
