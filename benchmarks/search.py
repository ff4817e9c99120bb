"""Vector search and the Search RPC at 10k, 100k and 1M stored vectors on the embedded Qdrant Edge index,
against exact numpy search on the same vectors.

    clipstream bench search [--sizes 10000,100000,1000000] [--append-sizes 10000,100000] [--tasks 10]
                            [--queries 300] [--uniform-size 100000] [--rpc-size 100000] [--rpc-queries 200]
                            [--arch clipstream-vit-small] [--extra-arch ViT-B-32 --extra-sizes 100000]
                            [--compact-segments N]

For each size N, a gallery of N stored vectors, N/2 images and their N/2 captions, in the embedding dimension of
`--arch` (any open_clip architecture by name), and at each of `--extra-sizes` once more in `--extra-arch`'s (a real
CLIP's, such as ViT-B-32's 512, beside a small model's), is written to an EdgeIndex by one reindex (one segment per
modality for every task), and for the sizes in `--append-sizes` once more task by task (`--tasks` tasks of N/2/tasks pairs: the no-reindex policy with compaction
off, one segment per task and modality), measured again after `compact` merged those segments, and built a third
time as the default policy serves it at its most segments (the first tasks merged, the last `--compact-segments`
appended after them); the build and compaction times are recorded. The vectors are clustered as a CLIP gallery is:
each task around a direction of its own, each class (about 50 pairs) around a direction near its task's, each image
near its class, each caption near its image plus a modality gap that every caption shares. Queries are the captions
of random pairs (text → image, k=10: a query searches the N/2 images), searched task-known (within the pair's task)
and task-unknown (one ranking over every task), one query at a time, by the index and by exact numpy search (a
float32 matrix-vector product and a top-10 selection over the same unit vectors, on one BLAS thread); both are
timed per query on the same queries. recall@10 = the share of the exact top 10 that the index returns. At
`--uniform-size` (when it is one of the sizes) the same is measured once more with uniform random unit vectors, the
hardest case for an approximate index.

The Search RPC (a text query → hits: client → Serve gRPC proxy → Encoder ingress → Search, which encodes the
text with a real `--arch` model through the Encoder and ranks the gallery) is timed at `--rpc-size` (when it is
one of the sizes) on that size's gallery, pinned to the served model's version, task-known and task-unknown.
The gallery's vectors do not come from that model, so the hits mean nothing: only the latency counts.

Targets (issue 15): recall@10 ≥ 0.99 of exact, vector-search p99 ≤ 5 ms at 100k and ≤ 20 ms at 1M, task-known
and task-unknown. Writes benchmarks/results/search.md and search.png (latency against size, with the targets).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from clipstream.benchmarks import report

K = 10
TARGET_RECALL = 0.99
TARGET_P99_MS = {100_000: 5.0, 1_000_000: 20.0}  # vector-search p99 at these sizes
CLASS_SIZE = 50  # pairs per class of the clustered galleries
MODES = ("known", "unknown")
# the layouts a p99 target applies to: what clipstream serves. "append" (compaction off, index_compact_segments 0)
# is reported beside them: its task-unknown cost grows with the number of appended tasks, by design
SERVED_LAYOUTS = ("reindex", "policy", "compacted")


def default_compact_segments() -> int:
    """Settings' index_compact_segments: how many appended segments the default policy lets stand."""
    from clipstream.settings import Settings

    return Settings.model_fields["index_compact_segments"].default


