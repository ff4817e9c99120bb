"""`clipstream bench methods`: every continual-learning method trained on the same synthetic stream, one
MLflow experiment (stream) each; AA, forgetting, BWT, task-unknown AA, zero-shot retrieval on a held-out
task no method trains on (and its drop from version 1) and the cost per step relative to finetune, as a
table and a plot of AA after each task. Writes benchmarks/results/methods.md (+ .png).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from matplotlib.figure import Figure

from clipstream import models
from clipstream.benchmarks import report
from clipstream.registry import Registry
from clipstream.settings import Settings, configure_process
from clipstream.training.data.synth import held_out_task, synthesize
from clipstream.training.job import run_task
from clipstream.training.methods import build
from clipstream.training.methods.config import load_presets, method_presets, resolve


def seeded(seed: int) -> list[str]:
    """What makes a benchmark rerun give the same numbers: `--seed` seeds the data and the training, and
    the input is ordered (`train.deterministic`). `--set` can still override either."""
    return [f"train.seed={seed}", "train.deterministic=true"]


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every benchmark that trains streams (as `clipstream train` has them)."""
    parser.add_argument("--seed", type=int, default=0, help="seeds the synthetic data and the training (default 0)")
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default 2)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a preset value for every stream, e.g. train.epochs=2")
    parser.add_argument("--arch", default="", help="the model every stream trains: any open_clip architecture by name, "
                                                   "e.g. ViT-B-32 (default: the presets' own; --set model.arch=)")


def training_sets(args: argparse.Namespace) -> list[str]:
    """The `--set` overrides of every stream, `--arch` first as model.arch (looked up by name: an unknown one is one
    line before anything runs)."""
    if args.arch:
        models.architecture(args.arch)
    return [f"model.arch={args.arch}"] * bool(args.arch) + args.set


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=3, help="domain tasks; the digits task is added last (default 3)")
    p.add_argument("--methods", default=",".join(method_presets()),
                   help="comma-separated method presets, one stream each (default: every preset)")
    p.add_argument("--start-with", default="", metavar="PRESET",
                   help="train every stream's first task with this preset (a trained CLIP for the others to adapt, "
                        "as a pretrained checkpoint would be); default: each method itself, except those that need "
                        "a trained start (CLL-CLIP), which start with finetune")
    p.add_argument("--out", default=str(report.RESULTS / "methods.md"), help="the markdown; the plot goes next to it (.png)")
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = report.parse(parser(prog), argv)
    text = methods(Settings(), args.tasks, args.seed, args.methods.split(","), args.workers, training_sets(args),
                   Path(args.out),
                   args.start_with)
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


def methods(settings: Settings, tasks: int = 3, seed: int = 0, names: Sequence[str] = (), workers: int = 2,
            overrides: Iterable[str] = (), out: Path = Path("benchmarks/results/methods.md"), start_with: str = "") -> str:
    """Train the same synthetic stream (`tasks` domain tasks + digits) once per method, each in its own
    stream (MLflow experiment and registered model); write the comparison to `out` and its plot next to it."""
    overrides = list(overrides)
    train_sets = [*seeded(seed), *overrides]
    names = check_methods(names or method_presets(), train_sets)
    if start_with:
        check_methods([start_with], train_sets)
    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    stamp = time.strftime("%Y%m%d%H%M%S")
    root = settings.data_dir / f"bench-methods-s{seed}-{stamp}"
    dirs = synthesize(root, tasks=tasks, seed=seed)
    zero_shot = [held_out_task(root)]
    results: dict[str, dict] = {}
    for m, method in enumerate(names, 1):
        run_settings = settings.model_copy(update={"stream": f"bench-methods-{method}-s{seed}-{stamp}"})
        registry, parent, steps, seconds, result, sd = Registry(run_settings), None, [], 0.0, None, []
        # CLL-CLIP teaches a trained CLIP: its stream's first task is trained with finetune
        first = start_with or ("finetune" if build(resolve(method, train_sets)).needs_trained_start else method)
        for t, folder in enumerate(dirs, 1):
            trainer = first if t == 1 else method
            print(f"== method {m}/{len(names)} {method}: task {t}/{len(dirs)} {folder.name} with {trainer} "
                  f"(parent {parent or 'none'})", flush=True)
            result = run_task(folder, trainer, parent, workers, train_sets, run_settings,
                              zero_shot=zero_shot if t == 1 else ())  # the later versions inherit it
            parent, seconds = result.version, seconds + result.seconds
            metrics = registry.run_metrics(result.run_id)
            steps.append(metrics.get("train/step_ms", math.nan))
            if t > 1:
                sd.append({k: metrics.get(k, math.nan) for k in SD_COLUMNS})
        results[method] = {"known": result.known, "unknown": result.unknown, "step_ms": float(np.mean(steps)),
                           "zero_shot": result.zero_shot,
                           "seconds": seconds, "sd": {k: float(np.nanmean([d[k] for d in sd])) for k in SD_COLUMNS}
                           if sd else {}}
        print(f"== method {m}/{len(names)} {method}: AA {result.known.average_accuracy():.1f}, "
              f"forgetting {result.known.mean_forgetting():.1f}, BWT {result.known.bwt():.1f}, "
              f"zero-shot {result.zero_shot[-1]:.1f} (drop {result.zero_shot[0] - result.zero_shot[-1]:.1f}), "
              f"{seconds / 60:.1f} min", flush=True)
    sets = "".join(f" --set {o}" for o in overrides)
    command = (f"clipstream bench methods --tasks {tasks} --seed {seed} --methods {','.join(names)} "
               f"--workers {workers}{sets}{f' --start-with {start_with}' if start_with else ''} --out {out}")
    return methods_report(results, Path(out), command, report.device(f"{workers} Ray Train workers"),
                          f"{tasks} synthetic domain tasks + the digits task (seed {seed}); zero-shot: the held-out "
                          f"domain task {zero_shot[0].name}" + (
                              f"; every stream trains its first task with {start_with}" if start_with else "".join(
                                  f"; {n} trains the first task with finetune (it teaches a trained CLIP)" for n in names
                                  if build(resolve(n, train_sets)).needs_trained_start)))


