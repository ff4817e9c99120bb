"""Ray Data pipelines that turn a task split into model-ready tensors.

Reading, image decoding, augmentation and tokenisation run as Ray Data tasks, off the training
workers, so a worker's loop only moves ready batches into the model (`get_dataset_shard`).

The dataset plan travels to Ray's helper actors (Ray Train's controller, the dataset manager, the split
coordinator), which unpickle it, and with it this module. So the plan holds only plain values (the
preprocessing as open_clip's `preprocess_cfg` dict, the tokenizer by name) and this module imports
open_clip and torch inside the functions that run in the map tasks: the helper actors then never load
them (they did: ~1 GB and ~10 s of CPU each, per task job, on a 2-core machine).
"""

from __future__ import annotations

import json
import zlib
from functools import lru_cache
from typing import Callable, Iterable

import numpy as np
import ray.data

from clipstream.training.data.task import DataError, Task, image_source


@lru_cache(maxsize=4)
def _tokenizer(spec: str):
    """One tokenizer per process: building the BPE tables costs more than a batch."""
    import open_clip

    from clipstream import models  # noqa: F401  (registers our architectures, so their tokenizers resolve)
    from clipstream.training.shared import local

    if spec.startswith("local-dir:"):  # a model folder the job shares (on a URI: read from a local copy)
        spec = f"local-dir:{local(spec.removeprefix('local-dir:'))}"
    return open_clip.get_tokenizer(spec)


@lru_cache(maxsize=4)
def _transform(cfg: str, augment: bool) -> Callable:
    """open_clip's own image transform for a model's preprocess_cfg (JSON), as `create_model_and_transforms`
    builds it: preprocess_train when `augment`, else preprocess_val."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(**json.loads(cfg)), is_train=augment)


def _prepare(batch: dict, *, root: str, preprocess: str, augment: bool, tokenizer: str, skip_ids: frozenset,
             seed: int | None, teacher_tokenizer: str | None = None) -> dict:
    import torch

    from clipstream.models import load_image

    transform = _transform(preprocess, augment)
    keep = [i for i, id_ in enumerate(batch["id"]) if str(id_) not in skip_ids]
    images = []
    for i in keep:
        if seed is not None:  # the row's random crop follows from (seed, id), not from which process got it
            torch.manual_seed(zlib.crc32(f"{seed}:{batch['id'][i]}".encode()))
        try:
            images.append(transform(load_image(batch_image(batch, i, root))).numpy())
        except DataError as exc:  # its path leads out of the task directory: refused as that, never read
            raise DataError(f"task {root}: id {str(batch['id'][i])!r}: {exc}") from exc
        except Exception as exc:  # the file changed after the task was checked
            raise DataError(f"task {root}: cannot decode image of id {batch['id'][i]!r}: {exc}") from exc
    captions = [str(batch["caption"][i]) for i in keep]
    empty = np.zeros((0, 1), np.int64)
    if not keep:
        return {"image": np.zeros((0, 3, 1, 1), np.float32), "text": empty, **({"text_en": empty} if teacher_tokenizer else {})}
    out = {"image": np.stack(images).astype(np.float32), "text": _tokenizer(tokenizer)(captions).numpy()}
    if teacher_tokenizer:  # a language task's English caption (CLL-CLIP's r^E), in the teacher's tokens
        english = [str(batch["caption_en"][i]) for i in keep] if "caption_en" in batch else captions
        out["text_en"] = _tokenizer(teacher_tokenizer)(english).numpy()
    return out


def batch_image(batch: dict, i: int, root: str):
    """Row i's image in a batch of `read_split` rows: its bytes or its path (`image_source`, which refuses a
    path out of the task directory with a DataError, as checking the task does)."""
    return image_source(root, batch["image"][i], batch["image_bytes"][i] if "image_bytes" in batch else None)


def read_split(task: Task, split: str, cpus: float = 1.0) -> ray.data.Dataset:
    """The raw rows of a split with Ray Data's own readers: `id, image, caption[, image_bytes]`, each read
    task reserving `cpus`."""
    spec = task.split(split)
    files = [str(f) for f in spec.files]
    remote = {"num_cpus": cpus}
    if spec.format == "jsonl":
        return ray.data.read_json(files, lines=True, ray_remote_args=remote)
    if spec.format == "csv":
        return ray.data.read_csv(files, ray_remote_args=remote)
    wds = ray.data.read_webdataset(files, decoder=None, ray_remote_args=remote)
    return wds.map_batches(_from_webdataset, batch_format="numpy", num_cpus=cpus)


def _from_webdataset(batch: dict) -> dict:
    n = len(batch["__key__"])
    image_col = next(c for c in ("png", "jpg", "jpeg", "webp") if c in batch)
    captions = []
    for i in range(n):
        where = f"{batch['__url__'][i] if '__url__' in batch else 'shard'}:{batch['__key__'][i]}"  # as Task.check names it
        txt = batch["txt"][i] if "txt" in batch else None
        try:
            if isinstance(txt, (bytes, bytearray)):  # a sample without KEY.txt holds None or NaN here
                captions.append(bytes(txt).decode("utf-8").strip())
            else:
                captions.append(json.loads(bytes(batch["json"][i]).decode("utf-8"))["caption"])
        except UnicodeDecodeError as exc:
            raise DataError(f"{where}: its caption is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at byte "
                            f"{exc.start + 1}); save it as UTF-8") from exc
        except (ValueError, KeyError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
            raise DataError(f"{where}: no caption: neither a UTF-8 .txt nor a .json object with 'caption' ({exc!r})") from exc
    ids = [str(k).rsplit("/", 1)[-1] for k in batch["__key__"]]
    return {"id": np.array(ids), "image": np.array([f"{k}.{image_col}" for k in batch["__key__"]]),
            "caption": np.array(captions), "image_bytes": np.array([bytes(b) for b in batch[image_col]], dtype=object)}


def training_dataset(tasks: Iterable[tuple[Task, Iterable[str]]], preprocess: dict, tokenizer: str,
                     split: str = "train", seed: int | None = None, augment: bool = True,
                     cpus: float = 1.0, teacher_tokenizer: str | None = None) -> ray.data.Dataset:
    """Union of the given tasks' splits as `{image: float32[3,H,W], text: int64[L]}` rows, images through
    open_clip's transform for `preprocess` (a model's `visual.preprocess_cfg`; with its random crop when
    `augment`), captions through the tokenizer named `tokenizer`.

    Each entry is (task, ids to skip): the ids that checking found bad under the `skip` policy.
    With a `seed`, the rows' augmentations and the block order are fixed by it, so that run with
    `preserve_order` the dataset yields the same batches every time (each row is cropped the same
    way in every epoch). Each read and preprocessing task reserves `cpus` (a preset's `train.data_cpus`).
    With a `teacher_tokenizer`, rows also carry `text_en`: the `caption_en` column (else the caption) in its tokens."""
    parts = []
    for task, skip_ids in tasks:
        raw = read_split(task, split, cpus)
        parts.append(raw.map_batches(
            _prepare, batch_format="numpy", batch_size=64, num_cpus=cpus,
            fn_kwargs={"root": str(task.root), "preprocess": json.dumps(dict(preprocess), sort_keys=True),
                       "augment": augment, "tokenizer": tokenizer,
                       "skip_ids": frozenset(map(str, skip_ids)), "seed": seed, "teacher_tokenizer": teacher_tokenizer},
        ))
    # several tasks (joint, replay): blocks in a random order (a new one each epoch unless seeded), so the
    # workers' local shuffle buffers see every task throughout the epoch rather than one task after another
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:]).randomize_block_order(seed=seed)
