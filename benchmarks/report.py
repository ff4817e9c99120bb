"""What every benchmark's results file shares: the device line, the commit of the code, the markdown table, written
once."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
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


def git(folder: str | Path, *args: str) -> str | None:
    """`git ARGS` run in `folder`: its output, or None where git is missing or fails (not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@functools.cache
def code_version() -> str:
    """The commit the code ran from (`git describe --always --dirty`: -dirty when the work tree had changes), or
    the installed package's version outside a checkout. Once per process: the code a process runs is what it
    imported at its start."""
    here = Path(__file__).resolve()
    # a package installed inside some other checkout (a virtual environment in a clone) is not that commit's code
    tracked = git(here.parent, "ls-files", "--error-unmatch", "--", here.name) is not None
    rev = (git(here.parent, "describe", "--always", "--dirty") or "").strip() if tracked else ""
    if rev:
        return rev
    from importlib.metadata import PackageNotFoundError, version

    from clipstream.settings import DISTRIBUTION

    try:
        return f"clipstream {version(DISTRIBUTION)}"
    except PackageNotFoundError:
        return "unknown"


def table(header: Sequence[str], rows: Iterable[Sequence]) -> list[str]:
    """A markdown table; floats with one decimal unless already formatted."""
    cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def stamped(lines: Sequence[str]) -> list[str]:
    """`lines` with the commit of the code that made them (`Code: ...`) as a paragraph of its own after the one with
    the Reproduce line (after the title in a file that has none): the command and the code a number came from."""
    lines = list(lines)
    at = next((i for i, line in enumerate(lines) if "Reproduce" in line), 0)
    after = lines[at + 1:at + 2]
    lines[at + 1:at + 1] = ["", f"Code: `{code_version()}`.", *([""] if after and after[0].strip() else [])]
    return lines


def write(out: str | Path, lines: Sequence[str]) -> str:
    """Write the results file (its folder made as needed) and return its text; a markdown one names the commit of
    the code that made it (`stamped`; other files, such as a benchmark's JSON of its parts so far, are written as
    given)."""
    if Path(out).suffix == ".md":
        lines = stamped(lines)
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
    """Write the checks next to the results file (`<stem>.json`, what `clipstream bench all` summarises, with the
    commit of the code) and return them as markdown lines for the results file."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).with_suffix(".json").write_text(json.dumps({"checks": list(checks), "code": code_version()}, indent=1)
                                              + "\n")
    return ["## Targets", "", *table(["check", "measured", "target", "verdict"], [
        [c["check"], c["value"], c["target"], ("met" if c["ok"] else "**not met**") + (f" ({c['why']})" if c["why"] else "")]
        for c in checks])]
