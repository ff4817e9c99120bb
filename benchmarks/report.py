"""What every benchmark's results file shares: the device line and the markdown table, written once."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Callable, Iterable, Sequence

RESULTS = Path("benchmarks/results")  # relative: the results folder of the clone one runs from

# what `clipstream bench` runs once a benchmark's options parsed (its quiet mode: see parse)
after_parse: list[Callable[[], None]] = []


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The benchmark's options. `clipstream bench` sends the libraries' output to a log file only from here on, so
    the benchmark's own `--help` and a bad option's one-line error reach the terminal."""
    args = parser.parse_args(argv)
    for hook in after_parse:
        hook()
    return args


def device(*details: str) -> str:
    """The machine a number was measured on: the GPU, or the CPU with its cores, then `details`
    (workers, threads) as the benchmark ran them."""
    import torch

    if torch.cuda.is_available():
        base = f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} GPU{'s' * (torch.cuda.device_count() > 1)})"
    else:
        base = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return ", ".join([base, *details])


def table(header: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    """A markdown table; floats with one decimal unless already formatted."""
    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def write(out: str | Path, lines: Sequence[str]) -> str:
    """Write the results file (its folder made as needed) and return its text."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    return text


def shown(out: str | Path, lines: Sequence[str]) -> str:
    """`write`, and the text printed: what a benchmark run from the command line ends with."""
    text = write(out, lines)
    print(text)
    return text


def save_figure(fig, path: str | Path) -> Path:
    """A results plot (a bare matplotlib Figure: no pyplot state, works headless) saved as PNG; its path."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return Path(path)


def check(name: str, value: float, *, at_least: float | None = None, at_most: float | None = None,
          fmt: str = "{:.2f}", why: str = "") -> dict:
    """One measured figure against its target (a lower or an upper bound); `why` explains a miss or a caveat."""
    ok = (at_least is None or value >= at_least) and (at_most is None or value <= at_most)
    target = " and ".join([f"{sign} {fmt.format(bound)}" for sign, bound in (("≥", at_least), ("≤", at_most))
                           if bound is not None])
    shown = fmt.format(value)
    if not ok and shown in {fmt.format(b) for b in (at_least, at_most) if b is not None}:
        shown = f"{value:.6g}"  # a miss that rounds onto its bound ("1.25, ≤ 1.25: not met"): the digits that decide it
    return {"check": name, "value": shown, "target": target, "ok": bool(ok), "why": why}


def targets(out: str | Path, checks: Sequence[dict]) -> list[str]:
    """Write the checks next to the results file (`<stem>.json`, what `clipstream bench all` summarises) and
    return them as markdown lines for the results file."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).with_suffix(".json").write_text(json.dumps({"checks": list(checks)}, indent=1) + "\n")
    return ["## Targets", "", *table(["check", "measured", "target", "verdict"], [
        [c["check"], c["value"], c["target"], ("met" if c["ok"] else "**not met**") + (f" ({c['why']})" if c["why"] else "")]
        for c in checks])]
