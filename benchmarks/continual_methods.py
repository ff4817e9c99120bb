"""`clipstream bench methods`: every continual-learning method trained on the same synthetic stream, over several
seeds; AA, forgetting, BWT, task-unknown AA and R@1/5/10, zero-shot retrieval on a held-out task no method trains on
(and its drop from version 1), each the mean over seeds with a 95% confidence interval, the paired difference of
each method against finetune with its interval, and the cost per step relative to finetune, as tables, a plot of
AA after each task and a forest plot. Writes benchmarks/results/methods.md (+ .png, -forest.png).

Each (method, seed) is a cell (`benchmarks/cells.py`): cached as it finishes, so a run can be stopped and continued;
`--vary` sweeps a parameter through the same tables; the intervals come from `benchmarks/stats.py`.
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from clipstream import models
from clipstream.benchmarks import cells, report, stats
from clipstream.benchmarks.stats import Statistic
from clipstream.settings import Settings, configure_process
from clipstream.training.data.synth import _DIGITS_MAX_TEST as DIGITS_MAX_TEST
from clipstream.training.data.synth import held_out_tasks, synthesize
from clipstream.training.evaluate import KS
from clipstream.training.methods import build
from clipstream.training.methods.config import load_presets, method_presets, resolve

BASELINE = "finetune"  # what every method's paired difference is measured against
SEEDS = "0,1,2"
TEST_PER_TASK = 500  # test pairs per task: one query is 0.2 point of R@K, R@10 far from its ceiling


def seeded(seed: int) -> list[str]:
    """What makes a benchmark rerun give the same numbers: `--seed` seeds the data and the training, and
    the input is ordered (`train.deterministic`). `--set` can still override either."""
    return [f"train.seed={seed}", "train.deterministic=true"]


def add_training_arguments(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """The options of every benchmark that trains streams (as `clipstream train` has them); `seed=False`: the
    benchmark takes several seeds (add_cell_arguments) instead of one."""
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="seeds the synthetic data and the training (default 0)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a preset value for every stream, e.g. train.epochs=2")
    parser.add_argument("--arch", default="", help="the model every stream trains: any open_clip architecture by name, "
                                                   "e.g. ViT-B-32 (default: the presets' own; --set model.arch=)")


def add_cell_arguments(parser: argparse.ArgumentParser, test_per_task_max: int | None = None) -> None:
    """The options of a benchmark of cells (`benchmarks/cells.py`): seeds, gallery size, sweeps, the cache and the
    bootstrap."""
    parser.add_argument("--seeds", default=SEEDS, metavar="S1,S2,...",
                        help=f"seeds, each its own data and training; the intervals resample them (default {SEEDS})")
    parser.add_argument("--test-per-task", type=int, default=TEST_PER_TASK, metavar="N",
                        help=f"test pairs per task (default {TEST_PER_TASK}" +
                             (f", at most {test_per_task_max})" if test_per_task_max else ")"))
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2", help=cells.VARY_HELP)
    parser.add_argument("--cache", default="", metavar="DIR",
                        help="where finished cells are kept (default HOME/bench-cells/BENCH): a rerun with the same "
                             "options reads them instead of training again")
    parser.add_argument("--fresh", action="store_true", help="train every cell again, ignoring the cache")
    parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")


def training_sets(args: argparse.Namespace) -> list[str]:
    """The `--set` overrides of every stream, `--arch` first as model.arch (looked up by name: an unknown one is one
    line before anything runs)."""
    if args.arch:
        models.architecture(args.arch)
    return [f"model.arch={args.arch}"] * bool(args.arch) + args.set


def check_cells(seeds: Sequence[int], test_per_task: int, resamples: int, most: int | None = None) -> list[int]:
    """The seeds (checked as --seeds is), the gallery size and the resamples, refused in one line before anything
    runs."""
    seeds = cells.parse_seeds(",".join(map(str, seeds)))
    if test_per_task < 1 or (most is not None and test_per_task > most):
        raise ValueError(f"--test-per-task must be between 1 and {most}, got {test_per_task}" if most else
                         f"--test-per-task must be >= 1, got {test_per_task}")
    if resamples < 10:
        raise ValueError(f"--resamples must be >= 10, got {resamples}")
    return seeds


EXAMPLES = """examples:
  clipstream bench methods                                   # every method, seeds 0,1,2, 500 test pairs per task
  clipstream bench methods --methods finetune,lwf,modx,ctp,cclip --start-with finetune \
      --out benchmarks/results/methods-trained-start.md     # the same trained start for every method
  clipstream bench methods --methods finetune,ewc,mas --vary weight=1,100,10000   # a sweep: rows 'ewc weight=100'...
  clipstream bench methods --seeds 0,1 --methods finetune,lwf --tasks 1 --test-per-task 100   # a small run
