"""Serving under load and faults, and the table of every fault and bad input with its observed outcome.

    clipstream bench reliability [--clients 16] [--seconds 60] [--replicas 2] [--no-suite]

Starts the real app (`clipstream serve`'s path: local Ray, loopback gRPC, an API key) on a two-task synthetic
stream with two registered versions, then drives `--clients` concurrent clients (the shipped Python client,
its gRPC retry policy the only retry) with mixed EncodeText, EncodeImage, text and image Search:
1. `--seconds` of load alone: requests, failures, p50/p99 per call;
2. the same load while a promotion to the second version reindexes and switches the gallery, and an Encoder
   replica is killed (SIGKILL through Ray): failures, and every response checked for a mixed generation or a
   version it did not use.
Then, in a checkout, runs the fault and bad-input suite (`tests/reliability`, pytest) and lists every case
with its outcome. Writes benchmarks/results/reliability.md.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from clipstream.benchmarks import report
from clipstream.services.client import Client

KINDS = ("encode_text", "encode_image", "search_text", "search_image")


def drive(client_factory: Callable[[], Client], texts: Sequence[str], images: Sequence[bytes], *, clients: int = 16,
          seconds: float = 60.0, events: Sequence[tuple[float, str, Callable[[], object]]] = ()) -> dict:
    """`clients` threads calling in turn every kind of RPC for `seconds` (and until every event has run); events
    (at_s, name, fn) run one after another in their own thread at their offsets. Returns counts, failures,
    latencies per kind, the versions seen, responses that mixed generations or versions, and the events' timings."""
    stop, lock = threading.Event(), threading.Lock()
    log: list[tuple] = []  # (kind, client, seconds, version)
    failures: list[str] = []
    incoherent: list[str] = []
    done_events: list[tuple[str, float, float, str]] = []

    def call(client: Client, kind: str, i: int):
        if kind == "encode_text":
            return client.encode_text([texts[i % len(texts)]])[1]
        if kind == "encode_image":
            return client.encode_image([images[i % len(images)]])[1]
        hits = (client.search(text=texts[i % len(texts)], k=5) if kind == "search_text"
                else client.search(image=images[i % len(images)], k=5))
        versions = {h["query_model_version"] for h in hits}
        if len({h["index_generation"] for h in hits}) > 1 or len(versions) > 1 or \
                {h["model_version"] for h in hits} - versions:  # hits made by another encoder than the query's
            with lock:
                incoherent.append(f"{kind}: {[(h['model_version'], h['index_generation']) for h in hits]} "
                                  f"for query v{versions}")
        return versions.pop() if versions else ""

    def worker(me: int):
        with client_factory() as client:
            i = me
            while not stop.is_set():
                kind = KINDS[i % len(KINDS)]
                tic = time.perf_counter()
                try:
                    version = call(client, kind, i)
                    with lock:
                        log.append((kind, me, time.perf_counter() - tic, version, time.monotonic()))
                except Exception as exc:  # any failure is what this measures
                    rpc = callable(getattr(exc, "code", None)) and callable(getattr(exc, "details", None))  # a gRPC error
                    code, details = (exc.code(), exc.details()) if rpc else (type(exc).__name__, exc)
                    with lock:
                        failures.append(f"{kind} at {time.monotonic() - start:.1f} s (took {time.perf_counter() - tic:.1f} s): "
                                        f"{code}: {details}"[:300])
                i += 1

    def run_events(start: float):
        for at_s, name, fn in events:
            time.sleep(max(0.0, start + at_s - time.monotonic()))
            tic = time.monotonic()
            try:
                outcome = str(fn() or "done")
            except Exception as exc:
                outcome = f"FAILED: {type(exc).__name__}: {exc}"[:300]
            done_events.append((name, tic - start, time.monotonic() - tic, outcome))

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    eventer = threading.Thread(target=run_events, args=(start,), daemon=True)
    eventer.start()
    time.sleep(seconds)
    eventer.join()
    stop.set()
    for t in threads:
        t.join(timeout=120)
    elapsed = time.monotonic() - start
    latency = defaultdict(list)
    for kind, _, seconds_, _, _ in log:
        latency[kind].append(seconds_)
    per_client = defaultdict(list)
    for kind, me, _, version, _ in log:
        if kind.startswith("search"):
            per_client[me].append(version)
    return {"seconds": elapsed, "requests": len(log), "failures": failures, "incoherent": incoherent,
            "events": done_events, "versions": sorted({v for *_, v, _ in log if v}),
            "per_client_search_versions": dict(per_client),
            "latency_ms": {k: {"n": len(v), "p50": 1000 * float(np.percentile(v, 50)),
                               "p99": 1000 * float(np.percentile(v, 99))} for k, v in sorted(latency.items())}}


