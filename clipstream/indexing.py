"""The indexing job and evaluation through the index: registered versions (training) meet the vector
index (services) here, the one place that may import both.

`index_task` embeds a task's gallery with a model version as a Ray Data batch-inference job (the model
loaded once per actor) and stores it under the no-reindex or reindex policy; `evaluate_through_index`
scores retrieval by querying the stored vectors, so the no-reindex policy (old vectors from old
versions, queries from the latest) can be measured with the same R@K as the in-memory evaluator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import numpy as np
import ray.data
import torch
from PIL import Image

from clipstream.settings import Settings
from services.index import TaskVectors, VectorIndex, open_index
from training import evaluate, models
from training.data.reader import read_split
from training.data.task import DataError, Task
from training.registry import Registry, Version

Policy = Literal["no-reindex", "reindex"]
POLICIES = ("no-reindex", "reindex")


class _Embedder:
    """A Ray Data actor: one model version in memory, batches of rows in, both embeddings out."""

    def __init__(self, folder: str, root: str, images: bool = True):
        self.bundle = models.load_exported(folder)
        self.bundle.model.eval()
        self.root, self.images = root, images

    def __call__(self, batch: dict) -> dict:
        import io

        captions = [str(c) for c in batch["caption"]]
        out = {"id": np.asarray([str(i) for i in batch["id"]])}
        with torch.no_grad():
            out["text_vec"] = self.bundle.model.encode_text(self.bundle.tokenizer(captions), normalize=True).float().numpy()
            if self.images:
                pixels = []
                for i in range(len(captions)):
                    data = batch["image_bytes"][i] if "image_bytes" in batch else None
                    with Image.open(io.BytesIO(data) if data is not None else f"{self.root}/{batch['image'][i]}") as img:
                        pixels.append(self.bundle.preprocess_val(img.convert("RGB")))
                out["image_vec"] = self.bundle.model.encode_image(torch.stack(pixels), normalize=True).float().numpy()
        return out


def embed_gallery(version: Version, task: Task, task_index: int, split: str = "test", batch_size: int = 64,
                  stored_images: Optional[dict] = None) -> TaskVectors:
    """A task split embedded by `version`, rows in the split's order. `stored_images` (item_id -> vector
    bytes, from the index) replaces image embedding when the version's image tower did not change."""
    rows = task.check(split).rows
    ds = read_split(task, split).map_batches(
        _Embedder, fn_constructor_kwargs={"folder": str(version.folder), "root": str(task.root),
                                          "images": stored_images is None},
        batch_size=batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=1))
    out = {str(r["id"]): r for r in ds.take_all()}
    ids = [str(r["id"]) for r in rows]
    image = (np.stack([out[i]["image_vec"] for i in ids]) if stored_images is None else
             np.stack([np.frombuffer(stored_images[i][0], dtype=np.float32) for i in ids]))
    return TaskVectors(task.name, task_index, version.version, ids, image.astype(np.float32),
                       np.stack([out[i]["text_vec"] for i in ids]).astype(np.float32),
                       [str(r["caption"]) for r in rows], split)


def index_task(settings: Settings, version_ref: str, task_dir: str | Path, policy: Policy = "no-reindex",
               split: str = "test", index_name: Optional[str] = None) -> dict:
    """Index task `task_dir` with version `version_ref` under `policy`; returns the index state."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    registry = Registry(settings)
    version = registry.resolve(version_ref)
    task = Task.load(task_dir)
    lineage = {e["task"]: (i, e) for i, e in enumerate(version.lineage)}
    if task.name not in lineage:
        raise ValueError(f"version {version.version} was not trained through task {task.name!r} "
                         f"(its tasks: {', '.join(lineage)}); index a task with a version that has seen it")
    index = open_index(settings, index_name)
    index.progress = True
    try:
        if policy == "no-reindex":
            state = index.append(embed_gallery(version, task, lineage[task.name][0], split))
        else:
            state = index.reindex([_vectors_for_reindex(index, version, name, lineage, split)
                                   for name in _reindex_tasks(index, task.name, lineage)])
    finally:
        index.close()
    return record_index_state(registry, version.version, state, policy)


def record_index_state(registry: Registry, version: str, state: dict, policy: Policy) -> dict:
    """Tag the version with what the index now holds, so the registry side can read it too."""
    for key, value in (("index_generation", state["generation"]), ("index_policy", policy),
                       ("indexed_tasks", ",".join(state["tasks"]))):
        registry.client.set_model_version_tag(registry.name, version, key, str(value))
    return state


def _reindex_tasks(index: VectorIndex, new_task: str, lineage: dict) -> list[str]:
    names = list(index.state()["tasks"]) + [new_task]
    unknown = [n for n in names if n not in lineage]
    if unknown:
        raise ValueError(f"reindex refused: indexed task(s) {unknown} are not in this version's lineage")
    return sorted(dict.fromkeys(names), key=lambda n: lineage[n][0])


def _vectors_for_reindex(index: VectorIndex, version: Version, name: str, lineage: dict, split: str) -> TaskVectors:
    task_index, entry = lineage[name]
    try:
        task = Task.load(entry["path"])
    except DataError as exc:
        raise DataError(f"reindex refused: the raw data of indexed task {name!r} is gone ({exc}); "
                        f"reindexing re-embeds every indexed task, so keep their data or use --policy no-reindex") from exc
    unchanged = "image" in version.manifest.get("unchanged_towers", []) and name in index.state()["tasks"]
    return embed_gallery(version, task, task_index, split,  # an unmoved image tower: reuse its vectors as stored
                         stored_images=index.points(name, "image") if unchanged else None)


def evaluate_through_index(index: VectorIndex, bundle: models.ClipBundle, tasks: list[Task], split: str = "test",
                           k: int = max(evaluate.KS)) -> dict[str, dict[str, dict[str, float]]]:
    """R@K like `evaluate.evaluate_seen`, but every gallery is what the index stores; queries are
    encoded by `bundle` (the latest version). Same pessimistic tie rule."""
    known, unknown = {}, {}
    for task in tasks:
        query = evaluate.embed_task(bundle, task, split)
        rows = task.check(split).rows
        row_of = {str(r["id"]): i for i, r in enumerate(rows)}
        for mode, target in (("known", task.name), ("unknown", None)):
            i2t = _ranks(index.search_batch(query.img, "text", target, k), task.name, row_of, query.positive, k)
            t2i = _ranks(index.search_batch(query.txt, "image", target, k), task.name, row_of, query.positive.T, k)
            (known if mode == "known" else unknown)[task.name] = evaluate.metrics_from_ranks(i2t, t2i)
    return {"known": known, "unknown": unknown}


def _ranks(results, task: str, row_of: dict[str, int], positive: np.ndarray, k: int) -> np.ndarray:
    """First-hit rank per query from its top-k hits: negatives scoring >= the best positive come first."""
    ranks = np.full(len(results), k)
    for q, hits in enumerate(results):
        is_pos = [h.task == task and h.item_id in row_of and positive[q, row_of[h.item_id]] for h in hits]
        if any(is_pos):
            best = max(h.score for h, p in zip(hits, is_pos) if p)
            ranks[q] = sum(1 for h, p in zip(hits, is_pos) if not p and h.score >= best)
    return ranks
