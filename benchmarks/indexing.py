"""`clipstream index` against an in-process encode loop over the same images; reindex and append time against the
size of the index; what a text-only change (CLL-CLIP's) saves by keeping the stored image vectors. Measured side by
side in one run, on one registered version of a real open_clip model.

    clipstream bench indexing [--pairs 2048] [--rounds 3] [--tasks 1,2,4,8] [--task-pairs 256] [--arch clipstream-vit-tiny]

(a) Throughput: vectors/s (an image and a text vector per pair) of `clipstream.indexing.index_task` (registry
    lookup, the Ray Data batch-inference job, forced for the `--pairs` gallery, and the upserts into the Edge index)
    against an in-process loop that loads the exported model and calls `embed_texts` and `embed_images` over the
    same captions and image files, with a torch thread per core and with one (the faster is the baseline: on a
    loaded machine one thread wins). The sides alternate for `--rounds` rounds; medians are compared. The first
    indexing job of the run is reported apart: its Ray workers import torch and open_clip for the first time (a
    worker process keeps those imports for the next job's actors; the in-process side paid them before its clock
    started).
(b) Index size: `--tasks` tasks of `--task-pairs` pairs each are appended one by one (no-reindex) into one index,
    and once it holds 1, 2, 4, 8... tasks they are all reindexed (every image re-embedded). Every append and
    reindex is split into embed (the gallery's vectors), store (the index's append or reindex) and other (registry,
    task data, tags).
(c) Text-only change: with the most tasks indexed, a version that kept its parent's image tower (as CLL-CLIP's
    do) reindexes them, with the stored image vectors reused and re-embedded, alternating for `--rounds` rounds.

Ray's workers run at this process's priority (RAY_worker_niceness=0, unless set) rather than Ray's default 15 lower:
on a shared machine that default measures the neighbours' load, not the pipeline. Writes
benchmarks/results/indexing.md and indexing.png.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
import yaml

from clipstream import indexing, models
from clipstream.benchmarks import report
from clipstream.index import NO_REINDEX, REINDEX, VectorIndex
from clipstream.registry import MANIFEST, Registry
from clipstream.runtime import init_ray
from clipstream.settings import Settings, configure_process
from clipstream.training.data.synth import MIN_TASK_PAIRS, P9D_SHARES, synthesize
from clipstream.training.data.task import Task
from clipstream.training.methods.state import STATE_FILE, save_state

TARGET_RATIO = 0.80  # vectors/s of `clipstream index` ÷ the in-process encode loop
FLAT = 1.5  # an append's store seconds late in the stream ÷ early (store_growth): "independent of the index size"
REUSE_AT_MOST = 0.8  # a text-only reindex with image vectors reused ÷ re-embedding them


class Clock:
    """Seconds spent embedding (a gallery's vectors, or the stored image vectors read back for reuse) and storing (the
    index's append or reindex) inside `index_task`, by wrapping those functions while `installed`."""

    def __init__(self):
        self.seconds = {"embed": 0.0, "store": 0.0}
        self._depth = {"embed": 0, "store": 0}

    def reset(self) -> dict:
        out, self.seconds = self.seconds, {"embed": 0.0, "store": 0.0}
        return out

    def _wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth[part] += 1
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[part] -= 1
                if not self._depth[part]:  # (nested: _regallery calls embed_gallery; a subclass calls super)
                    self.seconds[part] += time.perf_counter() - tic
        return timed

    @contextlib.contextmanager
    def installed(self):
        targets = [(indexing, name, "embed") for name in ("embed_gallery", "_regallery")]
        for cls in (VectorIndex, *_subclasses(VectorIndex)):
            targets += [(cls, name, "store") for name in ("append", "reindex") if name in vars(cls)]
        saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        try:
            for owner, name, part in targets:
                setattr(owner, name, self._wrap(part, getattr(owner, name)))
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)


def _subclasses(cls) -> list[type]:
    return [s for c in cls.__subclasses__() for s in (c, *_subclasses(c))]


def timed_index(clock: Clock, settings: Settings, version: str, task_dir: Path, policy, index_name: str,
                reuse_images: bool = True) -> dict:
    """One `index_task` call: {total, embed, store, other} seconds."""
    clock.reset()
    tic = time.perf_counter()
    indexing.index_task(settings, version, task_dir, policy, index_name=index_name, reuse_images=reuse_images)
    total = time.perf_counter() - tic
    parts = clock.reset()
    return {"total": total, **parts, "other": max(0.0, total - parts["embed"] - parts["store"])}