def kill_replica(app: str, deployment: str = "Encoder") -> str:
    """SIGKILL one replica of `deployment` in application `app` (Ray kills its worker process; Serve starts a
    replacement)."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#"))
    if not names:
        raise RuntimeError(f"no replica of {app}/{deployment} is running")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return f"killed {names[0].rpartition('#')[2]} of {len(names)}"


def png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def format_load(title: str, result: dict) -> list[str]:
    lines = [f"### {title}", "",
             f"{result['requests']} requests in {result['seconds']:.0f} s, **{len(result['failures'])} failed**, "
             f"{len(result['incoherent'])} responses mixing generations or versions; versions answering: "
             f"{', '.join('v' + v for v in result['versions']) or '-'}", "",
             "| call | requests | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['n']} | {v['p50']:.1f} | {v['p99']:.1f} |" for k, v in result["latency_ms"].items()]
    if result["events"]:
        lines += ["", "| during the load | at s | took s | outcome |", "|---|---:|---:|---|"]
        lines += [f"| {name} | {at:.1f} | {took:.1f} | {outcome} |" for name, at, took, outcome in result["events"]]
    for failure in result["failures"][:5] + result["incoherent"][:5]:
        lines.append(f"- {failure}")
    return lines + [""]


def suite(repo: Path) -> list[str]:
    """Run tests/reliability and list every case with its outcome (pytest's own report, one line per case)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "--no-header", "-p", "no:cacheprovider",
                          str(repo / "tests" / "reliability")], cwd=repo, capture_output=True, text=True)
    rows = []
    for line in out.stdout.splitlines():
        status, _, case = line.partition(" ")
        if status in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS") and "::" in case:
            module, _, name = case.partition("::")
            rows.append(f"| {Path(module).stem.removeprefix('test_')} | {name.split(' - ')[0]} | {status} |")
    return ["| suite | case (the documented outcome is the test's assertion) | observed |", "|---|---|---|", *rows]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--no-suite", action="store_true", help="skip running tests/reliability")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "reliability.md")
    args = report.parse(parser, argv)
    load = measure(args.clients, args.seconds, args.replicas)
    lines = ["# Reliability: serving under load and faults, every fault and bad input", "",
             f"`clipstream bench reliability --clients {args.clients} --seconds {args.seconds:g} --replicas "
             f"{args.replicas}` on {platform.node() or 'this machine'} ({os.cpu_count()} cores, {platform.machine()}).", ""]
    lines += format_load(f"{args.clients} clients, no faults", load["steady"])
    lines += format_load(f"{args.clients} clients during a promotion (reindex switch) and an Encoder replica kill",
                         load["faults"])
    repo = Path(__file__).resolve().parents[1]
    if not args.no_suite and (repo / "tests" / "reliability").is_dir():
        lines += ["## Faults and bad input (tests/reliability)", "", *suite(repo), ""]
    report.shown(args.out, lines)
    print(f"\nwritten {args.out}")


def measure(clients: int, seconds: float, replicas: int) -> dict:
    """The two load phases on a fresh home (a temp dir), the app started as `clipstream serve` starts it."""
    import tempfile

    from ray import serve

    from clipstream.promotion import promote
    from clipstream.runtime import free_port
    from clipstream.services import app
    from clipstream.settings import Settings
    from clipstream.training.data.synth import synthesize
    from clipstream.training.data.task import Task

    with tempfile.TemporaryDirectory(prefix="bench-reliability-") as tmp:
        root = Path(tmp)
        (root / "key").write_text("bench-key\n")
        settings = Settings(home=root / "home", grpc_port=free_port(), api_key_file=root / "key", serve_replicas=replicas,
                            serve_encoder_cpus=0, serve_search_cpus=0, index_policy="reindex").ensure_dirs()
        dirs = synthesize(root / "data", tasks=2, seed=0, train_pairs=160, test_per_task=64, digits=False, progress=False)
        v1 = register_untrained(settings, 1, dirs[:1])
        v2 = register_untrained(settings, 2, dirs, parent=v1)
        promote(settings, v1)
        app.serve(settings)
        try:
            rows = [r for d in dirs for r in Task.load(d).check("test").rows]
            texts = [r["caption"] for r in rows]
            images = [(Task.load(dirs[0]).root / r["image"]).read_bytes() for r in Task.load(dirs[0]).check("test").rows]
            factory = lambda: Client(f"127.0.0.1:{settings.grpc_port}", api_key="bench-key")  # noqa: E731
            steady = drive(factory, texts, images, clients=clients, seconds=seconds)
            faults = drive(factory, texts, images, clients=clients, seconds=seconds, events=[
                (seconds * 0.1, f"promote v{v2} (reindex: new generation, then the switch)",
                 lambda: f"production v{promote(settings, v2)['to_version']}"),
                (seconds * 0.5, "SIGKILL an Encoder replica", lambda: kill_replica(settings.serve_app))])
        finally:
            serve.shutdown()
    return {"steady": steady, "faults": faults}


def register_untrained(settings, seed: int, task_dirs, parent: str = "") -> str:
    """A version made without training (a random tiny open_clip model) whose lineage is `task_dirs`: serving and
    indexing cost the same whatever the weights."""
    import json

    import torch

    from clipstream import models
    from clipstream.registry import MANIFEST, Registry
    from clipstream.training.data.task import Task
    from clipstream.training.methods.state import STATE_FILE, save_state

    torch.manual_seed(seed)
    tasks = [Task.load(d) for d in task_dirs]
    lineage = [{"task": t.name, "path": str(t.root), "data_sha": t.data_sha()} for t in tasks]
    folder = settings.home / f"export-{seed}" / "checkpoint"
    models.export(models.create("clipstream-vit-tiny"), folder)
    save_state({}, folder / STATE_FILE)
    (folder / MANIFEST).write_text(json.dumps({"lineage": lineage, "matrix": {}}))
    tags = {"task": tasks[-1].name, "task_index": str(len(tasks) - 1), "method": "none", "parent_version": parent,
            "data_sha": lineage[-1]["data_sha"]}
    registry = Registry(settings)
    with registry.run(f"bench-reliability-{seed}", tags) as run_id:
        registry.log(run_id).log_metrics({"known/AA": 50.0, "known/forgetting": 0.0})
        return registry.register(folder, tags, run_id=run_id)


if __name__ == "__main__":
    from clipstream.settings import configure_process

    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
