"""A task directory from the image-caption formats users already have: open_clip's CSV/TSV (`filepath`, `title`,
tab-separated by default, as open_clip's `--csv-*` flags), JSONL, parquet (img2dataset, Hugging Face datasets:
a path, or the image's bytes, or HF's {bytes, path}), COCO captions JSON and the Karpathy splits of COCO/Flickr30k.

The task is written as clipstream reads every task (task.yaml, JSONL rows, the images inside its directory): each
image is hard-linked where the filesystem allows, else copied, so the task keeps the safety rules of `task.py` (no
path out of it) and moves between machines whole. Splits come from the source where it has them (Karpathy's; a
`--split` for the whole file), else a seeded share of the images goes to `test` (all captions of an image on the
same side). The result is checked like any task before it is reported written; a row whose image is missing or
whose caption is empty is refused with the source file and row.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import yaml

from clipstream.training.data.task import DataError, Task

FORMATS = ("csv", "tsv", "jsonl", "parquet", "coco", "karpathy")
KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}


@dataclass
class Pair:
    where: str  # the source file and row, for messages
    image: Path | bytes  # a file, or the encoded image itself
    caption: str
    split: Optional[str] = None  # from the source, where it has one
    key: str = ""  # which image: its captions stay on one side of a random split
    fields: dict = field(default_factory=dict)  # more of the row: a language task's `lang` and `caption_en`


def read_pairs(fmt: str, source: Path, image_root: Optional[Path] = None, img_key: Optional[str] = None,
               caption_key: Optional[str] = None, separator: Optional[str] = None) -> Iterator[Pair]:
    """The source's pairs, images resolved against `image_root` (default: the source file's folder)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if not source.is_file():
        raise DataError(f"{source}: no such file")
    root = image_root or source.parent
    if fmt in ("csv", "tsv"):  # open_clip's defaults: `filepath` and `title`, tab-separated (also in its .csv files)
        img_key, caption_key = img_key or "filepath", caption_key or "title"
        with open(source, newline="", encoding="utf-8-sig") as f:
            sep = separator or ("\t" if fmt == "tsv" else _separator(f.readline()))
            f.seek(0)
            reader = csv.DictReader(f, delimiter=sep)
            _columns(source, reader.fieldnames or [], img_key, caption_key, f"--separator {sep!r}")
            for n, row in enumerate(reader, 2):
                yield _pair(f"{source}:{n}", root, row[img_key], row[caption_key])
    elif fmt == "jsonl":
        img_key, caption_key = img_key or "image", caption_key or "caption"
        with open(source, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    _columns(source, list(row), img_key, caption_key, f"row {n}")
                    yield _pair(f"{source}:{n}", root, row[img_key], row[caption_key])
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        img_key, caption_key = img_key or "image", caption_key or "caption"
        table = pq.read_table(source)
        _columns(source, table.column_names, img_key, caption_key, "")
        for n, row in enumerate(table.select([img_key, caption_key]).to_pylist()):
            image = row[img_key]
            if isinstance(image, dict):  # Hugging Face's Image feature: {bytes, path}
                image = image.get("bytes") or image.get("path")
            yield _pair(f"{source}: row {n}", root, image, row[caption_key])
    else:
        data = json.loads(source.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("images"), list):
            raise DataError(f"{source}: not a {fmt} captions file (no `images` list)")
        if fmt == "coco":
            if not isinstance(data.get("annotations"), list):
                raise DataError(f"{source}: not a COCO captions file (no `annotations` list)")
            files = {im["id"]: im["file_name"] for im in data["images"]}
            for n, ann in enumerate(data["annotations"]):
                if ann.get("image_id") not in files:
                    raise DataError(f"{source}: annotation {n} names image_id {ann.get('image_id')!r}, which `images` "
                                    "does not list")
                yield _pair(f"{source}: annotation {n}", root, files[ann["image_id"]], ann.get("caption"),
                            key=str(ann["image_id"]))
        else:
            for n, im in enumerate(data["images"]):
                split = KARPATHY_SPLITS.get(im.get("split"))
                if split is None:
                    raise DataError(f"{source}: image {n} has split {im.get('split')!r}; Karpathy splits are "
                                    f"{', '.join(KARPATHY_SPLITS)}")
                path = "/".join(p for p in (im.get("filepath"), im.get("filename")) if p)
                for s in im.get("sentences", []):
                    yield _pair(f"{source}: image {n}", root, path, s.get("raw"), split, key=path)


def _separator(header: str) -> str:
    """The header's separator among tab, comma, semicolon and bar: the one it has most of (tab on a tie, as open_clip)."""
    return max("\t,;|", key=lambda c: (header.count(c), c == "\t"))


def _columns(source: Path, present: list, img_key: str, caption_key: str, hint: str) -> None:
    missing = [k for k in (img_key, caption_key) if k not in present]
    if missing:
        raise DataError(f"{source}: no column {missing[0]!r} (has {', '.join(map(str, present)) or 'none'}"
                        f"{'; ' + hint if hint else ''}); name the columns with --img-key and --caption-key")


def _pair(where: str, root: Path, image, caption, split: Optional[str] = None, key: str = "") -> Pair:
    if not isinstance(caption, str) or not caption.strip():
        raise DataError(f"{where}: empty caption")
    if isinstance(image, (bytes, bytearray)):
        return Pair(where, bytes(image), " ".join(caption.split()), split, key or where)
    if not isinstance(image, str) or not image:
        raise DataError(f"{where}: no image path")
    path = Path(image) if os.path.isabs(image) else root / image
    if not path.is_file():
        raise DataError(f"{where}: image {image!r} not found (looked at {path}; --image-root sets where relative "
                        "paths start)")
    return Pair(where, path, " ".join(caption.split()), split, key or str(path))


def import_task(pairs: Iterator[Pair], out: Path, name: str, *, split: Optional[str] = None,
                test_fraction: float = 0.1, seed: int = 0, kind: str = "domain", lang: Optional[str] = None,
                description: str = "", index: int | None = None, metadata: dict | None = None) -> Task:
    """Write the task directory `out` (new or empty) from `pairs` and return it, checked; `index` (its place in a
    stream) and `metadata` (free-form: provenance, protocol) go into task.yaml."""
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: import into a new folder")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    pairs = list(pairs)
    if not pairs:
        raise DataError("the source has no pairs")
    keys = sorted({p.key for p in pairs})
    share = max(1, round(test_fraction * len(keys))) if len(keys) > 1 else 0
    test_keys = set(random.Random(seed).sample(keys, share))
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _write(pairs, out, name, split, test_keys, kind, lang, description, index, metadata)
    except BaseException:
        shutil.rmtree(out)  # (a new or empty folder: nothing of the user's is in it)
        raise


def _write(pairs: list[Pair], out: Path, name: str, split: Optional[str], test_keys: set, kind: str,
           lang: Optional[str], description: str, index: int | None, metadata: dict | None) -> Task:
    rows: dict[str, list[dict]] = {}
    placed: dict[str, str] = {}  # one file per source image, however many captions it has
    for n, p in enumerate(pairs):
        where = split or p.split or ("test" if p.key in test_keys else "train")
        key = p.key if isinstance(p.image, Path) else f"bytes-{n}"
        if key not in placed:
            suffix = p.image.suffix.lower() if isinstance(p.image, Path) else _sniff(p.image)
            rel = f"images/{len(placed):07d}{suffix}"
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(p.image, bytes):
                (out / rel).write_bytes(p.image)
            else:
                _place(p.image, out / rel)
            placed[key] = rel
        # ids carry the task's name, as the synthetic tasks' do: every task's items share the vector index, where an
        # id must be unique across tasks (two imports would otherwise both hold "test-0000000")
        rows.setdefault(where, []).append({"id": f"{name}-{where}-{len(rows.get(where, [])):07d}", "image": placed[key],
                                           "caption": p.caption, **p.fields})
    for where, split_rows in rows.items():
        with open(out / f"{where}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in split_rows)
    meta = {"name": name, "kind": kind, **({"lang": lang} if lang else {}),
            **({"index": index} if index is not None else {}),
            "description": description or f"imported: {len(pairs)} pairs, {len(placed)} images",
            "splits": {where: f"{where}.jsonl" for where in sorted(rows)}, **({"metadata": metadata} if metadata else {})}
    (out / "task.yaml").write_text(yaml.safe_dump(meta, sort_keys=False), encoding="utf-8")
    task = Task.load(out)
    for where in task.splits:
        task.check(where)
    return task


def _place(src: Path, dst: Path) -> None:
    """A hard link (no copy of the bytes) where source and task share a filesystem, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _sniff(data: bytes) -> str:
    for magic, suffix in ((b"\x89PNG", ".png"), (b"\xff\xd8", ".jpg"), (b"RIFF", ".webp"), (b"GIF8", ".gif")):
        if data.startswith(magic):
            return suffix
    return ".img"