def embed_dim(arch: str) -> int:
    from clipstream import models

    return int(models.architecture(arch)["embed_dim"])


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def synthetic_gallery(n: int, tasks: int, dim: int, kind: str = "clustered", seed: int = 0,
                      version: str = "1") -> list:
    """`tasks` TaskVectors of about n/tasks pairs each, unit float32 vectors (see the module docstring)."""
    from clipstream.index import TaskVectors

    rng = np.random.default_rng(seed)
    gap = _unit(rng.standard_normal(dim))  # the modality gap: every caption is shifted the same way
    noise = 1 / math.sqrt(dim)  # a standard normal vector times this has about unit norm
    gallery = []
    for t in range(tasks):
        m = n // tasks + (t < n % tasks)
        if kind == "uniform":
            image = _unit(rng.standard_normal((m, dim), dtype=np.float32))
            text = _unit(rng.standard_normal((m, dim), dtype=np.float32))
        elif kind == "clustered":
            direction = _unit(rng.standard_normal(dim))
            centres = _unit(direction + noise * rng.standard_normal((max(1, m // CLASS_SIZE), dim)))
            image = _unit(centres[rng.integers(0, len(centres), m)] + noise * rng.standard_normal((m, dim),
                                                                                                   dtype=np.float32))
            text = _unit(image + 0.8 * noise * rng.standard_normal((m, dim), dtype=np.float32) + 0.5 * gap)
        else:
            raise ValueError(f"kind must be 'clustered' or 'uniform', got {kind!r}")
        gallery.append(TaskVectors(task=f"t{t:02d}", task_index=t, model_version=version,
                                   item_ids=[f"t{t:02d}-{i}" for i in range(m)], image=image, text=text,
                                   captions=[f"t{t:02d} {i}" for i in range(m)]))
    return gallery


def build(root: Path, gallery: list, name: str = "bench", layout: str = "reindex", hnsw_ef: int = 0,
          compact_segments: int = 0):
    """An EdgeIndex at root holding `gallery`, its segments searched with `hnsw_ef` (0: the index's rule):
    "reindex": one reindex, one segment per modality for every task; "append": every task appended in turn, one
    segment per task and modality (compaction off); "policy": the most segments the default no-reindex policy
    serves, the first tasks appended and merged by `compact`, the last `compact_segments` appended after them
    (compact_segments + 1 segments per modality: an append that leaves more than compact_segments is served while
    the indexing job merges them). (index, seconds, seconds of each append)."""
    from clipstream.index import EdgeIndex

    index, appends = EdgeIndex(root, name=name, hnsw_ef=hnsw_ef), []
    if layout == "reindex":
        tic = time.perf_counter()
        index.reindex(gallery)
        return index, time.perf_counter() - tic, []
    merged = len(gallery) - compact_segments if layout == "policy" and compact_segments else 0
    merge_s = 0.0
    for i, tv in enumerate(gallery):
        tic = time.perf_counter()
        index.append(tv)
        appends.append(time.perf_counter() - tic)
        if i + 1 == merged and merged > 1:
            tic = time.perf_counter()
            index.compact()
            merge_s = time.perf_counter() - tic
    return index, sum(appends) + merge_s, appends


def queries_for(gallery: list, count: int, seed: int = 1) -> list[tuple[int, np.ndarray]]:
    """(task position, caption vector) of `count` random pairs, tasks weighted by their size."""
    rng = np.random.default_rng(seed)
    sizes = np.array([len(tv.item_ids) for tv in gallery])
    rows = rng.integers(0, sizes.sum(), count)
    starts = np.cumsum(sizes) - sizes
    out = []
    for r in rows.tolist():
        t = int(np.searchsorted(starts, r, side="right") - 1)
        out.append((t, np.asarray(gallery[t].text[r - starts[t]], dtype=np.float32)))
    return out


def measure(index, gallery: list, queries: list[tuple[int, np.ndarray]], k: int = K) -> dict:
    """mode -> {"index_ms", "exact_ms": per-query latencies, "recall": per-query recall@k}, over the same queries."""
    images = np.ascontiguousarray(np.concatenate([tv.image for tv in gallery]), dtype=np.float32)
    ids = np.array([i for tv in gallery for i in tv.item_ids])
    bounds = np.cumsum([0] + [len(tv.item_ids) for tv in gallery])
    out = {}
    for mode in MODES:
        for t in range(len(gallery)):  # warm-up: every segment opened, caches filled
            index.search(queries[0][1], "image", gallery[t].task if mode == "known" else None, k)
        # the index's queries back to back, then exact search's: interleaved, each would find the caches full of
        # the other's data (numpy streams the whole gallery per query), which a search replica does not see
        index_ms, exact_ms, recall, found = [], [], [], []
        for t, q in queries:
            tic = time.perf_counter()
            hits = index.search(q, "image", gallery[t].task if mode == "known" else None, k)
            index_ms.append(1000 * (time.perf_counter() - tic))
            found.append({h.item_id for h in hits})
        for (t, q), hits in zip(queries, found):
            lo, hi = (bounds[t], bounds[t + 1]) if mode == "known" else (0, len(ids))
            tic = time.perf_counter()
            scores = images[lo:hi] @ q
            top = np.argpartition(-scores, k)[:k] if hi - lo > k else np.arange(hi - lo)
            top = top[np.argsort(-scores[top])]
            exact_ms.append(1000 * (time.perf_counter() - tic))
            recall.append(len(hits & set(ids[lo + top].tolist())) / len(top))
        out[mode] = {"index_ms": index_ms, "exact_ms": exact_ms, "recall": recall}
    return out


def summary(cell: dict) -> dict:
    return {"recall": float(np.mean(cell["recall"])), "min_recall": float(np.min(cell["recall"])),
            **{f"{side}_{q}": float(np.percentile(cell[f"{side}_ms"], q)) for side in ("index", "exact") for q in (50, 99)}}


def run_size(n: int, tasks: int, dim: int, count: int, kind: str, root: Path, name: str = "bench",
             version: str = "1", layout: str = "reindex", hnsw_ef: int = 0, compact_segments: int = 0) -> list[dict]:
    """Build a gallery of n stored vectors (n/2 pairs) of `dim` dimensions under root in `layout` (see `build`),
    measure it, drop the vectors (the index stays on disk): one result {"n", "dim", "kind", "layout", "tasks", "segments", "build_s",
    "appends_s", "load", mode: summary}; for layout "append" a second one, measured once more after `compact`
    merged the appended segments (layout "compacted", its "build_s" the compaction's seconds)."""
    gallery = synthetic_gallery(n // 2, tasks, dim, kind, version=version)
    index, seconds, appends = build(root, gallery, name, layout, hnsw_ef, compact_segments)
    queries, results = queries_for(gallery, count), []
    try:
        for step in [layout] + (["compacted"] if layout == "append" else []):
            if step == "compacted":
                tic = time.perf_counter()
                index.compact()
                seconds, appends = time.perf_counter() - tic, []
            load = os.getloadavg()[0]
            measured = measure(index, gallery, queries)
            load = (load + os.getloadavg()[0]) / 2  # the machine's 1-minute load average while measuring
            print(f"[{kind} {n} {dim}-d {step}] {'compaction' if step == 'compacted' else 'build'} {seconds:.1f} s; " + "; ".join(
                f"{m}: recall {np.mean(c['recall']):.4f}, index p50/p99 {np.percentile(c['index_ms'], 50):.2f}/"
                f"{np.percentile(c['index_ms'], 99):.2f} ms, exact p50/p99 {np.percentile(c['exact_ms'], 50):.2f}/"
                f"{np.percentile(c['exact_ms'], 99):.2f} ms" for m, c in measured.items()), flush=True)
            results.append({"n": n, "dim": dim, "kind": kind, "layout": step, "tasks": tasks, "segments": index.segments(),
                            "build_s": seconds, "appends_s": appends, "load": load, **{m: summary(c) for m, c in measured.items()}})
    finally:
        index.close()
    return results


def serving(tmp: Path, arch: str):
    """Settings of an app to serve (its own home, a free port, a local Ray) and the `arch` model registered
    there as the production version: (settings, version)."""
    from clipstream.benchmarks.grpc_encode import register
    from clipstream.runtime import free_port
    from clipstream.settings import Settings

    settings = Settings(home=tmp / "rpc" / "home", grpc_port=free_port(), ray_address=None, serve_encoder_cpus=0,
                        serve_search_cpus=0).ensure_dirs()
    return settings, register(settings, arch)


def rpc(settings, version: str, n: int, tasks: int, count: int) -> dict:
    """Search RPC latency (ms per call, p50/p99), task-known and task-unknown, on the gallery already indexed
    under `settings` (n vectors over `tasks` tasks, pinned to `version`)."""
    from ray import serve

    from clipstream.services import app
    from clipstream.services.client import Client

    words = "a small large red blue green striped dotted cup lamp chair bird on the left right top".split()
    rng = np.random.default_rng(2)
    texts = [" ".join(rng.choice(words, 6)) for _ in range(count)]
    out = {"n": n}
    try:
        target = app.serve(settings, timeout_s=180)
        with Client(target, timeout_s=60) as client:
            for mode in MODES:
                task = lambda i: f"t{i % tasks:02d}" if mode == "known" else ""  # noqa: E731
                for i, text in enumerate(texts[:5]):  # warm-up: model loaded, shards opened, connections made
                    client.search(text=text, task=task(i), k=K)
                ms = []
                for i, text in enumerate(texts):
                    tic = time.perf_counter()
                    hits = client.search(text=text, task=task(i), k=K)
                    ms.append(1000 * (time.perf_counter() - tic))
                    assert len(hits) == K and hits[0]["model_version"] == version
                out[mode] = {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}
                print(f"[rpc {n} {mode}] p50/p99 {out[mode]['p50']:.1f}/{out[mode]['p99']:.1f} ms", flush=True)
    finally:
        serve.shutdown()
    return out


def checks(results: list[dict]) -> list[dict]:
    """recall@K ≥ TARGET_RECALL at every clustered size and mode, index p99 ≤ TARGET_P99_MS at the sizes named there
    (report.check dicts, for report.targets)."""
    out = []
    for r in results:
        if r["kind"] != "clustered":
            continue
        for mode in MODES:
            out.append(report.check(f"recall@{K} at {_size(r['n'])} ({r['dim']}-d), task-{mode}{_built(r)}", r[mode]["recall"],
                                    at_least=TARGET_RECALL, fmt="{:.4f}"))
        for mode in MODES if r["n"] in TARGET_P99_MS and r.get("layout", "reindex") in SERVED_LAYOUTS else ():
            out.append(report.check(f"vector search p99 ms at {_size(r['n'])} ({r['dim']}-d), task-{mode}{_built(r)}",
                                    r[mode]["index_99"],
                                    at_most=TARGET_P99_MS[r["n"]], fmt="{:.2f}"))
    return out


def _built(r: dict) -> str:
    return {"append": ", appended, compaction off", "compacted": ", appended then compacted",
            "policy": f", appended under the default policy ({r.get('segments', '?')} segments)"}.get(r.get("layout"), "")


def _size(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)


def search_report(results: list[dict], rpc_result: dict | None, out: Path, command: str, device: str,
                  seconds: float | None = None, hnsw_ef: int = 0,
                  compact_segments: int | None = None) -> str:
    """The tables to `out` and latency against size to `out`.png; returns the markdown."""
    from clipstream.index import HNSW_EF, HNSW_EF_CONSTRUCT, HNSW_EF_POINTS, HNSW_FROM_KB, HNSW_M, OVERSAMPLING

    out = Path(out)
    if compact_segments is None:
        compact_segments = default_compact_segments()
    lines = ["# Vector search on the embedded Qdrant Edge index vs exact numpy search", "",
             f"Reproduce: `{command}`", "",
             f"Device: {device}." + (f" Wall time {seconds / 60:.1f} min." if seconds else ""), "",
             "N = stored vectors: N/2 images and their N/2 captions, in d dimensions (a model's embed_dim), spread evenly "
             f"over the tasks; queries are captions (text → image: each searches the N/2 images), k = {K}, one at a time. "
             "Known = ranked within the query's task, unknown = one ranking over every task. p50/p99 in ms per "
             "query; exact = numpy float32 matrix-vector product + top-k over the same unit vectors, measured after the "
             "index's queries (not interleaved: each would evict the other's data from the caches). Layout reindex = "
             "the gallery written by one reindex: one segment per modality holds every task (task-known filters it "
             "by the payload-indexed task); append = every task appended in turn (no-reindex) with compaction off "
             "(index_compact_segments 0): one segment per task and modality, and task-unknown queries each and merges "
             "their top-k, so its cost grows with the number of tasks (no p99 target: clipstream does not serve this "
             "by default); compacted = that appended index after `compact` merged its segments into one per modality; "
             "policy = the most segments the default no-reindex policy serves (index_compact_segments = "
             f"{compact_segments}): the first tasks appended and merged, the last {compact_segments} appended after "
             "them, as served while the indexing job merges an append that left more than "
             f"{compact_segments}. Segments = per modality. Build = that write, both modalities (for "
             "compacted: the compaction). Load = the machine's 1-minute load average while measuring (other work shares the cores: "
             f"a p99 is only as good as the machine is quiet). A segment holding more than {HNSW_FROM_KB} KB of "
             f"vectors has an HNSW graph (m={HNSW_M}, ef_construct={HNSW_EF_CONSTRUCT}; searched with "
             + (f"hnsw_ef={hnsw_ef} for every segment (--hnsw-ef)) over" if hnsw_ef else
                f"hnsw_ef={HNSW_EF}, and {HNSW_EF} × points / {HNSW_EF_POINTS} past {HNSW_EF_POINTS} points) over") +
             f" int8-quantised vectors, {OVERSAMPLING:g}× oversampled and rescored in float32 "
             "(scores are exact cosines); smaller segments are scanned exactly. "
             f"Targets: recall@{K} ≥ {TARGET_RECALL}, p99 ≤ " +
             " and ".join(f"{t:g} ms at {_size(n)}" for n, t in TARGET_P99_MS.items()) + ".", ""]
    rows = []
    for r in results:
        for mode in MODES:
            c = r[mode]
            target = TARGET_P99_MS.get(r["n"]) if r["kind"] == "clustered" and \
                r.get("layout", "reindex") in SERVED_LAYOUTS else None
            rows.append([_size(r["n"]), r["dim"], r["kind"], r.get("layout", "reindex"), r["tasks"], r.get("segments", "-"), mode,
                         f"{c['recall']:.4f}", f"{c['min_recall']:.1f}",
                         f"{c['index_50']:.2f}", f"{c['index_99']:.2f}", f"{c['exact_50']:.2f}", f"{c['exact_99']:.2f}",
                         f"{c['exact_50'] / c['index_50']:.1f}×", f"≤ {target:g}" if target else "-",
                         f"{r['build_s']:.1f}" if mode == "known" else "", f"{r['load']:.1f}" if "load" in r else "-"])
    lines += report.table(["N", "d", "vectors", "layout", "tasks", "segments", "mode", f"recall@{K}", "worst query",
                           "index p50", "index p99", "exact p50", "exact p99", "exact ÷ index (p50)", "p99 target", "build s", "load"], rows)
    if rpc_result:
        lines += ["", f"## Search RPC at {_size(rpc_result['n'])} (text → hits, through gRPC and the Encoder)", "",
                  *report.table(["mode", "p50 ms", "p99 ms"],
                                [[m, f"{rpc_result[m]['p50']:.1f}", f"{rpc_result[m]['p99']:.1f}"] for m in MODES])]
    png = plot(results, out.with_suffix(".png"))
    lines += ["", f"![p50 and p99 search latency against stored vectors]({png.name})", "", *report.targets(out, checks(results))]
    return report.write(out, lines)


def plot(results: list[dict], path: Path) -> Path:
    """p50 and p99 latency against N (log-log), index and exact, per mode, with the p99 targets, a panel per
    dimension (bare Figure, Agg)."""
    from matplotlib.figure import Figure

    dims = sorted({r["dim"] for r in results})
    fig = Figure(figsize=(8 * len(dims), 5))
    for i, dim in enumerate(dims):
        clustered = [r for r in results if r["kind"] == "clustered" and r.get("layout", "reindex") == "reindex"
                     and r["dim"] == dim]
        _panel(fig.add_subplot(1, len(dims), i + 1), clustered, dim)
    return report.save_figure(fig, path)


def _panel(ax, clustered: list[dict], dim: int) -> None:
    xs = [r["n"] for r in clustered]
    for mode, colour in zip(MODES, ("tab:blue", "tab:orange")):
        for side, style in (("index", "-"), ("exact", ":")):
            for q, marker in ((99, "o"), (50, "x")):
                ax.plot(xs, [r[mode][f"{side}_{q}"] for r in clustered], style, marker=marker, color=colour,
                        alpha=1.0 if side == "index" else 0.6,
                        label=f"{'Edge index' if side == 'index' else 'exact numpy'} {mode} p{q}")
    for n, limit in TARGET_P99_MS.items():
        ax.plot([n], [limit], "r_", markersize=30, markeredgewidth=2)
        ax.annotate(f"p99 target {limit:g} ms", (n, limit), textcoords="offset points", xytext=(-40, 8), color="r",
                    fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("stored vectors (N: N/2 images searched by a text query)")
    ax.set_ylabel("latency per query (ms)")
    ax.set_title(f"Vector search, {dim}-d, k={K}: embedded Qdrant Edge vs exact numpy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated N (stored vectors: N/2 pairs)")
    p.add_argument("--tasks", type=int, default=10, help="tasks each gallery is spread over")
    p.add_argument("--queries", type=int, default=300, help="queries per size and mode")
    p.add_argument("--append-sizes", default="10000,100000",
                   help="of --sizes, those also measured with the gallery appended task by task (a segment per task), "
                        "compacted, and as the default policy serves it at its most segments")
    p.add_argument("--compact-segments", type=int, default=default_compact_segments(), metavar="N",
                   help="the policy layout's index_compact_segments (default: Settings' default)")
    p.add_argument("--uniform-size", type=int, default=100_000,
                   help="also measure uniform random vectors at this N, when it is one of --sizes (0: never)")
    p.add_argument("--rpc-size", type=int, default=100_000,
                   help="time the Search RPC at this N, when it is one of --sizes (0: never)")
    p.add_argument("--rpc-queries", type=int, default=200)
    p.add_argument("--arch", default="clipstream-vit-small", help="the model (any open_clip architecture by name) "
                                                                   "whose dimension the vectors have and which encodes "
                                                                   "the RPC's queries")
    p.add_argument("--extra-arch", default="", metavar="ARCH",
                   help="also measure vectors of this model's dimension (e.g. ViT-B-32: 512) at --extra-sizes, in the "
                        "same layouts as --arch's at those sizes")
    p.add_argument("--extra-sizes", default="100000", help="comma-separated N of --extra-arch's galleries")
    p.add_argument("--hnsw-ef", type=int, default=0, metavar="N",
                   help="search every HNSW segment with this candidate list instead of the index's rule (a sweep of "
                        "recall against latency; the Search RPC's replica keeps the rule). 0: the rule")
    p.add_argument("--out", default=str(report.RESULTS / "search.md"), help="the markdown; the plot goes next to it (.png)")
    args = report.parse(p, argv)
    if args.compact_segments < 1:
        p.error("--compact-segments: at least 1 (0 is the append layout: compaction off)")
    if args.hnsw_ef < 0:
        p.error("--hnsw-ef: a candidate list length > 0 (or 0 for the index's rule)")
    dim, extra_dim = embed_dim(args.arch), embed_dim(args.extra_arch) if args.extra_arch else None
    sizes = sorted(int(s) for s in args.sizes.split(","))
    extra_sizes = sorted(int(s) for s in args.extra_sizes.split(",")) if extra_dim else []
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)  # exact search on one thread, as Qdrant scans a segment: per-query latency, not throughput
    wall = time.perf_counter()
    results, rpc_result = [], None
    with tempfile.TemporaryDirectory() as tmp:
        served = serving(Path(tmp), args.arch) if args.rpc_size in sizes else None
        for n in sizes:  # the RPC's size is indexed where its app reads, under the served version
            where = (served[0].qdrant_path, served[0].stream, served[1]) if served and n == args.rpc_size else \
                (Path(tmp) / f"clustered-{n}", "bench", "1")
            results += run_size(n, args.tasks, dim, args.queries, "clustered", *where, hnsw_ef=args.hnsw_ef)
            gc.collect()
        for n in extra_sizes:
            results += run_size(n, args.tasks, extra_dim, args.queries, "clustered", Path(tmp) / f"clustered-{n}-{extra_dim}",
                                hnsw_ef=args.hnsw_ef)
            gc.collect()
        appended = [(n, dim) for n in sizes] + [(n, extra_dim) for n in extra_sizes]
        for n, d in [(n, d) for n, d in appended if str(n) in args.append_sizes.split(",")]:
            for layout in ("append", "policy"):
                results += run_size(n, args.tasks, d, args.queries, "clustered", Path(tmp) / f"{layout}-{n}-{d}",
                                    layout=layout, hnsw_ef=args.hnsw_ef, compact_segments=args.compact_segments)
                gc.collect()
        if args.uniform_size in sizes:
            results += run_size(args.uniform_size, args.tasks, dim, args.queries, "uniform",
                                Path(tmp) / f"uniform-{args.uniform_size}", hnsw_ef=args.hnsw_ef)
            gc.collect()
        if served:
            rpc_result = rpc(*served, args.rpc_size, args.tasks, args.rpc_queries)
    seconds = time.perf_counter() - wall
    command = (f"clipstream bench search --sizes {','.join(map(str, sizes))} --append-sizes {args.append_sizes} "
               f"--tasks {args.tasks} --queries "
               f"{args.queries} --uniform-size {args.uniform_size} --rpc-size {args.rpc_size} --rpc-queries "
               f"{args.rpc_queries} --arch {args.arch}" +
               (f" --extra-arch {args.extra_arch} --extra-sizes {','.join(map(str, extra_sizes))}" if extra_dim else "") +
               (f" --hnsw-ef {args.hnsw_ef}" if args.hnsw_ef else "") +
               (f" --compact-segments {args.compact_segments}"
                if args.compact_segments != default_compact_segments() else "") +
               f" --out {args.out}")
    text = search_report(results, rpc_result, Path(args.out), command, report.device(), seconds, args.hnsw_ef,
                         args.compact_segments)
    print(text)
    found = checks(results)
    print(json.dumps({"pass": all(c["ok"] for c in found), "checks": found}))
    return text


if __name__ == "__main__":
    main()