def methods_report(results: dict[str, dict], out: Path, command: str, device: str, stream: str = "") -> str:
    """Write the comparison table to `out` (markdown) and AA after each task to `out` with suffix .png;
    return the markdown. `results`: method -> {"known": ResultMatrix, "unknown": ResultMatrix,
    "step_ms": mean time of a training step over its tasks, "seconds": wall time of all its tasks, "zero_shot":
    held-out Rm after each task (optional)}."""
    out = Path(out)
    png = plot_methods(results, out.with_suffix(".png"))
    base = results.get("finetune", {}).get("step_ms", math.nan)
    lines = [
        "# Continual-learning methods on one stream",
        "",
        f"Reproduce: `{command}`",
        "",
        f"Device: {device}." + (f" Stream: {stream}." if stream else ""),
        "",
        "Rm in percent, task-known (each query ranked within its own task) unless said; AA = mean of the last row "
        "of R, forgetting = mean over earlier tasks of (best earlier R[l][j] − final R[T][j]), BWT = mean of "
        "R[T][j] − R[j][j]. Step time ×finetune = the method's mean training step (batch in hand to optimizer step "
        "and method hooks done, last epoch of each task, mean over tasks) ÷ finetune's, same micro batch; minutes = "
        "wall time of all its task jobs. Zero-shot = Rm on a held-out task that no version trains on (its own "
        "gallery) after the last task, and its drop from version 1 (positive = lost).",
        "",
    ]
    rows = []
    for method, r in results.items():
        known, unknown, step = r["known"], r["unknown"], r["step_ms"]
        ratio = step / base if math.isfinite(base) and math.isfinite(step) and base > 0 else math.nan
        zs = r.get("zero_shot")
        rows.append([method, known.average_accuracy(), known.mean_forgetting(), known.bwt(), unknown.average_accuracy(),
                     zs[-1] if zs else "-", zs[0] - zs[-1] if zs else "-", "-" if math.isnan(ratio) else f"{ratio:.2f}",
                     r["seconds"] / 60])
    lines += report.table(["method", "AA", "forgetting", "BWT", "final Rm (task-unknown AA)", "zero-shot Rm",
                           "zero-shot drop", "step time ×finetune", "minutes"], rows)
    if any(r.get("sd") for r in results.values()):
        lines += ["", "Mod-X's spatial disorder between consecutive versions on the old tasks' test pairs (mean over "
                  "tasks 2..T; degrees): how far each modality rotated, how differently the two rotated, and the "
                  "share of pairs the old version retrieved whose image-text angle moved by at most 5°.", ""]
        lines += report.table(["method", *SD_COLUMNS.values()],
                              [[method, *(r["sd"][k] for k in SD_COLUMNS)] for method, r in results.items() if r.get("sd")])
    lines += ["", f"![task-known AA after each task]({png.name})"]
    return report.write(out, lines)


def plot_methods(results: dict[str, dict], path: Path) -> Path:
    """One line per method: task-known AA over the tasks seen so far, after each task (bare Figure, Agg)."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    names: list[str] = []
    for method, r in results.items():
        known = r["known"]
        names = max(names, list(known.tasks), key=len)
        x = range(1, len(known.tasks) + 1)
        ax.plot(x, [known.average_accuracy(i) for i in range(len(known.tasks))], marker="o", label=method)
    ax.set_xticks(range(1, len(names) + 1), [f"{i}\n{n}" for i, n in enumerate(names, 1)], fontsize=8)
    ax.set_xlabel("after task")
    ax.set_ylabel("task-known AA over seen tasks (Rm, %)")
    ax.set_title("Average accuracy after each task")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return report.save_figure(fig, path)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
