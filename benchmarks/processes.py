"""What a block of work costs the processes that run it, sampled from outside: CPU seconds by kind of process (the
driver and the Ray workers it started) and the peak resident set of each Ray Train worker. Shared by the
benchmarks that run task jobs (stream-growth, train-throughput)."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path


class JobCost:
    """What the jobs run inside the block cost, sampled from outside every `every_s`: the CPU seconds of this process
    and of the Ray worker processes it started (titled `ray::…`: the Ray Train workers and controller, the workers
    that run Ray Data's tasks), each from the block's start or its own to its last sample (a process's last < every_s
    is missed), without Ray's daemons and agents (GCS, raylet, dashboard, log monitor: they tick with the clock, not
    with the work); and the peak resident set (VmHWM) of each Ray Train worker process the block saw start."""

    DAEMONS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")

    def __init__(self, every_s: float = 0.2, match: str = "RayTrainWorker"):
        self.every_s, self.match = every_s, match
        self._cpu: dict[tuple, list[float]] = {}  # (pid, start time) -> [CPU at the block's start, at its last sample]
        self._titles: dict[tuple, str] = {}  # (pid, start time) -> what the process is: "driver" or its Ray title
        self._peaks: dict[tuple, int] = {}
        self._stop = threading.Event()

    def __enter__(self) -> JobCost:
        self._started = time.time()
        self._workers_before = {key for key, title in self._sample(first=True) if self.match in title}
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def cpu_s(self) -> float:
        return sum(last - first for first, last in self._cpu.values())

    @property
    def cpu_by_process(self) -> dict[str, float]:
        """The CPU seconds by kind of process ("driver", or the Ray title without `ray::`: RayTrainWorker,
        TrainController, the helper actors Ray Train and Ray Data start for each run...), largest first."""
        by: dict[str, float] = {}
        for key, (first, last) in self._cpu.items():
            by[self._titles[key]] = by.get(self._titles[key], 0.0) + last - first
        return dict(sorted(by.items(), key=lambda kv: -kv[1]))

    @property
    def peak_mib(self) -> float:
        """The largest Ray Train worker's peak resident set, in MiB (NaN when none was seen: not on Linux, or the
        workers run on other nodes)."""
        return max(self.worker_peaks_mib, default=math.nan)

    @property
    def worker_peaks_mib(self) -> list[float]:
        """Each Ray Train worker's peak resident set in MiB, largest first."""
        return sorted((v / (1 << 20) for v in self._peaks.values()), reverse=True)

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self, first: bool = False) -> list[tuple[tuple, str]]:
        import psutil

        me, seen = psutil.Process(), []
        for proc in [me, *me.children(recursive=True)]:
            try:
                with proc.oneshot():
                    cmdline = proc.cmdline()
                    title = cmdline[0] if cmdline else ""
                    if proc.pid != me.pid and (not title.startswith("ray::") or title.startswith(self.DAEMONS)):
                        continue
                    key, cpu = (proc.pid, proc.create_time()), sum(proc.cpu_times()[:2])
            except psutil.Error:
                continue
            seen.append((key, title))
            self._titles[key] = "driver" if proc.pid == me.pid else process_kind(title, self._titles.get(key))
            # a process older than the block counts from its first sample; one it started, from 0
            self._cpu.setdefault(key, [cpu if first or key[1] < self._started else 0.0, cpu])[1] = cpu
            if not first and self.match in title and key not in self._workers_before:
                peak = vm_hwm(proc.pid)
                if peak:
                    self._peaks[key] = max(self._peaks.get(key, 0), peak)
        return seen


DATA_TASKS = "Ray Data tasks"  # the kind of a worker process that ran Ray Data's read and map operators


def process_kind(title: str, before: str | None = None) -> str:
    """A Ray process's kind from its title (`ray::…`): the actor's class (`ray::TrainController.run` ->
    `TrainController`), or "Ray Data tasks" for a worker that runs Ray Data's read and map operators
    (`ReadPandasJSON->SplitBlocks(4)`, `MapBatches(_prepare)`: one process alternates between them). Between tasks
    a worker is titled `ray::IDLE`: it keeps the kind it had `before`, the work it did."""
    title = title.removeprefix("ray::")
    if title == "IDLE" and before:
        return before
    if title.startswith(("Read", "Map", "FlatMap", "Filter", "Write")):
        return DATA_TASKS
    return title.split(".", 1)[0].split(" ", 1)[0]


def vm_hwm(pid: int) -> int:
    """A process's peak resident set in bytes (Linux /proc VmHWM); 0 when it is gone or unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
