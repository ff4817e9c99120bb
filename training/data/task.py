"""A task: a directory with `task.yaml` and its image-caption pairs, checked before any training starts.

The directory is a local path or a URI (`s3://`, `gs://`, `file://`, any fsspec filesystem): a cluster's
training jobs read tasks from object storage, through universal-pathlib here and pyarrow in Ray Data.

Pairs are JSONL or CSV rows `{id, image, caption[, label, lang]}` (image paths relative to the task
directory) or WebDataset shards (`KEY.png|jpg|jpeg|webp` + `KEY.txt` or `KEY.json` with a caption).
Every problem is reported with the file and row it comes from, so a bad row is fixed in minutes, and
a training job never meets it halfway through an epoch.
"""

from __future__ import annotations

import csv
import glob
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional

import yaml
from PIL import Image

BadImagePolicy = Literal["fail", "skip"]
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
KINDS = ("domain", "language")


class DataError(ValueError):
    """A task that cannot be used as given; the message names the file (and row)."""


def location(path: str | Path):
    """A local path (absolute), or a `UPath` for a URI: the same path API over fsspec's filesystems."""
    if "://" in str(path):
        from upath import UPath

        return UPath(str(path))
    return Path(path).absolute()


@dataclass(frozen=True)
class Split:
    name: str
    files: tuple[Path, ...]  # or UPaths: str() of either is what Ray Data's readers take
    format: Literal["jsonl", "csv", "webdataset"]


@dataclass
class Check:
    """What validating one split found: usable rows and skipped ones with their reason."""

    rows: list[dict]
    skipped: list[str] = field(default_factory=list)
    skipped_ids: set[str] = field(default_factory=set)


@dataclass
class Task:
    name: str
    kind: str
    root: Path
    splits: dict[str, Split]
    index: Optional[int] = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> "Task":
        root = location(path)
        manifest = root / "task.yaml"
        if not root.is_dir():
            raise DataError(f"{root}: task directory not found")
        if not manifest.is_file():
            raise DataError(f"{manifest}: missing task.yaml (a task is a directory with task.yaml and its pairs)")
        try:
            meta = yaml.safe_load(manifest.read_text()) or {}
        except yaml.YAMLError as exc:
            raise DataError(f"{manifest}: not valid YAML: {exc}") from exc
        if not isinstance(meta, dict):
            raise DataError(f"{manifest}: expected a mapping, got {type(meta).__name__}")
        for key in ("name", "splits"):
            if key not in meta:
                raise DataError(f"{manifest}: missing required key {key!r}")
        kind = meta.get("kind", "domain")
        if kind not in KINDS:
            raise DataError(f"{manifest}: kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(meta["splits"], dict) or not meta["splits"]:
            raise DataError(f"{manifest}: splits must map split names to files")
        splits = {name: _split(manifest, name, spec) for name, spec in meta["splits"].items()}
        return cls(str(meta["name"]), kind, root, splits, meta.get("index"), meta)

    def split(self, name: str) -> Split:
        if name not in self.splits:
            raise DataError(f"{self.root / 'task.yaml'}: task {self.name!r} has no split {name!r} (has {sorted(self.splits)})")
        return self.splits[name]

    def check(self, split: str, on_bad_image: BadImagePolicy = "fail") -> Check:
        """Read and validate every row of a split; bad images fail or are skipped per the policy."""
        if on_bad_image not in ("fail", "skip"):
            raise ValueError(f"on_bad_image must be 'fail' or 'skip', got {on_bad_image!r}")
        check, seen = Check([]), {}
        for where, row in _read_rows(self.split(split)):
            if not row.get("id"):
                raise DataError(f"{where}: missing id")
            if row["id"] in seen:
                raise DataError(f"{where}: duplicate id {row['id']!r} (first at {seen[row['id']]})")
            seen[row["id"]] = where
            if not str(row.get("caption") or "").strip():
                raise DataError(f"{where}: empty caption for id {row['id']!r}")
            problem = self._image_problem(row)
            if problem:
                if on_bad_image == "fail":
                    raise DataError(f"{where}: {problem} (id {row['id']!r}; pass on_bad_image='skip' to skip such rows)")
                check.skipped.append(f"{where}: {problem}")
                check.skipped_ids.add(str(row["id"]))
                continue
            check.rows.append(row)
        if not check.rows:
            files = ", ".join(str(f) for f in self.split(split).files)
            raise DataError(f"{files}: split {split!r} of task {self.name!r} has no usable rows")
        return check

    def image(self, row: dict) -> bytes | Path:
        """A row's image: its bytes (a WebDataset shard carries them; remote files are read) or its local file."""
        return image_source(self.root, row.get("image"), row.get("image_bytes"))

    def _image_problem(self, row: dict) -> Optional[str]:
        if row.get("image_bytes") is None and not row.get("image"):
            return "missing image field"
        try:
            source = self.image(row)
        except FileNotFoundError:
            source = None
        if source is None or isinstance(source, Path) and not source.is_file():
            return f"image not found: {self.root / str(row['image'])}"
        try:
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as img:
                img.verify()
        except Exception as exc:  # PIL raises many types for corrupt data
            return f"corrupt image {row.get('image')}: {exc}"
        return None

    def data_sha(self) -> str:
        """Content hash of the manifest, every split file and every image: names the exact data a version saw."""
        digest = hashlib.sha256((self.root / "task.yaml").read_bytes())
        for split in sorted(self.splits):
            for where, row in _read_rows(self.splits[split]):
                digest.update(json.dumps({k: v for k, v in row.items() if k != "image_bytes"}, sort_keys=True).encode())
                try:
                    source = self.image(row) if row.get("image_bytes") is not None or row.get("image") else b""
                except FileNotFoundError:
                    source = b""
                data = source if isinstance(source, bytes) else source.read_bytes() if source.is_file() else b""
                digest.update(hashlib.sha256(data).digest())
        return digest.hexdigest()


def image_source(root: str | Path, image: Optional[str], image_bytes: Optional[bytes] = None) -> bytes | Path:
    """The one rule for where a row's image is, for rows (`Task.image`) and Ray Data batches alike: the bytes
    a shard carries, the local file, or the bytes of the remote file (FileNotFoundError if it is not there)."""
    if image_bytes is not None:
        return bytes(image_bytes)
    path = location(root) / str(image)
    return path if isinstance(path, Path) else path.read_bytes()


def _split(manifest: Path, name: str, spec) -> Split:
    pattern = spec if isinstance(spec, str) else (spec or {}).get("path")
    if not pattern:
        raise DataError(f"{manifest}: split {name!r} names no file")
    if isinstance(manifest, Path):
        files = tuple(Path(p) for p in sorted(glob.glob(str(manifest.parent / pattern))))
    else:
        files = tuple(sorted(manifest.parent.glob(pattern), key=str))
    if not files:
        raise DataError(f"{manifest}: split {name!r}: no file matches {manifest.parent / pattern}")
    suffixes = {f.suffix.lower() for f in files}
    formats = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".tar": "webdataset"}
    if len(suffixes) != 1 or next(iter(suffixes)) not in formats:
        raise DataError(f"{manifest}: split {name!r}: expected .jsonl, .csv or .tar files, got {sorted(suffixes)}")
    return Split(name, files, formats[next(iter(suffixes))])


