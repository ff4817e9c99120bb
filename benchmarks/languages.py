"""`clipstream bench languages`: CLL-CLIP's experiment on the synthetic language stream. English is trained
first (`finetune`: the CLIP every method then teaches the other languages, and their frozen teacher); from that
one version each method learns the K-1 synthetic languages in turn, training the token embeddings only. Rows:

- embeddings: the token embeddings fine-tuned with the CLIP loss alone, new rows random (N(0, 0.02²));
- cllclip: CLL-CLIP, its cross-modal + cross-lingual losses, new rows random, every row decayed (λ ≡ 1);
- teir: CLL-CLIP with TEIR (new rows from the old table's statistics, λ-scaled gradients and decay).

Reported from each stream's task-known R matrix (Rm, mean of R@1/5/10 both directions, per language's own test
gallery): AA, mean forgetting, forgetting on English. Writes benchmarks/results/languages.md and .png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Iterable, Sequence

from clipstream.benchmarks import report
from clipstream.benchmarks.continual_methods import add_training_arguments, seeded, training_sets
from clipstream.settings import Settings, configure_process
from clipstream.training.data.synth import synthesize_languages
from clipstream.training.evaluate import ResultMatrix
from clipstream.training.job import run_task

# name -> (preset, overrides)
STREAMS = {
    "embeddings": ("cllclip", ["method.cllclip.cross_modal_weight=1.0", "method.cllclip.cross_lingual_weight=0.0"]),
    "cllclip": ("cllclip", []),
    "teir": ("teir", []),
}


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--languages", type=int, default=4, help="English plus K-1 synthetic languages (default 4)")
    p.add_argument("--streams", default=",".join(STREAMS), help=f"comma-separated, of {', '.join(STREAMS)}")
    p.add_argument("--out", default=str(report.RESULTS / "languages.md"))
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = report.parse(parser(prog), argv)
    names = [n for n in args.streams.split(",") if n]
    unknown = sorted(set(names) - set(STREAMS))
    if unknown:
        raise SystemExit(f"unknown stream(s) {unknown}; known: {', '.join(STREAMS)}")
    text = languages(Settings(), args.languages, names, args.seed, args.workers, training_sets(args), Path(args.out))
    print(text)
    return text


def languages(settings: Settings, k: int, names: list[str], seed: int = 0, workers: int = 2,
              overrides: Iterable[str] = (), out: Path = report.RESULTS / "languages.md") -> str:
    if k < 2:
        raise ValueError(f"a language stream needs English and at least one more language, got {k}")
    overrides = list(overrides)
    stream = f"bench-languages-s{seed}-{time.strftime('%Y%m%d%H%M%S')}"
    settings = settings.model_copy(update={"stream": stream})
    dirs = synthesize_languages(settings.data_dir / stream, k, seed=seed)
    print(f"== {dirs[0].name}: finetune (the teacher)", flush=True)
    english = run_task(dirs[0], "finetune", None, workers, seeded(seed), settings).version
    matrices = {}
    for name in names:
        preset, sets = STREAMS[name]
        parent, result = english, None
        for folder in dirs[1:]:
            print(f"== {name}: {folder.name}", flush=True)
            result = run_task(folder, preset, parent, workers, [*seeded(seed), *sets, *overrides], settings)
            parent = result.version
        matrices[name] = result.known
    return languages_report(matrices, k, seed, overrides, out)


def languages_report(matrices: dict[str, ResultMatrix], k: int, seed: int, overrides: Iterable[str], out: Path) -> str:
    """The summary table (AA, forgetting, English forgetting) and each stream's R matrix; a plot of English's
    Rm after each language, per stream."""
    sets = "".join(f" --set {o}" for o in overrides)
    first = next(iter(matrices.values())).tasks[0]
    rows = []
    for name, m in matrices.items():
        forgetting = m.forgetting()
        rows.append((name, STREAMS[name][0], m.average_accuracy(), m.mean_forgetting(), forgetting.get(first, 0.0),
                     m.values[-1, 0]))
    lines = [
        "# Languages: CLL-CLIP and TEIR against fine-tuning the token embeddings",
        "",
        f"Machine: {report.device()}. Stream: English then {k - 1} synthetic languages (seed {seed}; the same images "
        "in every language), all learnt from one English version trained with `finetune`. "
        f"Reproduce: `clipstream bench languages --languages {k} --seed {seed}{sets} --out {out}`.",
        "Rm in percent (mean of R@1/5/10, both directions, task-known); forgetting F_j = best earlier Rm on task j "
        "minus the last; lower is better.",
        "",
        *report.table(["stream", "preset", "AA", "forgetting", f"forgetting on {first}", f"{first} Rm at the end"], rows),
        "",
        "![English retrieval after each language](languages.png)",
        "",
    ]
    for name, m in matrices.items():
        lines += [f"## {name}", "", "```", m.format_table(), "```", ""]
    _plot(matrices, Path(out).with_suffix(".png"))
    return report.write(out, lines)


def _plot(matrices: dict[str, ResultMatrix], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, m in matrices.items():
        ax.plot(range(len(m.tasks)), m.values[:, 0], marker="o", label=name)
    tasks = next(iter(matrices.values())).tasks
    ax.set_xticks(range(len(tasks)), [t.split("-lang-")[-1] for t in tasks])
    ax.set_xlabel("after learning language")
    ax.set_ylabel(f"Rm on {tasks[0]} (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
