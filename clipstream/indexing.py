"""The indexing job: a registered version's galleries into the vector index, and evaluation through it.
It joins the registry and the index (ground floor) with the task data (training), so it stands on top.

`index_task` embeds one task's gallery with a version as a Ray Data batch-inference job (a task per block of
rows on each CPU, in worker processes that keep the model, or with `Settings.index_gpus` actors that hold it on their
GPU; a gallery below `Settings.index_ray_min_rows` pairs in this process, on its GPU if it has one) and stores it under the no-reindex or reindex policy; `put_lineage` makes the index hold
every task a version was trained through (what promotion needs); `evaluate_through_index` scores retrieval
by querying the stored vectors, so the no-reindex policy (old vectors from old versions, queries from the
latest) can be measured with the same R@K as the in-memory evaluator.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import numpy as np
import ray.data

from clipstream import catalogue, models
from clipstream.index import CATALOGUE, NO_REINDEX, POLICIES, REINDEX, Policy, TaskVectors, VectorIndex, open_index
from clipstream.registry import Registry, Version
from clipstream.settings import Settings
from clipstream.training import evaluate
from clipstream.training.data.reader import batch_image, read_split
from clipstream.training.data.task import DataError, Task

BLOCK_ROWS = 256  # rows per task of the embedding job: enough tasks to keep every CPU busy, each worth scheduling


@functools.lru_cache(maxsize=2)
def _cached_bundle(folder: str, stamp: tuple, precision: str) -> models.ClipBundle:
    models.keep_freed_memory()  # a process that embeds block after block
    return models.load_exported(folder).to(*models.placement(precision, gpu=False))


def _bundle(folder: str | Path, precision: str = "auto") -> models.ClipBundle:
    """The exported model in `folder`, loaded once per process (the weights' size and mtime in the key all the
    same): a Ray worker process keeps it, with torch and open_clip imported, for the job's next block and for the
    next job's, where an actor pool would start new processes that import and load again for every job."""
    st = (Path(folder) / models.WEIGHTS_FILE).stat()
    return _cached_bundle(str(folder), (st.st_size, st.st_mtime_ns), precision)


def _embed_rows(bundle: models.ClipBundle, batch: dict, root: str, images: bool, batch_size: int) -> dict:
    """A block of a split's rows in, both embeddings out."""
    out = {"id": np.asarray([str(i) for i in batch["id"]]),
           "text_vec": bundle.embed_texts([str(c) for c in batch["caption"]], batch_size)}
    if images:
        out["image_vec"] = bundle.embed_images([batch_image(batch, i, root) for i in range(len(batch["id"]))],
                                               batch_size)
    return out


def _embed_batch(batch: dict, *, folder: str, precision: str, **rows) -> dict:
    """A Ray Data CPU task: a block embedded by the model this process holds."""
    return _embed_rows(_bundle(folder, precision), batch, **rows)


class _GpuEmbedder:
    """A Ray Data actor on the GPU Ray gave it (Settings.index_gpus): the model loaded onto it once, every block
    the actor is handed embedded there. An actor, not tasks, because a GPU is held by the process that put the
    model on it."""

    def __init__(self, folder: str, precision: str):
        models.keep_freed_memory()
        self.bundle = models.load_exported(folder).to(*models.placement(precision, gpu=True))

    def __call__(self, batch: dict, **rows) -> dict:
        return _embed_rows(self.bundle, batch, **rows)


