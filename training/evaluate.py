"""Retrieval evaluation for the task stream: R@K / Rm, task-known and task-unknown galleries,
the R[i][j] result matrix with AA / forgetting / BWT, and embedding a split with an open_clip model.

Metric definitions follow CTP (Zhu et al., ICCV 2023, arXiv:2308.07146: R@1/5/10, their mean Rm, BWT) and
"Continual learning in cross-modal retrieval" (Wang et al., arXiv:2104.06806: task-known and task-unknown
galleries): rank by cosine of L2-normalised embeddings, a query hits at K when any positive is in its top K.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

KS = (1, 5, 10)
_QUERY_CHUNK = 2048  # query rows scored at once, so union galleries never need a full [Q, G] matrix


def positives(image_keys: Sequence[str], captions: Sequence[str]) -> np.ndarray:
    """bool [N, N]: image row i matches text row j when i == j, they share an image key or the caption
    text is identical. Datasets repeat images (several captions each) and captions ("a red dress"), so
    counting only the diagonal would punish a model for retrieving an equally correct item."""
    if len(image_keys) != len(captions):
        raise ValueError(f"{len(image_keys)} image keys but {len(captions)} captions")
    key = np.unique(np.asarray(image_keys, dtype=object), return_inverse=True)[1]
    cap = np.unique(np.asarray(captions, dtype=object), return_inverse=True)[1]
    return (key[:, None] == key[None, :]) | (cap[:, None] == cap[None, :]) | np.eye(len(key), dtype=bool)


def _first_hit_rank(scores: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """0-based rank of each query's best positive under a pessimistic tie rule: every negative scoring
    >= the best positive is ranked above it. Ties between positives cannot matter (one of them comes
    first either way), which keeps identical captions hits; ties with negatives never favour positives.
    The result depends only on the scores, not on gallery order, so it is deterministic."""
    if scores.shape != positive.shape:
        raise ValueError(f"scores {scores.shape} and positive {positive.shape} differ in shape")
    if not np.isfinite(scores).all():
        raise ValueError("non-finite scores (NaN/inf embeddings?) would rank as hits")
    missing = ~positive.any(axis=1)
    if missing.any():
        raise ValueError(
            f"{int(missing.sum())} queries have no positive in the gallery, e.g. row {int(missing.argmax())}"
        )
    best = np.where(positive, scores, -np.inf).max(axis=1, keepdims=True)
    return ((scores >= best) & ~positive).sum(axis=1)


def _recall(ranks: np.ndarray, ks: Sequence[int]) -> dict[int, float]:
    return {k: float(np.mean(ranks < k)) for k in ks}


def recall_at_k(scores: np.ndarray, positive: np.ndarray, ks: Sequence[int] = KS) -> dict[int, float]:
    """Fraction of queries (rows of scores [Q, G]) with any positive in the top K; see _first_hit_rank
    for ties. A query without a positive raises ValueError: it would silently deflate the score."""
    return _recall(_first_hit_rank(np.asarray(scores), np.asarray(positive, dtype=bool)), ks)


def _directional(queries: np.ndarray, gallery: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """The first-hit rank of each query against gallery by cosine (dot product of unit rows), in query chunks."""
    ranks = [
        _first_hit_rank(queries[s : s + _QUERY_CHUNK] @ gallery.T, positive[s : s + _QUERY_CHUNK])
        for s in range(0, len(queries), _QUERY_CHUNK)
    ]
    return np.concatenate(ranks)


class Metrics(dict):
    """One gallery's percent metrics (`i2t_R@1` ... `t2i_R@10`, `Rm`) and `ranks`: the 0-based first-hit rank of
    every query they came from, (image->text, text->image) int arrays. A bootstrap resamples the queries' ranks
    (R@K of a sample = the mean of rank < K over it) instead of embedding anything again."""

    def __init__(self, values: dict[str, float], ranks: tuple[np.ndarray, np.ndarray]):
        super().__init__(values)
        self.ranks = ranks


def _as_percent(i2t_ranks: np.ndarray, t2i_ranks: np.ndarray) -> Metrics:
    i2t, t2i = np.asarray(i2t_ranks), np.asarray(t2i_ranks)
    out = {f"{name}_R@{k}": 100.0 * r[k] for name, r in (("i2t", _recall(i2t, KS)), ("t2i", _recall(t2i, KS)))
           for k in KS}
    out["Rm"] = float(np.mean(list(out.values())))
    return Metrics(out, (i2t, t2i))


DIRECTIONS = ("i2t", "t2i")  # the order of `Metrics.ranks`
ZERO_SHOT = "zero_shot"  # beside the gallery modes in a version's ranks: its held-out tasks' (`job.TaskResult.ranks`)


def flat_ranks(ranks: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]) -> dict[str, np.ndarray]:
    """{mode: {task: (i2t, t2i)}} as {"MODE/TASK/i2t": ranks, ...}: the arrays of one npz file (no pickles)."""
    return {f"{mode}/{task}/{d}": np.asarray(r, dtype=np.int32)
            for mode, per_task in ranks.items() for task, pair in per_task.items() for d, r in zip(DIRECTIONS, pair)}


def nested_ranks(flat: dict[str, np.ndarray]) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The inverse of flat_ranks."""
    out: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for key, r in flat.items():
        mode, task, d = key.split("/")
        out.setdefault(mode, {}).setdefault(task, {})[d] = np.asarray(r)
    return {mode: {task: tuple(pair[d] for d in DIRECTIONS) for task, pair in per_task.items()}
            for mode, per_task in out.items()}


