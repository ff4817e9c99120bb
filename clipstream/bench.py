"""`clipstream bench index-policy`: the continual cross-modal retrieval paper's experiment on our benchmark.

A stream is trained with one method; after each task its gallery is indexed twice, once per policy
(no-reindex: only the new task, embedded by the new version; reindex: every task re-embedded by it).
At the end, queries from the last version are ranked through each index, task-known and task-unknown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from clipstream.indexing import POLICIES, evaluate_through_index, index_task
from clipstream.settings import Settings
from services.index import open_index
from training import evaluate, models
from training.data.synth import synthesize
from training.data.task import Task
from training.job import run_task
from training.registry import Registry

COLUMNS = ("i2t_R@1", "i2t_R@10", "t2i_R@1", "t2i_R@10")


def index_policy(settings: Settings, tasks: int = 3, seed: int = 0, method: str = "finetune", workers: int = 2,
                 overrides: Iterable[str] = (), out: Path = Path("benchmarks/results/index-policy.md")) -> str:
    stream = f"bench-index-policy-s{seed}-{time.strftime('%Y%m%d%H%M%S')}"
    settings = settings.model_copy(update={"stream": stream})
    dirs = synthesize(settings.data_dir / stream, tasks=tasks, seed=seed, digits=False)
    parent = None
    for folder in dirs:
        print(f"== {folder.name}: train ({method}), then index under both policies", flush=True)
        parent = run_task(folder, method, parent, workers, overrides, settings).version
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
    table = _markdown(results, [t.name for t in task_list], tasks, seed, method, overrides)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table)
    return table


def _markdown(results: dict, names: list[str], tasks: int, seed: int, method: str, overrides: Iterable[str]) -> str:
    sets = " ".join(f"--set {o}" for o in overrides)
    lines = [
        "# Index policy: no-reindex vs reindex",
        "",
        f"Stream: {tasks} synthetic domain tasks (seed {seed}), `{method}`, queries from the last version. "
        f"Reproduce: `clipstream bench index-policy --tasks {tasks} --seed {seed} --method {method} {sets}`.",
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
