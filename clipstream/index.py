"""Versioned vector index: per-task gallery embeddings tagged with the model version that made them.

Two indexing policies ("Continual learning in cross-modal retrieval", Wang, Herranz and van de Weijer, CVPR
Workshops 2021, arXiv:2104.06806): **no-reindex** appends one task to the
serving generation and never touches older points; **reindex** builds generation g+1 with every task under
one version, verifies it, switches atomically and drops g. Queries always read one published state, so a
result never mixes generations. The policy logic lives in `VectorIndex`; `EdgeIndex` (embedded Qdrant Edge,
immutable segments + an atomically replaced manifest) and `ServerIndex` (Qdrant server, collections +
aliases) only implement the storage primitives at the bottom of the base class.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import fcntl
import heapq
import json
import os
import re
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from clipstream import console
from clipstream.settings import NO_REINDEX, POLICIES, REINDEX, Policy  # noqa: F401 (POLICIES: re-exported)

MODALITIES = ("image", "text")
PAYLOAD_INDEXES = {"task": "keyword", "modality": "keyword", "model_version": "keyword", "index_generation": "integer"}
BATCH = 256  # points per upsert call
MAX_K = 1000
MAX_DEPTH = 10_000  # offset + k: how deep paging may go into one ranking
META = "meta"  # a point's payload key holding its item's own fields (AddItems metadata); filters name them bare
FIELD_TYPES = ("keyword", "integer", "float")  # what a declared field (Settings index_fields) may hold
CATALOGUE = "catalogue"  # a task kind: items users add and delete (AddItems), not a trained task's gallery
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
Z_POOL = 100  # per-task candidates whose scores give the z-score statistics (normalize_per_task)
# Edge segments. The values below were chosen with `clipstream bench search` (benchmarks/search.py: recall@10
# against exact numpy search, p50/p99 latency at 10k-1M vectors; its results in benchmarks/results/search*.md), and
# `clipstream bench search --hnsw-ef N` reruns the sweep. A segment holding more than HNSW_FROM_KB of vectors gets an
# HNSW graph; a smaller one is scanned exactly, which is faster there (a graph search with hnsw_ef 256 reads about as
# many vectors as such a segment holds) and loses no recall, where a smaller hnsw_ef loses recall even on small
# graphs; graphs on many small appended segments also made appends and task-unknown searches slower than scans. A
# task-known search of a merged segment scans the task's points, through the payload index, below the same
# threshold. Vectors are int8-quantised for the graph walk and scan; OVERSAMPLING x k candidates are rescored with
# the float32 vectors, so scores are exact cosines. HNSW_EF is the candidate list of a search (recall vs time);
# m=32/ef_construct=200 because the recall lost at m=16/ef_construct=100 was the graph's, not the int8 scores'.
# A larger graph needs a longer candidate list for the same recall: a segment of more than HNSW_EF_POINTS points is
# searched with hnsw_ef = HNSW_EF x points / HNSW_EF_POINTS (graph randomness put a 500k segment at the edge of the
# recall target at 1024, so it gets 1280).
HNSW_M, HNSW_EF_CONSTRUCT, HNSW_EF, HNSW_FROM_KB, OVERSAMPLING = 32, 200, 256, 5000, 2.0
HNSW_EF_POINTS = 100_000
MERGED = "+tasks"  # names the Edge segments that hold several tasks: a reindex's or a compaction's ('+' is never in a slug)
_NAMESPACE = uuid.UUID("5b0e8f3a-6c1d-4f51-9c2e-c1195742ea70")
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class VectorIndexError(ValueError):
    """A bad input or a refused operation; nothing stored has changed."""


def point_id(item_id: str, modality: str, model_version: str, lineage: str) -> str:
    """uuid5 of (item, modality, model_version, lineage) as a string: a rerun never duplicates."""
    return str(uuid.uuid5(_NAMESPACE, f"{item_id}\x1f{modality}\x1f{model_version}\x1f{lineage}"))


def _item_key(kind: str, task: str, item_id: str) -> str:
    """What names an item in its point id: a trained task's item id as it is (tasks of one version keep their ids
    apart, `_check_ids_disjoint`), a catalogue's within its catalogue, so that no id a user picks can collide with
    a task's or another catalogue's (a collision would block a promotion)."""
    return f"\x1e{task}\x1e{item_id}" if kind == CATALOGUE else item_id


@dataclass
class TaskVectors:
    """One task's gallery embedded by one model version (rows are pairs: image i goes with caption i)."""

    task: str
    task_index: int
    model_version: str
    item_ids: list[str]
    image: np.ndarray
    text: np.ndarray
    captions: list[str]
    split: str = "test"
    image_uris: list[str] = field(default_factory=list)  # where each image row is, for image hits ([]: not said)
    kind: str = "task"  # or CATALOGUE
    metadata: list[dict] = field(default_factory=list)  # per item_id, its own payload fields ([]: none)
    # a catalogue's items need not have both: the items with an image (the rows of `image`), with a text (the rows of
    # `text` and `captions`); None: every item, in item_ids' order (a task's pairs)
    image_ids: list[str] | None = None
    text_ids: list[str] | None = None

    def ids(self, modality: str) -> list[str]:
        """The items whose `modality` rows these vectors hold, in row order."""
        own = self.image_ids if modality == "image" else self.text_ids
        return self.item_ids if own is None else own


@dataclass(frozen=True)
class Hit:
    """One search result; model_version/index_generation say which encoder and build produced the vector."""

    item_id: str
    task: str
    task_index: int
    modality: str
    score: float
    model_version: str
    index_generation: int
    lineage: str
    caption: str | None
    image_uri: str | None = None  # image hits: where the image is (a path on the machine that indexed it, or a URI)
    metadata: dict = field(default_factory=dict, hash=False)  # the item's own fields (catalogue items)


