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
    image_uris: list[str] = field(default_factory=list)  # where each row's image is, for image hits ([]: not said)


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


def _check_task(tv: TaskVectors, dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Validate one task completely before anything is written; returns its unit image and text vectors."""
    if not isinstance(tv, TaskVectors):
        raise VectorIndexError(f"expected TaskVectors, got {type(tv).__name__}")
    for name in ("task", "model_version", "split"):
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
    image, text = _unit(tv.image, f"{where} image", dim), _unit(tv.text, f"{where} text", dim)
    if image.shape[1] != text.shape[1]:
        raise VectorIndexError(f"{where}: image dimension {image.shape[1]} != text dimension {text.shape[1]}")
    if tv.image_uris and (len(tv.image_uris) != n or not all(isinstance(u, str) for u in tv.image_uris)):
        raise VectorIndexError(f"{where}: image_uris must be one string per row, or none")
    if not (len(image) == len(text) == len(tv.captions) == n):
        raise VectorIndexError(f"{where}: lengths differ: {n} item_ids, {len(image)} image rows, "
                               f"{len(text)} text rows, {len(tv.captions)} captions")
    return image, text


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)[:40]


class VectorIndex:
    """Policy logic (validation, ids, payloads, generations, search merging); storage lives in subclasses."""

    def __init__(self, name: str, lineage: str = "shared"):
        for what, value in (("name", name), ("lineage", lineage)):
            if not isinstance(value, str) or not _SAFE.match(value):
                raise VectorIndexError(f"index {what} {value!r}: use 1-64 letters, digits, '.', '_' or '-'")
        self.name, self.lineage = name, lineage
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
            arrays = _check_task(vectors, state["dim"])
            self._check_ids_disjoint([vectors], state)
            self._sweep(state)  # leftovers of a failed earlier write are never served; clear them
            new = self._build(state, max(state["generation"], 1), [(vectors, arrays)])
            new["query_version"] = state.get("query_version") or vectors.model_version
            return self._commit(state, new)

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
        first = _check_task(tasks[0], None)  # a reindex may change the dimension: every task must agree on it
        items = [(tasks[0], first)] + [(t, _check_task(t, first[0].shape[1])) for t in tasks[1:]]
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
                    for v, p in self._scroll(state, t, modality):
                        ids.append(point_id(p["item_id"], modality, p["model_version"], self.lineage))
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
               normalize_per_task: bool = False) -> list[Hit]:
        """task given = task-known; None = one ranking over all tasks by raw cosine (the paper's setting).

        normalize_per_task=True ranks task-unknown hits by each task's z-scored cosine (statistics over the
        task's top max(k, Z_POOL) candidates); Hit.score stays the raw cosine.
        """
        v = np.asarray(vector)
        if v.ndim != 1:
            raise VectorIndexError(f"search takes one vector [D], got shape {v.shape}; use search_batch")
        return self.search_batch(v[None, :], target_modality, task, k, normalize_per_task)[0]

    def search_batch(self, vectors: np.ndarray, target_modality: str, task: str | None = None, k: int = 10,
                     normalize_per_task: bool = False) -> list[list[Hit]]:
        if target_modality not in MODALITIES:
            raise VectorIndexError(f"target_modality must be one of {MODALITIES}, got {target_modality!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_K:
            raise VectorIndexError(f"k must be an integer in [1, {MAX_K}], got {k!r}")
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
                    rows = self._zscored(state, target_modality, queries, int(k))
                else:
                    rows = self._query(state, target_modality, [task] if task else sorted(state["tasks"]),
                                       queries, int(k))
            except Exception:
                # a writer switched generations and dropped what this snapshot named: retry on the new one
                if attempt == 2 or self._read() == state:
                    raise
                continue
            return [[self._hit(score, p) for score, p in row] for row in rows]

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
        """Point ids carry no task, so two tasks under one version must not share an item id."""
        seen: dict[tuple[str, str], str] = {}
        for tv in tasks:
            for i in tv.item_ids:
                if seen.setdefault((tv.model_version, i), tv.task) != tv.task:
                    raise VectorIndexError(f"item id {i!r} is in tasks {seen[(tv.model_version, i)]!r} and "
                                           f"{tv.task!r} under one version; item ids must be unique across tasks")
        for tv in tasks if state else ():  # an append: compare with the indexed tasks of the same version
            others = [t for t, meta in state["tasks"].items() if t != tv.task and meta["model_version"] == tv.model_version]
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
        bar = console.bar(total=sum(2 * len(tv.item_ids) for tv, _ in items), unit="pt", desc=f"index g{gen}",
                   disable=not self.progress)
        # a reindexed generation is written whole: where storage merges it (Edge), one segment per modality holds
        # every task, so a task-unknown search walks one graph instead of one per task
        groups = [items] if fresh and self.merges_reindex and len(items) > 1 else [[item] for item in items]
        for group in groups:
            refs = {}
            for m, modality in enumerate(MODALITIES):
                ids = [point_id(i, modality, tv.model_version, self.lineage) for tv, _ in group for i in tv.item_ids]
                payloads = [p for tv, _ in group for p in self._payloads(tv, modality, gen, now)]
                x = np.concatenate([arrays[m] for _, arrays in group])
                refs[modality] = self._write(gen, group[0][0].task if len(group) == 1 else None, modality, ids, x,
                                             payloads)
                bar.update(len(ids))
            stored = {modality: self._counts(ref, [tv.task for tv, _ in group]) for modality, ref in refs.items()}
            for tv, _ in group:
                counts = {modality: stored[modality][tv.task] for modality in MODALITIES}
                for modality, count in counts.items():
                    if count != len(tv.item_ids):
                        raise VectorIndexError(f"task {tv.task!r} {modality}: stored {count} points, expected "
                                               f"{len(tv.item_ids)}; the serving generation is unchanged, rerun to "
                                               "complete")
                new["tasks"][tv.task] = {"task_index": tv.task_index, "model_version": tv.model_version,
                                         "counts": counts, "indexed_at": now}
                new["segments"][tv.task] = dict(refs)
        bar.close()
        return new

    def _payloads(self, tv: TaskVectors, modality: str, gen: int, now: str) -> list[dict]:
        payloads = [{"item_id": i, "task": tv.task, "task_index": tv.task_index, "modality": modality,
                     "model_version": tv.model_version, "index_generation": gen, "lineage": self.lineage,
                     "split": tv.split, "indexed_at": now} for i in tv.item_ids]
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

    def _zscored(self, state: dict, modality: str, queries: np.ndarray, k: int) -> list[list]:
        merged = [[] for _ in queries]
        for t in sorted(state["tasks"]):
            for q, row in enumerate(self._query(state, modality, [t], queries, max(k, Z_POOL))):
                scores = np.array([s for s, _ in row])
                mu, sd = scores.mean(), scores.std()
                merged[q] += [((s - mu) / (sd if sd > 0 else 1.0), s, p) for s, p in row]
        return [[(s, p) for _, s, p in heapq.nlargest(k, row, key=lambda r: r[0])] for row in merged]

    @staticmethod
    def _hit(score: float, p: dict) -> Hit:
        return Hit(item_id=p["item_id"], task=p["task"], task_index=p["task_index"], modality=p["modality"],
                   score=float(score), model_version=p["model_version"], index_generation=p["index_generation"],
                   lineage=p["lineage"], caption=p.get("caption") if p["modality"] == "text" else None,
                   image_uri=p.get("image_uri") if p["modality"] == "image" else None)

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

    def _query(self, state: dict, modality: str, tasks: list[str], queries: np.ndarray, limit: int) -> list[list]:
        """Per query, the top `limit` (score, payload) over the given tasks, best first."""
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

    def __init__(self, root: str | Path, name: str = "clipstream", lineage: str = "shared", hnsw_ef: int = 0):
        """`hnsw_ef`: the candidate list of every HNSW segment's searches (a recall/latency sweep); 0: the rule,
        HNSW_EF and more past HNSW_EF_POINTS points."""
        super().__init__(name, lineage)
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

    def _filter(self, tasks: list[str]):
        qe = self._qe
        match = qe.MatchValue(tasks[0]) if len(tasks) == 1 else qe.MatchAny(tasks)
        return qe.Filter(must=[qe.FieldCondition(key="task", match=match)])

    def _by_segment(self, state: dict, modality: str, tasks: list[str]) -> dict:
        """ref -> (the filter its search needs, or None; the tasks it serves). A merged segment (a reindexed
        generation) holds other tasks, or an older copy of a task appended again since: filter it to the tasks
        it serves; a task's own segment holds only that task."""
        out: dict[str, list[str]] = {}
        for t in tasks:
            out.setdefault(state["segments"][t][modality], []).append(t)
        return {ref: (self._filter(ts) if ref.split("/")[-1].startswith(MERGED) else None, ts)
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
        ref = f"g{gen}/{_slug(task) if task else MERGED}.{modality}.v{_slug(payloads[0]['model_version'])}.{uuid.uuid4().hex[:8]}"
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
            kinds = {"keyword": qe.PayloadSchemaType.Keyword, "integer": qe.PayloadSchemaType.Integer}
            for field, kind in PAYLOAD_INDEXES.items():
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

    def _query(self, state, modality, tasks, queries, limit):
        qe, per_segment = self._qe, []
        for ref, (flt, _) in self._by_segment(state, modality, tasks).items():
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

    def __init__(self, client, name: str = "clipstream", lineage: str = "shared"):
        super().__init__(name, lineage)
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

    def _filter(self, tasks: list[str]):
        m = self._m
        match = m.MatchValue(value=tasks[0]) if len(tasks) == 1 else m.MatchAny(any=tasks)
        return m.Filter(must=[m.FieldCondition(key="task", match=match)])

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
            for field, kind in PAYLOAD_INDEXES.items():  # before the upload, so points are indexed as they arrive
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

    def _query(self, state, modality, tasks, queries, limit):
        m, flt = self._m, self._filter(tasks)  # only published tasks: a half-written append is never served
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
        return EdgeIndex(settings.qdrant_path, name, lineage)
    from qdrant_client import QdrantClient

    url = settings.qdrant_url
    client = (QdrantClient(path=url.removeprefix("local:")) if url.startswith("local:")
              else QdrantClient(url=url, api_key=settings.secret("qdrant_api_key")))
    index = ServerIndex(client, name, lineage)
    index._owns_client = True
    return index