def _gpu_actors(gpus: float) -> int:
    """How many embedding actors of `gpus` GPUs each the cluster holds; a ValueError when not one fits (the job
    would wait for a GPU forever)."""
    total = ray.cluster_resources().get("GPU", 0)
    if total < gpus:
        raise ValueError(f"index_gpus={gpus:g} but the cluster has {total:g} GPUs: lower CLIPSTREAM_INDEX_GPUS "
                         "(0 embeds on the CPUs)")
    return int(total // gpus)


def embed_gallery(version: Version, task: Task, task_index: int, split: str = "test", batch_size: int = 64,
                  stored_images: Optional[dict] = None, ray_min_rows: int = 0, gpus: float = 0,
                  precision: str = "auto") -> TaskVectors:
    """A task split embedded by `version`, rows in the split's order. `stored_images` (item_id -> vector
    bytes, from the index) replaces image embedding when the version's image tower did not change.

    A gallery of at least `ray_min_rows` pairs is a Ray Data job: the split in blocks of `BLOCK_ROWS` rows, each a
    task on one CPU (Ray gives it one torch thread), as many at once as the cluster has CPUs, in worker processes
    that keep the model between blocks and jobs (`_bundle`). A smaller gallery is embedded here, in batches of the
    same size: starting the job costs more than it does. With `gpus` > 0 the blocks go to actors of `gpus` GPUs
    each (as many as the cluster's GPUs hold), their model on the GPU; `precision` as `models.placement` takes it."""
    rows = task.check(split).rows
    ids = [str(r["id"]) for r in rows]
    images = stored_images is None
    if len(rows) < ray_min_rows:  # (not `_bundle`: this process may be a long-lived server, which keeps no model)
        bundle = models.load_exported(version.folder).to(*models.placement(precision))
        text = bundle.embed_texts([str(r["caption"]) for r in rows], batch_size)
        image = bundle.embed_images([task.image(r) for r in rows], batch_size) if images else None
    else:
        blocks = max(1, -(-len(rows) // BLOCK_ROWS))
        if task.split(split).format == "webdataset":  # the images are in the shards: Ray Data's reader gets them
            ds = read_split(task, split).repartition(blocks)
        else:  # ids, captions and image paths: the rows this process has just read to check them
            ds = ray.data.from_items([{"id": i, "caption": str(r["caption"]), "image": str(r["image"])}
                                      for i, r in zip(ids, rows)], override_num_blocks=blocks)
        rows_kwargs = {"root": str(task.root), "images": images, "batch_size": batch_size}
        if gpus:
            ds = ds.map_batches(_GpuEmbedder, fn_constructor_kwargs={"folder": str(version.folder), "precision": precision},
                                fn_kwargs=rows_kwargs, concurrency=_gpu_actors(gpus), num_gpus=gpus, batch_size=None,
                                batch_format="numpy")
        else:
            models.placement(precision, gpu=False)  # a precision the CPU cannot run is refused here, not in a task
            ds = ds.map_batches(_embed_batch, fn_kwargs={"folder": str(version.folder), "precision": precision,
                                                         **rows_kwargs},
                                batch_size=None, batch_format="numpy", num_cpus=1)
        # (this job's only: by default Ray Data holds back part of the CPUs for each operator, and on 2 cores the
        # blocks then ran one at a time, slower than embedding in this process; `clipstream bench indexing` measures it)
        ds.context.op_resource_reservation_enabled = False
        out = {str(r["id"]): r for r in ds.take_all()}
        missing = [i for i in ids if i not in out]
        if missing or len(out) != len(ids):
            raise DataError(f"task {task.name}: the embedding job returned {len(out)} rows for {len(ids)} (missing "
                            f"{missing[:3]}); did the split change while it ran? rerun")
        text = np.stack([out[i]["text_vec"] for i in ids])
        image = np.stack([out[i]["image_vec"] for i in ids]) if images else None
    if not images:
        image = np.stack([np.frombuffer(stored_images[i][0], dtype=np.float32) for i in ids])
    return TaskVectors(task.name, task_index, version.version, ids, image.astype(np.float32), text.astype(np.float32),
                       [str(r["caption"]) for r in rows], split, [image_uri(task, r) for r in rows])


def image_uri(task: Task, row: dict) -> str:
    """Where a row's image is, for its image hits: its file (a path on the machine that indexed it, or the task's URI
    joined with it; an allowed outside path or URI as written); "" for an image inside a WebDataset shard."""
    image = row.get("image")
    if not isinstance(image, str) or not image:
        return ""
    return image if "://" in image or image.startswith("/") else str(task.root / image)


def index_task(settings: Settings, version_ref: str, task_dir: str | Path, policy: Policy = NO_REINDEX,
               split: str = "test", index_name: Optional[str] = None, reuse_images: bool = True) -> dict:
    """Index task `task_dir` with version `version_ref` under `policy`; returns the index state.
    no-reindex appends the task; reindex re-embeds every indexed task and this one under the version (stored
    image vectors made by the same image tower are kept unless `reuse_images` is False: for measuring)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    registry = Registry(settings)
    version = registry.resolve(version_ref)
    task = Task.load(task_dir)
    lineage = _lineage(version)
    if task.name not in lineage and version.lineage:
        raise ValueError(f"version {version.version} was not trained through task {task.name!r} "
                         f"(its tasks: {', '.join(lineage)}); index a task with a version that has seen it")
    if task.name not in lineage:
        raise ValueError(f"version {version.version} is a version 0 (trained on no task): it serves the tasks it was "
                         f"evaluated on (its tasks: {', '.join(lineage) or 'none'}), not {task.name!r}; register the "
                         "model with `clipstream register --evaluate` naming that task")
    with open_index(settings, index_name) as index:
        index.progress = True
        if policy == NO_REINDEX:
            index.append(embed_gallery(version, task, lineage[task.name][0], split,
                                       ray_min_rows=settings.index_ray_min_rows, **_on(settings)))
            state = _compacted(index, settings)
        else:
            trained, catalogues = _kinds(index.state())
            names = trained + [task.name]
            unknown = [n for n in names if n not in lineage]
            if unknown:
                raise ValueError(f"reindex refused: indexed task(s) {unknown} are not in this version's lineage")
            state = index.reindex([_regallery(index, registry, version, n, lineage, split, settings.index_ray_min_rows,
                                              reuse_images, **_on(settings)) for n in sorted(dict.fromkeys(names), key=lambda n: lineage[n][0])]
                                  + [_recatalogue(settings, version, c) for c in catalogues])
    return _record(registry, version.version, state, policy)


def put_lineage(settings: Settings, version: Version, split: str = "test") -> dict:
    """Make the index hold every task of `version`'s lineage, by `settings.index_policy`, and pin the
    version as the query encoder once its gallery is in place.

    no-reindex: append the lineage tasks the index lacks (the others keep their vectors); reindex: one
    atomic generation with exactly the lineage under this version (which also drops tasks outside it,
    such as the newer tasks a rollback leaves behind). Catalogues (items users added) are no task of a lineage:
    kept as they are under no-reindex, embedded again from their stored items by this version under reindex."""
    registry, lineage = Registry(settings), _lineage(version)
    with open_index(settings) as index:
        index.progress = True
        state = index.state()
        if settings.index_policy == NO_REINDEX:
            for name, (i, entry) in lineage.items():
                if name not in state["tasks"]:
                    task = _task_of(entry, "indexing", "keep the data of every task a version may need to index")
                    gallery = embed_gallery(version, task, i, split, ray_min_rows=settings.index_ray_min_rows,
                                            **_on(settings))
                    index.append(gallery)
                    state = _record(registry, version.version, _compacted(index, settings), NO_REINDEX)
        elif not lineage:
            raise ValueError(f"version {version.version} serves no task (a version 0 registered without --evaluate): "
                             "the reindex policy would empty the index; register the model with --evaluate TASK")
        elif set(_kinds(state)[0]) != set(lineage) or any(t["model_version"] != version.version
                                                          for t in state["tasks"].values()):
            state = _record(registry, version.version,
                            index.reindex([_regallery(index, registry, version, n, lineage, split, settings.index_ray_min_rows,
                                                      **_on(settings))
                                           for n in lineage]
                                          + [_recatalogue(settings, version, c) for c in _kinds(state)[1]]), REINDEX)
        # Search switches its query encoder here, with the gallery in place (a reindex already pinned it)
        return index.pin(version.version) if state["tasks"] else state


def evaluate_through_index(index: VectorIndex, bundle: models.ClipBundle, tasks: list[Task], split: str = "test",
                           k: int = max(evaluate.KS)) -> dict[str, dict[str, dict[str, float]]]:
    """R@K like `evaluate.evaluate_seen`, but every gallery is what the index stores; queries are
    encoded by `bundle` (the latest version). Same positives (`evaluate.UnionPositives`: the same image or caption
    in another task's gallery is a hit) and the same pessimistic tie rule, over the top k hits."""
    embedded = evaluate.embed_tasks(bundle, tasks, split)
    union = evaluate.UnionPositives(embedded)
    # (task, item id) -> (the task's place, the item's row in it); a hit of a task not evaluated here is a negative
    where = {(task.name, str(r["id"])): (p, i) for p, task in enumerate(tasks)
             for i, r in enumerate(task.check(split).rows)}
    known, unknown = {}, {}
    for t, query in enumerate(embedded):
        for mode, target in (("known", query.task), ("unknown", None)):
            i2t = _ranks(index.search_batch(query.img, "text", target, k), union, t, "i2t", where, k)
            t2i = _ranks(index.search_batch(query.txt, "image", target, k), union, t, "t2i", where, k)
            (known if mode == "known" else unknown)[query.task] = evaluate.metrics_from_ranks(i2t, t2i)
    return {"known": known, "unknown": unknown}


def _lineage(version: Version) -> dict[str, tuple[int, dict]]:
    """task name -> (task index, lineage entry) of the tasks `version` serves (`Version.gallery`), in order."""
    return {e["task"]: (i, e) for i, e in enumerate(version.gallery)}


def _task_of(entry: dict, step: str, advice: str) -> Task:
    try:
        return Task.load(entry["path"])
    except DataError as exc:
        raise DataError(f"{step} refused: the raw data of task {entry['task']!r} is gone ({exc}); {advice}") from exc


def _regallery(index: VectorIndex, registry: Registry, version: Version, name: str, lineage: dict, split: str,
               ray_min_rows: int = 0, reuse_images: bool = True, gpus: float = 0, precision: str = "auto") -> TaskVectors:
    """Task `name` embedded by `version` for a reindex. Its stored image vectors are kept when the version that
    made them has this version's image tower (CLL-CLIP trains the text side only): re-embedding would give the
    same vectors, and images cost most of a gallery's embedding time."""
    task_index, entry = lineage[name]
    task = _task_of(entry, "reindex", "reindexing re-embeds every indexed task, so keep their data or use "
                                      "--policy no-reindex")
    stored = index.state()["tasks"].get(name)
    same = reuse_images and stored is not None and \
        registry.resolve(stored["model_version"], download=False).image_tower == version.image_tower
    return embed_gallery(version, task, task_index, split, stored_images=index.points(name, "image") if same else None,
                         ray_min_rows=ray_min_rows, gpus=gpus, precision=precision)


def _kinds(state: dict) -> tuple[list[str], list[str]]:
    """The indexed tasks' names: (trained tasks' galleries, catalogues)."""
    kinds = {name: meta.get("kind", "task") for name, meta in state["tasks"].items()}
    return [n for n, k in kinds.items() if k != CATALOGUE], [n for n, k in kinds.items() if k == CATALOGUE]


def _recatalogue(settings: Settings, version: Version, name: str, batch_size: int = 64) -> TaskVectors:
    """Catalogue `name` embedded by `version` from its stored items, for a reindex."""
    store = catalogue.Catalogue.of(settings, name)
    items = list(store.items().values())
    if not items:
        raise DataError(f"reindex refused: catalogue {name!r} is indexed but its items are not stored in {store.root} "
                        "(HOME moved?); point HOME at them, or delete the catalogue's items, or use --policy no-reindex")
    bundle = models.load_exported(version.folder).to(*models.placement(settings.embed_precision))
    return catalogue.vectors(name, version.version, items,
                             bundle.embed_images([store.read_image(i) for i in items if i.image], batch_size),
                             bundle.embed_texts([i.text for i in items if i.text], batch_size))


def _on(settings: Settings) -> dict:
    """Where and in which dtype the settings embed a gallery (embed_gallery's `gpus` and `precision`)."""
    return {"gpus": settings.index_gpus, "precision": settings.embed_precision}


def _compacted(index: VectorIndex, settings: Settings) -> dict:
    """The index state after an append, its segments merged when the appends have left more than
    `settings.index_compact_segments` per modality (the new task is served before the merge starts)."""
    if settings.index_compact_segments and index.segments() > settings.index_compact_segments:
        return index.compact()
    return index.state()


def _record(registry: Registry, version: str, state: dict, policy: Policy) -> dict:
    """Tag the version with what the index now holds, so the registry side can read it too."""
    registry.set_tags(version, {"index_generation": state["generation"], "index_policy": policy,
                                "indexed_tasks": ",".join(state["tasks"])})
    return state


def _ranks(results, union: evaluate.UnionPositives, t: int, direction: str, where: dict[tuple[str, str], tuple],
           k: int) -> np.ndarray:
    """First-hit rank per query of task t from its top-k hits: negatives scoring >= the best positive come first;
    k when no positive is among them."""
    gallery_start = union.txt_start if direction == "i2t" else union.img_start
    ranks = np.full(len(results), k)
    for s in range(0, len(results), evaluate._QUERY_CHUNK):
        positive = union.rows(t, direction, s, min(s + evaluate._QUERY_CHUNK, len(results)))
        for q, hits in enumerate(results[s:s + evaluate._QUERY_CHUNK]):
            rows = [where.get((h.task, h.item_id)) for h in hits]
            is_pos = [r is not None and bool(positive[q, gallery_start[r[0]] + r[1]]) for r in rows]
            if any(is_pos):
                best = max(h.score for h, p in zip(hits, is_pos) if p)
                ranks[s + q] = sum(1 for h, p in zip(hits, is_pos) if not p and h.score >= best)
    return ranks