def _unit(x, what: str, dim: int | None) -> np.ndarray:
    """Rows L2-normalised as float32; refuses wrong dimension, zero and non-finite rows (cosine needs a direction)."""
    x = np.asarray(x)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.number):
        raise VectorIndexError(f"{what}: expected a numeric 2-D array [N, D], got shape {x.shape} of {x.dtype}")
    if dim is not None and x.shape[1] != dim:
        raise VectorIndexError(f"{what}: vectors have dimension {x.shape[1]}, but the index holds dimension {dim}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise VectorIndexError(f"{what}: vectors contain NaN or infinite values")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if (norms == 0).any():
        raise VectorIndexError(f"{what}: zero vector at row {int(np.flatnonzero(norms[:, 0] == 0)[0])}")
    return (x / norms).astype(np.float32)


def check_fields(fields: dict | None) -> dict[str, str]:
    """Declared payload fields (name -> one of FIELD_TYPES), the ones searches may filter on."""
    fields = dict(fields or {})
    for name, kind in fields.items():
        if not isinstance(name, str) or not _FIELD.match(name):
            raise VectorIndexError(f"field name {name!r}: use a letter or '_' then up to 63 letters, digits or '_'")
        if kind not in FIELD_TYPES:
            raise VectorIndexError(f"field {name!r}: type {kind!r} is not one of {', '.join(FIELD_TYPES)}")
    return fields


def _undeclared(name: str, fields: dict) -> str:
    close = difflib.get_close_matches(name, list(fields), n=1)
    return (f"field {name!r} is not declared" + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; declared fields: {', '.join(sorted(fields)) or 'none'} (Settings index_fields, "
            "CLIPSTREAM_INDEX_FIELDS)")


def _of_type(value, kind: str) -> bool:
    if kind == "keyword":
        return isinstance(value, str)
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, (int, float, np.integer, np.floating)) and np.isfinite(value)


def check_metadata(metadata, fields: dict, where: str = "metadata") -> dict:
    """An item's own fields, each declared and of its declared type (an integer field takes 3.0 as 3)."""
    if not isinstance(metadata, dict):
        raise VectorIndexError(f"{where}: expected a mapping of field -> value, got {type(metadata).__name__}")
    out = {}
    for name, value in metadata.items():
        if name not in fields:
            raise VectorIndexError(f"{where}: {_undeclared(name, fields)}")
        if not _of_type(value, fields[name]):
            raise VectorIndexError(f"{where}: field {name!r} is declared {fields[name]}, got {type(value).__name__} "
                                   f"{value!r:.40}")
        out[name] = int(value) if fields[name] == "integer" else float(value) if fields[name] == "float" else value
    return out


def check_where(where, fields: dict) -> list[tuple[str, str, object]]:
    """A search's filter as (field, "any" | "range", values | (gte, lte)) conditions, all of which must hold: each
    field declared; a value (equal), a list (any of) or {"gte": x, "lte": y} (a numeric field's range)."""
    if where is None:
        return []
    if not isinstance(where, dict):
        raise VectorIndexError(f"filter: expected a mapping of field -> condition, got {type(where).__name__}")
    out = []
    for name, cond in where.items():
        if name not in fields:
            raise VectorIndexError(f"filter: {_undeclared(name, fields)}")
        kind = fields[name]
        if isinstance(cond, dict):
            if kind not in ("integer", "float") or not cond or set(cond) - {"gte", "lte"}:
                raise VectorIndexError(f"filter on {name!r}: a range is {{'gte': x, 'lte': y}} on an integer or float "
                                       f"field; {name!r} is {kind}")
            if not all(_of_type(v, "float") for v in cond.values()):
                raise VectorIndexError(f"filter on {name!r}: range bounds must be finite numbers, got {cond!r:.60}")
            out.append((name, "range", (cond.get("gte"), cond.get("lte"))))
            continue
        values = list(cond) if isinstance(cond, (list, tuple)) else [cond]
        if not values or not all(_of_type(v, kind) for v in values):
            raise VectorIndexError(f"filter on {name!r}: field {name!r} is declared {kind}, got {cond!r:.60}")
        if kind == "float":
            raise VectorIndexError(f"filter on {name!r}: a float field is filtered by a range, {{'gte': x, 'lte': y}}")
        out.append((name, "any", [int(v) if kind == "integer" else v for v in values]))
    return out


def _check_task(tv: TaskVectors, dim: int | None, fields: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Validate one task completely before anything is written; returns its unit image and text vectors."""
    if not isinstance(tv, TaskVectors):
        raise VectorIndexError(f"expected TaskVectors, got {type(tv).__name__}")
    for name in ("task", "model_version", "split", "kind"):
        if not isinstance(getattr(tv, name), str) or not getattr(tv, name):
            raise VectorIndexError(f"TaskVectors.{name} must be a non-empty string, got {getattr(tv, name)!r}")
    where = f"task {tv.task!r} (version {tv.model_version})"
    if not isinstance(tv.task_index, int) or tv.task_index < 0:
        raise VectorIndexError(f"{where}: task_index must be an int >= 0, got {tv.task_index!r}")
    n = len(tv.item_ids)
    if n == 0:
        raise VectorIndexError(f"{where}: no items")
    if len(set(tv.item_ids)) != n or not all(isinstance(i, str) and i for i in tv.item_ids):
        raise VectorIndexError(f"{where}: item_ids must be unique non-empty strings")
    if not all(isinstance(c, str) for c in tv.captions):
        raise VectorIndexError(f"{where}: captions must be strings")
    known = set(tv.item_ids)
    for modality in MODALITIES:
        rows = tv.ids(modality)
        if len(set(rows)) != len(rows) or not known.issuperset(rows):
            raise VectorIndexError(f"{where}: {modality}_ids must be distinct item ids of item_ids")
    if len(set(tv.ids("image")) | set(tv.ids("text"))) != n:
        raise VectorIndexError(f"{where}: every item needs an image or a text")
    image, text = _unit(tv.image, f"{where} image", dim), _unit(tv.text, f"{where} text", dim)
    if image.shape[1] != text.shape[1]:
        raise VectorIndexError(f"{where}: image dimension {image.shape[1]} != text dimension {text.shape[1]}")
    nimage, ntext = len(tv.ids("image")), len(tv.ids("text"))
    if tv.image_uris and (len(tv.image_uris) != nimage or not all(isinstance(u, str) for u in tv.image_uris)):
        raise VectorIndexError(f"{where}: image_uris must be one string per image row, or none")
    if not (len(image) == nimage and len(text) == len(tv.captions) == ntext):
        raise VectorIndexError(f"{where}: lengths differ: {nimage} items with an image, {len(image)} image rows, "
                               f"{ntext} items with a text, {len(text)} text rows, {len(tv.captions)} captions")
    if tv.metadata:
        if len(tv.metadata) != n:
            raise VectorIndexError(f"{where}: metadata must be one mapping per item, or none")
        tv.metadata = [check_metadata(m, fields or {}, f"{where} item {i!r} metadata")
                       for i, m in zip(tv.item_ids, tv.metadata)]
    return image, text


def _joined(a: TaskVectors, b: TaskVectors) -> TaskVectors:
    """Two catalogues' items as one (b's after a's; the ids disjoint)."""
    def uris(tv):
        return tv.image_uris or [""] * len(tv.ids("image"))

    def meta(tv):
        return tv.metadata or [{} for _ in tv.item_ids]

    return TaskVectors(a.task, a.task_index, a.model_version, a.item_ids + b.item_ids,
                       np.concatenate([np.asarray(a.image, np.float32), np.asarray(b.image, np.float32)]),
                       np.concatenate([np.asarray(a.text, np.float32), np.asarray(b.text, np.float32)]),
                       list(a.captions) + list(b.captions), a.split, uris(a) + uris(b), CATALOGUE, meta(a) + meta(b),
                       a.ids("image") + b.ids("image"), a.ids("text") + b.ids("text"))


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:40]


class VectorIndex:
    """Policy logic (validation, ids, payloads, generations, search merging); storage lives in subclasses."""

    def __init__(self, name: str, lineage: str = "shared", fields: dict | None = None):
        """`fields`: the items' own payload fields searches may filter on (name -> one of FIELD_TYPES), each with a
        payload index; an item's metadata may hold only these."""
        for what, value in (("name", name), ("lineage", lineage)):
            if not isinstance(value, str) or not _SAFE.match(value):
                raise VectorIndexError(f"index {what} {value!r}: use 1-64 letters, digits, '.', '_' or '-'")
        self.name, self.lineage, self.fields = name, lineage, check_fields(fields)
        self.progress = False  # a progress bar over points written (the indexing job turns it on)
        self._wlock = threading.Lock()

    # ---- public API -------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {k: v for k, v in copy.deepcopy(self._read()).items() if k != "segments"}

    def append(self, vectors: TaskVectors) -> dict:
        """No-reindex: add one task to the serving generation; other tasks' points are never touched."""
        if not isinstance(vectors, TaskVectors):
            raise VectorIndexError(f"append takes TaskVectors, got {type(vectors).__name__}")
        with self._writing():
            state = self._read()
            old = state["tasks"].get(vectors.task)
            if old and old["model_version"] != vectors.model_version:
                raise VectorIndexError(
                    f"task {vectors.task!r} is already indexed under model version {old['model_version']}; appending "
                    f"version {vectors.model_version} would mix versions within the task: run a reindex instead")
            return self._put(state, vectors)

    def upsert(self, vectors: TaskVectors) -> dict:
        """Add items to catalogue `vectors.task`, or replace those of the same item id (both modalities: an item sent
        again without a text loses its text); its other items are kept. The catalogue is written again whole in the
        serving generation and switched atomically, as an append is: a search sees it before or after, never
        half-written. Under the catalogue's version only: a catalogue never mixes versions."""
        if not isinstance(vectors, TaskVectors) or vectors.kind != CATALOGUE:
            raise VectorIndexError(f"upsert takes a catalogue's TaskVectors (kind {CATALOGUE!r}), got {vectors!r:.80}")
        with self._writing():
            state = self._read()
            old = self._catalogue(state, vectors.task, vectors.model_version)
            if old:
                kept, _ = self._stored(state, vectors.task, drop=set(vectors.item_ids))
                vectors = _joined(kept, vectors) if kept else vectors
            return self._put(state, vectors)

    def delete(self, task: str, item_ids: list[str]) -> tuple[dict, list[str]]:
        """Remove items from catalogue `task`, switched atomically; returns (the state, the ids it did not hold).
        A catalogue left with no items leaves the index."""
        if not isinstance(item_ids, (list, tuple)) or not all(isinstance(i, str) and i for i in item_ids):
            raise VectorIndexError(f"delete takes a list of item ids, got {item_ids!r:.80}")
        with self._writing():
            state = self._read()
            if task not in state["tasks"]:
                raise VectorIndexError(f"unknown catalogue {task!r}; indexed: {sorted(state['tasks'])}")
            self._catalogue(state, task, state["tasks"][task]["model_version"])
            kept, held = self._stored(state, task, drop=set(item_ids))
            missing = [i for i in item_ids if i not in held]
            if len(missing) == len(item_ids):
                return self.state(), missing
            self._sweep(state)
            if kept:
                new = self._build(state, max(state["generation"], 1), [(kept, _check_task(kept, state["dim"],
                                                                                            self.fields))])
            else:
                new = copy.deepcopy(state)
                del new["tasks"][task], new["segments"][task]
            return self._commit(state, new), missing

    def _catalogue(self, state: dict, task: str, version: str) -> dict | None:
        """The indexed catalogue `task` (None when not indexed); refused when it is a trained task's gallery or
        under another version."""
        old = state["tasks"].get(task)
        if old and old.get("kind", "task") != CATALOGUE:
            raise VectorIndexError(f"{task!r} is a trained task's gallery, not a catalogue: items are added to and "
                                   "deleted from catalogues (name another)")
        if old and old["model_version"] != version:
            raise VectorIndexError(f"catalogue {task!r} is indexed under model version {old['model_version']}, not "
                                   f"{version}: its items are embedded by its own version")
        return old

    def _put(self, state: dict, vectors: TaskVectors) -> dict:
        """Write one task (whole) into the serving generation and switch to it."""
        arrays = _check_task(vectors, state["dim"], self.fields)
        self._check_ids_disjoint([vectors], state)
        self._sweep(state)  # leftovers of a failed earlier write are never served; clear them
        new = self._build(state, max(state["generation"], 1), [(vectors, arrays)])
        new["query_version"] = state.get("query_version") or vectors.model_version
        return self._commit(state, new)

    def _stored(self, state: dict, task: str, drop: set = frozenset()) -> tuple[TaskVectors | None, set[str]]:
        """(task `task` as stored (vectors, captions, URIs, metadata) without the items in `drop`, None if none is
        left; every item id it held), from one read of its points."""
        meta = state["tasks"][task]
        every = {m: list(self._scroll(state, task, m)) for m in MODALITIES}
        held = {p["item_id"] for m in MODALITIES for _, p in every[m]}
        rows = {m: [(v, p) for v, p in every[m] if p["item_id"] not in drop] for m in MODALITIES}
        items: dict[str, dict] = {}
        for m in MODALITIES:
            for _, p in rows[m]:
                items.setdefault(p["item_id"], p.get(META) or {})
        if not items:
            return None, held
        dim = state["dim"]
        vectors = {m: np.asarray([v for v, _ in rows[m]], dtype=np.float32).reshape(-1, dim) for m in MODALITIES}
        return TaskVectors(task, meta["task_index"], meta["model_version"], list(items), vectors["image"],
                           vectors["text"], [p.get("caption", "") for _, p in rows["text"]],
                           split=rows["image"][0][1]["split"] if rows["image"] else rows["text"][0][1]["split"],
                           image_uris=[p.get("image_uri", "") for _, p in rows["image"]], kind=meta.get("kind", "task"),
                           metadata=list(items.values()), image_ids=[p["item_id"] for _, p in rows["image"]],
                           text_ids=[p["item_id"] for _, p in rows["text"]]), held

    def reindex(self, tasks: list[TaskVectors]) -> dict:
        """Reindex: build generation g+1 with exactly these tasks, verify counts, switch atomically, drop g."""
        tasks = list(tasks)
        if not tasks or not all(isinstance(t, TaskVectors) for t in tasks):
            raise VectorIndexError(f"reindex needs a non-empty list of TaskVectors, got {tasks!r:.80}")
        versions = sorted({t.model_version for t in tasks}, key=str)
        if len(versions) != 1:
            raise VectorIndexError(f"reindex needs one model version for all tasks, got {versions}")
        names = [t.task for t in tasks]
        if len(set(names)) != len(names):
            raise VectorIndexError(f"reindex got a task twice: {names}")
        first = _check_task(tasks[0], None, self.fields)  # a reindex may change the dimension: every task must agree
        items = [(tasks[0], first)] + [(t, _check_task(t, first[0].shape[1], self.fields)) for t in tasks[1:]]
        self._check_ids_disjoint(tasks)
        with self._writing():
            state = self._read()
            self._sweep(state)
            new = self._build(state, state["generation"] + 1, items, fresh=True)
            new["query_version"] = versions[0]  # the old queries no longer match: switch with the gallery
            return self._commit(state, new)

    def segments(self) -> int:
        """How many segments a task-unknown search reads per modality (storage that merges its own: 1)."""
        state = self._read()
        return len({refs["image"] for refs in state["segments"].values()}) if self.merges_reindex else 1

    def compact(self) -> dict:
        """Merge the serving generation's segments into one per modality, so that a task-unknown search walks one
        graph however many tasks were appended (each append writes a segment of its own). Every point keeps its
        vector, payload and model version; the counts are verified and the switch is atomic, as a reindex's: a
        search before it reads the old segments. Storage that merges its own segments (a Qdrant server's
        optimizer) has nothing to do."""
        with self._writing():
            state = self._read()
            if not self.merges_reindex or self.segments() <= 1:
                return self.state()
            self._sweep(state)
            new, tasks = copy.deepcopy(state), sorted(state["tasks"])
            bar = console.bar(total=sum(sum(state["tasks"][t]["counts"].values()) for t in tasks), unit="pt",
                       desc=f"compact g{state['generation']}", disable=not self.progress)
            for modality in MODALITIES:
                ids, x, payloads = [], [], []
                for t in tasks:
                    kind = state["tasks"][t].get("kind", "task")
                    for v, p in self._scroll(state, t, modality):
                        ids.append(point_id(_item_key(kind, t, p["item_id"]), modality, p["model_version"],
                                            self.lineage))
                        x.append(v)
                        payloads.append(p)
                    bar.update(state["tasks"][t]["counts"][modality])
                ref = self._write(state["generation"], None, modality, ids, np.asarray(x, dtype=np.float32), payloads)
                stored = self._counts(ref, tasks)
                for t in tasks:
                    if stored[t] != state["tasks"][t]["counts"][modality]:
                        raise VectorIndexError(f"compaction: task {t!r} {modality}: stored {stored[t]} points, expected "
                                               f"{state['tasks'][t]['counts'][modality]}; the serving segments are "
                                               "unchanged, rerun to complete")
                    new["segments"][t][modality] = ref
            bar.close()
            return self._commit(state, new)

    def pin(self, version: str) -> dict:
        """Name the model version whose query encoder this gallery serves (Search encodes queries with it).

        A reindex pins its own version in the same atomic switch; the first append pins its version;
        promotion pins the promoted version once its gallery is in place, so queries never change
        encoder before the vectors they are ranked against."""
        with self._writing():
            state = self._read()
            if not state["tasks"]:
                raise VectorIndexError(f"index {self.name}/{self.lineage} is empty: nothing to pin {version!r} to")
            if state.get("query_version") != str(version):
                self._publish({**copy.deepcopy(state), "query_version": str(version)})
            return self.state()

    def search(self, vector: np.ndarray, target_modality: str, task: str | None = None, k: int = 10,
               normalize_per_task: bool = False, **options) -> list[Hit]:
        """task given = task-known; None = one ranking over all tasks by raw cosine (the paper's setting).

        normalize_per_task=True ranks task-unknown hits by each task's z-scored cosine (statistics over the
        task's top max(k, Z_POOL) candidates); Hit.score stays the raw cosine.
        """
        v = np.asarray(vector)
        if v.ndim != 1:
            raise VectorIndexError(f"search takes one vector [D], got shape {v.shape}; use search_batch")
        return self.search_batch(v[None, :], target_modality, task, k, normalize_per_task, **options)[0]

    def search_batch(self, vectors: np.ndarray, target_modality: str, task: str | None = None, k: int = 10,
                     normalize_per_task: bool = False, where: dict | None = None, score_threshold: float | None = None,
                     offset: int = 0) -> list[list[Hit]]:
        """Per query, hits offset+1 .. offset+k of its ranking (`offset`: paging), only items whose declared fields
        match `where` (`check_where`) and only scores of at least `score_threshold` (a cosine)."""
        if target_modality not in MODALITIES:
            raise VectorIndexError(f"target_modality must be one of {MODALITIES}, got {target_modality!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
            raise VectorIndexError(f"k must be an integer in [1, {MAX_K}], got {k!r}")
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or not 0 <= offset <= MAX_DEPTH - k:
            raise VectorIndexError(f"offset must be an integer in [0, {MAX_DEPTH} - k], got {offset!r}")
        if score_threshold is not None and not (_of_type(score_threshold, "float") and -1 <= score_threshold <= 1):
            raise VectorIndexError(f"score_threshold must be a cosine in [-1, 1], got {score_threshold!r}")
        conditions, depth = check_where(where, self.fields), int(offset) + int(k)
        for attempt in range(3):
            state = self._read()
            if not state["tasks"]:
                raise VectorIndexError(f"index {self.name}/{self.lineage} is empty: append or reindex a task first")
            if task is not None and task not in state["tasks"]:
                raise VectorIndexError(f"unknown task {task!r}; indexed tasks: {sorted(state['tasks'])}")
            queries = _unit(vectors, "query", state["dim"])
            if not len(queries):
                return []
            try:
                if task is None and normalize_per_task:
                    rows = self._zscored(state, target_modality, queries, depth, conditions)
                else:
                    rows = self._query(state, target_modality, [task] if task else sorted(state["tasks"]),
                                       queries, depth, conditions)
            except Exception:
                # a writer switched generations and dropped what this snapshot named: retry on the new one
                if attempt == 2 or self._read() == state:
                    raise
                continue
            return [[self._hit(score, p) for score, p in row[offset:]
                     if score_threshold is None or score >= score_threshold] for row in rows]

    def points(self, task: str, modality: str) -> dict[str, tuple[bytes, dict]]:
        """item_id -> (float32 vector bytes as stored, payload) of one task in the serving generation."""
        if modality not in MODALITIES:
            raise VectorIndexError(f"modality must be one of {MODALITIES}, got {modality!r}")
        state = self._read()
        if task not in state["tasks"]:
            raise VectorIndexError(f"unknown task {task!r}; indexed tasks: {sorted(state['tasks'])}")
        return {p["item_id"]: (np.asarray(v, dtype=np.float32).tobytes(), p)
                for v, p in self._scroll(state, task, modality)}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- shared mechanism -------------------------------------------------------------------------------
    def _empty(self) -> dict:
        return {"name": self.name, "lineage": self.lineage, "dim": None, "generation": 0, "tasks": {}, "segments": {},
                "query_version": None}

    def _check_ids_disjoint(self, tasks: list[TaskVectors], state: dict | None = None) -> None:
        """A trained task's point ids carry no task, so two tasks under one version must not share an item id
        (a catalogue's carry it: `_item_key`)."""
        tasks = [tv for tv in tasks if tv.kind != CATALOGUE]
        seen: dict[tuple[str, str], str] = {}
        for tv in tasks:
            for i in tv.item_ids:
                if seen.setdefault((tv.model_version, i), tv.task) != tv.task:
                    raise VectorIndexError(f"item id {i!r} is in tasks {seen[(tv.model_version, i)]!r} and "
                                           f"{tv.task!r} under one version; item ids must be unique across tasks")
        for tv in tasks if state else ():  # an append: compare with the indexed tasks of the same version
            others = [t for t, meta in state["tasks"].items() if t != tv.task and meta["model_version"] == tv.model_version
                      and meta.get("kind") != CATALOGUE]
            if not others:
                continue
            # same item, version and lineage give the same point id: look the new ids up instead of reading the
            # other tasks' points, so an append costs what the new task holds, not what the index holds
            ids = {point_id(i, "image", tv.model_version, self.lineage): i for i in tv.item_ids}
            for other, taken in self._taken(state, others, list(ids)).items():
                if taken:
                    raise VectorIndexError(f"item ids {sorted(ids[t] for t in taken)[:3]} of task {tv.task!r} are "
                                           f"already used by task {other!r} under version {tv.model_version}")

    def _build(self, state: dict, gen: int, items: list, fresh: bool = False) -> dict:
        """Write the tasks into generation `gen`, verify the stored counts, return the state to publish."""
        new = self._empty() if fresh else copy.deepcopy(state)
        new["generation"], new["dim"] = gen, int(items[0][1][0].shape[1])
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        bar = console.bar(total=sum(len(tv.ids(m)) for tv, _ in items for m in MODALITIES), unit="pt",
                          desc=f"index g{gen}", disable=not self.progress)
        # a reindexed generation is written whole: where storage merges it (Edge), one segment per modality holds
        # every task, so a task-unknown search walks one graph instead of one per task
        groups = [items] if fresh and self.merges_reindex and len(items) > 1 else [[item] for item in items]
        for group in groups:
            refs = {}
            for m, modality in enumerate(MODALITIES):
                ids = [point_id(_item_key(tv.kind, tv.task, i), modality, tv.model_version, self.lineage)
                       for tv, _ in group for i in tv.ids(modality)]
                payloads = [p for tv, _ in group for p in self._payloads(tv, modality, gen, now)]
                x = np.concatenate([arrays[m] for _, arrays in group])
                refs[modality] = self._write(gen, group[0][0].task if len(group) == 1 else None, modality, ids, x,
                                             payloads)
                bar.update(len(ids))
            stored = {modality: self._counts(ref, [tv.task for tv, _ in group]) for modality, ref in refs.items()}
            for tv, _ in group:
                counts = {modality: stored[modality][tv.task] for modality in MODALITIES}
                for modality, count in counts.items():
                    if count != len(tv.ids(modality)):
                        raise VectorIndexError(f"task {tv.task!r} {modality}: stored {count} points, expected "
                                               f"{len(tv.ids(modality))}; the serving generation is unchanged, rerun "
                                               "to complete")
                new["tasks"][tv.task] = {"task_index": tv.task_index, "model_version": tv.model_version,
                                         "counts": counts, "indexed_at": now, "kind": tv.kind}
                new["segments"][tv.task] = dict(refs)
        bar.close()
        return new

    def _payloads(self, tv: TaskVectors, modality: str, gen: int, now: str) -> list[dict]:
        meta = dict(zip(tv.item_ids, tv.metadata)) if tv.metadata else {}
        payloads = [{"item_id": i, "task": tv.task, "task_index": tv.task_index, "modality": modality,
                     "model_version": tv.model_version, "index_generation": gen, "lineage": self.lineage,
                     "split": tv.split, "indexed_at": now, **({META: meta[i]} if meta.get(i) else {})}
                    for i in tv.ids(modality)]
        if modality == "text":
            for p, c in zip(payloads, tv.captions):
                p["caption"] = c
        else:
            for p, uri in zip(payloads, tv.image_uris):
                p["image_uri"] = uri
        return payloads

    def _commit(self, old: dict, new: dict) -> dict:
        self._publish(new)  # the atomic switch: before it readers see `old`, after it `new`
        self._sweep(new)
        return {k: v for k, v in copy.deepcopy(new).items() if k != "segments"}

    def _zscored(self, state: dict, modality: str, queries: np.ndarray, k: int, conditions: list = ()) -> list[list]:
        merged = [[] for _ in queries]
        for t in sorted(state["tasks"]):
            for q, row in enumerate(self._query(state, modality, [t], queries, max(k, Z_POOL), conditions)):
                if not row:
                    continue
                scores = np.array([s for s, _ in row])
                mu, sd = scores.mean(), scores.std()
                merged[q] += [((s - mu) / (sd if sd > 0 else 1.0), s, p) for s, p in row]
        return [[(s, p) for _, s, p in heapq.nlargest(k, row, key=lambda r: r[0])] for row in merged]

    def _payload_indexes(self) -> dict[str, str]:
        """payload key -> index type: the fixed fields' and the declared ones'."""
        return {**PAYLOAD_INDEXES, **{f"{META}.{name}": kind for name, kind in self.fields.items()}}

    @staticmethod
    def _hit(score: float, p: dict) -> Hit:
        return Hit(item_id=p["item_id"], task=p["task"], task_index=p["task_index"], modality=p["modality"],
                   score=float(score), model_version=p["model_version"], index_generation=p["index_generation"],
                   lineage=p["lineage"], caption=p.get("caption") if p["modality"] == "text" else None,
                   image_uri=p.get("image_uri") if p["modality"] == "image" else None, metadata=p.get(META) or {})

    @contextlib.contextmanager
    def _writing(self):
        with self._wlock:
            yield

    # ---- storage primitives (per backend) ---------------------------------------------------------------
    def _read(self) -> dict:
        """The published state (+ "segments": task -> modality -> storage ref); treat as read-only."""
        raise NotImplementedError

    def _write(self, gen: int, task: str | None, modality: str, ids: list[str], x: np.ndarray,
               payloads: list[dict]) -> str:
        """Store one task's points (task None: several tasks', when merges_reindex) of one modality in generation
        `gen`, unpublished; returns a storage ref."""
        raise NotImplementedError

    merges_reindex = False  # whether _write may take several tasks at once (task=None)

    def _counts(self, ref: str, tasks: list[str]) -> dict[str, int]:
        """task -> points it has in ref, read back from storage."""
        raise NotImplementedError

    def _taken(self, state: dict, tasks: list[str], ids: list[str]) -> dict[str, list[str]]:
        """task -> those of these image point ids it stores in the serving generation (lookups by id)."""
        raise NotImplementedError

    def _publish(self, new: dict) -> None:
        """Atomically make `new` the serving state."""
        raise NotImplementedError

    def _sweep(self, state: dict) -> None:
        """Delete storage that `state` (the published one) does not reference."""
        raise NotImplementedError

    def _query(self, state: dict, modality: str, tasks: list[str], queries: np.ndarray, limit: int,
               conditions: list = ()) -> list[list]:
        """Per query, the top `limit` (score, payload) over the given tasks whose points meet `conditions`
        (`check_where`'s), best first."""
        raise NotImplementedError

    def _scroll(self, state: dict, task: str, modality: str):
        """Yield (vector, payload) of one task and modality."""
        raise NotImplementedError


class EdgeIndex(VectorIndex):
    """Embedded Qdrant Edge, immutable segments under root/name/lineage/g<gen>/, published by manifest.json.

    Each segment is one EdgeShard per (generation, task, modality, version), created WITHOUT a WAL, filled,
    optimised (int8 quantisation, and HNSW above HNSW_FROM_KB), flushed and closed by the writer and never
    written again; a WAL-less shard takes no file lock, so any number of reader processes open it concurrently.
    Writers serialise on a flock. A task-unknown search queries every task's segment and merges their top-k.
    """

    def __init__(self, root: str | Path, name: str = "clipstream", lineage: str = "shared", hnsw_ef: int = 0,
                 fields: dict | None = None):
        """`hnsw_ef`: the candidate list of every HNSW segment's searches (a recall/latency sweep); 0: the rule,
        HNSW_EF and more past HNSW_EF_POINTS points."""
        super().__init__(name, lineage, fields)
        import qdrant_edge as qe

        self._qe, self._hnsw_ef = qe, hnsw_ef
        self._dir = Path(root).absolute() / name / lineage
        self._manifest = self._dir / "manifest.json"
        self._lock = threading.Lock()
        self._key, self._state, self._shards = None, self._empty(), {}

    def close(self) -> None:
        with self._lock:
            shards, self._shards, self._key = self._shards, {}, None
        for shard, _ in shards.values():
            shard.close()

    def _filter(self, tasks: list[str], conditions: list = ()):
        """Points of `tasks` (none: any) meeting `conditions`; None when that is every point."""
        qe, must = self._qe, []
        if tasks:
            must.append(qe.FieldCondition(key="task", match=qe.MatchValue(tasks[0]) if len(tasks) == 1
                                          else qe.MatchAny(tasks)))
        for name, how, values in conditions:
            if how == "range":
                must.append(qe.FieldCondition(key=f"{META}.{name}", range=qe.RangeFloat(gte=values[0], lte=values[1])))
            else:
                must.append(qe.FieldCondition(key=f"{META}.{name}", match=qe.MatchValue(values[0]) if len(values) == 1
                                              else qe.MatchAny(values)))
        return qe.Filter(must=must) if must else None

    def _by_segment(self, state: dict, modality: str, tasks: list[str], conditions: list = ()) -> dict:
        """ref -> (the filter its search needs, or None; the tasks it serves). A merged segment (a reindexed
        generation) holds other tasks, or an older copy of a task appended again since: filter it to the tasks
        it serves; a task's own segment holds only that task."""
        out: dict[str, list[str]] = {}
        for t in tasks:
            out.setdefault(state["segments"][t][modality], []).append(t)
        return {ref: (self._filter(ts if ref.split("/")[-1].startswith(MERGED) else [], conditions), ts)
                for ref, ts in out.items()}

    @contextlib.contextmanager
    def _writing(self):
        self._dir.mkdir(parents=True, exist_ok=True)
        with super()._writing(), open(self._dir / ".writer.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict:
        try:
            st = os.stat(self._manifest)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        with self._lock:
            if key != self._key:  # cheap stat compare on every call; parse only when the manifest changed
                self._state = json.loads(self._manifest.read_text()) if key else self._empty()
                self._key = key
                live = {r for refs in self._state["segments"].values() for r in refs.values()}
                # drop shards no longer served; in-flight searches still hold them and GC closes them
                self._shards = {r: s for r, s in self._shards.items() if r in live}
            return self._state

    def _open(self, ref: str):
        """(the segment's shard, the hnsw_ef its searches use), opened once per reader (a segment never changes)."""
        with self._lock:
            opened = self._shards.get(ref)
        if opened is None:
            shard = self._qe.EdgeShard.load(str(self._dir / ref))
            ef = self._hnsw_ef or max(HNSW_EF, round(HNSW_EF * shard.info().points_count / HNSW_EF_POINTS))
            with self._lock:
                opened = self._shards.setdefault(ref, (shard, ef))
        return opened

    merges_reindex = True

    def _write(self, gen, task, modality, ids, x, payloads):
        qe = self._qe
        version = _slug(payloads[0]["model_version"]) if payloads else "none"
        ref = f"g{gen}/{_slug(task) if task else MERGED}.{modality}.v{version}.{uuid.uuid4().hex[:8]}"
        config = qe.EdgeConfig(
            # held in RAM when a reader opens the segment (Pinned): a search never waits for a page fault
            vectors=qe.EdgeVectorParams(size=x.shape[1], distance=qe.Distance.Cosine, memory=qe.Memory.Pinned),
            hnsw_config=qe.HnswIndexConfig(m=HNSW_M, ef_construct=HNSW_EF_CONSTRUCT, full_scan_threshold=HNSW_FROM_KB,
                                           memory=qe.Memory.Pinned),
            quantization_config=qe.ScalarQuantizationConfig(qe.ScalarType.Int8, quantile=0.99, memory=qe.Memory.Pinned),
            payload_memory=qe.Memory.Pinned,
            # a search runs on the calling thread: handing each segment's search to Qdrant's pool cost more than the
            # search itself (`clipstream bench search` measures it)
            max_search_threads=1,
            optimizers=qe.EdgeOptimizersConfig(default_segment_number=1, indexing_threshold=HNSW_FROM_KB),
            wal_enabled=False)
        shard = qe.EdgeShard.create(str(self._dir / ref), config)
        try:
            kinds = {"keyword": qe.PayloadSchemaType.Keyword, "integer": qe.PayloadSchemaType.Integer,
                     "float": qe.PayloadSchemaType.Float}
            for field, kind in self._payload_indexes().items():
                shard.update(qe.UpdateOperation.create_field_index(field, kinds[kind]))
            for s in range(0, len(ids), BATCH):
                chunk = zip(ids[s:s + BATCH], x[s:s + BATCH], payloads[s:s + BATCH])
                shard.update(qe.UpdateOperation.upsert_points([qe.Point(i, v.tolist(), p) for i, v, p in chunk]))
            shard.optimize()  # one segment: quantised, with HNSW above HNSW_FROM_KB
            shard.flush()
        finally:
            shard.close()
        return ref

    def _counts(self, ref, tasks):
        shard = self._qe.EdgeShard.load(str(self._dir / ref))  # reopen: proves it is on disk and loadable
        try:
            return {t: shard.count(self._qe.CountRequest(exact=True, filter=self._filter([t]))) for t in tasks}
        finally:
            shard.close()

    def _publish(self, new):
        tmp = self._dir / f".manifest.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump(new, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._manifest)
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sweep(self, state):
        live = {r for refs in state["segments"].values() for r in refs.values()}
        for gen_dir in self._dir.glob("g*"):
            for seg in gen_dir.iterdir():
                if f"{gen_dir.name}/{seg.name}" not in live:
                    shutil.rmtree(seg, ignore_errors=True)
            if gen_dir.name != f"g{state['generation']}" and not any(gen_dir.iterdir()):
                gen_dir.rmdir()
        for tmp in self._dir.glob(".manifest.*.tmp"):
            tmp.unlink(missing_ok=True)

    def _query(self, state, modality, tasks, queries, limit, conditions=()):
        qe, per_segment = self._qe, []
        for ref, (flt, _) in self._by_segment(state, modality, tasks, conditions).items():
            shard, ef = self._open(ref)
            # (a segment without a graph is scanned over its int8 vectors too: scanning the float32 ones, quantisation
            # ignored, was slower in `clipstream bench search`: 4x the bytes to read)
            params = qe.SearchParams(hnsw_ef=max(ef, limit),
                                     quantization=qe.QuantizationSearchParams(rescore=True, oversampling=OVERSAMPLING))
            per_segment.append(shard.query_batch(qe.QueryBatchRequest([
                qe.QueryRequest(limit=limit, query=qe.Query.Nearest(q.tolist()), params=params, filter=flt,
                                with_payload=True) for q in queries])))
        # task-known reads one segment; task-unknown merges each segment's top-k by raw cosine
        return [heapq.nlargest(limit, ((p.score, p.payload) for res in per_segment for p in res[q]), key=lambda r: r[0])
                for q in range(len(queries))]

    def _taken(self, state, tasks, ids):
        out = {t: [] for t in tasks}
        for ref, (_, served) in self._by_segment(state, "image", tasks).items():
            for r in self._open(ref)[0].retrieve(ids, True, False):
                if r.payload["task"] in served:  # a merged segment also holds other tasks' points
                    out[r.payload["task"]].append(str(r.id))
        return out

    def _scroll(self, state, task, modality):
        [(ref, (flt, _))] = self._by_segment(state, modality, [task]).items()
        shard, offset = self._open(ref)[0], None
        while True:
            records, offset = shard.scroll(self._qe.ScrollRequest(offset=offset, limit=1024, filter=flt,
                                                                  with_payload=True, with_vector=True))
            yield from ((r.vector, r.payload) for r in records)
            if offset is None:
                return


class ServerIndex(VectorIndex):
    """Qdrant server: collections f"{name}-{lineage}-g{g}-{modality}", aliases f"{name}-{lineage}-{modality}".

    The aliases are the commit point (both switched in one update_collection_aliases call); the state of
    generation g is point g of f"{name}-{lineage}-state", written before the switch. A search resolves the
    alias once and queries that generation's collection, so one result never mixes generations.
    """

    def __init__(self, client, name: str = "clipstream", lineage: str = "shared", fields: dict | None = None):
        super().__init__(name, lineage, fields)
        from qdrant_client import models

        self._m, self.client, self._owns_client = models, client, False
        self._prefix = f"{name}-{lineage}"
        self._state_coll = f"{self._prefix}-state"
        self._gen_re = re.compile(rf"^{re.escape(self._prefix)}-g(\d+)-(image|text)$")

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def _coll(self, gen: int, modality: str) -> str:
        return f"{self._prefix}-g{gen}-{modality}"

    def _filter(self, tasks: list[str], conditions: list = ()):
        m = self._m
        match = m.MatchValue(value=tasks[0]) if len(tasks) == 1 else m.MatchAny(any=tasks)
        must = [m.FieldCondition(key="task", match=match)]
        for name, how, values in conditions:
            key = f"{META}.{name}"
            must.append(m.FieldCondition(key=key, range=m.Range(gte=values[0], lte=values[1])) if how == "range" else
                        m.FieldCondition(key=key, match=m.MatchValue(value=values[0]) if len(values) == 1
                                         else m.MatchAny(any=values)))
        return m.Filter(must=must)

    def _aliases(self) -> dict[str, str]:
        return {a.alias_name: a.collection_name for a in self.client.get_aliases().aliases}

    def _read(self) -> dict:
        target = self._aliases().get(f"{self._prefix}-image")
        if target is None:
            return self._empty()
        gen = int(self._gen_re.match(target).group(1))
        records = self.client.retrieve(self._state_coll, [gen], with_payload=True)
        if not records:
            raise VectorIndexError(f"alias {self._prefix}-image points at generation {gen}, whose state is missing")
        return records[0].payload

    def _write(self, gen, task, modality, ids, x, payloads):
        m, coll = self._m, self._coll(gen, modality)
        if not self.client.collection_exists(coll):
            params = m.VectorParams(size=x.shape[1], distance=m.Distance.COSINE)
            self.client.create_collection(coll, vectors_config=params)
            for field, kind in self._payload_indexes().items():  # before the upload: points are indexed as they come
                self.client.create_payload_index(coll, field, field_schema=kind, wait=True)
        for s in range(0, len(ids), BATCH):
            chunk = zip(ids[s:s + BATCH], x[s:s + BATCH], payloads[s:s + BATCH])
            self.client.upsert(coll, wait=True,
                               points=[m.PointStruct(id=i, vector=v.tolist(), payload=p) for i, v, p in chunk])
        if self._counts(coll, [task])[task] > len(ids):  # re-append with fewer items: drop the points this write did not make
            keep = set(ids)
            stale = [str(r.id) for r in self._records(coll, task, vectors=False) if str(r.id) not in keep]
            self.client.delete(coll, points_selector=m.PointIdsList(points=stale), wait=True)
        return coll

    def _counts(self, ref, tasks):
        return {t: self.client.count(ref, count_filter=self._filter([t]), exact=True).count for t in tasks}

    def _taken(self, state, tasks, ids):
        found = self.client.retrieve(self._coll(state["generation"], "image"), ids, with_payload=["task"])
        return {t: [str(r.id) for r in found if r.payload["task"] == t] for t in tasks}

    def _publish(self, new):
        m, gen = self._m, new["generation"]
        if not self.client.collection_exists(self._state_coll):
            self.client.create_collection(self._state_coll, vectors_config={})
        self.client.upsert(self._state_coll, points=[m.PointStruct(id=gen, vector={}, payload=new)], wait=True)
        current = self._aliases()
        want = {f"{self._prefix}-{mod}": self._coll(gen, mod) for mod in MODALITIES}
        if any(current.get(alias) != coll for alias, coll in want.items()):
            ops = [m.DeleteAliasOperation(delete_alias=m.DeleteAlias(alias_name=a)) for a in want if a in current]
            ops += [m.CreateAliasOperation(create_alias=m.CreateAlias(collection_name=c, alias_name=a))
                    for a, c in want.items()]
            self.client.update_collection_aliases(change_aliases_operations=ops)  # atomic for both modalities

    def _sweep(self, state):
        m, gen = self._m, state["generation"]
        for c in self.client.get_collections().collections:
            match = self._gen_re.match(c.name)
            if match and int(match.group(1)) != gen:
                self.client.delete_collection(c.name)
        if gen and state["tasks"]:
            # an append writes into the serving collections before its state is published: a writer that died
            # there left points of a task no state names (never served: queries filter on published tasks)
            unpublished = m.FilterSelector(filter=m.Filter(must_not=[
                m.FieldCondition(key="task", match=m.MatchAny(any=sorted(state["tasks"])))]))
            for modality in MODALITIES:
                if self.client.collection_exists(self._coll(gen, modality)):
                    self.client.delete(self._coll(gen, modality), points_selector=unpublished, wait=True)
        if self.client.collection_exists(self._state_coll):
            stale = [r.id for r in self._records(self._state_coll, None, vectors=False) if r.id != gen]
            if stale:
                self.client.delete(self._state_coll, points_selector=self._m.PointIdsList(points=stale), wait=True)

    def _query(self, state, modality, tasks, queries, limit, conditions=()):
        m, flt = self._m, self._filter(tasks, conditions)  # only published tasks: a half-written append is never served
        responses = self.client.query_batch_points(self._coll(state["generation"], modality), requests=[
            m.QueryRequest(query=q.tolist(), filter=flt, limit=limit, with_payload=True) for q in queries])
        return [[(p.score, p.payload) for p in r.points] for r in responses]

    def _records(self, coll: str, task: str | None, vectors: bool):
        offset = None
        while True:
            records, offset = self.client.scroll(coll, scroll_filter=self._filter([task]) if task else None,
                                                 limit=1024, offset=offset, with_payload=True, with_vectors=vectors)
            yield from records
            if offset is None:
                return

    def _scroll(self, state, task, modality):
        for record in self._records(self._coll(state["generation"], modality), task, vectors=True):
            yield record.vector, record.payload


def open_index(settings, name: str | None = None, lineage: str = "shared") -> VectorIndex:
    """Edge under settings.qdrant_path by default; a Qdrant server when settings.qdrant_url is set
    (`local:PATH` selects qdrant-client's own on-disk local mode, the server API without a server)."""
    name = name or settings.stream
    if not settings.qdrant_url:
        return EdgeIndex(settings.qdrant_path, name, lineage, fields=settings.index_fields)
    from qdrant_client import QdrantClient

    url = settings.qdrant_url
    client = (QdrantClient(path=url.removeprefix("local:")) if url.startswith("local:")
              else QdrantClient(url=url, api_key=settings.secret("qdrant_api_key")))
    index = ServerIndex(client, name, lineage, fields=settings.index_fields)
    index._owns_client = True
    return index
