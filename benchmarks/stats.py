"""Confidence intervals for the method benchmarks, from the rank of every test query (`TaskResult.ranks`).

Each label's statistics (AA, forgetting, BWT, ...): the mean over seeds with a hierarchical percentile bootstrap that
resamples the seeds with replacement, then the test pairs within each task of each drawn seed, and recomputes every
statistic through the whole R matrix from the resampled ranks. R@K of a sample is the mean of (rank < K) over its
queries: nothing is embedded again, and 1000 resamples of a few streams take seconds (numpy, the resamples as count
matrices times hit matrices). With a few seeds that interval is narrower than its level (3 seeds drawn with
replacement understate their spread: a simulation of it covered 76-93% for a 95% interval), so it describes each
estimate, and no comparison rests on it.

A paired difference against the baseline (finetune) is taken seed by seed: same seed = same data, same queries, and
each seed's statistic on its whole test set. It is signed so that > 0 favours the method (baseline − method for a
statistic where lower is better). Its interval is Student t over the seeds' differences (the seeds are the
independent replicates; the test pairs' noise is inside each seed's difference), and the comparisons one table shows
(labels × statistics) are Holm-adjusted together, so the chance of any false better/worse call in a table stays
within 5% (as far as the t test's p-values hold: roughly normal differences between seeds). A method beats the
baseline on a statistic only when its adjusted interval lies above 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import scipy.stats
from matplotlib.figure import Figure

from clipstream import console
from clipstream.benchmarks import report
from clipstream.training.evaluate import KS, ZERO_SHOT

LEVEL = 95  # percent: the intervals' coverage
ALPHA = 1 - LEVEL / 100  # and the error rate a table's Holm-adjusted comparisons keep to


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
    lo: float  # NaN where there is no interval (a paired difference of one seed)
    hi: float
    p: float = math.nan  # a paired difference's two-sided p-value (t test of no difference); NaN for an estimate

    @property
    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def format(self, signed: bool = False) -> str:
        if not math.isfinite(self.point):
            return "-"
        f = "{:+.1f}" if signed else "{:.1f}"
        bounds = f"[{f.format(self.lo)}, {f.format(self.hi)}]" if math.isfinite(self.lo) else "[-]"
        p = "" if not math.isfinite(self.p) else " p<0.001" if self.p < 0.001 else f" p={self.p:.3f}"
        return f"{f.format(self.point)} {bounds}{p}"


def t_interval(d: np.ndarray, alpha: float | np.ndarray = ALPHA) -> tuple[np.ndarray, ...]:
    """Over the last axis of `d` (the seeds' paired differences): the mean, its Student t interval at level
    1 − alpha (mean ± t(n−1, 1 − alpha/2) · sd/√n) and the two-sided p-value of a zero mean; NaN bounds and p with
    one seed (no spread between seeds to measure). Vectorised over the other axes."""
    d = np.asarray(d, dtype=float)
    n, mean = d.shape[-1], d.mean(axis=-1)
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return mean, nan, nan, nan
    se = d.std(axis=-1, ddof=1) / math.sqrt(n)
    half = scipy.stats.t.ppf(1 - np.asarray(alpha) / 2, n - 1) * se
    with np.errstate(divide="ignore", invalid="ignore"):
        # seeds that all differ by the same amount: certain (p 0) unless that amount is 0 (p 1)
        p = np.where(se > 0, 2 * scipy.stats.t.sf(np.abs(mean) / se, n - 1), np.where(mean == 0, 1.0, 0.0))
    return mean, mean - half, mean + half, np.where(np.isfinite(se), p, np.nan)


def paired(d: np.ndarray, alpha: float = ALPHA) -> Interval:
    """One comparison's seeds' differences `d` [seeds] as an Interval (t_interval)."""
    return Interval(*map(float, t_interval(d, alpha)))


def holm(p: Sequence[float], alpha: float = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down over m finite p-values: the adjusted p-values (monotone in p) and each comparison's interval
    level. In order of p the i-th (from 1) is tested at alpha/(m−i+1) while every smaller one was rejected; the first
    that is not, and every later one, keep that step's level (below their own: wider intervals), so an interval
    excludes 0 exactly where the adjusted p-value is below alpha. (statsmodels' multipletests(method="holm") adjusts
    the p-values alike; it is not a dependency here.)"""
    p = np.asarray(p, dtype=float)
    order = np.argsort(p, kind="stable")
    factor = len(p) - np.arange(len(p))  # m, m−1, ..., 1
    adjusted = np.empty(len(p))
    adjusted[order] = np.minimum(1, np.maximum.accumulate(factor * p[order]))
    rejected = int((adjusted[order] < alpha).sum())  # the rejected ones come first in order of p
    levels = np.empty(len(p))
    levels[order] = alpha / factor[np.minimum(np.arange(len(p)), rejected)]
    return adjusted, levels


@dataclass
class Summary:
    """Each label's statistics with their intervals and, against the baseline, each seed's paired difference (> 0:
    the method is better)."""

    estimates: dict[str, dict[str, Interval]]
    per_seed: dict[str, dict[str, np.ndarray]]  # label -> statistic -> [seeds], in the order of `seeds`
    baseline: str | None
    seeds: list[int]
    resamples: int
    rng_seed: int

    @cached_property
    def differences(self) -> dict[str, dict[str, Interval]]:
        """The paired differences with their t intervals, each on its own (unadjusted)."""
        return {label: {n: paired(d) for n, d in by_name.items()} for label, by_name in self.per_seed.items()}

    def adjusted(self, names: Sequence[str]) -> tuple[dict[str, dict[str, Interval]], int]:
        """The paired differences on the statistics `names` of every label, Holm-adjusted together (one table's
        comparisons): each interval at the level Holm tests it at, p the adjusted p-value; and m, how many
        comparisons that is. Those without an interval (one seed, a statistic not measured) stay as they are and are
        not counted."""
        out = {label: {n: self.differences[label][n] for n in names} for label in self.differences}
        keys = [(label, n) for label, row in out.items() for n in names if math.isfinite(row[n].p)]
        for (label, n), p, level in zip(keys, *holm([out[label][n].p for label, n in keys])):
            out[label][n] = replace(paired(self.per_seed[label][n], level), p=float(p))
        return out, len(keys)

    def beats(self, label: str, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """Which of the statistics `names` `label` is better than the baseline on (its interval, Holm-adjusted over
        every label × `names`, above 0), and worse (below 0)."""
        d = self.adjusted(names)[0].get(label, {})
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
    """Mean over seeds and a percentile interval for every statistic of every label (`cells[label][seed]`), plus
    each seed's paired difference against `baseline` (the Summary's t intervals). Every label needs the same seeds,
    and a seed's tasks the same test pairs in every label (the same data)."""
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

    # the point estimates: every query once, the mean over seeds; and each seed's paired difference on them
    full = {s: values(s, {task: np.ones((1, n), np.float32) for task, n in sizes[s].items()}) for s in seeds}
    point = {label: {st.name: float(np.mean([full[s][label][st.name][0] for s in seeds])) for st in statistics}
             for label in cells}
    per_seed = {label: {st.name: np.array([improvement(st, full[s][label][st.name][0], full[s][baseline][st.name][0])
                                           for s in seeds]) for st in statistics}
                for label in cells if baseline is not None and label != baseline}
    rng = np.random.default_rng(rng_seed)
    draws = {label: {st.name: np.empty(resamples) for st in statistics} for label in cells}
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
            bar.update(b)

    def interval(p: float, d: np.ndarray) -> Interval:
        if not math.isfinite(p) or not np.isfinite(d).all():
            return Interval(math.nan, math.nan, math.nan)
        lo, hi = np.percentile(d, [(100 - LEVEL) / 2, 100 - (100 - LEVEL) / 2])
        return Interval(p, float(lo), float(hi))

    return Summary({label: {n: interval(point[label][n], draws[label][n]) for n in draws[label]} for label in cells},
                   per_seed, baseline, seeds, resamples, rng_seed)


def describe(summary: Summary) -> str:
    """How the intervals were made, for the results file."""
    n = len(summary.seeds)
    text = (f"Each cell: the mean over the seeds ({', '.join(map(str, summary.seeds))}) and its {LEVEL}% interval "
            f"[lo, hi]: a hierarchical bootstrap of {summary.resamples} resamples (the seeds drawn with replacement, "
            "then the test pairs of each task of each drawn seed, the same pairs in every row of R, both directions "
            "and both galleries; every statistic recomputed from the resampled query ranks through the whole R "
            f"matrix), percentile interval, RNG seed {summary.rng_seed}. " +
            ("With one seed it holds the test pairs' noise only, not the spread between seeds" if n == 1 else
             f"With {n} seeds it covers less than {LEVEL}% (drawing a few seeds with replacement understates their "
             "spread)") + ": it describes each estimate, and no comparison rests on it.")
    if summary.baseline is None:
        return text
    return text + (" The paired differences are taken seed by seed (each seed's statistic on its whole test set, the "
                   "same data and queries in both rows): " +
                   (f"the mean over the {n} seeds with a Student t interval on their differences ({n - 1} degrees of "
                    "freedom; it assumes them roughly normal), Holm-adjusted over each difference table's comparisons."
                    if n > 1 else "with one seed they have no interval, and no row is told better or worse."))


def difference_table(summary: Summary, statistics: Sequence[Statistic], label: str = "method") -> list[str]:
    """A line saying how the intervals were made, then the paired differences against the baseline as markdown, each
    column saying its sign, and which statistics the method is better (its Holm-adjusted interval above 0) or worse
    (below 0) on."""
    base, names = summary.baseline, [st.name for st in statistics]
    adjusted, m = summary.adjusted(names)
    seeds = len(summary.seeds)
    note = (f"Each cell: the mean over the {seeds} seeds of their paired difference, its {LEVEL}% Student t interval "
            f"Holm-adjusted over this table's {m} comparisons ({label}s × statistics) and the Holm-adjusted p-value; a "
            f"{label} beats {base} on a statistic only where that interval lies above 0." if seeds > 1 else
            f"One seed: no interval (no spread between seeds to measure), so no {label} is told better or worse than "
            f"{base}.")
    header = [label] + [f"Δ {st.name} ({base} − {label}: > 0 = lower)" if st.lower_is_better
                        else f"Δ {st.name} ({label} − {base})" for st in statistics]
    rows = []
    for name, diffs in adjusted.items():
        better, worse = summary.beats(name, names)
        rows.append([name, *(diffs[n].format(signed=True) for n in names), ", ".join(better) or "-",
                     ", ".join(worse) or "-"])
    return [note, "", *report.table([*header, f"beats {base} on (Holm CI > 0)", f"worse than {base} on (Holm CI < 0)"],
                                    rows)]


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


def plot_forest(summary: Summary, statistics: Sequence[Statistic], path: Path,
                family: Sequence[Statistic] = ()) -> Path:
    """A forest plot: per statistic a panel, per label its paired difference against the baseline with its interval,
    Holm-adjusted over every label × `family` (the difference table's statistics, which hold `statistics`; default:
    `statistics`) so that it is the table's (> 0: better than the baseline; filled where the interval excludes 0)."""
    labels = list(summary.differences)
    adjusted, m = summary.adjusted([st.name for st in family or statistics])
    fig = Figure(figsize=(3.2 * len(statistics) + 1.5, 0.45 * max(len(labels), 2) + 1.6))
    axes = fig.subplots(1, len(statistics), sharey=True, squeeze=False)[0]
    y = np.arange(len(labels))[::-1]
    for ax, st in zip(axes, statistics):
        for yi, label in zip(y, labels):
            d = adjusted[label][st.name]
            if not math.isfinite(d.point):
                continue
            bar = [[d.point - d.lo], [d.hi - d.point]] if math.isfinite(d.lo) else None  # one seed: no interval
            ax.errorbar(d.point, yi, xerr=bar, fmt="o", capsize=3, color="C0", mfc="C0" if d.excludes_zero else "white")
        ax.axvline(0, color="k", lw=1)
        ax.set_title(f"Δ {st.name}" + (f"\n({summary.baseline} − method)" if st.lower_is_better else
                                           f"\n(method − {summary.baseline})"), fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, labels, fontsize=8)
    n = len(summary.seeds)
    fig.suptitle(f"Paired difference vs {summary.baseline}, " +
                 (f"{n} seeds, {LEVEL}% t interval Holm-adjusted over {m} comparisons" if n > 1 else
                  "one seed: no interval") + " (> 0: better; filled: the interval excludes 0)", fontsize=10)
    return report.save_figure(fig, path)
