"""`clipstream bench index-policy`: the experiment of "Continual learning in cross-modal retrieval" (Wang,
Herranz and van de Weijer, arXiv:2104.06806). A stream is trained with one method; after each task its
gallery is indexed twice, once per policy (no-reindex: only the new task, embedded by the new version;
reindex: every task re-embedded by it). At the end, queries from the last version are ranked through each
index, task-known and task-unknown, and checked against the final row of the R matrices the jobs' evaluation
logged under each policy (`training.job.evaluate_version`), which the report shows in full, row by row.
Writes benchmarks/results/index-policy.md.

Each reindex is also run a second time with its stored image vectors re-embedded rather than kept, on an index
of its own: the seconds between the two are what a version whose image tower did not change (CLL-CLIP's, on a
`--languages` stream) saves. A language stream's first task (English) is trained with `finetune`: the CLIP
that the method then teaches the other languages.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

from clipstream.benchmarks import report
from clipstream.benchmarks.continual_methods import add_training_arguments, seeded, training_sets
from clipstream.index import NO_REINDEX, POLICIES, REINDEX, open_index
from clipstream.indexing import evaluate_through_index, index_task
from clipstream.registry import Registry
from clipstream.settings import Settings, configure_process
from clipstream.training import evaluate, job
from clipstream.training.data.synth import synthesize, synthesize_languages
from clipstream.training.data.task import Task
from clipstream.training.job import NOREINDEX, run_task

COLUMNS = ("i2t_R@1", "i2t_R@10", "t2i_R@1", "t2i_R@10")


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=3, help="synthetic domain tasks (default 3)")
    p.add_argument("--method", default="finetune", help="the method preset the stream trains with (default finetune)")
    p.add_argument("--languages", type=int, default=0,
                   help="a language stream of K tasks instead of domain tasks (English, then K-1 synthetic languages)")
    p.add_argument("--test-per-task", type=int, default=None,
                   help="gallery pairs per task (default: the synthetic benchmark's, 64 per domain, 48 per language)")
    p.add_argument("--out", default=str(report.RESULTS / "index-policy.md"))
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = report.parse(parser(prog), argv)
    text = index_policy(Settings(), args.tasks, args.seed, args.method, args.workers, training_sets(args), Path(args.out),
                        args.languages, args.test_per_task)
    print(text)
    return text


def index_policy(settings: Settings, tasks: int = 3, seed: int = 0, method: str = "finetune", workers: int = 2,
                 overrides: Iterable[str] = (), out: Path = Path("benchmarks/results/index-policy.md"),
                 languages: int = 0, test_per_task: int | None = None) -> str:
    stream = f"bench-index-policy-s{seed}-{time.strftime('%Y%m%d%H%M%S')}"
    overrides = list(overrides)
    train_sets = [*seeded(seed), *overrides]
    settings = settings.model_copy(update={"stream": stream})
    gallery = {"test_per_task": test_per_task} if test_per_task else {}
    dirs = (synthesize_languages(settings.data_dir / stream, languages, seed=seed, **gallery) if languages else
            synthesize(settings.data_dir / stream, tasks=tasks, seed=seed, digits=False, **gallery))
    parent, costs, result = None, [], None
    for i, folder in enumerate(dirs):
        trainer = "finetune" if languages and i == 0 else method
        print(f"== {folder.name}: train ({trainer}), then index under both policies", flush=True)
        result = run_task(folder, trainer, parent, workers, train_sets if trainer == method else seeded(seed), settings)
        parent = result.version
        seconds = {}
        for policy, reuse in [*((p, True) for p in POLICIES), (REINDEX, False)]:
            tic = time.perf_counter()
            index_task(settings, parent, folder, policy, index_name=f"{stream}-{policy}{'' if reuse else '-full'}",
                       reuse_images=reuse)
            seconds[policy if reuse else "full"] = time.perf_counter() - tic
        costs.append((folder.name, trainer, seconds))

    bundle = Registry(settings).load(parent)
    task_list = [Task.load(d) for d in dirs]
    results = {"in memory (= reindex)": evaluate.evaluate_seen(evaluate.embed_tasks(bundle, task_list))}
    for policy in POLICIES:
        with open_index(settings, f"{stream}-{policy}") as index:
            results[policy] = evaluate_through_index(index, bundle, task_list)
    return index_policy_report(results, [t.name for t in task_list], tasks, seed, method, overrides, out, costs,
                               languages, test_per_task, result.matrices)


# the R matrices of the evaluation, by name in `TaskResult.matrices`: (index policy, gallery mode), in report order
MATRICES = {name: (NO_REINDEX if name.startswith(NOREINDEX) else REINDEX, name.removeprefix(NOREINDEX))
            for name in job.MATRICES}


def matrix_sections(matrices: dict[str, evaluate.ResultMatrix], results: dict) -> list[str]:
    """The evaluation's R matrices under both policies (Rm, row i after task i, with AA, forgetting and BWT), then
    its final rows beside the same queries ranked through each policy's index (`results`): the two paths agree up
    to the index's float rounding and its top-k cut, so a difference there is a bug in one of them."""
    lines = ["## R matrices of the evaluation (Rm), both policies", "",
             "R[i][j] = Rm after task i on task j, as each version's evaluation logged it: reindex ranks every gallery "
             "as the evaluated version embeds it; no-reindex ranks that version's queries against each task's gallery "
             "as the version trained on it embedded it (task-unknown: the union of those).", ""]
    for name, (policy, mode) in MATRICES.items():
        matrix = matrices.get(name)
        if matrix is None:
            continue
        labels, values = matrix.shown()
        rows = [[label, *[f"{v:.1f}" if math.isfinite(v) else "" for v in row],
                 f"{matrix.average_accuracy(i - (len(labels) - len(matrix.tasks))):.1f}"
                 if label in matrix.tasks else ""] for i, (label, row) in enumerate(zip(labels, values))]
        lines += [f"### {policy}, task-{mode}", "", *report.table(["after \\ on", *matrix.columns, "AA"], rows), "",
                  f"AA {matrix.average_accuracy():.1f}, forgetting {matrix.mean_forgetting():.1f}, "
                  f"BWT {matrix.bwt():+.1f}", ""]
    rows = []
    for name, (policy, mode) in MATRICES.items():
        if name in matrices and policy in results:
            final = matrices[name].values[-1]
            for j, task in enumerate(matrices[name].tasks):
                through = results[policy][mode][task]["Rm"]
                rows.append([policy, f"task-{mode}", task, f"{final[j]:.2f}", f"{through:.2f}",
                             f"{through - final[j]:+.2f}"])
    if rows:
        lines += ["### Final row: the evaluation against the index", "",
                  *report.table(["policy", "gallery", "task", "Rm, evaluation", "Rm, through the index", "difference"],
                                rows), ""]
    return lines


