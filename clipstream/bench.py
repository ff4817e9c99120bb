"""Reproducible experiments on the synthetic benchmark.

`clipstream bench index-policy`: the continual cross-modal retrieval paper's experiment. A stream is trained
with one method; after each task its gallery is indexed twice, once per policy (no-reindex: only the new task,
embedded by the new version; reindex: every task re-embedded by it). At the end, queries from the last version
are ranked through each index, task-known and task-unknown.

`clipstream bench methods`: every continual-learning method trained on the same stream, one MLflow
experiment each; AA, forgetting, BWT, task-unknown AA and the cost per step relative to finetune.
"""

from __future__ import annotations

import math
import os
import platform
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from matplotlib.figure import Figure

from clipstream.indexing import POLICIES, evaluate_through_index, index_task
from clipstream.settings import Settings
from services.index import open_index
from training import evaluate, models
from training.data.synth import synthesize
from training.data.task import Task
from training.job import run_task
from training.methods.config import load_presets, resolve
from training.registry import Registry

COLUMNS = ("i2t_R@1", "i2t_R@10", "t2i_R@1", "t2i_R@10")


def seeded(seed: int) -> list[str]:
    """What makes a benchmark rerun give the same numbers: `--seed` seeds the data and the training, and
    the input is ordered (`train.deterministic`). `--set` can still override either."""
    return [f"train.seed={seed}", "train.deterministic=true"]


