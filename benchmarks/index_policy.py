"""`clipstream bench index-policy`: the experiment of "Continual learning in cross-modal retrieval" (Wang,
Herranz and van de Weijer, arXiv:2104.06806). A stream is trained with one method; after each task its
gallery is indexed twice, once per policy (no-reindex: only the new task, embedded by the new version;
reindex: every task re-embedded by it). At the end, queries from the last version are ranked through each
index, task-known and task-unknown. Writes benchmarks/results/index-policy.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Iterable, Sequence

from clipstream.benchmarks import report
from clipstream.benchmarks.continual_methods import add_training_arguments, seeded
from clipstream.index import POLICIES, open_index
from clipstream.indexing import evaluate_through_index, index_task
from clipstream.registry import Registry
from clipstream.settings import Settings
from clipstream.training import evaluate
from clipstream.training.data.synth import synthesize
from clipstream.training.data.task import Task
from clipstream.training.job import run_task

COLUMNS = ("i2t_R@1", "i2t_R@10", "t2i_R@1", "t2i_R@10")


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=3, help="synthetic domain tasks (default 3)")
    p.add_argument("--method", default="finetune", help="the method preset the stream trains with (default finetune)")
    p.add_argument("--out", default=str(report.RESULTS / "index-policy.md"))
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = parser(prog).parse_args(argv)
    text = index_policy(Settings(), args.tasks, args.seed, args.method, args.workers, args.set, Path(args.out))
    print(text)
    return text


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

    bundle = Registry(settings).load(parent)
    task_list = [Task.load(d) for d in dirs]
    results = {"in memory (= reindex)": evaluate.evaluate_seen([evaluate.embed_task(bundle, t) for t in task_list])}
    for policy in POLICIES:
        with open_index(settings, f"{stream}-{policy}") as index:
            results[policy] = evaluate_through_index(index, bundle, task_list)
    return index_policy_report(results, [t.name for t in task_list], tasks, seed, method, overrides, out)


def index_policy_report(results: dict, names: list[str], tasks: int, seed: int, method: str,
                        overrides: Iterable[str], out: Path) -> str:
    """Write the markdown table of `index_policy` to `out`: per policy and mode, R@K of each task and their mean."""
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
        rows = []
        for policy, scores in results.items():
            for name in names + ["mean"]:
                rows.append([policy, name, *([scores[mode][name][c] for c in COLUMNS] if name != "mean" else
                                             [sum(scores[mode][n][c] for n in names) / len(names) for c in COLUMNS])])
        lines += [f"## Task-{mode}", "", *report.table(["policy", "task", *COLUMNS], rows), ""]
    return report.write(out, lines)


if __name__ == "__main__":
    main()
