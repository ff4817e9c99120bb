"""How long the command line takes to answer before it does any work: `clipstream --help`, `--version` and a
command's `--help`, each a fresh process, against a bare `python -c pass` in the same run (the interpreter's own
start, which no change to clipstream can remove).

    clipstream bench cli-startup [--rounds 7] [--out benchmarks/results/cli-startup.md]

The rounds take turns (one of each command per round) and the table keeps each command's median wall time; the
target is an absolute one (under 1 s), checked on the median. Writes benchmarks/results/cli-startup.md (and .json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

from clipstream.benchmarks import report

TARGET_S = 1.0
COMMANDS = {"python -c pass (the interpreter alone)": [sys.executable, "-c", "pass"],
            "clipstream --help": [sys.executable, "-m", "clipstream.cli", "--help"],
            "clipstream --version": [sys.executable, "-m", "clipstream.cli", "--version"],
            "clipstream train --help": [sys.executable, "-m", "clipstream.cli", "train", "--help"],
            "clipstream search --help": [sys.executable, "-m", "clipstream.cli", "search", "--help"]}


def measure(rounds: int) -> dict[str, list[float]]:
    """Seconds of each command's process, start to exit, `rounds` times, the commands taking turns."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for name, argv in COMMANDS.items():  # one warm-up each: the first run reads the files from disk
        subprocess.run(argv, capture_output=True, env=env, check=True)
    for _ in range(rounds):
        for name, argv in COMMANDS.items():
            tic = time.perf_counter()
            subprocess.run(argv, capture_output=True, env=env, check=True)
            times[name].append(time.perf_counter() - tic)
    return times


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7, help="timed runs of each command, taking turns (default 7)")
    p.add_argument("--out", default=str(report.RESULTS / "cli-startup.md"))
    args = report.parse(p, argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    load = os.getloadavg()[0]
    times = measure(args.rounds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    checks = [report.check(f"{name} (median s)", medians[name], at_most=TARGET_S)
              for name in COMMANDS if name.startswith("clipstream")]
    lines = ["# Command-line start-up", "",
             f"Reproduce: `clipstream bench cli-startup --rounds {args.rounds} --out {args.out}`", "",
             f"Device: {report.device()}, load average {load:.1f} at start.", "",
             "Each command a fresh process from start to exit (its output discarded), the commands taking turns, "
             f"{args.rounds} rounds after one warm-up each; median and slowest wall time.", "",
             *report.table(["command", "median s", "slowest s"],
                           [[name, f"{medians[name]:.2f}", f"{max(times[name]):.2f}"] for name in COMMANDS]),
             "", *report.targets(args.out, checks)]
    return report.shown(args.out, lines)


if __name__ == "__main__":
    main()