def _read_rows(split: Split) -> Iterator[tuple[str, dict]]:
    """Yield (`file:line` or `shard:key`, row) for every pair of a split."""
    for path in split.files:
        if split.format == "jsonl":
            with path.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
                    if not isinstance(row, dict):
                        raise DataError(f"{path}:{lineno}: expected a JSON object")
                    yield f"{path}:{lineno}", row
        elif split.format == "csv":
            with path.open(encoding="utf-8", newline="") as f:
                reader = csv.DictReader(f)
                missing = {"id", "image", "caption"} - set(reader.fieldnames or ())
                if missing:
                    raise DataError(f"{path}:1: CSV header lacks {sorted(missing)}")
                for lineno, row in enumerate(reader, 2):
                    yield f"{path}:{lineno}", {k: v for k, v in row.items() if v not in (None, "")}
        else:
            yield from _read_shard(path)


def _read_shard(path: Path) -> Iterator[tuple[str, dict]]:
    samples: dict[str, dict] = {}
    try:
        with path.open("rb") as f, tarfile.open(fileobj=f) as tar:
            for member in tar:
                if not member.isfile():
                    continue
                folder, slash, base = member.name.rpartition("/")  # WebDataset: key ends at the first dot of the file name
                stem, _, ext = base.partition(".")
                key = folder + slash + stem
                data = tar.extractfile(member).read()
                sample = samples.setdefault(key, {"id": Path(key).name})
                ext = ext.lower()
                if ext in IMAGE_EXTS:
                    sample["image"], sample["image_bytes"] = member.name, data
                elif ext == "txt":
                    sample["caption"] = data.decode("utf-8").strip()
                elif ext == "json":
                    sample.update({k: v for k, v in json.loads(data).items() if k in ("caption", "label", "lang", "id")})
    except tarfile.TarError as exc:
        raise DataError(f"{path}: not a readable WebDataset shard: {exc}") from exc
    for key, sample in samples.items():
        yield f"{path}:{key}", sample