A rerun of the same command reads the cells it finished (HOME/bench-cells/methods) and trains only the others."""


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("--tasks", type=int, default=3, help="domain tasks; the digits task is added last (default 3)")
    p.add_argument("--methods", default=",".join(method_presets()),
                   help="comma-separated method presets, one row each (default: every preset)")
    p.add_argument("--start-with", default="", metavar="PRESET",
                   help="train every stream's first task with this preset, once per seed, the version then the "
                        "start of every method (a trained CLIP for the others to adapt, as a pretrained checkpoint "
                        "would be); default: each method itself, except those that need a trained start (CLL-CLIP), "
                        "which start from finetune's")
    p.add_argument("--against", default="", metavar="ROW",
                   help="also the paired differences against this row, named as the table names it (e.g. "
                        "'ctp queue_size=256'): a sweep's values against the preset's, beside those against finetune")
    p.add_argument("--out", default=str(report.RESULTS / "methods.md"),
                   help="the markdown; the plots go next to it (.png, -forest.png)")
    add_training_arguments(p, seed=False)
    add_cell_arguments(p, DIGITS_MAX_TEST)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = report.parse(parser(prog), argv)
    text = methods(Settings(), args.tasks, cells.parse_seeds(args.seeds), args.methods.split(","), args.workers,
                   training_sets(args), Path(args.out), args.start_with, cells.parse_vary(args.vary),
                   args.test_per_task, args.fresh, args.cache, args.resamples, args.against)
    print(text)
    return text


SD_COLUMNS = {"sd/image_rotation_mean": "image rotation", "sd/text_rotation_mean": "text rotation",
              "sd/intermodal_deviation_mean": "inter-modal deviation", "sd/imav_le5_pct": "ImAV ≤ 5° (%)"}


def check_methods(names: Sequence[str], overrides: Iterable[str] = ()) -> list[str]:
    """The method names, checked against the presets (and each preset with `overrides` resolved) so that a
    typo fails before anything trains; ValueError otherwise."""
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError("no methods given")
    presets = load_presets()
    unknown = [n for n in names if n not in presets]
    if unknown:
        raise ValueError(f"unknown method preset(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(sorted(presets))}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"method(s) given more than once: {', '.join(repeated)}")
    for name in names:
        resolve(name, overrides, presets)
    return names


def statistics(tasks: int, modes: Sequence[str] = ("known", "unknown")) -> dict[str, list[Statistic]]:
    """What the tables report, by table, for a stream of `tasks` tasks evaluated in `modes` (every gallery mode the
    versions' evaluations have)."""
    known = lambda v: v.rm("known")  # noqa: E731
    return {
        "headline": [
            Statistic("AA", lambda v: stats.average_accuracy(known(v))),
            Statistic("forgetting", lambda v: stats.forgetting(known(v)), lower_is_better=True),
            Statistic("BWT", lambda v: stats.bwt(known(v))),
            Statistic("final Rm (task-unknown AA)", lambda v: stats.average_accuracy(v.rm("unknown"))),
            Statistic("zero-shot Rm", lambda v: v.zero_shot()[:, -1]),
            Statistic("zero-shot drop", lambda v: v.zero_shot()[:, 0] - v.zero_shot()[:, -1], lower_is_better=True)],
        "recall": [Statistic(f"task-{mode} R@{k}", lambda v, mode=mode, k=k: stats.average_accuracy(v.recall(mode, k)))
                   for mode in ("known", "unknown") for k in KS],
        "modes": [Statistic(f"{mode} {name}", lambda v, mode=mode, of=of: of(v.rm(mode)), lower_is_better=lower)
                  for mode in modes for name, of, lower in (("AA", stats.average_accuracy, False),
                                                             ("forgetting", stats.forgetting, True))],
        "curve": [Statistic(f"AA after task {t + 1}", lambda v, t=t: stats.average_accuracy(known(v), t))
                  for t in range(tasks)],
    }


def methods(settings: Settings, tasks: int = 3, seeds: Sequence[int] = (0, 1, 2), names: Sequence[str] = (),
            workers: int = 2, overrides: Iterable[str] = (), out: Path = report.RESULTS / "methods.md",
            start_with: str = "", vary: Sequence[tuple[str, list[str]]] = (), test_per_task: int = TEST_PER_TASK,
            fresh: bool = False, cache: str | Path = "", resamples: int = 1000, against: str = "") -> str:
    """Train the same synthetic stream (`tasks` domain tasks + digits, `test_per_task` test pairs each) once per
    method variant and seed, each seed's streams in one MLflow experiment and registered model; write the comparison
    to `out` and its plots next to it."""
    overrides = list(overrides)
    train_sets = [*seeded(0), *overrides]
    names = check_methods(names or method_presets(), train_sets)
    if start_with:
        check_methods([start_with], train_sets)
    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    seeds = check_cells(seeds, test_per_task, resamples, DIGITS_MAX_TEST)
    variants = cells.expand({n: (n, []) for n in names}, vary, BASELINE, train_sets)
    if against and against not in [v.label for v in variants]:
        raise ValueError(f"--against {against!r}: no such row; the rows are "
                         f"{', '.join(repr(v.label) for v in variants)}")

    def first(variant: cells.Variant) -> tuple[str, tuple[str, ...]]:
        if start_with:
            return start_with, ()
        if build(resolve(variant.preset, [*train_sets, *variant.sets])).needs_trained_start:
            return "finetune", ()  # CLL-CLIP teaches a trained CLIP
        return variant.preset, variant.sets

    key = {"bench": "methods", "tasks": tasks, "test_per_task": test_per_task, "workers": workers,
           "overrides": overrides}
    store = cells.Cache(Path(cache) if cache else settings.home / "bench-cells" / "methods", fresh)
    results = cells.run_seeds(settings, "methods", seeds, {"tasks": tasks, "test_per_task": test_per_task},
                              lambda root, seed: synthesize(root, tasks=tasks, seed=seed, test_per_task=test_per_task),
                              variants, first, workers, lambda seed: [*seeded(seed), *overrides], store, key,
                              held_out_tasks)
    streams = cells.streams(results)
    tables = statistics(tasks + 1, stats.modes(streams))
    summary = stats.bootstrap(streams, [st for table in tables.values() for st in table],
                              BASELINE if BASELINE in results else None, resamples)
    versus = stats.bootstrap(streams, compared(tables), against, resamples) if against else None
    sets = "".join(f" --set {o}" for o in overrides) + "".join(f" --vary {k}={','.join(v)}" for k, v in vary)
    command = (f"clipstream bench methods --tasks {tasks} --seeds {','.join(map(str, seeds))} --test-per-task "
               f"{test_per_task} --methods {','.join(names)} --workers {workers}{sets}"
               f"{f' --start-with {start_with}' if start_with else ''}"
               f"{f' --against {shlex.quote(against)}' if against else ''} --resamples {resamples} --out {out}")
    starts = (f"every stream trains its first task with {start_with}, once per seed" if start_with else "".join(
        f"; {n} starts from finetune's first task (it teaches a trained CLIP)" for n in names
        if build(resolve(n, train_sets)).needs_trained_start).removeprefix("; "))
    return methods_report(summary, results, tables, Path(out), command, report.device(f"{workers} Ray Train workers"),
                          f"{tasks} synthetic domain tasks + the digits task, {test_per_task} test pairs per task "
                          f"(the task-unknown gallery after the last task: {(tasks + 1) * test_per_task}); zero-shot: "
                          f"the held-out domain task, {test_per_task} test pairs" + (f"; {starts}" if starts else ""),
                          versus)


def finite_mean(values: Iterable[float]) -> float:
    """The mean of the finite values; NaN when there are none (a metric no task logged)."""
    kept = [v for v in values if math.isfinite(v)]
    return float(np.mean(kept)) if kept else math.nan


def cost(cell: dict, base: dict | None) -> tuple[float, float]:
    """(mean step time ÷ the baseline's of the same seed, over the tasks after the first, which the row's own method
    trained; wall minutes of all its tasks)."""
    step = finite_mean(cell["step_ms"][1:] or cell["step_ms"])
    ratio = math.nan
    if base is not None:
        b = finite_mean(base["step_ms"][1:] or base["step_ms"])
        ratio = step / b if b > 0 else math.nan
    return ratio, sum(cell["seconds"]) / 60


def accuracy_cell(cells: list[dict]) -> str:
    """Zero-shot top-1 accuracy (%) after the last task: the mean over the seeds and [their lowest, highest] (a
    classification has no per-query ranks kept, so no bootstrap); '-' where a cell did not record it (cells from
    before it was recorded, or no labelled held-out task)."""
    found = [c["zero_shot_accuracy"][-1] for c in cells if c.get("zero_shot_accuracy")]  # (percent, as logged)
    if len(found) != len(cells) or not found:
        return "-"
    return f"{np.mean(found):.1f} [{min(found):.1f}, {max(found):.1f}]"


def compared(tables: dict[str, list[Statistic]]) -> list[Statistic]:
    """The statistics the paired differences show: the headline's and task-unknown R@1."""
    return [*tables["headline"], tables["recall"][len(KS)]]


def methods_report(summary: stats.Summary, results: dict[str, dict[int, dict]], tables: dict[str, list[Statistic]],
                   out: Path, command: str, device: str, stream: str = "", versus: stats.Summary | None = None) -> str:
    """Write the tables to `out` (markdown), AA after each task with its band to `out`.png and the paired differences
    to `out`-forest.png; return the markdown. `results[label][seed]`: the cells (`cells.run_seed`); `versus`: the
    paired differences against another row too (`--against`)."""
    out = Path(out)
    base = summary.baseline
    curve = [st.name for st in tables["curve"]]
    tasks = next(iter(next(iter(results.values())).values()))["tasks"]
    png = stats.plot_curves(summary, curve, [f"{i}\n{n}" for i, n in enumerate(tasks, 1)], out.with_suffix(".png"),
                            "task-known AA over seen tasks (Rm, %)", "Average accuracy after each task")
    pairs = {len(c["rows"][0]["known"][tasks[0]][0]) for by_seed in results.values() for c in by_seed.values()}
    lines = [
        f"# Continual-learning methods on one stream: {len(summary.seeds)} seeds, mean and {stats.LEVEL}% CI",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Device: {device}. Stream: {stream}. Seeds {', '.join(map(str, summary.seeds))}; test pairs per task: "
        f"{', '.join(map(str, sorted(pairs)))}.",
        "",
        "Rm in percent (the mean of R@1/5/10, image→text and text→image), task-known (each query ranked within its "
        "own task) unless said; AA = mean of the last row of R, forgetting = mean over earlier tasks of (best earlier "
        "R[l][j] − final R[T][j]; lower is better), BWT = mean of R[T][j] − R[j][j]. Zero-shot = Rm on a held-out task "
        "that no version trains on (its own gallery) after the last task, and its drop from version 1 (positive = "
        "lost; lower is better). Step time ×" + (base or "finetune") + " = the method's mean training step (batch in "
        "hand to optimizer step and method hooks done, last epoch of each task, mean over the tasks after the first) "
        "÷ the baseline's on the same seed, same micro batch; minutes = wall time of all its task jobs, the first "
        "task's included (shared by the rows that start alike). " + stats.describe(summary),
        "",
    ]
    headline = tables["headline"]
    rows = []
    for label, est in summary.estimates.items():
        ratios, minutes = zip(*(cost(c, results[base][s] if base else None) for s, c in results[label].items()))
        ratio = finite_mean(ratios)
        rows.append([label, *(est[st.name].format() for st in headline),
                     accuracy_cell(list(results[label].values())), "-" if math.isnan(ratio) else f"{ratio:.2f}",
                     float(np.mean(minutes))])
    lines += report.table(["method", *(f"{st.name} (lower is better)" if st.lower_is_better else st.name
                                       for st in headline), "zero-shot top-1 % (seeds' range)",
                           f"step time ×{base or '-'}", "minutes"], rows)
    lines += ["", "## Recall after the last task", "",
              "R@K of the last row of R, the mean over its tasks and both directions; task-known: each query in its "
              "own task's gallery; task-unknown: in the union of every task's gallery.", ""]
    lines += report.table(["method", *(st.name for st in tables["recall"])],
                          [[label, *(est[st.name].format() for st in tables["recall"])]
                           for label, est in summary.estimates.items()])
    for paired in ([summary] if base else []) + ([versus] if versus else []):
        against = paired.baseline
        lines += ["", f"## Paired difference against {against}", "",
                  f"Each method minus {against}, seed by seed (same seed = same data and queries; each seed's "
                  f"statistic on its whole test set), signed so that > 0 favours the method: for forgetting and the "
                  f"zero-shot drop, where lower is better, it is {against} − method.", ""]
        lines += stats.difference_table(paired, compared(tables))
        if paired is summary:
            forest = stats.plot_forest(summary, [headline[0], headline[1], headline[3], headline[5]],
                                       out.with_name(f"{out.stem}-forest.png"), compared(tables))
            lines += ["", f"![paired differences against {base}]({forest.name})"]
    if len(tables["modes"]) > 4:  # more gallery modes than task-known and task-unknown
        lines += ["", "## Every gallery mode", ""]
        lines += report.table(["method", *(st.name for st in tables["modes"])],
                              [[label, *(est[st.name].format() for st in tables["modes"])]
                               for label, est in summary.estimates.items()])
    sd = {label: {k: finite_mean(d.get(k, math.nan) for c in by_seed.values() for d in c["sd"][1:]) for k in SD_COLUMNS}
          for label, by_seed in results.items()}
    sd = {label: row for label, row in sd.items() if any(map(math.isfinite, row.values()))}
    if sd:
        lines += ["", "Mod-X's spatial disorder between consecutive versions on the old tasks' test pairs (mean over "
                  "tasks 2..T and the seeds; degrees): how far each modality rotated, how differently the two rotated, "
                  "and the share of pairs the old version retrieved whose image-text angle moved by at most 5°.", ""]
        lines += report.table(["method", *SD_COLUMNS.values()], [[label, *row.values()] for label, row in sd.items()])
    lines += ["", f"![task-known AA after each task]({png.name})"]
    return report.write(out, lines)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