def index_policy(settings: Settings, tasks: int = 3, seed: int = 0, method: str = "finetune", workers: int = 2,
                 overrides: Iterable[str] = (), out: Path = Path("benchmarks/results/index-policy.md")) -> str:
    stream = f"bench-index-policy-s{seed}-{time.strftime('%Y%m%d%H%M%S')}"
    overrides = list(overrides)
    train_sets = [*seeded(seed), *overrides]
    settings = settings.model_copy(update={"stream": stream})
    dirs = synthesize(settings.data_dir / stream, tasks=tasks, seed=seed, digits=False)
    parent = None
    for folder in dirs:
        print(f"== {folder.name}: train ({method}), then index under both policies", flush=True)
        parent = run_task(folder, method, parent, workers, train_sets, settings).version
        for policy in POLICIES:
            index_task(settings, parent, folder, policy, index_name=f"{stream}-{policy}")

    bundle = models.load_exported(Registry(settings).resolve(parent).folder)
    task_list = [Task.load(d) for d in dirs]
    results = {"in memory (= reindex)": evaluate.evaluate_seen([evaluate.embed_task(bundle, t) for t in task_list])}
    for policy in POLICIES:
        index = open_index(settings, f"{stream}-{policy}")
        try:
            results[policy] = evaluate_through_index(index, bundle, task_list)
        finally:
            index.close()
    table = index_policy_report(results, [t.name for t in task_list], tasks, seed, method, overrides, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    return table


def index_policy_report(results: dict, names: list[str], tasks: int, seed: int, method: str,
                        overrides: Iterable[str], out: Path) -> str:
    """The markdown table of `index_policy`: per policy and mode, R@K of each task and their mean."""
    sets = "".join(f" --set {o}" for o in overrides)
    lines = [
        "# Index policy: no-reindex vs reindex",
        "",
        f"Stream: {tasks} synthetic domain tasks (seed {seed}), `{method}`, queries from the last version. "
        f"Reproduce: `clipstream bench index-policy --tasks {tasks} --seed {seed} --method {method}{sets} --out {out}`.",
        "R@K in percent; known = the query's own task's gallery, unknown = the union of all tasks' galleries.",
        "",
    ]
    for mode in ("known", "unknown"):
        lines += [f"## Task-{mode}", "", "| policy | task | " + " | ".join(COLUMNS) + " |",
                  "|---|---|" + "---|" * len(COLUMNS)]
        for policy, scores in results.items():
            for name in names + ["mean"]:
                row = ([scores[mode][name][c] for c in COLUMNS] if name != "mean" else
                       [sum(scores[mode][n][c] for n in names) / len(names) for c in COLUMNS])
                lines.append(f"| {policy} | {name} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
        lines.append("")
    return "\n".join(lines)


SD_COLUMNS = {"sd/image_rotation_mean": "image rotation", "sd/text_rotation_mean": "text rotation",
              "sd/intermodal_deviation_mean": "inter-modal deviation", "sd/imav_le5_pct": "ImAV ≤ 5° (%)"}
METHODS = ("finetune", "joint", "ewc", "mas", "lwf", "er", "modx", "ctp", "ctp_er")


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


def methods(settings: Settings, tasks: int = 3, seed: int = 0, names: Sequence[str] = METHODS, workers: int = 2,
            overrides: Iterable[str] = (), out: Path = Path("benchmarks/results/methods.md")) -> str:
    """Train the same synthetic stream (`tasks` domain tasks + digits) once per method, each in its own
    stream (MLflow experiment and registered model); write the comparison to `out` and its plot next to it."""
    overrides = list(overrides)
    train_sets = [*seeded(seed), *overrides]
    names = check_methods(names, train_sets)
    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    stamp = time.strftime("%Y%m%d%H%M%S")
    dirs = synthesize(settings.data_dir / f"bench-methods-s{seed}-{stamp}", tasks=tasks, seed=seed)
    results: dict[str, dict] = {}
    for m, method in enumerate(names, 1):
        run_settings = settings.model_copy(update={"stream": f"bench-methods-{method}-s{seed}-{stamp}"})
        registry, parent, steps, seconds, result, sd = Registry(run_settings), None, [], 0.0, None, []
        for t, folder in enumerate(dirs, 1):
            print(f"== method {m}/{len(names)} {method}: task {t}/{len(dirs)} {folder.name} "
                  f"(parent {parent or 'none'})", flush=True)
            result = run_task(folder, method, parent, workers, train_sets, run_settings)
            parent, seconds = result.version, seconds + result.seconds
            metrics = registry.run_metrics(result.run_id)
            steps.append(metrics.get("train/step_ms", math.nan))
            if t > 1:
                sd.append({k: metrics.get(k, math.nan) for k in SD_COLUMNS})
        results[method] = {"known": result.known, "unknown": result.unknown, "step_ms": float(np.mean(steps)),
                           "seconds": seconds, "sd": {k: float(np.nanmean([d[k] for d in sd])) for k in SD_COLUMNS}
                           if sd else {}}
        print(f"== method {m}/{len(names)} {method}: AA {result.known.average_accuracy():.1f}, "
              f"forgetting {result.known.mean_forgetting():.1f}, BWT {result.known.bwt():.1f}, "
              f"{seconds / 60:.1f} min", flush=True)
    sets = "".join(f" --set {o}" for o in overrides)
    command = (f"clipstream bench methods --tasks {tasks} --seed {seed} --methods {','.join(names)} "
               f"--workers {workers}{sets} --out {out}")
    return methods_report(results, Path(out), command, _device(workers),
                          f"{tasks} synthetic domain tasks + the digits task (seed {seed})")


def methods_report(results: dict[str, dict], out: Path, command: str, device: str, stream: str = "") -> str:
    """Write the comparison table to `out` (markdown) and AA after each task to `out` with suffix .png;
    return the markdown. `results`: method -> {"known": ResultMatrix, "unknown": ResultMatrix,
    "step_ms": mean time of a training step over its tasks, "seconds": wall time of all its tasks}."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
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
        "wall time of all its task jobs.",
        "",
        "| method | AA | forgetting | BWT | final Rm (task-unknown AA) | step time ×finetune | minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        known, unknown, step = r["known"], r["unknown"], r["step_ms"]
        ratio = step / base if math.isfinite(base) and math.isfinite(step) and base > 0 else math.nan
        cells = [known.average_accuracy(), known.mean_forgetting(), known.bwt(), unknown.average_accuracy()]
        lines.append(f"| {method} | " + " | ".join(f"{v:.1f}" for v in cells) +
                     f" | {'-' if math.isnan(ratio) else f'{ratio:.2f}'} | {r['seconds'] / 60:.1f} |")
    if any(r.get("sd") for r in results.values()):
        lines += ["", "Mod-X's spatial disorder between consecutive versions on the old tasks' test pairs (mean over "
                  "tasks 2..T; degrees): how far each modality rotated, how differently the two rotated, and the "
                  "share of pairs the old version retrieved whose image-text angle moved by at most 5°.", "",
                  "| method | " + " | ".join(SD_COLUMNS.values()) + " |", "|---|" + "---|" * len(SD_COLUMNS)]
        lines += [f"| {method} | " + " | ".join(f"{r['sd'][k]:.1f}" for k in SD_COLUMNS) + " |"
                  for method, r in results.items() if r.get("sd")]
    lines += ["", f"![task-known AA after each task]({png.name})", ""]
    text = "\n".join(lines)
    out.write_text(text)
    return text


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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _device(workers: int) -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPUs), {workers} Ray Train workers"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), {workers} Ray Train workers"