def metrics_from_ranks(i2t_ranks: np.ndarray, t2i_ranks: np.ndarray) -> Metrics:
    """The same percent metrics from 0-based first-hit ranks computed elsewhere (e.g. through a vector index)."""
    return _as_percent(i2t_ranks, t2i_ranks)


def retrieval_metrics(img: np.ndarray, txt: np.ndarray, positive: np.ndarray) -> Metrics:
    """Image->text and text->image R@1/5/10 on one gallery plus Rm (their mean), in percent as the
    papers report, with each query's rank (`Metrics.ranks`). img [N_img, D], txt [N_txt, D], positive bool
    [N_img, N_txt]."""
    positive = np.asarray(positive, dtype=bool)
    return _as_percent(_directional(img, txt, positive), _directional(txt, img, positive.T))


def content_key(image: bytes | Path) -> str:
    """The identity of an image by what it shows: sha256 of its bytes (`Task.image` gives bytes or a local file).
    Tasks that share images (a language stream: the same pictures captioned in several languages, each task with
    its own copy of the files) then share keys, whatever the files are called."""
    return hashlib.sha256(image if isinstance(image, bytes) else Path(image).read_bytes()).hexdigest()


@dataclass
class Embedded:
    """One task's test split embedded by one model: unit rows, and which image matches which text.

    `keys` (the content key of each row's image, `content_key`) and `captions` (each row's caption) describe rows
    that are pairs (image i goes with caption i): with them, task-unknown retrieval finds positives in the other
    tasks' galleries too (`UnionPositives`). Without them only `positive`, inside the task, is known."""

    task: str
    img: np.ndarray  # [N_img, D] float32
    txt: np.ndarray  # [N_txt, D] float32
    positive: np.ndarray  # bool [N_img, N_txt]
    keys: Optional[Sequence[str]] = None  # [N] content key of each pair's image
    captions: Optional[Sequence[str]] = None  # [N] each pair's caption

    def __post_init__(self) -> None:
        if self.positive.shape != (len(self.img), len(self.txt)):
            raise ValueError(
                f"task {self.task!r}: positive {self.positive.shape} does not match "
                f"{len(self.img)} images x {len(self.txt)} texts"
            )
        if (self.keys is None) != (self.captions is None):
            raise ValueError(f"task {self.task!r}: give both keys and captions, or neither")
        if self.keys is not None and not len(self.keys) == len(self.captions) == len(self.img) == len(self.txt):
            raise ValueError(f"task {self.task!r}: keys and captions describe pairs: need one of each per row, got "
                             f"{len(self.keys)} keys, {len(self.captions)} captions for {len(self.img)} images x "
                             f"{len(self.txt)} texts")