def index_policy_report(results: dict, names: list[str], tasks: int, seed: int, method: str,
                        overrides: Iterable[str], out: Path, costs: list = (), languages: int = 0,
                        test_per_task: int | None = None, matrices: dict | None = None) -> str:
    """Write the markdown tables of `index_policy` to `out`: per policy and mode, R@K of each task and their mean;
    then the seconds each indexing took, and what keeping the stored image vectors saved; then the evaluation's R
    matrices (`matrices`, by name as `TaskResult.matrices` holds them) and their final rows against the index's."""
    sets = "".join(f" --set {o}" for o in overrides)
    what = (f"{languages} language tasks (English trained with `finetune`, then `{method}`)" if languages
            else f"{tasks} synthetic domain tasks, `{method}`")
    size = (f"--languages {languages}" if languages else f"--tasks {tasks}") + \
        (f" --test-per-task {test_per_task}" if test_per_task else "")
    lines = [
        "# Index policy: no-reindex vs reindex",
        "",
        f"Machine: {report.device()}. Stream: {what} (seed {seed}), queries from the last version. "
        f"Reproduce: `clipstream bench index-policy {size} --seed {seed} --method {method}{sets} --out {out}`.",
        "R@K in percent; known = the query's own task's gallery, unknown = the union of all tasks' galleries.",
        "",
    ]
    if costs:
        rows = [(name, trainer, f"{s[NO_REINDEX]:.1f}", f"{s[REINDEX]:.1f}", f"{s['full']:.1f}",
                 f"{s['full'] - s[REINDEX]:.1f} ({1 - s[REINDEX] / s['full']:.0%})") for name, trainer, s in costs]
        lines += ["## Indexing cost (seconds, after each task)", "",
                  "reindex keeps the stored image vectors of a task when the version that made them has the new "
                  "version's image tower (a method that trains the text side only); `re-embedding all` is the same "
                  "reindex with every image embedded again, measured in the same run.", "",
                  *report.table(["after task", "trained with", "no-reindex", "reindex", "reindex, re-embedding all",
                                 "saved by reuse"], rows), ""]
    for mode in ("known", "unknown"):
        rows = []
        for policy, scores in results.items():
            for name in names + ["mean"]:
                rows.append([policy, name, *([scores[mode][name][c] for c in COLUMNS] if name != "mean" else
                                             [sum(scores[mode][n][c] for n in names) / len(names) for c in COLUMNS])])
        lines += [f"## Task-{mode}", "", *report.table(["policy", "task", *COLUMNS], rows), ""]
    if matrices:
        lines += matrix_sections(matrices, results)
    figure = plot(results, names, Path(out).with_suffix(".png"))
    lines[5:5] = [f"![R@10 of each task through each policy, task-known and task-unknown]({figure.name})", ""]
    return report.write(out, lines)


def plot(results: dict, names: list[str], path: Path) -> Path:
    """R@10 (image→text and text→image averaged) of each task and their mean, a bar per policy, task-known on the
    left and task-unknown on the right."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 + 1.6 * len(names), 4))
    labels = [*names, "mean"]
    width = 0.8 / len(results)
    for k, (ax, mode) in enumerate(zip(fig.subplots(1, 2, sharey=True), ("known", "unknown"))):
        for i, (policy, scores) in enumerate(results.items()):
            r10 = [(scores[mode][n]["i2t_R@10"] + scores[mode][n]["t2i_R@10"]) / 2 for n in names]
            ax.bar([x + (i - (len(results) - 1) / 2) * width for x in range(len(labels))], [*r10, sum(r10) / len(r10)],
                   width=width, label=policy)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        ax.set_title(f"task-{mode}")
        if k == 0:
            ax.set_ylabel("R@10, mean of i2t and t2i (%)")
            ax.legend(fontsize=8)
    return report.save_figure(fig, path)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