def in_process(folder: Path, captions: list[str], images: list[Path], batch: int, threads: int) -> float:
    """The baseline's seconds: load the exported model, embed every caption and image file with `threads` torch
    threads, nothing else."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tic = time.perf_counter()
        bundle = models.load_exported(folder)
        bundle.embed_texts(captions, batch)
        bundle.embed_images(images, batch)
        return time.perf_counter() - tic
    finally:
        torch.set_num_threads(before)


def register(settings: Settings, arch: str, dirs: list[Path]) -> tuple[str, str]:
    """Two versions of a real open_clip `arch` trained through `dirs`: the first, and a text-only change of it (its
    text projection moved, its manifest naming the first's image tower, as a CLL-CLIP version's does)."""
    torch.manual_seed(0)
    bundle = models.create(arch)
    lineage = [{"task": Task.load(d).name, "path": str(d)} for d in dirs]
    registry, versions = Registry(settings), []
    for i, tower in enumerate(("", "1")):
        if i:
            with torch.no_grad():
                bundle.model.text_projection.add_(0.01 * torch.randn_like(bundle.model.text_projection))
        folder = settings.home / f"export-{i}" / "checkpoint"
        models.export(bundle, folder)
        save_state({}, folder / STATE_FILE)
        (folder / MANIFEST).write_text(json.dumps({"lineage": lineage, "matrix": {}, "image_tower": tower}))
        with registry.run(f"bench-indexing-{i}", {}) as run_id:
            versions.append(registry.register(folder, {"task": lineage[-1]["task"], "task_index": len(lineage) - 1,
                                                       "method": "cllclip" if i else "finetune"}, run_id=run_id))
    assert registry.resolve(versions[1], download=False).image_tower == versions[0]
    return versions[0], versions[1]


def fewest_train_pairs(tasks: int) -> int:
    """The smallest train split `synthesize` accepts for `tasks` tasks (only their test splits are indexed)."""
    shares = [P9D_SHARES[i % len(P9D_SHARES)] for i in range(tasks)]
    return math.ceil(MIN_TASK_PAIRS * sum(shares) / min(shares)) + tasks


def gallery_task(out: Path, pairs: int, seed: int) -> Path:
    """One synthetic task whose test split has `pairs` pairs, named apart from the size tasks'."""
    folder = synthesize(out, tasks=1, seed=seed, train_pairs=MIN_TASK_PAIRS, test_per_task=pairs, digits=False,
                        held_out=False, progress=False)[0]
    meta = yaml.safe_load((folder / "task.yaml").read_text())
    meta["name"] = f"gallery-{pairs}"
    (folder / "task.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))
    return folder


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2048, help="pairs of the throughput gallery (a)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (a) and of (c), the sides alternating")
    p.add_argument("--tasks", default="1,2,4,8", help="index sizes (tasks) at which (b) reindexes; the largest is "
                                                      "how many tasks it appends")
    p.add_argument("--task-pairs", type=int, default=256, help="gallery pairs of each task of (b) and (c)")
    p.add_argument("--batch", type=int, default=64, help="the in-process loop's batch (the indexing job's default)")
    p.add_argument("--arch", default="clipstream-vit-tiny", help="the model, any open_clip architecture by name "
                                                                 "(default: what the method presets train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(report.RESULTS / "indexing.md"), help="the markdown; the plot goes next to "
                                                                              "it (.png)")
    args = report.parse(p, argv)
    models.architecture(args.arch)  # an unknown name: one line, before anything runs
    sizes = sorted({int(s) for s in args.tasks.split(",")})
    if sizes[0] < 1 or args.rounds < 1 or args.pairs < 1 or args.task_pairs < 1:
        p.error("--tasks, --rounds, --pairs and --task-pairs must be positive")
    os.environ.setdefault("RAY_worker_niceness", "0")
    wall = time.perf_counter()
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # appends measured alone: the indexing job's merge of appended segments is `bench search`'s to measure
        settings = Settings(home=tmp / "home", stream="bench-indexing", index_compact_segments=0).ensure_dirs()
        tic = time.perf_counter()
        big = gallery_task(tmp / "gallery", args.pairs, args.seed)
        dirs = synthesize(tmp / "tasks", tasks=sizes[-1], seed=args.seed, train_pairs=fewest_train_pairs(sizes[-1]),
                          test_per_task=args.task_pairs, digits=False, held_out=False, progress=False)
        v1, v2 = register(settings, args.arch, [big, *dirs])
        folder = Registry(settings).resolve(v1).folder
        setup = {"data and versions": time.perf_counter() - tic}
        tic = time.perf_counter()
        init_ray(settings)
        setup["Ray start-up"] = time.perf_counter() - tic
        rows = Task.load(big).check("test").rows
        captions, images = [str(r["caption"]) for r in rows], [Task.load(big).image(r) for r in rows]
        forced = settings.model_copy(update={"index_ray_min_rows": 0})
        clock = Clock()
        with clock.installed():
            print(f"== (a) {args.pairs} pairs: clipstream index (Ray Data) against the in-process loop", flush=True)
            cold = timed_index(clock, forced, v1, big, NO_REINDEX, "throughput-cold")
            threads = sorted({torch.get_num_threads(), 1}, reverse=True)
            local, served = {t: [] for t in threads}, []
            for r in range(args.rounds):
                for side in ([*threads, "index"] if r % 2 == 0 else ["index", *threads]):
                    if side == "index":
                        served.append(timed_index(clock, forced, v1, big, NO_REINDEX, f"throughput-{r}"))
                    else:
                        local[side].append(in_process(folder, captions, images, args.batch, side))
                print(f"[round {r}] in-process " + ", ".join(f"{local[t][-1]:.1f} s ({t} thread{'s' * (t > 1)})"
                                                            for t in threads)
                      + f"; clipstream index {served[-1]['total']:.1f} s", flush=True)
            loads.append(os.getloadavg()[0])

            print(f"== (b) {sizes[-1]} tasks of {args.task_pairs} pairs: appends, and reindexes at {sizes}", flush=True)
            appends, reindexes = [], []
            for k, task_dir in enumerate(dirs, 1):
                appends.append(timed_index(clock, settings, v1, task_dir, NO_REINDEX, "size"))
                if k in sizes:
                    reindexes.append({"tasks": k, **timed_index(clock, settings, v1, task_dir, REINDEX, "size",
                                                                reuse_images=False)})
                print(f"[{k} tasks] append {appends[-1]['total']:.1f} s"
                      + (f", reindex {reindexes[-1]['total']:.1f} s" if k in sizes else ""), flush=True)
            loads.append(os.getloadavg()[0])

            print(f"== (c) text-only change: reindex {sizes[-1]} tasks, image vectors reused and re-embedded", flush=True)
            text_only = {"reused": [], "re-embedded": []}
            for r in range(args.rounds):
                for reuse in ((True, False) if r % 2 == 0 else (False, True)):
                    text_only["reused" if reuse else "re-embedded"].append(
                        timed_index(clock, settings, v2, dirs[-1], REINDEX, "size", reuse_images=reuse))
                print(f"[round {r}] reused {text_only['reused'][-1]['total']:.1f} s, re-embedded "
                      f"{text_only['re-embedded'][-1]['total']:.1f} s", flush=True)
            loads.append(os.getloadavg()[0])
    setup["whole run"] = time.perf_counter() - wall
    results = {"pairs": args.pairs, "task_pairs": args.task_pairs, "rounds": args.rounds, "local": local,
               "served": served, "cold": cold, "appends": appends, "reindexes": reindexes, "text_only": text_only,
               "setup": setup, "loads": loads,
               "ray_min_rows": settings.index_ray_min_rows, "block_rows": indexing.BLOCK_ROWS}
    command = (f"clipstream bench indexing --pairs {args.pairs} --rounds {args.rounds} --tasks "
               f"{','.join(map(str, sizes))} --task-pairs {args.task_pairs} --batch {args.batch} --arch {args.arch} "
               f"--seed {args.seed} --out {args.out}")
    text = indexing_report(results, Path(args.out), command, report.device(f"{torch.get_num_threads()} torch threads"))
    print(text)
    print(json.dumps(summary(results)))
    return text


