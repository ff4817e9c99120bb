"""Every performance benchmark in one run, each against its baseline, and the summary of their targets.

    clipstream bench all [--quick] [--only NAME,...] [--out DIR]

Runs the cost benchmarks one after another, each in its own process (each starts its own local Ray, DeepSpeed
and serving app, and a fresh process leaves nothing behind for the next), with the sizes in `PLAN`: the full
sizes fit in 25 minutes on 2 cores without ViT-B-32's rows (search's, method-step's and train-throughput's
`--extra-arch`), `--quick` in 5 (small sizes: a smoke run whose ratios are noisy, written to
benchmarks/results/quick/ so that it never overwrites the committed results). A progress bar shows the benchmark
running; each one's own output goes to `DIR/logs/NAME.log`. Every script writes its table (and
plot) and, through `report.targets`, `NAME.json` with its checks against the targets; the summary
(`DIR/summary.md`) collects them with each benchmark's wall time. `--only` reruns some of them: the summary keeps
the others' rows from their last run (each benchmark's exit code and wall time are recorded in `DIR/suite.json`);
`--summarize` runs nothing and rebuilds the summary from what DIR holds (after a run was stopped part way).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from clipstream import console
from clipstream.benchmarks import report

# name -> (results file stem, full-size options, --quick options); the order is the order they run in
PLAN: dict[str, tuple[str, list[str], list[str]]] = {
    # 3 rounds of 10 interleaved steps: each ratio is a median over 30 paired steps (4 rounds ran 28 minutes in all)
    # ViT-B-32 after the small model, in the same run: 2 cycles of the plain step, finetune and LwF at batch 8 (a real
    # CLIP's steps are slow on a CPU, and each engine holds its own model, gradients and AdamW moments: with EWC and
    # CTP besides, the engines outgrew what this shared machine had free)
    "method-step": ("method-step", ["--steps", "10", "--rounds", "3", "--profile", "lwf,modx,ctp",
                                    "--extra-arch", "ViT-B-32"],
                    ["--methods", "finetune,ewc,ctp", "--steps", "3", "--rounds", "2"]),
    # the last of 2 epochs is as steady as the last of 3 (the first carries the start-up): a minute less in all; one
    # round of each side (its two rounds agreed within 3% in most runs): two minutes less, for the 25-minute budget
    # ViT-B-32 after it, one round of both sides on 48 pairs at batch 8
    "train-throughput": ("train-throughput", ["--epochs", "2", "--rounds", "1", "--extra-arch", "ViT-B-32"],
                         ["--pairs", "256", "--epochs", "1", "--rounds", "1", "--zero-stages", "none"]),
    # one shape each (flat, bounded by the buffer, linear) over 4 tasks: 8 tasks x 5 methods (40 jobs) would take
    # most of the suite's budget, so that is its own run: clipstream bench stream-growth. --quick: one method's 3 jobs
    # (two methods took almost half of --quick's time)
    "stream-growth": ("stream-growth", ["--tasks", "4", "--methods", "finetune,er,joint"],
                      ["--tasks", "3", "--methods", "ewc"]),
    # 2 rounds, not the script's 3: the ratios at 16 and 64 clients sit far past their target (grpc-encode.md)
    "grpc-encode": ("grpc-encode", ["--rounds", "2"], ["--clients", "1,16", "--rounds", "1", "--modalities", "text",
                                        "--no-batching-baseline", "--one-client", "1000"]),
    # 1M is its own run (search-1m.md): writing its 1M vectors (two HNSW graphs of 500k) alone takes many minutes;
    # so is the uniform-vector worst case (search-uniform.md: its 100k graph alone takes over a minute to build)
    # ViT-B-32's 512-d vectors at 100k beside the small model's: a real CLIP's gallery (see search-1m.md for 1M)
    "search": ("search", ["--sizes", "10000,100000", "--append-sizes", "100000", "--uniform-size", "0",
                          "--extra-arch", "ViT-B-32", "--extra-sizes", "100000"],
               ["--sizes", "10000", "--append-sizes", "", "--uniform-size", "0", "--rpc-size", "0", "--queries", "100"]),
    "indexing": ("indexing", [], ["--pairs", "256", "--rounds", "1", "--tasks", "1,2", "--task-pairs", "64"]),
    "data-check": ("data-check", [], ["--images", "300", "--rounds", "1"]),
    "cli-startup": ("cli-startup", [], ["--rounds", "2"]),
    "gpu": ("gpu", [], []),
}

def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, under 5 minutes on 2 cores (a smoke run)")
    p.add_argument("--only", default="", metavar="NAME,...", help=f"a subset of: {', '.join(PLAN)}")
    p.add_argument("--summarize", action="store_true",
                   help="run nothing: rebuild DIR/summary.md from the results DIR holds (after a run stopped part way)")
    p.add_argument("--out", default="", metavar="DIR",
                   help=f"where the results go (default {report.RESULTS}, with --quick {report.RESULTS / 'quick'})")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = parser(prog)
    args = report.parse(p, argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(PLAN)
    unknown = [n for n in names if n not in PLAN]
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(PLAN)}")
    out = Path(args.out or (report.RESULTS / "quick" if args.quick else report.RESULTS))
    if args.summarize:
        text = summary(out, recorded(out, []), args.quick)
        print(text)
        return text
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs = []
    with console.bar(total=len(names), unit="bench", desc="bench all") as bar:
        for name in names:
            stem, full, quick = PLAN[name]
            bar.set_postfix_str(name)
            runs.append(run(name, [*(quick if args.quick else full), "--out", str(out / f"{stem}.md")],
                            out / "logs" / f"{name}.log") + (stem,))
            bar.update()
    text = summary(out, recorded(out, runs), args.quick, ran=names)
    print(text)
    failed = [name for name, rc, _, _ in runs if rc != 0]
    if failed:
        sys.exit(f"bench all: {', '.join(failed)} failed; see {out / 'logs'}/NAME.log")
    return text


def run(name: str, options: list[str], log: Path) -> tuple[str, int, float]:
    """One benchmark in its own process, its output to `log`; (name, exit code, wall seconds)."""
    tic = time.perf_counter()
    with open(log, "w") as f:
        # -v: its Ray, DeepSpeed and MLflow lines in that log too, beside its own (a log per benchmark already)
        rc = subprocess.call([sys.executable, "-m", "clipstream.cli", "-v", "bench", name, *options], stdout=f,
                             stderr=subprocess.STDOUT)
    return name, rc, time.perf_counter() - tic


def recorded(out: Path, runs: list[tuple[str, int, float, str]]) -> list[tuple[str, int, float | None, str]]:
    """This command's runs merged into DIR/suite.json (each benchmark's last run: exit code, wall seconds), in PLAN
    order: every benchmark run here or before, or whose checks are in DIR from before that record (wall unknown)."""
    path = out / "suite.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record.update({name: {"rc": rc, "seconds": wall} for name, rc, wall, _ in runs})
    path.write_text(json.dumps(record, indent=1) + "\n")
    return [(name, record[name]["rc"], record[name]["seconds"], stem) if name in record else (name, 0, None, stem)
            for name, (stem, _, _) in PLAN.items() if name in record or (out / f"{stem}.json").exists()]


def summary(out: Path, runs: list[tuple[str, int, float | None, str]], quick: bool, ran: list[str] | None = None) -> str:
    """DIR/summary.md: every check of every benchmark against its target, with each benchmark's wall time (None: not
    recorded); `ran`: the benchmarks this command ran, when not all of `runs`."""
    rows, total = [], sum(wall or 0 for _, _, wall, _ in runs)
    minutes = lambda wall: "-" if wall is None else f"{wall / 60:.1f}"  # noqa: E731
    for name, rc, wall, stem in runs:
        checks = out / f"{stem}.json"
        found = json.loads(checks.read_text())["checks"] if rc == 0 and checks.exists() else []
        if rc != 0:
            rows.append([name, minutes(wall), "failed (exit %d): see logs/%s.log" % (rc, name), "", "", ""])
        for i, c in enumerate(found or ([] if rc else [{"check": "(no target)", "value": "", "target": "", "ok": None}])):
            verdict = {True: "met", False: "**not met**", None: ""}[c["ok"]]
            rows.append([name if i == 0 else "", minutes(wall) if i == 0 else "", c["check"], c["value"],
                         c["target"], verdict + (f" ({c['why']})" if c.get("why") else "")])
    rest = [name for name, *_ in runs if ran is not None and name not in ran]
    unknown = [name for name, _, wall, _ in runs if wall is None]
    return report.write(out / "summary.md", [
        f"# clipstream bench all{' --quick' if quick else ''}: every cost against its baseline", "",
        f"Device: {report.device()}. Reproduce: `clipstream bench all{' --quick' if quick else ''}`; "
        f"each benchmark's table and plot is in its own file here, its output in logs/. Total {total / 60:.1f} min"
        + (f" of those with minutes ({', '.join(unknown)}: results of runs the suite did not record)" if unknown else "")
        + "." + (f" Last run: `clipstream bench all --only {','.join(ran)}`; the rows of {', '.join(rest)} are from their own "
           "last run." if rest else ""),
        "",
        *report.table(["benchmark", "minutes", "check", "measured", "target", "verdict"], rows)])


if __name__ == "__main__":
    main()
