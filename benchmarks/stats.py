"""Confidence intervals for the method benchmarks, from the rank of every test query (`TaskResult.ranks`): a
hierarchical bootstrap that resamples the seeds with replacement, then the test pairs within each task of each drawn
seed, and recomputes every statistic (AA, forgetting, BWT, ...) through the whole R matrix from the resampled ranks.
R@K of a sample is the mean of (rank < K) over its queries: nothing is embedded again, and 1000 resamples of a few
streams take seconds (numpy, the resamples as count matrices times hit matrices).

A paired difference against the baseline (finetune) uses the same drawn seeds and the same resampled test pairs for
both methods: same seed = same data, same queries. It is signed so that > 0 favours the method (baseline − method for
a statistic where lower is better), and a method beats the baseline on a statistic only when its interval lies above
0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from matplotlib.figure import Figure

from clipstream import console
from clipstream.benchmarks import report
from clipstream.training.evaluate import KS, ZERO_SHOT

LEVEL = 95  # percent: the intervals' coverage


@dataclass
class Stream:
    """One (method variant, seed) stream's evaluation: `rows[i]` holds the ranks of the version after task `tasks[i]`,
    {mode: {task: (image->text ranks, text->image ranks)}} for each gallery mode (and `ZERO_SHOT`)."""

    tasks: list[str]
    rows: list[dict]


class View:
    """R@K of one stream under a batch of resamples ("slots"): what the statistics read, vectorised over slots."""

    def __init__(self, tasks: list[str], recall: dict[tuple[str, int, str], np.ndarray], slots: int):
        self.tasks, self._recall, self.slots = tasks, recall, slots  # (mode, row, task) -> [slots, 2, len(KS)], %
        self._seen: dict[tuple, np.ndarray] = {}  # (mode, k) -> recall(mode, k), read by several statistics

    def recall(self, mode: str, k: int | None = None) -> np.ndarray:
        """[slots, T, T]: R[i][j] of `mode`, NaN above the diagonal; R@k (both directions' mean), or Rm (None: the
        mean of R@1/5/10 in both directions)."""
        if (mode, k) in self._seen:
            return self._seen[mode, k]
        t = len(self.tasks)
        out = np.full((self.slots, t, t), np.nan)
        for i in range(t):
            for j, task in enumerate(self.tasks[: i + 1]):
                r = self._recall.get((mode, i, task))
                if r is None:
                    raise ValueError(f"no ranks of {mode!r} after task {self.tasks[i]!r} on {task!r}")
                out[:, i, j] = r.mean(axis=(1, 2)) if k is None else r[:, :, KS.index(k)].mean(axis=1)
        self._seen[mode, k] = out
        return out

    def rm(self, mode: str) -> np.ndarray:
        return self.recall(mode)

    def zero_shot(self) -> np.ndarray:
        """[slots, T]: the held-out tasks' mean Rm after each task (NaN without held-out tasks)."""
        out = np.full((self.slots, len(self.tasks)), np.nan)
        for i in range(len(self.tasks)):
            found = [r.mean(axis=(1, 2)) for (mode, row, _), r in self._recall.items()
                     if mode == ZERO_SHOT and row == i]
            if found:
                out[:, i] = np.mean(found, axis=0)
        return out


# the statistics of an R matrix [slots, T, T], vectorised over slots (the papers' definitions, as ResultMatrix has them)
def average_accuracy(r: np.ndarray, t: int = -1) -> np.ndarray:
    """AA after task t: the mean of row t over the tasks seen by then."""
    t = t % r.shape[1]
    return r[:, t, : t + 1].mean(axis=1)


def forgetting(r: np.ndarray) -> np.ndarray:
    """Mean over j < T-1 of (best R[l][j] for l in [j, T-2]) − R[T-1][j]; 0 with one task."""
    last = r.shape[1] - 1
    if last == 0:
        return np.zeros(len(r))
    return np.mean([r[:, j:last, j].max(axis=1) - r[:, last, j] for j in range(last)], axis=0)


def bwt(r: np.ndarray) -> np.ndarray:
    """Mean over j < T-1 of R[T-1][j] − R[j][j]; 0 with one task."""
    last = r.shape[1] - 1
    if last == 0:
        return np.zeros(len(r))
    return np.mean([r[:, last, j] - r[:, j, j] for j in range(last)], axis=0)


