"""`clipstream bench stream-growth`: what one task of a stream costs as the stream grows. One stream of T tasks per
method, every task its own task job (`run_task`: Ray Train + DeepSpeed, evaluation on every seen task, registration);
per task the wall and CPU time of the job, its mean training step, the peak memory of its training worker and its
evaluation time with the union gallery it scored. A table per method, a 2x2 plot, and a verdict against the expected
shape: flat for regularisation and distillation (finetune, ewc, ctp), bounded by the buffer for replay (er), linear
for joint. Writes benchmarks/results/stream-growth.md (+ .png, and .json with the checks).

    clipstream bench stream-growth [--tasks 8] [--methods finetune,ewc,er,ctp,joint] [--pairs 128] [--gallery 64]
                                   [--workers 1] [--seed 0] [--set KEY=VALUE ...] [--out PATH]

Every task has the same size: `--pairs` training pairs (the synthetic stream's P9D-sized domain tasks cut to it) and
`--gallery` test pairs, so what changes from task to task is the stream, not the task. One epoch per task unless
`--set train.epochs=N`; every stream runs in this process's one local Ray session. Sampled from outside the job
every 0.2 s (`JobCost`): its CPU time (the driver and Ray's worker processes, not Ray's daemons), which a busy
machine stretches far less than the wall time, so the growth checks use it; and memory, the peak resident set
(VmHWM) of the job's Ray Train worker process (the largest, when there are several): RSS, not the torch allocator's
count, so it includes the ~hundreds of MiB that torch, DeepSpeed and Ray map into every process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from matplotlib.figure import Figure

from clipstream.benchmarks import report
from clipstream.benchmarks.continual_methods import add_training_arguments, check_methods, seeded, training_sets
from clipstream.benchmarks.processes import DATA_TASKS, JobCost
from clipstream.registry import Registry
from clipstream.settings import Settings, configure_process
from clipstream.training.data.synth import MIN_TASK_PAIRS, P9D_SHARES, synthesize
from clipstream.training.methods import resolve

METHODS = ("finetune", "ewc", "er", "ctp", "joint")
FLAT = 1.15  # a cost that should not grow: task T within 1.15x task 2
LINEAR = 0.8  # joint's time in training steps after the first, task T ÷ task 2: at least 0.8 x T/2
EVAL_SHARE = 0.25  # the evaluation's share of the last task's job CPU, at most
COLUMNS = ["task", "train pairs", "steps", "step ms", "job s", "job CPU s", "eval s", "eval CPU s", "eval share",
           "peak RSS MiB", "gallery pairs", "embedded pairs"]


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=8, help="tasks of each stream (default 8)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated method presets, one stream each "
                                                                 f"(default {','.join(METHODS)})")
    p.add_argument("--pairs", type=int, default=128, help="training pairs of every task (default 128)")
    p.add_argument("--gallery", type=int, default=64, help="test pairs of every task: its gallery (default 64)")
    p.add_argument("--out", default=str(report.RESULTS / "stream-growth.md"),
                   help="the markdown; the plot (.png) and the checks (.json) go next to it")
    add_training_arguments(p)
    p.set_defaults(workers=1)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = parser(prog)
    args = report.parse(p, argv)
    sets = training_sets(args)
    try:
        names = check_methods(args.methods.split(","), ["train.epochs=1", *seeded(args.seed), *sets])
    except ValueError as exc:
        p.error(str(exc))
    for flag, value, least in (("--tasks", args.tasks, 2), ("--pairs", args.pairs, 1), ("--gallery", args.gallery, 1),
                               ("--workers", args.workers, 1)):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    text = stream_growth(Settings(), names, args.tasks, args.pairs, args.gallery, args.workers, args.seed, sets,
                         Path(args.out))
    print(text)
    print(verdict_line(json.loads(Path(args.out).with_suffix(".json").read_text())["checks"]))
    return text


def equal_tasks(root: Path, tasks: int, pairs: int, gallery: int, seed: int = 0) -> list[Path]:
    """`tasks` synthetic domain tasks (no digits, no held-out task) of `pairs` training pairs and `gallery` test
    pairs each: the P9D-sized tasks `synthesize` writes, each training split cut to its first `pairs` rows."""
    shares = [P9D_SHARES[i % len(P9D_SHARES)] for i in range(tasks)]
    total = math.ceil(max(pairs, MIN_TASK_PAIRS) * sum(shares) / min(shares)) + tasks  # (+ the rounding)
    dirs = synthesize(root, tasks=tasks, seed=seed, train_pairs=total, test_per_task=gallery, digits=False,
                      held_out=False, progress=False)
    for folder in dirs:
        lines = (folder / "train.jsonl").read_text().splitlines(keepends=True)
        if len(lines) < pairs:
            raise RuntimeError(f"{folder.name}: {len(lines)} training pairs written, {pairs} needed")
        (folder / "train.jsonl").write_text("".join(lines[:pairs]))
    return dirs


def shape_of(config: dict, tasks: int, pairs: int) -> tuple[str, int | None]:
    """The growth a method's training cost should have, from its resolved preset: ("linear", None) for joint (every
    task so far), ("bounded", buffer pairs) for replay, ("flat", None) for the rest. A buffer that is a fraction of
    the pairs seen is bounded by what it holds at the end of the stream (`tasks` of `pairs`): that share, up to one
    more pair per task (each task's share is rounded up or down)."""
    method = config.get("method") or {}
    if "joint" in method:
        return "linear", None
    if "er" in method:
        er = method["er"]
        if er.get("buffer_pairs") is not None:
            return "bounded", int(er["buffer_pairs"])
        return "bounded", math.ceil(er["buffer_fraction"] * tasks * pairs) + tasks
    return "flat", None


def stream_growth(settings: Settings, names: Sequence[str], tasks: int = 8, pairs: int = 128, gallery: int = 64,
                  workers: int = 1, seed: int = 0, overrides: Iterable[str] = (),
                  out: Path = report.RESULTS / "stream-growth.md") -> str:
    """Train one stream of `tasks` equal tasks per method; write the report to `out` (+ .png, .json)."""
    from clipstream.runtime import init_ray
    from clipstream.training.job import run_task

    overrides = list(overrides)
    train_sets = ["train.epochs=1", *seeded(seed), *overrides]  # (a --set comes last: it wins)
    tic, load = time.perf_counter(), os.getloadavg()[0]
    stamp = time.strftime("%Y%m%d%H%M%S")
    dirs = equal_tasks(settings.data_dir / f"bench-growth-s{seed}-{stamp}", tasks, pairs, gallery, seed)
    init_ray(settings)  # one local Ray session for every stream, started before the first job is timed
    results: dict[str, dict] = {}
    last: tuple[Settings, str] | None = None
    for m, method in enumerate(names, 1):
        config = resolve(method, train_sets)
        shape, buffer = shape_of(config, tasks, pairs)
        run_settings = settings.model_copy(update={"stream": f"bench-growth-{method}-s{seed}-{stamp}"})
        registry, parent, rows = Registry(run_settings), None, []
        for t, folder in enumerate(dirs, 1):
            with JobCost() as cost:
                result = run_task(folder, method, parent, workers, train_sets, run_settings)
            parent = result.version
            run = registry.client.get_run(result.run_id)
            metrics = run.data.metrics
            rows.append({"task": folder.name, "rows": int(run.data.params["train_rows"]), "wall_s": result.seconds,
                         "cpu_s": cost.cpu_s, "eval_s": metrics.get("eval/seconds", math.nan),
                         "eval_cpu_s": metrics.get("eval/cpu_seconds", math.nan),
                         "steps": int(metrics.get("train/step", 0)), "step_ms": metrics.get("train/step_ms", math.nan),
                         "first_step_ms": metrics.get("train/first_step_ms", 0.0),
                         "peak_mib": cost.peak_mib, "gallery": int(metrics.get("eval/gallery_pairs", 0)),
                         "embedded": int(metrics.get("eval/embedded_pairs", 0)), "cpu_by": cost.cpu_by_process})
            r = rows[-1]
            print(f"== {method} ({m}/{len(names)}) task {t}/{tasks}: {r['rows']} pairs, job {r['wall_s']:.1f} s "
                  f"({r['cpu_s']:.1f} CPU s), evaluation {r['eval_s']:.1f} s ({r['eval_cpu_s']:.1f} CPU s) on "
                  f"{r['gallery']} gallery pairs, step {r['step_ms']:.0f} ms, peak RSS {r['peak_mib']:.0f} MiB",
                  flush=True)
        results[method] = {"shape": shape, "buffer": buffer, "pairs": pairs, "tasks": rows}
        print(f"== {method}: {json.dumps(results[method])}", flush=True)  # (the raw numbers, in the log)
        last = (run_settings, parent)
    baseline = embedding_baseline(*last) if last and tasks > 1 else None
    sets = "".join(f" --set {o}" for o in overrides)
    command = (f"clipstream bench stream-growth --tasks {tasks} --methods {','.join(names)} --pairs {pairs} "
               f"--gallery {gallery} --workers {workers} --seed {seed}{sets} --out {out}")
    device = report.device(f"{workers} Ray Train worker{'s' * (workers > 1)}",
                           f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    return growth_report(results, Path(out), command, device, time.perf_counter() - tic, baseline)


def embedding_baseline(settings: Settings, version: str, rounds: int = 2) -> dict:
    """The last version's evaluation embedding, measured side by side with how the job embedded before (each seen
    task's test split on its own, then the old tasks again with the parent, for the spatial disorder) and how it
    does now (all seen tasks' rows together in batches of eval.batch_size, once per version: the parent's vectors
    are the ones its own evaluation made). Best of `rounds`, alternating."""
    from clipstream import models
    from clipstream.training import evaluate
    from clipstream.training.data.task import Task

    registry = Registry(settings)
    new = registry.resolve(version)
    old = registry.resolve(new.tags["parent_version"])
    batch = int(new.manifest["config"].get("eval", {}).get("batch_size", 256))
    tasks = [Task.load(e["path"]) for e in new.lineage]
    bundle, parent = models.load_exported(new.folder), models.load_exported(old.folder)

    def before() -> None:
        for model, seen in ((bundle, tasks), (parent, tasks[:-1])):
            for task in seen:
                evaluate.embed_task(model, task, batch_size=batch)

    def now() -> None:
        evaluate.embed_tasks(bundle, tasks, batch_size=batch)

    times: dict[str, list[tuple[float, float]]] = {"before": [], "now": []}
    for _ in range(rounds):
        for name, embed in (("before", before), ("now", now)):
            tic, cpu = time.perf_counter(), time.process_time()
            embed()
            times[name].append((time.perf_counter() - tic, time.process_time() - cpu))
    gallery = sum(len(t.check("test").rows) for t in tasks)
    return {"tasks": len(tasks), "batch": batch, "now_pairs": gallery,
            "before_pairs": 2 * gallery - len(tasks[-1].check("test").rows),
            **{f"{name}_s": min(w for w, _ in runs) for name, runs in times.items()},
            **{f"{name}_cpu_s": min(c for _, c in runs) for name, runs in times.items()}}


def fit_ratio(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares line through (xs, ys) at the last x ÷ at the first: a ratio that one noisy task cannot
    swing (NaN with fewer than two finite points, or a line not above 0 at the first x)."""
    pts = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    if len(pts) < 2:
        return math.nan
    x, y = np.array(pts, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1)
    first, end = intercept + slope * xs[0], intercept + slope * xs[-1]
    return float(end / first) if first > 0 else math.nan


def steps_s(task: dict) -> float:
    """A task job's seconds in its training steps after the first: the first also creates AdamW's state and the
    allocator's pools, a fixed cost per job that would hide how the training work grows (recorded before this metric
    existed: every step). The job's metrics are its last epoch's: with `--set train.epochs=N` (N > 1) this is all
    steps at the last epoch's mean, less that epoch's first step."""
    return (task["steps"] * task["step_ms"] - task.get("first_step_ms", 0.0)) / 1000


def growth(r: dict) -> dict:
    """A method's ratios task T ÷ task 2, fitted over tasks 2..T (task 1 is special: no parent, no teacher, nothing to
    replay): the job's CPU seconds and wall time without its evaluation, step ms, peak memory, time in training
    steps after the first (`steps_s`) and train pairs; and `work`, the growth its training work should have (the
    ratio of its train pairs)."""
    rows, pairs = r["tasks"], r["pairs"]
    later = rows[1:]
    idx = list(range(2, len(rows) + 1))
    series = {"train_cpu": [t["cpu_s"] - t["eval_cpu_s"] for t in later],
              "train_s": [t["wall_s"] - t["eval_s"] for t in later], "step_ms": [t["step_ms"] for t in later],
              "peak_mib": [t["peak_mib"] for t in later], "steps_s": [steps_s(t) for t in later]}
    out = {k: fit_ratio(idx, v) for k, v in series.items()}
    out["rows"] = later[-1]["rows"] / later[0]["rows"] if later else math.nan
    if r["shape"] == "linear":
        out["work"] = len(rows) / 2
    elif r["shape"] == "bounded":
        full = pairs + r["buffer"]
        out["work"] = min(full, len(rows) * pairs) / min(full, 2 * pairs)  # task t trains pairs + min(buffer, seen)
    else:
        out["work"] = 1.0
    return out


def _expected(r: dict, g: dict) -> tuple[bool, str]:
    """Whether a method's growth is the one its shape says (see `checks`), and the shape in words."""
    t = len(r["tasks"])
    ok = g["train_cpu"] <= FLAT * g["work"] and g["step_ms"] <= FLAT and g["peak_mib"] <= FLAT
    if r["shape"] == "bounded":
        ok = ok and max(x["rows"] for x in r["tasks"]) <= r["pairs"] + r["buffer"]
        return ok, (f"bounded by its buffer of {r['buffer']} pairs (train pairs {r['tasks'][1]['rows']} → "
                    f"{r['tasks'][-1]['rows']}, at most {r['pairs'] + r['buffer']}; job CPU within {FLAT}x their "
                    "growth)")
    if r["shape"] == "linear":
        ok = ok and g["steps_s"] >= LINEAR * g["work"]
        return ok, (f"linear (train pairs ×{g['rows']:.1f}; time in training steps after the first ×{g['steps_s']:.2f}, at least "
                    f"{LINEAR} × {t}/2)")
    return ok, f"flat (≤ {FLAT}x)"


def checks(results: dict[str, dict]) -> list[dict]:
    """The targets, task T against task 2: each method's job CPU without evaluation grows as its shape says (flat: ≤
    1.15x; replay: ≤ 1.15x the growth of its train pairs, which stay within pairs + buffer; joint: ≤ 1.15x linear,
    and its time in training steps ≥ 0.8x linear); step time and peak worker memory ≤ 1.15x for every method; every
    evaluation embeds each pair of its union gallery once; and the evaluation ≤ 25% of the last job's CPU."""
    out = []
    for method, r in results.items():
        if len(r["tasks"]) < 3:
            continue  # task 2 is the reference: growth needs a third task
        g, t = growth(r), len(r["tasks"])
        shape = {"flat": "flat", "bounded": "bounded by the buffer", "linear": "linear"}[r["shape"]]
        out.append(report.check(f"{method} ({shape}): job CPU s w/o evaluation, task {t} ÷ task 2", g["train_cpu"],
                                at_most=FLAT * g["work"],
                                why="" if g["work"] == 1 else
                                f"{FLAT} × the {g['work']:.2f}x growth of its train pairs"))
        if r["shape"] == "bounded":
            out.append(report.check(f"{method}: most train pairs of a task", max(x["rows"] for x in r["tasks"]),
                                    at_most=r["pairs"] + r["buffer"], fmt="{:.0f}",
                                    why=f"{r['pairs']} of the task + a buffer of {r['buffer']}"))
        if r["shape"] == "linear":
            out.append(report.check(f"{method}: time in training steps after the first, task {t} ÷ task 2", g["steps_s"],
                                    at_least=LINEAR * g["work"], why=f"linear: {t} tasks' pairs against 2"))
        out.append(report.check(f"{method}: step ms, task {t} ÷ task 2", g["step_ms"], at_most=FLAT))
        out.append(report.check(f"{method}: peak worker RSS, task {t} ÷ task 2", g["peak_mib"], at_most=FLAT))
    tasks = [x for r in results.values() for x in r["tasks"]]
    if tasks:
        once = max(x["embedded"] / x["gallery"] if x["gallery"] else math.nan for x in tasks)
        out.append(report.check("pairs embedded per evaluation ÷ its union gallery (most over all jobs)", once,
                                at_most=1.0, why="each version embeds each task's gallery once"))
        share = max(_share(r["tasks"][-1]) for r in results.values())
        out.append(report.check("evaluation's share of the last task's job CPU (most over methods)", share,
                                at_most=EVAL_SHARE, fmt="{:.0%}"))
    return out


def _share(task: dict) -> float:
    return task["eval_cpu_s"] / task["cpu_s"] if task["cpu_s"] > 0 else math.nan


def growth_report(results: dict[str, dict], out: Path, command: str, device: str, seconds: float | None = None,
                  baseline: dict | None = None) -> str:
    """Write the per-method tables, the evaluation's growth, the plot, the targets and the verdict to `out` (.md,
    .png; the checks to .json); return the markdown. `results`: method -> {"shape": flat | bounded | linear,
    "buffer": replay pairs or None, "pairs": training pairs per task, "tasks": per task {"task", "rows": train pairs,
    "wall_s", "cpu_s": the job's, "eval_s", "eval_cpu_s", "steps", "step_ms", "peak_mib", "gallery": union gallery
    pairs, "embedded": pairs embedded}}; `baseline`: `embedding_baseline`'s."""
    out = Path(out)
    png = plot_growth(results, out.with_suffix(".png"))
    found = checks(results)
    lines = [
        "# Cost per task as the stream grows",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Device: {device}." + (f" Wall time {seconds / 60:.1f} min." if seconds else ""),
        "",
        "One stream per method, every task a task job (`run_task`: Ray Train + DeepSpeed, evaluation on every seen "
        "task, registration), every task the same size. Job s = the job's wall time; job CPU s = the CPU time of the "
        "driver and of the Ray worker processes during the job (not Ray's daemons), which a busy machine stretches "
        "far less than the wall time: the growth checks use it; step ms = the mean training step (batch in hand to "
        "optimizer step and method hooks done); eval s and eval CPU s = the evaluation step's wall and CPU time, "
        "eval share = its CPU ÷ the job's; peak RSS = the peak resident set (VmHWM) of the job's Ray Train worker "
        "process, sampled from outside every 0.2 s (RSS, not the torch allocator: it includes what torch, DeepSpeed "
        "and Ray map into every process); gallery pairs = the union of the seen tasks' test splits that the "
        "evaluation scores; embedded pairs = the test pairs it embedded, with every model.",
        "",
    ]
    for method, r in results.items():
        lines += [f"## {method}", ""]
        lines += report.table(COLUMNS, [
            [i, t["rows"], t["steps"], f"{t['step_ms']:.0f}", float(t["wall_s"]), float(t["cpu_s"]), float(t["eval_s"]),
             float(t["eval_cpu_s"]), f"{_share(t):.0%}",
             f"{t['peak_mib']:.0f}" if math.isfinite(t["peak_mib"]) else "-", t["gallery"], t["embedded"]]
            for i, t in enumerate(r["tasks"], 1)])
        lines.append("")
    lines += process_lines(results)
    lines += evaluation_lines(results, baseline)
    lines += ["", f"![job time, step time, peak memory and evaluation time per task]({png.name})", ""]
    lines += report.targets(out, found)
    lines += ["", "## Verdict", ""] + [f"- {line}" for line in verdict_lines(results)]
    return report.write(out, lines)


def process_lines(results: dict[str, dict]) -> list[str]:
    """Where a job's CPU goes, by process, for each method's last task: what the per-job fixed cost is made of."""
    last = {m: r["tasks"][-1].get("cpu_by") or {} for m, r in results.items()}
    kinds = sorted({k for by in last.values() for k in by}, key=lambda k: -max(by.get(k, 0.0) for by in last.values()))
    if not kinds:
        return []
    driver_eval = {m: r["tasks"][-1]["eval_cpu_s"] for m, r in results.items()}
    helpers = {m: sum(v for k, v in by.items() if k not in ("driver", "RayTrainWorker", "TrainController", DATA_TASKS))
               for m, by in last.items()}
    rows = [[k, *(f"{last[m].get(k, 0.0):.1f}" for m in last)] for k in kinds]
    rows.append(["job", *(f"{sum(last[m].values()):.1f}" for m in last)])
    share = max(helpers[m] / max(sum(last[m].values()), 1e-9) for m in last)
    return [
        "## Where a job's CPU goes", "",
        "CPU seconds by process during each method's last task job: the driver (the job's preparation, its evaluation "
        f"({', '.join(f'{m} {v:.1f} s' for m, v in driver_eval.items())} of it) and the registration), the Ray Train "
        "worker (its process start, imports, DeepSpeed's initialisation, the steps, the checkpoint), the Train "
        f"controller, the {DATA_TASKS} (the workers that read and preprocess the pairs: a new process imports torch "
        "and open_clip before its first batch), and the helper actors Ray Train and Ray Data start afresh for every run (each a new worker "
        f"process importing Ray: {', '.join(f'{m} {v:.1f} s' for m, v in helpers.items())}, up to {share:.0%} of a "
        "job). These start-up costs are the same at every task and do not grow with the stream, but at this size "
        "(a few steps per task) they are most of a job, and they vary by ±15% from job to job on a shared machine: "
        "the growth checks fit a line through tasks 2..T so that one slow job does not decide them.", "",
        *report.table(["process", *last], rows), ""]


def evaluation_lines(results: dict[str, dict], baseline: dict | None) -> list[str]:
    """How the evaluation grows with the union gallery, and what keeps it from dominating, with this run's numbers."""
    lines = ["## Evaluation as the union gallery grows", ""]
    if not results:
        return lines
    first = next(iter(results.values()))["tasks"]
    g1, gt, t = first[0]["gallery"], first[-1]["gallery"], len(first)
    evals = "; ".join(f"{m} {r['tasks'][0]['eval_cpu_s']:.1f} → {r['tasks'][-1]['eval_cpu_s']:.1f} CPU s "
                      f"({_share(r['tasks'][-1]):.0%} of the job)" for m, r in results.items())
    lines += [
        f"After task t the new version is evaluated on every seen task: its union gallery is t × {g1} test pairs "
        f"({g1} → {gt} here). Embedding it is linear in t and is most of the evaluation; task-known scoring is t "
        f"blocks of {g1}² similarities and task-unknown ranks every query against the whole union, t² × {g1}² "
        f"({gt * gt:,} at task {t}), still milliseconds next to the embedding; the heatmaps and metrics grow with the "
        f"matrix. So the evaluation grows linearly with the stream while a flat method's training does not, and its "
        f"share of a job grows with the stream. Evaluation, task 1 → task {t}: {evals}.",
        "",
        "What keeps it down: each version embeds each task's test split once. Before, the job embedded every seen "
        "task on its own (one part-full batch per task and tower) and then embedded the old tasks a second time with "
        "the parent version for Mod-X's spatial disorder: 2t − 1 galleries at task t. Now the seen tasks' rows go "
        "through the model together in batches of eval.batch_size (`evaluate.embed_tasks`), the parent's vectors are "
        "the ones its own evaluation made (`evaluate.GalleryCache`: kept in the process between a stream's jobs; a "
        "job in a process of its own embeds them again), and the seen tasks' metrics go to MLflow in one call. The "
        "embedded-pairs column shows it: equal to the gallery at every task.",
    ]
    if baseline:
        b = baseline
        lines += ["", f"Side by side on the last version of the last stream ({b['tasks']} seen tasks, batch "
                  f"{b['batch']}, best of 2 rounds): the previous embedding ({b['before_pairs']} pairs: task by task, "
                  f"the old tasks again with the parent) took {b['before_s']:.2f} s ({b['before_cpu_s']:.2f} CPU s), "
                  f"the one-pass embedding ({b['now_pairs']} pairs) {b['now_s']:.2f} s ({b['now_cpu_s']:.2f} CPU s): "
                  f"{b['before_s'] / max(b['now_s'], 1e-9):.1f}x less wall time, "
                  f"{b['before_cpu_s'] / max(b['now_cpu_s'], 1e-9):.1f}x less CPU."]
    return lines


def verdict_lines(results: dict[str, dict]) -> list[str]:
    """One line per method: its ratios against the expected shape, as expected or not."""
    lines = []
    for method, r in results.items():
        if len(r["tasks"]) < 3:
            lines.append(f"{method}: {len(r['tasks'])} tasks, no growth to measure (task 2 is the reference: needs 3)")
            continue
        g, t = growth(r), len(r["tasks"])
        ok, expected = _expected(r, g)
        lines.append(f"{method}: task {t} ÷ task 2 (fitted over 2..{t}): job CPU w/o evaluation "
                     f"×{g['train_cpu']:.2f} (wall ×{g['train_s']:.2f}), step ×{g['step_ms']:.2f}, peak RSS "
                     f"×{g['peak_mib']:.2f}; expected {expected}: {'as expected' if ok else '**not as expected**'}")
    return lines


def verdict_line(found: Sequence[dict]) -> str:
    """The printed verdict: how many targets were met, and which were not."""
    missed = [c["check"] for c in found if not c["ok"]]
    return (f"stream-growth: {len(found) - len(missed)}/{len(found)} targets met"
            + (f"; not met: {'; '.join(missed)}" if missed else ""))


def plot_growth(results: dict[str, dict], path: Path) -> Path:
    """2x2 against the task index, one colour per method: the job's wall time (solid) and CPU time (dashed), the
    mean training step, the training worker's peak RSS, and the evaluation's wall (solid) and CPU time (dashed).
    A bare Figure (Agg)."""
    fig = Figure(figsize=(10, 7))
    panels = [(("wall_s", "cpu_s"), "job: wall s (—), CPU s (--)"), (("step_ms",), "mean training step (ms)"),
              (("peak_mib",), "peak RSS of a training worker (MiB)"), (("eval_s", "eval_cpu_s"),
                                                                       "evaluation: wall s (—), CPU s (--)")]
    axes = fig.subplots(2, 2)
    colours = [f"C{i}" for i in range(10)]
    for ax, (keys, label) in zip(axes.flat, panels):
        for (method, r), colour in zip(results.items(), colours * len(results)):
            x = range(1, len(r["tasks"]) + 1)
            for key, style in zip(keys, ("-", "--")):
                ax.plot(x, [t[key] for t in r["tasks"]], style, marker="o", color=colour, markersize=3,
                        label=method if style == "-" else None)
        ax.set_xticks(range(1, max((len(r["tasks"]) for r in results.values()), default=1) + 1))
        ax.set_xlabel("task")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Cost per task as the stream grows")
    return report.save_figure(fig, path)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