def summary(results: dict) -> dict:
    """The headline figures (the ratios, printed last); the baseline is the faster of the in-process loops."""
    vectors = 2 * results["pairs"]
    local = min(statistics.median(v) for v in results["local"].values())
    served = statistics.median(s["total"] for s in results["served"])
    reused = statistics.median(s["total"] for s in results["text_only"]["reused"])
    full = statistics.median(s["total"] for s in results["text_only"]["re-embedded"])
    stores = [a["store"] for a in results["appends"]]
    return {"in_process_vectors_per_s": vectors / local, "index_vectors_per_s": vectors / served,
            "ratio": local / served, "append_store_growth": store_growth(stores),
            "text_only_reused_s": reused, "text_only_reembedded_s": full, "text_only_ratio": reused / full}


def store_growth(stores: list[float]) -> float:
    """An append's store seconds late in the stream ÷ early: the median of the later half of the appends over the
    median of the earlier half, the first (which creates the index) left out. Medians, not the two end points: one
    append's store is ~0.5 s here, where a single slow sample on a busy machine moved the end-point ratio by 0.3."""
    later = stores[1:]
    if len(later) < 2:
        return 1.0
    half = len(later) // 2
    return statistics.median(later[half:]) / statistics.median(later[:half])


def _tasks(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def indexing_report(results: dict, out: Path, command: str, device: str) -> str:
    """Write the three tables, the plot and the targets of `results` to `out` (.md, .png, .json); return the text."""
    s = summary(results)
    pairs, vectors = results["pairs"], 2 * results["pairs"]
    median = lambda runs, part: statistics.median(r[part] for r in runs)  # noqa: E731
    served, best = results["served"], vectors / s["in_process_vectors_per_s"]
    seconds = lambda xs: ", ".join(f"{x:.1f}" for x in xs)  # noqa: E731
    setup = ", ".join(f"{k} {v:.0f} s" for k, v in results["setup"].items())
    lines = [
        "# Indexing: `clipstream index` against an in-process encode loop; reindex and append against the index size",
        "",
        f"Device: {device}. Reproduce: `{command}`.",
        f"Run: {setup}; 1-minute load average {' → '.join(f'{x:.1f}' for x in results['loads'])} (at the start and "
        "after each part).",
        "",
        f"## (a) Throughput: {pairs} pairs ({vectors} vectors), medians of {results['rounds']} alternating rounds",
        "",
        f"The indexing side is `index_task` on a registered version with the Ray Data job forced (blocks of "
        f"{results['block_rows']} rows, each a Ray task on one CPU with one torch thread, in worker processes that keep the model between blocks and jobs), upserts into the Edge index included; "
        f"the in-process side loads the exported model and embeds the same captions and image files, "
        f"with every core's torch thread and with one (× in-process: against the faster). embed/store/other: the indexing side's seconds in the embedding job, the "
        "index's append, and the rest (registry, task data, tags).",
        "",
        *report.table(["side", "vectors/s", "seconds", "embed s", "store s", "other s", "rounds (s)", "× in-process"], [
            *([f"in-process encode loop, {t} torch thread{'s' * (t > 1)}", f"{vectors / statistics.median(v):.0f}",
               statistics.median(v), "", "", "", seconds(v), f"{best / statistics.median(v):.2f}"]
              for t, v in results["local"].items()),
            ["clipstream index (Ray Data + upserts)", f"{s['index_vectors_per_s']:.0f}", median(served, "total"),
             median(served, "embed"), median(served, "store"), median(served, "other"),
             seconds(r["total"] for r in served), f"{s['ratio']:.2f}"],
            ["its first job (Ray workers import torch, open_clip)", f"{vectors / results['cold']['total']:.0f}",
             results["cold"]["total"], results["cold"]["embed"], results["cold"]["store"], results["cold"]["other"],
             "", f"{best / results['cold']['total']:.2f}"]]),
        "",
        f"## (b) Reindex and append against the index size ({results['task_pairs']} pairs per task)",
        "",
        f"Galleries below `index_ray_min_rows` ({results['ray_min_rows']}) pairs are embedded in the indexing process "
        "(the default). A reindex re-embeds every image here; an append adds one task to those already indexed "
        "(with the merge of appended segments turned off: `bench search` measures `compact`).",
        "",
        *report.table(["tasks reindexed", "pairs", "seconds", "embed s", "store s", "other s", "ms per pair"], [
            [r["tasks"], r["tasks"] * results["task_pairs"], r["total"], r["embed"], r["store"], r["other"],
             f"{1000 * r['total'] / (r['tasks'] * results['task_pairs']):.1f}"] for r in results["reindexes"]]),
        "",
        *report.table(["tasks already indexed", "append seconds", "embed s", "store s", "other s"], [
            [k, a["total"], a["embed"], a["store"], a["other"]] for k, a in enumerate(results["appends"])]),
        "",
    ]
    reused, full = results["text_only"]["reused"], results["text_only"]["re-embedded"]
    n_tasks = results["reindexes"][-1]["tasks"] if results["reindexes"] else len(results["appends"])
    lines += [
        f"## (c) Text-only change: reindexing {n_tasks} tasks with a version that kept its parent's image tower",
        "",
        "embed: the image vectors read back from the index (reused) or embedded again, and the text vectors.",
        "",
        *report.table(["image vectors", "seconds (median)", "embed s", "store s", "other s", "rounds (s)"], [
            ["re-embedded", s["text_only_reembedded_s"], median(full, "embed"), median(full, "store"),
             median(full, "other"), seconds(r["total"] for r in full)],
            ["reused", s["text_only_reused_s"], median(reused, "embed"), median(reused, "store"),
             median(reused, "other"), seconds(r["total"] for r in reused)]]),
        "",
        f"Reusing them saves {s['text_only_reembedded_s'] - s['text_only_reused_s']:.1f} s "
        f"({1 - s['text_only_ratio']:.0%}) of the reindex.",
        "",
        f"![throughput, reindex and append against the index size, and the text-only change]"
        f"({plot(results, Path(out).with_suffix('.png')).name})",
        "",
    ]
    stores = [a["store"] for a in results["appends"]]
    found = [report.check("clipstream index vectors/s ÷ in-process encode loop", s["ratio"], at_least=TARGET_RATIO)]
    if len(stores) > 2:
        half = (len(stores) - 1) // 2  # as store_growth splits them
        found.append(report.check(f"append store s (median), {_tasks(half + 1, len(stores) - 1)} tasks indexed ÷ {_tasks(1, half)}", s["append_store_growth"],
                                  at_most=FLAT, why="independent of the index size, within the machine's noise"))
    found.append(report.check("text-only reindex s, image vectors reused ÷ re-embedded", s["text_only_ratio"],
                              at_most=REUSE_AT_MOST))
    lines += report.targets(out, found)
    return report.write(out, lines)


def plot(results: dict, path: Path) -> Path:
    """Three panels: vectors/s of both sides; reindex and append seconds (embed and store) against the index size;
    the text-only reindex with image vectors reused and re-embedded (bare Figure, Agg)."""
    from matplotlib.figure import Figure

    s = summary(results)
    fig = Figure(figsize=(13, 4))
    a, b, c = fig.subplots(1, 3)
    local = {f"in-process\n{t} thread{'s' * (t > 1)}": 2 * results["pairs"] / statistics.median(v)
             for t, v in results["local"].items()}
    a.bar([*local, "clipstream index\n(Ray Data + upserts)"], [*local.values(), s["index_vectors_per_s"]],
          color=["tab:gray"] * len(local) + ["tab:blue"])
    a.axhline(TARGET_RATIO * s["in_process_vectors_per_s"], color="r", linestyle=":",
              label=f"target: {TARGET_RATIO:.2f}× the faster in-process")
    a.set_ylim(0, 1.25 * max(*local.values(), s["index_vectors_per_s"]))
    a.set_ylabel("vectors/s")
    a.set_title(f"(a) {results['pairs']} pairs, ratio {s['ratio']:.2f}")
    a.legend(fontsize=8, loc="upper center")
    per_task = results["task_pairs"]
    if results["reindexes"]:
        xs = [r["tasks"] * per_task for r in results["reindexes"]]
        b.plot(xs, [r["total"] for r in results["reindexes"]], "o-", color="tab:blue", label="reindex: total")
        b.plot(xs, [r["embed"] for r in results["reindexes"]], "x--", color="tab:blue", label="reindex: embed")
        b.plot(xs, [r["store"] for r in results["reindexes"]], "+:", color="tab:blue", label="reindex: store")
    xs = [k * per_task for k in range(len(results["appends"]))]
    b.plot(xs, [x["total"] for x in results["appends"]], "o-", color="tab:orange", label="append: total")
    b.plot(xs, [x["embed"] for x in results["appends"]], "x--", color="tab:orange", label="append: embed")
    b.plot(xs, [x["store"] for x in results["appends"]], "+:", color="tab:orange", label="append: store")
    b.set_xlabel("pairs indexed before (append) / reindexed")
    b.set_ylabel("seconds")
    b.set_title(f"(b) tasks of {per_task} pairs")
    b.legend(fontsize=7)
    names = ["re-embedded", "reused"]
    for i, part in enumerate(("embed", "store", "other")):
        bottom = [sum(statistics.median(r[q] for r in results["text_only"][n]) for q in ("embed", "store", "other")[:i])
                  for n in names]
        c.bar(names, [statistics.median(r[part] for r in results["text_only"][n]) for n in names], bottom=bottom,
              label=part, color=["tab:blue", "tab:orange", "tab:gray"][i])
    c.set_ylabel("seconds (median)")
    c.set_title(f"(c) text-only change: saved {1 - s['text_only_ratio']:.0%}")
    c.legend(fontsize=8)
    return report.save_figure(fig, path)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