@dataclass(frozen=True)
class Statistic:
    name: str
    of: Callable[[View], np.ndarray]  # View -> [slots]
    lower_is_better: bool = False


@dataclass(frozen=True)
class Interval:
    point: float  # the statistic on every query of every seed (the mean over seeds)
    lo: float
    hi: float

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def format(self, signed: bool = False) -> str:
        if not math.isfinite(self.point):
            return "-"
        f = "{:+.1f}" if signed else "{:.1f}"
        return f"{f.format(self.point)} [{f.format(self.lo)}, {f.format(self.hi)}]"


@dataclass
class Summary:
    """Each label's statistics with their intervals and, against the baseline, the paired differences (> 0: the
    method is better)."""

    estimates: dict[str, dict[str, Interval]]
    differences: dict[str, dict[str, Interval]]
    baseline: str | None
    seeds: list[int]
    resamples: int
    rng_seed: int

    def beats(self, label: str, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """Which of the statistics `names` `label` is better than the baseline on (interval above 0), and worse."""
        d = self.differences.get(label, {})
        return [n for n in names if d[n].lo > 0], [n for n in names if d[n].hi < 0]

    def point(self, label: str, name: str) -> float:
        return self.estimates[label][name].point


def counts(rng: np.random.Generator, slots: int, n: int) -> np.ndarray:
    """[slots, n] float32: how often each of n queries is drawn in each of `slots` resamples of n with replacement."""
    drawn = rng.integers(n, size=(slots, n)) + n * np.arange(slots)[:, None]
    return np.bincount(drawn.ravel(), minlength=slots * n).reshape(slots, n).astype(np.float32)


def _hits(stream: Stream) -> dict[str, tuple[list[tuple[str, int, str]], np.ndarray]]:
    """Per test set (task name): the (mode, row, task) keys of its ranks and their hits [N, keys × 2 × len(KS)]."""
    per_task: dict[str, tuple[list, list]] = {}
    for i, row in enumerate(stream.rows):
        for mode, tasks in row.items():
            for task, (i2t, t2i) in tasks.items():
                i2t, t2i = np.asarray(i2t), np.asarray(t2i)
                if len(i2t) != len(t2i) or not len(i2t):
                    raise ValueError(f"task {task!r} ({mode}, row {i}): {len(i2t)} image and {len(t2i)} text queries; "
                                     "the bootstrap resamples test pairs (one image and one caption each)")
                keys, blocks = per_task.setdefault(task, ([], []))
                if blocks and len(blocks[0]) != len(i2t):
                    raise ValueError(f"task {task!r}: {len(blocks[0])} queries in one evaluation, {len(i2t)} in "
                                     "another")
                keys.append((mode, i, task))
                blocks.append(np.stack([r[:, None] < np.array(KS) for r in (i2t, t2i)], axis=1).reshape(len(i2t), -1))
    return {task: (keys, np.concatenate(blocks, axis=1).astype(np.float32))
            for task, (keys, blocks) in per_task.items()}


def _view(stream: Stream, hits: dict, weights: dict[str, np.ndarray]) -> View:
    recall = {}
    for task, (keys, h) in hits.items():
        w = weights[task]
        r = (w @ h) * (100.0 / len(h))  # [slots, keys × 2 × len(KS)]
        for n, key in enumerate(keys):
            recall[key] = r[:, n * 2 * len(KS): (n + 1) * 2 * len(KS)].reshape(len(w), 2, len(KS))
    return View(stream.tasks, recall, len(next(iter(weights.values()))))


def point_matrix(stream: Stream, mode: str) -> np.ndarray:
    """[T, T]: R[i][j] (Rm) of `mode` on every query, as the versions' evaluations logged it; NaN above the diagonal."""
    hits = _hits(stream)
    return _view(stream, hits, {task: np.ones((1, len(h)), np.float32) for task, (_, h) in hits.items()}).rm(mode)[0]


def modes(cells: dict[str, dict[int, Stream]]) -> list[str]:
    """The gallery modes every version of every stream was evaluated in (task-known, task-unknown, ...)."""
    found = [set(row) - {ZERO_SHOT} for by_seed in cells.values() for s in by_seed.values() for row in s.rows]
    return sorted(set.intersection(*found)) if found else []


def bootstrap(cells: dict[str, dict[int, Stream]], statistics: Sequence[Statistic], baseline: str | None = None,
              resamples: int = 1000, rng_seed: int = 0, chunk: int = 200) -> Summary:
    """Mean over seeds and a percentile interval for every statistic of every label (`cells[label][seed]`), plus the
    paired differences against `baseline`. Every label needs the same seeds, and a seed's tasks the same test
    pairs in every label (the same data)."""
    if resamples < 10:
        raise ValueError(f"resamples must be >= 10, got {resamples}")
    if not cells:
        raise ValueError("no results to summarise")
    seeds = sorted(next(iter(cells.values())))
    for label, by_seed in cells.items():
        if sorted(by_seed) != seeds:
            raise ValueError(f"{label!r} has seeds {sorted(by_seed)}, others {seeds}: every row needs the same seeds")
    if baseline is not None and baseline not in cells:
        raise ValueError(f"baseline {baseline!r} is not among {', '.join(cells)}")
    hits = {label: {s: _hits(stream) for s, stream in by_seed.items()} for label, by_seed in cells.items()}
    sizes = {s: {task: len(h) for task, (_, h) in hits[next(iter(cells))][s].items()} for s in seeds}
    for label in cells:
        for s in seeds:
            if {task: len(h) for task, (_, h) in hits[label][s].items()} != sizes[s]:
                raise ValueError(f"{label!r}, seed {s}: other test sets than {next(iter(cells))!r}'s; the rows of one "
                                 "seed must be evaluated on the same test pairs")

    def values(seed: int, weights: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        out = {}
        for label in cells:
            view = _view(cells[label][seed], hits[label][seed], weights)
            out[label] = {st.name: np.asarray(st.of(view), dtype=float) for st in statistics}
        return out

    def improvement(st: Statistic, a: np.ndarray, base: np.ndarray) -> np.ndarray:
        return base - a if st.lower_is_better else a - base

    # the point estimates: every query once, the mean over seeds
    full = {s: values(s, {task: np.ones((1, n), np.float32) for task, n in sizes[s].items()}) for s in seeds}
    point = {label: {st.name: float(np.mean([full[s][label][st.name][0] for s in seeds])) for st in statistics}
             for label in cells}
    point_diff = {label: {st.name: float(np.mean([improvement(st, full[s][label][st.name][0],
                                                               full[s][baseline][st.name][0]) for s in seeds]))
                          for st in statistics} for label in cells if baseline is not None and label != baseline}
    rng = np.random.default_rng(rng_seed)
    draws = {label: {st.name: np.empty(resamples) for st in statistics} for label in cells}
    diff_draws = {label: {st.name: np.empty(resamples) for st in statistics} for label in point_diff}
    with console.bar(total=resamples, desc="bootstrap", unit="resample", leave=False) as bar:
        for start in range(0, resamples, chunk):
            b = min(chunk, resamples - start)
            chosen = rng.integers(len(seeds), size=(b, len(seeds)))  # each draw's seeds, with replacement
            slot = {label: {st.name: np.empty((b, len(seeds))) for st in statistics} for label in cells}
            for si, seed in enumerate(seeds):
                where = np.nonzero(chosen == si)
                if not len(where[0]):
                    continue
                weights = {task: counts(rng, len(where[0]), n) for task, n in sizes[seed].items()}
                for label, stats in values(seed, weights).items():
                    for name, v in stats.items():
                        slot[label][name][where] = v
            for label in cells:
                for st in statistics:
                    draws[label][st.name][start:start + b] = slot[label][st.name].mean(axis=1)
                    if label in diff_draws:
                        diff_draws[label][st.name][start:start + b] = improvement(
                            st, slot[label][st.name], slot[baseline][st.name]).mean(axis=1)
            bar.update(b)

    def interval(p: float, d: np.ndarray) -> Interval:
        if not math.isfinite(p) or not np.isfinite(d).all():
            return Interval(math.nan, math.nan, math.nan)
        lo, hi = np.percentile(d, [(100 - LEVEL) / 2, 100 - (100 - LEVEL) / 2])
        return Interval(p, float(lo), float(hi))

    return Summary({label: {n: interval(point[label][n], draws[label][n]) for n in draws[label]} for label in cells},
                   {label: {n: interval(point_diff[label][n], diff_draws[label][n]) for n in diff_draws[label]}
                    for label in diff_draws}, baseline, seeds, resamples, rng_seed)


def describe(summary: Summary) -> str:
    """How the intervals were made, for the results file."""
    return (f"Each cell: the mean over the seeds ({', '.join(map(str, summary.seeds))}) and its {LEVEL}% confidence "
            f"interval [lo, hi]: a hierarchical bootstrap of {summary.resamples} resamples (the seeds drawn with "
            "replacement, then the test pairs of each task of each drawn seed, the same pairs in every row of R, both "
            "directions and both galleries; every statistic recomputed from the resampled query ranks through the "
            f"whole R matrix), percentile interval, RNG seed {summary.rng_seed}.")


def difference_table(summary: Summary, statistics: Sequence[Statistic], label: str = "method") -> list[str]:
    """The paired differences against the baseline as markdown, each column saying its sign, and which statistics
    the method is better (interval above 0) or worse (below 0) on."""
    base = summary.baseline
    header = [label] + [f"Δ {st.name} ({base} − {label}: > 0 = lower)" if st.lower_is_better
                        else f"Δ {st.name} ({label} − {base})" for st in statistics]
    rows = []
    for name, diffs in summary.differences.items():
        better, worse = summary.beats(name, [st.name for st in statistics])
        rows.append([name, *(diffs[st.name].format(signed=True) for st in statistics),
                     ", ".join(better) or "-", ", ".join(worse) or "-"])
    return report.table([*header, f"beats {base} on (CI > 0)", f"worse than {base} on (CI < 0)"], rows)


def plot_curves(summary: Summary, names: Sequence[str], ticks: Sequence[str], path: Path, ylabel: str,
                title: str) -> Path:
    """One line per label over the statistics `names` (e.g. AA after each task), with its interval as a band."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    x = np.arange(1, len(names) + 1)
    for label, est in summary.estimates.items():
        point = [est[n].point for n in names]
        line, = ax.plot(x, point, marker="o", label=label)
        ax.fill_between(x, [est[n].lo for n in names], [est[n].hi for n in names], color=line.get_color(), alpha=0.15)
    ax.set_xticks(x, list(ticks), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} ({LEVEL}% CI, {len(summary.seeds)} seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return report.save_figure(fig, path)


def plot_forest(summary: Summary, statistics: Sequence[Statistic], path: Path) -> Path:
    """A forest plot: per statistic a panel, per label its paired difference against the baseline with its interval
    (> 0: better than the baseline; filled where the interval excludes 0)."""
    labels = list(summary.differences)
    fig = Figure(figsize=(3.2 * len(statistics) + 1.5, 0.45 * max(len(labels), 2) + 1.6))
    axes = fig.subplots(1, len(statistics), sharey=True, squeeze=False)[0]
    y = np.arange(len(labels))[::-1]
    for ax, st in zip(axes, statistics):
        for yi, label in zip(y, labels):
            d = summary.differences[label][st.name]
            if not math.isfinite(d.point):
                continue
            # (a percentile interval need not hold the point estimate: the bars start at it either way)
            ax.errorbar(d.point, yi, xerr=[[max(d.point - d.lo, 0)], [max(d.hi - d.point, 0)]], fmt="o", capsize=3,
                        color="C0", mfc="C0" if d.excludes_zero else "white")
        ax.axvline(0, color="k", lw=1)
        ax.set_title(f"Δ {st.name}" + (f"\n({summary.baseline} − method)" if st.lower_is_better else
                                           f"\n(method − {summary.baseline})"), fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, labels, fontsize=8)
    fig.suptitle(f"Paired difference vs {summary.baseline}, {LEVEL}% CI (> 0: better; filled: CI excludes 0)",
                 fontsize=10)
    return report.save_figure(fig, path)