class UnionPositives:
    """Which rows of the union of several tasks' galleries are positives of a query: the rule of `positives`
    (same image, identical caption, or the query's own pair) applied across the union, with the image's content
    key (`content_key`) as its identity. A task's own block also takes its `positive`. So the same image in
    another task's gallery (a language stream shows every image in every language) is a positive, not a negative
    that ties with the query's own. A task whose Embedded has no keys has positives in its own block only.

    Built per chunk of queries (`rows`), never as a full [Q, G] matrix."""

    def __init__(self, embedded: Sequence[Embedded]):
        self.embedded = list(embedded)
        self.img_start = np.cumsum([0] + [len(e.img) for e in self.embedded])
        self.txt_start = np.cumsum([0] + [len(e.txt) for e in self.embedded])
        self._img, self._txt = self._codes()

    def _codes(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(key codes, caption codes) of every image row and of every text row of the union: equal values share a
        code; rows without keys get codes no other row has (negative, so never equal to a value's)."""
        values: dict[tuple[str, str], int] = {}
        fresh = 0
        img, txt = ([], []), ([], [])
        for e in self.embedded:
            if e.keys is None:
                for side, n in ((img, len(e.img)), (txt, len(e.txt))):
                    for part in side:
                        part.append(-1 - fresh - np.arange(n))
                        fresh += n
                continue
            codes = [np.fromiter((values.setdefault((what, str(v)), len(values)) for v in column), dtype=np.int64,
                                 count=len(column)) for what, column in (("key", e.keys), ("caption", e.captions))]
            for side in (img, txt):  # (rows are pairs: image row i and text row i describe one item)
                side[0].append(codes[0])
                side[1].append(codes[1])
        return tuple(np.concatenate(p) for p in img), tuple(np.concatenate(p) for p in txt)

    def rows(self, t: int, direction: str, start: int, stop: int) -> np.ndarray:
        """bool [stop - start, G]: the positives of task t's queries start..stop-1 among the union's gallery rows,
        `direction` "i2t" (image queries, text gallery) or "t2i"."""
        if direction not in ("i2t", "t2i"):
            raise ValueError(f"direction must be 'i2t' or 't2i', got {direction!r}")
        (query, query_start), (gallery, gallery_start) = (
            ((self._img, self.img_start), (self._txt, self.txt_start)) if direction == "i2t"
            else ((self._txt, self.txt_start), (self._img, self.img_start)))
        q = slice(query_start[t] + start, query_start[t] + stop)
        out = (query[0][q, None] == gallery[0][None, :]) | (query[1][q, None] == gallery[1][None, :])
        own = self.embedded[t].positive
        out[:, gallery_start[t]:gallery_start[t + 1]] |= (own if direction == "i2t" else own.T)[start:stop]
        return out


def _union_ranks(queries: np.ndarray, gallery: np.ndarray, union: UnionPositives, t: int,
                 direction: str) -> np.ndarray:
    """First-hit ranks of task t's queries against the union gallery, in query chunks."""
    return np.concatenate([
        _first_hit_rank(queries[s : s + _QUERY_CHUNK] @ gallery.T,
                        union.rows(t, direction, s, min(s + _QUERY_CHUNK, len(queries))))
        for s in range(0, len(queries), _QUERY_CHUNK)
    ])


def evaluate_seen(embedded: Sequence[Embedded],
                  galleries: Optional[Sequence[Embedded]] = None) -> dict[str, dict[str, dict[str, float]]]:
    """{'known': {task: metrics}, 'unknown': {task: metrics}}. Task-known ranks a task's queries in its
    own gallery; task-unknown ranks them in the union of all tasks' galleries (raw cosine, no per-task
    normalisation), where other tasks' items are negatives that can distract the query, unless they show the same
    image or carry the same caption (`UnionPositives`).

    The queries are `embedded`; the galleries are `galleries` (the same tasks' rows in the same order, embedded by
    other models), by default the queries' own: the no-reindex policy ranks today's queries against the vectors
    each task's own version made (`noreindex_galleries`)."""
    names = [e.task for e in embedded]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate task names: {names}")
    galleries = list(embedded if galleries is None else galleries)
    if [g.task for g in galleries] != names or any(
            g.img.shape[0] != e.img.shape[0] or g.txt.shape[0] != e.txt.shape[0] for e, g in zip(embedded, galleries)):
        raise ValueError(f"the galleries must be the queries' tasks {names} with the same rows, got "
                         f"{[(g.task, len(g.img), len(g.txt)) for g in galleries]}")
    all_img = np.concatenate([g.img for g in galleries])
    all_txt = np.concatenate([g.txt for g in galleries])
    union = UnionPositives(embedded)
    known, unknown = {}, {}
    for t, (e, g) in enumerate(zip(embedded, galleries)):
        known[e.task] = _as_percent(_directional(e.img, g.txt, e.positive), _directional(e.txt, g.img, e.positive.T))
        unknown[e.task] = _as_percent(_union_ranks(e.img, all_txt, union, t, "i2t"),
                                      _union_ranks(e.txt, all_img, union, t, "t2i"))
    return {"known": known, "unknown": unknown}


BASELINE = "pretrained"  # the label of a matrix's row 0: the version a stream started from, before any training


class ResultMatrix:
    """R[i][j] = score (e.g. Rm) of the model after task i on task j, j <= i; NaN above the diagonal.
    Grows one row per task, so AA, forgetting and BWT can be read after every task of the stream.

    `baseline` is row 0, "before any training": the scores of the stream's version 0 (a pretrained model registered
    with `clipstream register --from ... --evaluate`) on the tasks it was evaluated on, which may be tasks the stream
    has not reached yet. It is kept beside the trained rows, not among them: AA, forgetting and BWT stay the papers'
    definitions over the trained rows (forgetting is measured from the best score after a task was learnt, never
    from the pretrained one), while the table, the heatmap and the curves show it first, labelled `BASELINE`. Its
    task-unknown scores rank each query in the union of the galleries of every task it was evaluated on."""

    def __init__(self, tasks: list[str] | None = None, rows: list[list[float]] | None = None,
                 baseline: dict[str, float] | None = None):
        tasks, rows = list(tasks or []), [list(map(float, r)) for r in rows or []]
        if len(tasks) != len(rows) or len(set(tasks)) != len(tasks):
            raise ValueError(f"need one row per distinct task, got tasks {tasks} and {len(rows)} rows")
        for i, row in enumerate(rows):
            if len(row) != i + 1 or not all(map(math.isfinite, row)):
                raise ValueError(f"row {i} must hold {i + 1} finite scores, got {row}")
        baseline = {str(k): float(v) for k, v in (baseline or {}).items()}
        if not all(map(math.isfinite, baseline.values())):
            raise ValueError(f"the {BASELINE} row must hold finite scores, got {baseline}")
        self.tasks, self._rows, self.baseline = tasks, rows, baseline

    def add_row(self, task: str, scores: dict[str, float]) -> None:
        """Append the evaluation after training on `task`: scores for every seen task and `task`."""
        if task in self.tasks:
            raise ValueError(f"task {task!r} already has a row")
        order = self.tasks + [task]
        missing, unknown = set(order) - set(scores), set(scores) - set(order)
        if missing or unknown:
            raise ValueError(
                f"scores after {task!r}: missing tasks {sorted(missing)}, unknown tasks {sorted(unknown)}"
            )
        row = [float(scores[name]) for name in order]
        if not all(map(math.isfinite, row)):
            raise ValueError(f"scores after {task!r} must be finite, got {row}")
        self.tasks, self._rows = order, self._rows + [row]

    @property
    def values(self) -> np.ndarray:
        """[T, T] float array, NaN above the diagonal."""
        out = np.full((len(self.tasks), len(self.tasks)), np.nan)
        for i, row in enumerate(self._rows):
            out[i, : i + 1] = row
        return out

    def average_accuracy(self, t: int | None = None) -> float:
        """AA_t = mean over j <= t of R[t][j]; t defaults to the last row."""
        if not self.tasks:
            raise ValueError("empty result matrix")
        t = len(self.tasks) - 1 if t is None else t
        if not 0 <= t < len(self.tasks):
            raise IndexError(f"row {t} out of range for {len(self.tasks)} tasks")
        return float(np.mean(self._rows[t]))

    def forgetting(self) -> dict[str, float]:
        """F_j = max over earlier rows l in [j, T-2] of R[l][j], minus R[T-1][j], for each j < T-1."""
        v, last = self.values, len(self.tasks) - 1
        return {self.tasks[j]: float(v[j:last, j].max() - v[last, j]) for j in range(last)}

    def mean_forgetting(self) -> float:
        """Mean of forgetting() over tasks; 0.0 with fewer than two tasks (nothing could be forgotten)."""
        f = self.forgetting()
        return float(np.mean(list(f.values()))) if f else 0.0

    def bwt(self) -> float:
        """Backward transfer: mean over j < T-1 of R[T-1][j] - R[j][j]; 0.0 with fewer than two tasks."""
        v, last = self.values, len(self.tasks) - 1
        return float(np.mean([v[last, j] - v[j, j] for j in range(last)])) if last > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready: tasks, the square matrix with None above the diagonal, and the summary numbers."""
        return {
            "tasks": list(self.tasks),
            "values": [row + [None] * (len(self.tasks) - len(row)) for row in self._rows],
            "average_accuracy": self.average_accuracy() if self.tasks else None,
            "forgetting": self.forgetting(),
            "mean_forgetting": self.mean_forgetting(),
            "bwt": self.bwt(),
            **({"baseline": {"label": BASELINE, "scores": dict(self.baseline)}} if self.baseline else {}),
        }

    @classmethod
    def from_dict(cls, d: dict) -> ResultMatrix:
        """Inverse of to_dict (summary numbers are recomputed, not read)."""
        return cls(d["tasks"], [row[: i + 1] for i, row in enumerate(d["values"])],
                   (d.get("baseline") or {}).get("scores"))

    @property
    def columns(self) -> list[str]:
        """The tasks shown: the trained ones in order, then those only the baseline row holds."""
        return self.tasks + [t for t in self.baseline if t not in self.tasks]

    def shown(self) -> tuple[list[str], np.ndarray]:
        """(row labels, [rows, columns] array, NaN where no score) of what the table and the plots show: the
        baseline row first when there is one, then the trained rows."""
        columns, labels = self.columns, ([BASELINE] if self.baseline else []) + self.tasks
        out = np.full((len(labels), len(columns)), np.nan)
        if self.baseline:
            out[0] = [self.baseline.get(t, np.nan) for t in columns]
        out[len(labels) - len(self.tasks):, :len(self.tasks)] = self.values
        return labels, out

    def heatmap(self, path: str | Path, title: str = "R[i][j] (Rm)") -> Path:
        """Write the matrix as an annotated PNG heatmap (blank above the diagonal); returns the path.
        Uses a bare Figure (Agg canvas) so no pyplot/global backend state is touched."""
        from matplotlib.figure import Figure  # (here: the embed path also runs where matplotlib is not installed)

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        labels, v = self.shown()
        columns, n = self.columns, max(len(labels), len(self.columns))
        fig = Figure(figsize=(1.6 + 0.9 * max(n, 2), 1.2 + 0.8 * max(n, 2)))
        ax = fig.add_subplot()
        im = ax.imshow(np.ma.masked_invalid(v), cmap="viridis")
        lo, hi = im.get_clim()
        for i, j in zip(*np.nonzero(np.isfinite(v))):
            dark = hi == lo or (v[i, j] - lo) / (hi - lo) < 0.5
            ax.text(j, i, f"{v[i, j]:.1f}", ha="center", va="center", color="white" if dark else "black")
        ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right")
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("on task j")
        ax.set_ylabel("after task i")
        ax.set_title(title)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
        return path

    def curves(self, path: str | Path, title: str = "Rm over the stream") -> Path:
        """Write each task's Rm after every task from the one that introduced it (R[i][j] for i >= j: what
        forgetting looks like), and AA, as a PNG line plot; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        labels, v = self.shown()
        n, first = len(labels), len(labels) - len(self.tasks)  # (first: the row of the first trained task)
        from matplotlib.figure import Figure

        fig = Figure(figsize=(2.5 + 0.9 * max(n, 2), 4), layout="constrained")
        ax = fig.add_subplot()
        for j, task in enumerate(self.columns):
            rows = np.flatnonzero(np.isfinite(v[:, j]))  # the baseline's score, then from the task's own row on
            ax.plot(rows, v[rows, j], "o-", label=task)
        if self.tasks:
            ax.plot(range(first, n), [self.average_accuracy(i) for i in range(len(self.tasks))], "k--", lw=2, label="AA")
        ax.set_xticks(range(n), labels, rotation=30, ha="right")
        ax.set(xlabel="after task i", ylabel="Rm (mean recall@1,5,10, %)", title=title)
        ax.legend(fontsize=8)
        fig.savefig(path, format="png", dpi=100)
        return path

    def format_table(self) -> str:
        """Fixed-width text table (rows: after task i, columns: on task j, last column AA_i) followed by
        the final AA, per-task forgetting and BWT, for the CLI."""
        head = "after \\ on"
        columns = self.columns
        w = max([8] + [len(t) + 1 for t in columns])
        lw = max(len(head), w, len(BASELINE))
        lines = [head.ljust(lw) + "".join(t.rjust(w) for t in columns) + "AA".rjust(w)]
        if self.baseline:  # (no AA: it is not a trained row)
            lines.append(BASELINE.ljust(lw) + "".join((f"{self.baseline[t]:.2f}" if t in self.baseline else "").rjust(w)
                                                      for t in columns))
        for i, (task, row) in enumerate(zip(self.tasks, self._rows)):
            cells = [f"{x:.2f}".rjust(w) for x in row] + [" " * w] * (len(columns) - len(row))
            lines.append(task.ljust(lw) + "".join(cells) + f"{self.average_accuracy(i):.2f}".rjust(w))
        if not self.tasks and self.baseline:  # row 0 alone: nothing trained, nothing forgotten yet
            return "\n".join(lines)
        if self.tasks:
            lines.append(f"AA (after {self.tasks[-1]}): {self.average_accuracy():.2f}")
        per_task = ", ".join(f"{t} {f:.2f}" for t, f in self.forgetting().items())
        per_task = f" ({per_task})" if per_task else ""
        lines.append(f"forgetting: mean {self.mean_forgetting():.2f}{per_task}")
        lines.append(f"BWT: {self.bwt():.2f}")
        return "\n".join(lines)


def embed_task(bundle, task, split: str = "test", batch_size: int = 256) -> Embedded:
    """A task split embedded by a model bundle (`clipstream.models.ClipBundle`), ready for `evaluate_seen`."""
    return embed_tasks(bundle, [task], split, batch_size)[0]


def embed_tasks(bundle, tasks: Sequence, split: str = "test", batch_size: int = 256) -> list[Embedded]:
    """Several tasks' splits embedded in one pass: their rows go through the model together, in batches of
    `batch_size`, and are split back per task. A stream's test splits are small next to a batch (64 pairs in the
    benchmarks against 256): one task at a time, most model calls would be small part-full batches, which two torch
    threads run poorly (8 tasks of 64 pairs, tiny model, 2 CPU threads: ~1.7x the CPU time of one pass). Each row
    is embedded once, in eval mode: its vector does not depend on the rows it shares a batch with (up to float
    rounding)."""
    rows = [task.check(split).rows for task in tasks]
    captions = [[str(r["caption"]) for r in task_rows] for task_rows in rows]
    images = [task.image(r) for task, task_rows in zip(tasks, rows) for r in task_rows]
    keys = [content_key(image) for image in images]
    img = bundle.embed_images(images, batch_size)
    txt = bundle.embed_texts([c for task_captions in captions for c in task_captions], batch_size)
    bounds = np.cumsum([0, *map(len, rows)])
    return [Embedded(task.name, img[a:b], txt[a:b], positives(keys[a:b], task_captions), keys[a:b], task_captions)
            for task, task_captions, a, b in zip(tasks, captions, bounds[:-1], bounds[1:])]


class GalleryCache:
    """The test-split vectors of the versions evaluated last in this process, so that a version's galleries are
    embedded once: the next task's job (in the same process: a stream of `clipstream demo`, a benchmark) needs
    its parent's vectors of the old tasks (Mod-X's spatial disorder) and takes them from here instead of
    embedding every old task again with the parent. Held by the MLflow run that trained the version (one run
    registers one version) and each task's lineage entry (name, path and data digest) and the batch size; only
    the image and text vectors are kept, for the last `keep` versions."""

    def __init__(self, keep: int = 1):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self._runs: OrderedDict[str, dict[tuple, tuple[np.ndarray, np.ndarray]]] = OrderedDict()

    @staticmethod
    def _key(entry: dict, batch_size: int) -> tuple:
        return entry["task"], str(entry.get("path", "")), entry.get("data_sha", ""), batch_size

    def put(self, run_id: str, entries: Sequence[dict], embedded: Sequence[Embedded], batch_size: int) -> None:
        """Keep the vectors the model of `run_id` gave each entry's split (`embedded`, in the order of `entries`)."""
        if len(entries) != len(embedded):
            raise ValueError(f"{len(entries)} entries but {len(embedded)} embedded splits")
        self._runs[run_id] = {self._key(e, batch_size): (x.img, x.txt) for e, x in zip(entries, embedded)}
        self._runs.move_to_end(run_id)
        while len(self._runs) > self.keep:
            self._runs.popitem(last=False)

    def get(self, run_id: str, entries: Sequence[dict],
            batch_size: int) -> Optional[list[tuple[np.ndarray, np.ndarray]]]:
        """(image vectors, text vectors) of every entry as the model of `run_id` embedded them; None unless all
        of them are held."""
        held = self._runs.get(run_id, {})
        found = [held.get(self._key(e, batch_size)) for e in entries]
        return None if any(f is None for f in found) else found


def format_scores(scores: dict[str, dict[str, dict[str, float]]]) -> str:
    """`evaluate_seen` output as one fixed-width table per gallery mode."""
    lines = []
    for mode, per_task in scores.items():
        keys = list(next(iter(per_task.values())))
        lines.append(f"task-{mode}")
        lines.append(f"{'task':<24}" + "".join(f"{k:>11}" for k in keys))
        for name, metrics in per_task.items():
            lines.append(f"{name:<24}" + "".join(f"{metrics[k]:>11.1f}" for k in keys))
    return "\n".join(lines)


# the test-split vectors of the last version this process evaluated: the next task's job, when it runs in this process
# too (a stream of `clipstream demo`, a benchmark), takes its parent's from here instead of embedding them again
GALLERIES = GalleryCache(keep=1)


# Zero-shot classification as the CLIP papers measure it: each image's class is the class name whose prompts its
# vector is closest to. open_clip's zero-shot classifier: every template filled with the class name, the unit text
# vectors averaged over the templates and renormalised. A task may give its own `templates` (task.yaml), as
# open_clip's per-dataset ones; these are the generic ones.
TEMPLATES = ("a photo of a {}.", "a {}.", "a photo of the {}.", "an image of a {}.")


def class_vectors(bundle, classes: Sequence[str], templates: Sequence[str] = TEMPLATES,
                  batch_size: int = 256) -> np.ndarray:
    """[C, D] unit rows: class c's prompts (`templates` with c in place of `{}`) embedded by `bundle`, averaged,
    renormalised."""
    if not classes or not templates:
        raise ValueError(f"class_vectors needs classes and templates, got {len(classes)} and {len(templates)}")
    prompts = bundle.embed_texts([t.replace("{}", str(c)) for c in classes for t in templates], batch_size)
    mean = prompts.reshape(len(classes), len(templates), -1).mean(axis=1)
    return mean / np.linalg.norm(mean, axis=1, keepdims=True)


def classification_accuracy(img: np.ndarray, classes: np.ndarray, labels: Sequence[int]) -> dict[str, float]:
    """Top-1 (and top-5 when there are more than 5 classes) accuracy in percent of the images `img` [N, D]
    against the class vectors `classes` [C, D] (cosine of unit rows), `labels` [N] the index of each image's class.
    Ties count against the true class, as in retrieval (`_first_hit_rank`): a class scoring the same is ranked
    above it."""
    labels = np.asarray(labels)
    if len(labels) != len(img) or not len(img):
        raise ValueError(f"{len(img)} images but {len(labels)} labels (need one per image, at least one)")
    if labels.min() < 0 or labels.max() >= len(classes):
        raise ValueError(f"labels must index the {len(classes)} classes, got values in [{labels.min()}, {labels.max()}]")
    own = np.zeros((len(img), len(classes)), dtype=bool)
    own[np.arange(len(img)), labels] = True
    ranks = _first_hit_rank(img @ classes.T, own)
    return {f"top{k}": 100.0 * float(np.mean(ranks < k)) for k in (1, 5) if k == 1 or len(classes) > 5}
