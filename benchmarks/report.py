"""What every benchmark's results file shares: the device line and the markdown table, written once."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

RESULTS = Path("benchmarks/results")  # relative: the results folder of the clone one runs from


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
