"""`clipstream bench languages`: CLL-CLIP's experiment on the synthetic language stream. English is trained
first (`finetune`: the CLIP every method then teaches the other languages, and their frozen teacher); from that
one version each method learns the K-1 synthetic languages in turn, training the token embeddings only. Rows:

- embeddings: the token embeddings fine-tuned with the CLIP loss alone, new rows random (N(0, 0.02²)), no decay;
- cllclip: CLL-CLIP, its cross-modal + cross-lingual losses, new rows random, every row decayed (λ ≡ 1);
- no-cross-lingual, no-decay: CLL-CLIP with one knob off (its ablations: the cross-lingual loss; the rows' decay);
- teir: CLL-CLIP with TEIR (new rows from the old table's statistics, λ-scaled gradients and decay).

Reported from each stream's task-known R matrix (Rm, mean of R@1/5/10 both directions, per language's own test
gallery) over several seeds, each the mean with a 95% confidence interval (`benchmarks/stats.py`): AA, mean
forgetting, forgetting on English, English at the end, task-unknown AA and R@1/5/10, and each stream's paired
difference against `embeddings` (the plain fine-tuning of the token embeddings). Each (stream, seed) is a cached cell
(`benchmarks/cells.py`); the English version is trained once per seed and shared. Writes
benchmarks/results/languages.md (+ .png, -forest.png).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from clipstream.benchmarks import cells, report, stats
from clipstream.benchmarks.continual_methods import (
    TEST_PER_TASK,
    add_cell_arguments,
    add_training_arguments,
    check_cells,
    seeded,
    training_sets,
)
from clipstream.benchmarks.stats import Statistic
from clipstream.settings import Settings, configure_process
from clipstream.training.data.synth import synthesize_languages
from clipstream.training.evaluate import KS, ResultMatrix

# name -> (preset, overrides)
STREAMS = {
    "embeddings": ("cllclip", ["method.cllclip.cross_modal_weight=1.0", "method.cllclip.cross_lingual_weight=0.0",
                               "method.cllclip.weight_decay=0.0"]),
    "cllclip": ("cllclip", []),
    "no-cross-lingual": ("cllclip-no-cross-lingual", []),
    "no-decay": ("cllclip-no-decay", []),
    "teir": ("teir", []),
}
BASELINE = "embeddings"  # the paired differences' baseline: the token embeddings fine-tuned with the CLIP loss alone


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--languages", type=int, default=4, help="English plus K-1 synthetic languages (default 4)")
    p.add_argument("--streams", default=",".join(STREAMS), help=f"comma-separated, of {', '.join(STREAMS)}")
    p.add_argument("--out", default=str(report.RESULTS / "languages.md"))
    add_training_arguments(p, seed=False)
    add_cell_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = report.parse(parser(prog), argv)
    names = [n for n in args.streams.split(",") if n]
    unknown = sorted(set(names) - set(STREAMS))
    if unknown:
        raise SystemExit(f"unknown stream(s) {unknown}; known: {', '.join(STREAMS)}")
    text = languages(Settings(), args.languages, names, cells.parse_seeds(args.seeds), args.workers,
                     training_sets(args), Path(args.out), cells.parse_vary(args.vary), args.test_per_task, args.fresh,
                     args.cache, args.resamples)
    print(text)
    return text


def statistics(k: int, first: str) -> dict[str, list[Statistic]]:
    """What the tables report, by table, for a stream of English + k-1 languages (`first`: English's task)."""
    known = lambda v: v.rm("known")  # noqa: E731
    return {
        "headline": [
            Statistic("AA", lambda v: stats.average_accuracy(known(v))),
            Statistic("forgetting", lambda v: stats.forgetting(known(v)), lower_is_better=True),
            Statistic(f"forgetting on {first}", lambda v: known(v)[:, :-1, 0].max(axis=1) - known(v)[:, -1, 0],
                      lower_is_better=True),
            Statistic(f"{first} Rm at the end", lambda v: known(v)[:, -1, 0]),
            Statistic("final Rm (task-unknown AA)", lambda v: stats.average_accuracy(v.rm("unknown")))],
        "recall": [Statistic(f"task-{mode} R@{r}", lambda v, mode=mode, r=r: stats.average_accuracy(v.recall(mode, r)))
                   for mode in ("known", "unknown") for r in KS],
        "curve": [Statistic(f"{first} after task {t + 1}", lambda v, t=t: known(v)[:, t, 0]) for t in range(k)],
    }


def languages(settings: Settings, k: int, names: list[str], seeds: Sequence[int] = (0, 1, 2), workers: int = 2,
              overrides: Iterable[str] = (), out: Path = report.RESULTS / "languages.md",
              vary: Sequence[tuple[str, list[str]]] = (), test_per_task: int = TEST_PER_TASK, fresh: bool = False,
              cache: str | Path = "", resamples: int = 1000) -> str:
    if k < 2:
        raise ValueError(f"a language stream needs English and at least one more language, got {k}")
    overrides = list(overrides)
    seeds = check_cells(seeds, test_per_task, resamples)
    variants = cells.expand({n: STREAMS[n] for n in names}, vary, BASELINE, [*seeded(0), *overrides])
    key = {"bench": "languages", "languages": k, "test_per_task": test_per_task, "workers": workers,
           "overrides": overrides}
    store = cells.Cache(Path(cache) if cache else settings.home / "bench-cells" / "languages", fresh)
    # English is trained once per seed with finetune (the CLIP every stream teaches the other languages, and their
    # frozen teacher; the command's --set are the streams'), the parent of every stream's second language
    results = cells.run_seeds(settings, "languages", seeds, {"languages": k, "test_per_task": test_per_task},
                              lambda root, seed: synthesize_languages(root, k, seed=seed, test_per_task=test_per_task),
                              variants, lambda v: ("finetune", ()), workers, lambda seed: [*seeded(seed), *overrides],
                              store, key, first_base=seeded)
    first = next(iter(next(iter(results.values())).values()))["tasks"][0]
    tables = statistics(k, first)
    summary = stats.bootstrap(cells.streams(results), [st for table in tables.values() for st in table],
                              BASELINE if BASELINE in results else None, resamples)
    return languages_report(summary, results, tables, k, test_per_task, overrides, vary, workers, Path(out))


def languages_report(summary: stats.Summary, results: dict[str, dict[int, dict]], tables: dict[str, list[Statistic]],
                     k: int, test_per_task: int, overrides: Iterable[str], vary: Sequence[tuple[str, list[str]]],
                     workers: int, out: Path) -> str:
    """The summary table, recall, the paired differences against embeddings and each stream's R matrix (the mean
    over seeds); a plot of English's Rm after each language with its band, and the forest plot."""
    out = Path(out)
    sets = "".join(f" --set {o}" for o in overrides) + "".join(f" --vary {key}={','.join(v)}" for key, v in vary)
    seeds = ",".join(map(str, summary.seeds))
    tasks = next(iter(next(iter(results.values())).values()))["tasks"]
    headline = tables["headline"]
    lines = [
        f"# Languages: CLL-CLIP and TEIR against fine-tuning the token embeddings, {len(summary.seeds)} seeds",
        "",
        f"Reproduce: `clipstream bench languages --languages {k} --seeds {seeds} --test-per-task {test_per_task} "
        f"--streams {','.join(dict.fromkeys(label.split()[0] for label in results))} --workers {workers}{sets} "
        f"--resamples {summary.resamples} --out {out}`",
        "",
        f"Device: {report.device(f'{workers} Ray Train workers')}. Stream: English then {k - 1} synthetic languages "
        f"(the same images in every language; {test_per_task} test pairs per task), all learnt from one English "
        "version per seed trained with `finetune`. Rm in percent (mean of R@1/5/10, both directions, task-known); "
        "forgetting F_j = best earlier Rm on task j minus the last; lower is better. " + stats.describe(summary),
        "",
        *report.table(["stream", "preset", *(f"{st.name} (lower is better)" if st.lower_is_better else st.name
                                             for st in headline)],
                      [[label, STREAMS[label.split()[0]][0], *(est[st.name].format() for st in headline)]
                       for label, est in summary.estimates.items()]),
        "",
        "R@K of the last row of R, the mean over its tasks and both directions:",
        "",
        *report.table(["stream", *(st.name for st in tables["recall"])],
                      [[label, *(est[st.name].format() for st in tables["recall"])]
                       for label, est in summary.estimates.items()]),
    ]
    if summary.baseline:
        compared = [*headline, tables["recall"][len(KS)]]
        lines += ["", f"Paired difference against {summary.baseline}, seed by seed (same seed = same data and queries; "
                  "each seed's statistic on its whole test set; > 0 favours the stream):", ""]
        lines += stats.difference_table(summary, compared, label="stream")
        forest = stats.plot_forest(summary, headline[:4], out.with_name(f"{out.stem}-forest.png"), compared)
        lines += ["", f"![paired differences against {summary.baseline}]({forest.name})"]
    png = stats.plot_curves(summary, [st.name for st in tables["curve"]], [t.split("-lang-")[-1] for t in tasks],
                            out.with_suffix(".png"), f"Rm on {tasks[0]} (%)", "English retrieval after each language")
    lines += ["", f"![English retrieval after each language]({png.name})", ""]
    for label, by_seed in results.items():
        mean = np.mean([stats.point_matrix(stats.Stream(c["tasks"], c["rows"]), "known") for c in by_seed.values()],
                       axis=0)
        matrix = ResultMatrix(tasks, [list(mean[i, : i + 1]) for i in range(len(tasks))])
        lines += [f"## {label} (task-known R, mean over seeds)", "", "```", matrix.format_table(), "```", ""]
    return report.write(out, lines)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
