"""A task: a directory with `task.yaml` and its image-caption pairs, checked before any training starts.

The directory is a local path or a URI (`s3://`, `gs://`, `file://`, any fsspec filesystem): a cluster's
training jobs read tasks from object storage, through universal-pathlib here and pyarrow in Ray Data.

Pairs are JSONL or CSV rows `{id, image, caption[, label, lang]}` (image paths relative to the task
directory; a `label` is one of the task's `classes` when task.yaml names them) or WebDataset shards
(`KEY.png|jpg|jpeg|webp` + `KEY.txt` or `KEY.json` with a caption).
Every problem is reported with the file and row it comes from, so a bad row is fixed in minutes, and
a training job never meets it halfway through an epoch.

A task directory is input from whoever made it, so it is held to rules that keep it from reaching out of
the directory or crashing a job:
- every path in it (a row's `image`, a split's file pattern) stays inside it: absolute paths, `..` that
  climbs out, and symlinks (to a file or a folder on the way) that point out are refused, always, whatever
  `on_bad_image` says (a manifest that reaches out is hostile, not a corrupt image). The decision is read
  from the path, before looking for the file, so the error is the same whether the outside file exists.
  In a task given by URI (no symlinks there) every `..` is refused. WebDataset member names are keys inside
  the shard, not paths: they are not subject to this.
- the task's `name` is 1-64 letters, digits, `.`, `_` or `-`, starting with a letter or digit, without
  `..`: it becomes MLflow tags, index payloads, alias names and paths.
- text is UTF-8 (a leading BOM is allowed), and the text fields of a row (id, image, caption, caption_en,
  label, lang) hold no control characters but tab: a NUL or a newline inside a caption breaks tokenizers,
  CSV tools and one-line logs.
- an image is at most `MAX_IMAGE_PIXELS` pixels (read from its header, before decoding: a few KB of PNG can
  declare gigapixels).
"""

from __future__ import annotations

import codecs
import csv
import difflib
import errno
import functools
import glob
import hashlib
import io
import json
import os
import re
import tarfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator, Literal, Optional

import yaml
from braceexpand import braceexpand
from PIL import Image

from clipstream.roots import location, under_allowed_root

BadImagePolicy = Literal["fail", "skip"]
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
KINDS = ("domain", "language")
# threads that open, verify and hash the images of a task on object storage: their time is an object store's round
# trips, so more threads than cores; on a local disk the work is Python's own (path checks, headers) and threads only
# contended for the GIL (`clipstream bench data-check`)
IO_THREADS = min(32, 4 * (os.cpu_count() or 1))
LOCAL_THREADS = 1
# task.yaml's keys: a typo (`knd: language`) is refused, not read as the default; `metadata` holds anything else
TASK_KEYS = ("name", "kind", "splits", "index", "description", "lang", "classes", "templates", "held_out", "metadata")
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # and no ".." (see Task.load)
TEXT_FIELDS = ("id", "image", "caption", "caption_en", "label", "lang")
CONTROL_CHARS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # C0 controls and DEL; tab is allowed
# a row's canonical JSON for data_sha; one encoder for every row (json.dumps with options builds one per call)
CANONICAL = json.JSONEncoder(sort_keys=True)
# The same limit as clipstream.models.MAX_IMAGE_PIXELS, which a model's loader applies; not imported from
# there, as that module loads torch and open_clip (seconds) and checking data needs neither (a test keeps them equal).
MAX_IMAGE_PIXELS = 4096 * 4096


class DataError(ValueError):
    """A task that cannot be used as given; the message names the file (and row)."""


class UnsafePath(DataError):
    """A path in a task that leads out of its directory: an error under any `on_bad_image` policy."""


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
    # what one read of each image found, kept for the Task's life: `check` and `data_sha` (a job's driver calls both)
    # then read each file once; and the task's folders as resolved, so a path's symlink check costs an lstat
    _images: dict = field(default_factory=dict, repr=False, compare=False)
    _folders: dict = field(default_factory=dict, repr=False, compare=False)
    _rows: dict = field(default_factory=dict, repr=False, compare=False)  # split -> its rows as read (not shards')

    @functools.cached_property
    def _local_folder(self) -> Optional[str]:
        """The task's local folder as a string, None on a remote filesystem."""
        local = _local(self.root)
        return None if local is None else str(local)

    @classmethod
    def load(cls, path: str | Path) -> "Task":
        root = location(path)
        manifest = root / "task.yaml"
        if not root.is_dir():
            raise DataError(f"{root}: task directory not found")
        if not manifest.is_file():
            raise DataError(f"{manifest}: missing task.yaml (a task is a directory with task.yaml and its pairs)")
        data = manifest.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise DataError(f"{manifest}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x}); save it as UTF-8") from exc
        try:
            meta = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)  # the line, and the problem without PyYAML's multi-line layout
            where = f"{manifest}:{mark.line + 1}" if mark is not None else f"{manifest}"
            raise DataError(f"{where}: not valid YAML: {_one_line(getattr(exc, 'problem', None) or exc)}") from exc
        if not isinstance(meta, dict):
            raise DataError(f"{manifest}: expected a mapping, got {type(meta).__name__}")
        unknown = [key for key in meta if key not in TASK_KEYS]
        if unknown:
            key = str(unknown[0])
            near = difflib.get_close_matches(key, TASK_KEYS, n=1)
            raise DataError(f"{manifest}: unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                            + f"; task.yaml takes {', '.join(TASK_KEYS)} (free-form notes go under `metadata`)")
        for key in ("name", "splits"):
            if key not in meta:
                raise DataError(f"{manifest}: missing required key {key!r}")
        name = meta["name"]
        if isinstance(name, bool) or not isinstance(name, (str, int)) or not NAME_RULE.fullmatch(str(name)) \
                or ".." in str(name):
            raise DataError(f"{manifest}: task name {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or "
                            "'-', starting with a letter or digit, without '..' (the name becomes MLflow tags, index "
                            "payloads, alias names and paths)")
        kind = meta.get("kind", "domain")
        if kind not in KINDS:
            raise DataError(f"{manifest}: kind must be one of {KINDS}, got {kind!r}")
        if not isinstance(meta["splits"], dict) or not meta["splits"]:
            raise DataError(f"{manifest}: splits must map split names to files")
        splits = {split: _split(manifest, split, spec) for split, spec in meta["splits"].items()}
        _check_classes(manifest, meta)
        return cls(str(name), kind, root, splits, meta.get("index"), meta)

    @property
    def classes(self) -> Optional[list[str]]:
        """The class names of the task's `label`s (task.yaml `classes`), None when it names none."""
        classes = self.meta.get("classes")
        return [str(c) for c in classes] if classes else None

    @property
    def templates(self) -> Optional[list[str]]:
        """Its zero-shot prompts (task.yaml `templates`, each with `{}` for the class name), None: the generic ones."""
        return self.meta.get("templates") or None

    def split(self, name: str) -> Split:
        if name not in self.splits:
            why = ": training evaluates every task on its test pairs (add a test split to task.yaml)" * (name == "test")
            raise DataError(f"{self.root / 'task.yaml'}: task {self.name!r} has no split {name!r} (has "
                            f"{sorted(self.splits)}){why}")
        return self.splits[name]

    def check(self, split: str, on_bad_image: BadImagePolicy = "fail") -> Check:
        """Read and validate every row of a split; bad images fail or are skipped per the policy."""
        if on_bad_image not in ("fail", "skip"):
            raise ValueError(f"on_bad_image must be 'fail' or 'skip', got {on_bad_image!r}")
        check, seen = Check([]), {}
        rows = self._split_rows(split)
        # every image opened and verified (on a pool of threads for a task on object storage: `threads`), the rows
        # then judged in order, as one loop would
        images = parallel(self._image_outcome, [row for _, row in rows], self.threads)
        for (where, row), (problem, error) in zip(rows, images):
            if not row.get("id"):
                raise DataError(f"{where}: missing id")
            if isinstance(row["id"], bool) or not isinstance(row["id"], (str, int)):
                raise DataError(f"{where}: id must be a string, got {type(row['id']).__name__}")
            control = _control_char(row)
            if control:
                raise DataError(f"{where}: {control}")
            if row["id"] in seen:
                raise DataError(f"{where}: duplicate id {row['id']!r} (first at {seen[row['id']]})")
            seen[row["id"]] = where
            if not isinstance(row.get("caption") or "", str):
                raise DataError(f"{where}: caption must be a string, got {type(row['caption']).__name__} (id {row['id']!r})")
            if not str(row.get("caption") or "").strip():
                raise DataError(f"{where}: empty caption for id {row['id']!r}")
            if self.classes and row.get("label") is not None and str(row["label"]) not in self.classes:
                raise DataError(f"{where}: label {row['label']!r} of id {row['id']!r} is not one of the task's classes "
                                f"(task.yaml: {', '.join(self.classes)}); add it to `classes` or fix the row")
            if error is not None:  # an image path out of the directory: an error whatever the policy
                raise DataError(f"{where}: {error} (id {row['id']!r})") from error
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
        return image_source(self.root, row.get("image"), row.get("image_bytes"), self._folders)

    @property
    def threads(self) -> int:
        """Threads that open, verify and hash the task's images: IO_THREADS for a task on object storage (each read
        waits a round trip), LOCAL_THREADS on a local disk (the work is Python's, under the GIL: threads slowed it)."""
        return LOCAL_THREADS if _local(self.root) is not None else IO_THREADS

    def _image_outcome(self, row: dict) -> tuple[Optional[str], Optional[DataError]]:
        try:
            return self._image_facts(row)[0], None
        except DataError as exc:
            return None, exc

    def _image_facts(self, row: dict) -> tuple[Optional[str], bytes]:
        """(what is wrong with a row's image or None, the sha256 of its bytes: of b"" when there are none), from one
        read, remembered by path for the Task's life: a job's driver checks and hashes a task within moments (an
        image changed after that read goes unseen, as one changed after the hash would). A path out of the task
        raises UnsafePath, and is never remembered."""
        if row.get("image_bytes") is not None:  # (a shard's: in hand already)
            data = bytes(row["image_bytes"])
            return self._verify(row, data), hashlib.sha256(data).digest()
        key = row.get("image")
        if not key:
            return "missing image field", hashlib.sha256(b"").digest()
        if isinstance(key, str) and key in self._images:
            return self._images[key]
        try:
            data = self._read_plain(key)
            if data is None:  # not a plain relative path: the full checks of image_location, then the read
                data = image_location(self.root, key, self._folders).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            facts = f"image not found: {self.root / str(key)}", hashlib.sha256(b"").digest()
        else:
            facts = self._verify(row, data), hashlib.sha256(data).digest()
        self._images[key] = facts
        return facts

    def _read_plain(self, key) -> Optional[bytes]:
        """The bytes of a local task's image at a plain relative path (no '..', no control character, a file name),
        or None for any other path (or a file that is a symlink): `image_location` then decides. The same rule as
        `_resolves_inside`, one system call cheaper: the file is opened without following a symlink (O_NOFOLLOW),
        so a symlinked file is never read here, and its folder is the memo's resolved one; the checks of a task of
        millions of images are mostly these opens."""
        local = self._local_folder
        if local is None or not isinstance(key, str) or ".." in key or "://" in key or key.startswith("/") \
                or CONTROL_CHARS.search(key):
            return None
        parent, name = os.path.split(os.path.join(local, key))
        try:
            if name in ("", ".") or not _within(_folder(parent, self._folders), _folder(local, self._folders)):
                return None
        except (OSError, RuntimeError):  # a symlink loop on the way: image_location says so
            return None
        try:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # the file is a symlink
                return None
            raise
        with open(fd, "rb") as f:
            return f.read()

    @staticmethod
    def _verify(row: dict, data: bytes) -> Optional[str]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)  # PIL only warns up to twice its limit
                with Image.open(io.BytesIO(data)) as img:
                    width, height = img.size  # from the header: nothing is decoded yet
                    if width * height > MAX_IMAGE_PIXELS:
                        return (f"image {row.get('image')} too large: {width}x{height} pixels, more than the "
                                f"{MAX_IMAGE_PIXELS:,} a model reads; downscale it")
                    img.verify()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            return (f"image {row.get('image')} too large: {_pixels(exc)} pixels, more than the {MAX_IMAGE_PIXELS:,} "
                    "a model reads; downscale it")
        except Exception as exc:  # PIL raises many types for corrupt data
            return f"corrupt image {row.get('image')}: {_one_line(exc)}"
        return None

    def data_sha(self) -> str:
        """Content hash of the manifest, every split file and every image: names the exact data a version saw."""
        digest = hashlib.sha256((self.root / "task.yaml").read_bytes())
        for split in sorted(self.splits):
            rows = self._split_rows(split)
            for (where, row), image in zip(rows, parallel(self._image_digest, rows, self.threads)):  # (as `check`)
                digest.update(CANONICAL.encode({k: v for k, v in row.items() if k != "image_bytes"}
                                               if "image_bytes" in row else row).encode())
                digest.update(image)
        return digest.hexdigest()

    def _split_rows(self, name: str) -> list[tuple[str, dict]]:
        """A split's (where, row) pairs, read once for the Task's life as its images are (`check` and `data_sha` both
        want them); a WebDataset split's are read again each time (its rows carry the images' bytes)."""
        if name in self._rows:
            return self._rows[name]
        split = self.split(name)
        rows = list(_read_rows(split))
        if split.format != "webdataset":
            self._rows[name] = rows
        return rows

    def _image_digest(self, where_row: tuple[str, dict]) -> bytes:
        where, row = where_row
        try:
            return self._image_facts(row)[1]
        except DataError as exc:  # a path out of the directory is never read
            raise DataError(f"{where}: {exc}") from exc


def parallel(fn, items: list, threads: int) -> list:
    """[fn(x) for x in items], on a pool of `threads` threads (one loop below 2 × threads items); the first exception
    raised is raised here."""
    if threads < 2 or len(items) < 2 * threads:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="task-check") as pool:
        return list(pool.map(fn, items, chunksize=64))


def _check_classes(manifest, meta: dict) -> None:
    """`classes` (the names a row's `label` takes: zero-shot classification prompts them) is a list of distinct
    names, and `templates` a list of prompts each with one `{}` for the name; DataError naming the key otherwise."""
    classes = meta.get("classes")
    if classes is not None:
        if not isinstance(classes, list) or not classes or any(
                isinstance(c, bool) or not isinstance(c, (str, int)) or not str(c).strip() for c in classes):
            raise DataError(f"{manifest}: classes must be a non-empty list of class names, got {classes!r}")
        repeated = sorted({str(c) for c in classes if [str(x) for x in classes].count(str(c)) > 1})
        if repeated:
            raise DataError(f"{manifest}: classes names {', '.join(map(repr, repeated))} more than once")
    templates = meta.get("templates")
    if templates is not None:
        if not isinstance(templates, list) or not templates or any(
                not isinstance(t, str) or t.count("{}") != 1 for t in templates):
            raise DataError(f"{manifest}: templates must be a non-empty list of prompts, each with one '{{}}' for "
                            f"the class name (e.g. 'a photo of a {{}}.'), got {templates!r}")
        if classes is None:
            raise DataError(f"{manifest}: templates given without classes to fill them with")


def image_source(root: str | Path, image: Optional[str], image_bytes: Optional[bytes] = None,
                 folders: Optional[dict] = None) -> bytes | Path:
    """The one rule for where a row's image is, for rows (`Task.image`) and Ray Data batches alike: the bytes
    a shard carries, the local file, or the bytes of the remote file (FileNotFoundError if it is not there).
    A path that leads out of the task directory raises UnsafePath (`_inside`), before the file is looked for.
    `folders`: the caller's memo of resolved folders (`_inside`)."""
    if image_bytes is not None:
        return bytes(image_bytes)
    path = image_location(root, image, folders)
    return path if isinstance(path, Path) else path.read_bytes()


def image_location(root: str | Path, image, folders: Optional[dict] = None):
    """Where a row's image file is: a local Path, or a UPath on a remote filesystem (not read); the checks of
    `image_source`."""
    if not isinstance(image, str):
        raise DataError(f"image must be a path relative to the task directory, got {type(image).__name__} {image!r}")
    return _inside(root, str(image), "image", folders)  # str: Ray Data hands numpy strings


def _inside(root: str | Path, rel: str, what: str, folders: Optional[dict] = None):
    """`root / rel`, refused with UnsafePath when it leads out of the task directory `root`: when it is absolute
    or a URI, when `..` climbs out of it (in a task given by URI: any `..`), or, on a local filesystem, when it
    resolves out of it through a symlink (to the file or to a folder on the way). Decided from the path and the
    task's own symlinks, before looking for the file: the answer is the same whether the outside file exists.
    `folders` memoises each folder's resolved path for a caller that checks many paths at once (a task's check):
    then a path costs an lstat of its last component, not one per component."""
    base = root if isinstance(root, Path) and root.is_absolute() else location(root)
    if CONTROL_CHARS.search(rel):
        raise DataError(f"{what} path {rel!r} contains a control character; rename the file")
    outside = under_allowed_root(rel) if what == "image" else None
    if outside is not None:
        return outside
    local = _local(base)
    reason = _climbs_out(rel, local is not None)
    if reason is None and local is not None:
        try:
            if not _resolves_inside(str(local), rel, {} if folders is None else folders):
                reason = "a symlink on the way points out of it"
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise DataError(f"{what} path {rel!r} cannot be resolved: {exc}") from exc
    if reason:
        allow = ("; or allow the folder it is in with CLIPSTREAM_IMAGE_ROOTS (Settings image_roots)"
                 if what == "image" and reason in ("it is absolute", "it is a URI") else "")
        raise UnsafePath(f"{what} path {rel!r} leaves the task directory {base}: {reason}; paths in a task are "
                         f"relative to its directory and stay inside it{allow}")
    return base / rel


def _resolves_inside(local: str, rel: str, folders: dict) -> bool:
    """Whether local/rel, its symlinks resolved (to the file, to each folder on the way), stays under `local`, whose
    folders' resolved paths `folders` holds (filled as they are met): a file that is no symlink is its resolved
    folder / its name, an lstat. String paths: pathlib's objects cost more here than the system calls."""
    target = os.path.join(local, rel)
    parent, name = os.path.split(target)
    if name in ("", ".", "..") or os.path.islink(target):
        resolved = _real(target)
    else:
        resolved = os.path.join(_folder(parent, folders), name)
    return _within(resolved, _folder(local, folders))


def _within(resolved: str, top: str) -> bool:
    """Whether the resolved path `resolved` is the folder `top` or under it."""
    return resolved == top or resolved.startswith(top.rstrip("/") + "/")


def _folder(path: str, folders: dict) -> str:
    """A folder's resolved path, from the memo `folders` or resolved into it."""
    if path not in folders:
        folders[path] = _real(path)
    return folders[path]


def _real(path: str) -> str:
    """os.path.realpath, a symlink loop an error (as Path.resolve makes it)."""
    resolved = os.path.realpath(path)
    try:
        os.stat(resolved)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RuntimeError(f"Symlink loop from {exc.filename!r}") from exc
    return resolved


def _local(base) -> Optional[Path]:
    """The local folder of a task directory (a path, or a file:// URI), None for a remote filesystem."""
    if isinstance(base, Path):
        return base
    return Path(base.path) if base.protocol in ("file", "local") else None


def _climbs_out(rel: str, local: bool) -> Optional[str]:
    """Why `rel` leaves its directory, read from the string alone, or None."""
    if "://" in rel:
        return "it is a URI"
    if rel.startswith("/"):
        return "it is absolute"
    if ".." in rel and os.path.normpath(rel).split("/")[0] == "..":
        return "'..' climbs out of it"
    if not local and ".." in PurePosixPath(rel).parts:  # no symlinks to resolve against there: no '..' at all
        return "'..' is not allowed in a task given by URI"
    return None


def _control_char(row: dict) -> Optional[str]:
    """A row's first text field holding a control character (all but tab), described, or None."""
    for key in TEXT_FIELDS:
        value = row.get(key)
        found = CONTROL_CHARS.search(value) if isinstance(value, str) else None
        if found:
            return (f"{key} of id {str(row.get('id'))!r} holds control character U+{ord(found.group()):04X} at "
                    f"position {found.start()}: text fields are one line without control characters (tab is "
                    "allowed); remove it or replace it with a space")
    return None


def _pixels(exc: Exception) -> str:
    """The pixel count in PIL's decompression-bomb message ("Image size (N pixels) exceeds ...")."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    return f"{int(found.group(1)):,}" if found else "too many"


def _one_line(detail) -> str:
    """A message part on one line: the CLI reports an error as one line."""
    return " ".join(str(detail).split())


def _split(manifest: Path, name: str, spec) -> Split:
    pattern = spec.get("path") if isinstance(spec, dict) else spec
    if not pattern:
        raise DataError(f"{manifest}: split {name!r} names no file")
    if not isinstance(pattern, str):
        raise DataError(f"{manifest}: split {name!r}: expected a file name or pattern, got {type(pattern).__name__}")
    root = manifest.parent
    # WebDataset's brace ranges (`shards/{000..099}.tar`, `{a,b}`), expanded as webdataset does, then globbed
    patterns = list(braceexpand(pattern))
    for each in patterns:
        reason = _climbs_out(each, _local(root) is not None)
        if reason:  # before matching: what lies outside is never listed
            raise UnsafePath(f"{manifest}: split {name!r}: pattern {pattern!r} leaves the task directory {root}: "
                             f"{reason}; split files are given relative to the task directory and stay inside it")
    if isinstance(manifest, Path):
        found = {Path(p) for each in patterns for p in glob.glob(str(root / each))}
    else:
        found = {p for each in patterns for p in root.glob(each)}
    files = tuple(sorted(found, key=str))
    local = _local(root)
    if local is not None:  # a match may still be a symlink out
        for f in files:
            try:
                _inside(root, str(Path(f if isinstance(f, Path) else f.path).relative_to(local)), f"split {name!r} file")
            except DataError as exc:
                raise UnsafePath(f"{manifest}: {exc}") from exc
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
            for lineno, line in _lines(path):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object")
                yield f"{path}:{lineno}", _not_bytes(row, f"{path}:{lineno}")
        elif split.format == "csv":
            reader = csv.DictReader(line for _, line in _lines(path))
            try:
                missing = {"id", "image", "caption"} - set(reader.fieldnames or ())
                if missing:
                    raise DataError(f"{path}:1: CSV header lacks {sorted(missing)}")
                for row in reader:
                    where = f"{path}:{reader.reader.line_num}"  # the physical line the row ends on
                    if None in row:  # DictReader keeps the fields beyond the header under None
                        raise DataError(f"{where}: {len(row[None])} more field(s) than the header "
                                        f"{reader.fieldnames}; quote fields that hold commas")
                    yield where, _not_bytes({k: v for k, v in row.items() if v not in (None, "")}, where)
            except csv.Error as exc:
                raise DataError(f"{path}:{reader.reader.line_num}: not valid CSV: {exc}") from exc  # (DictReader's lags)
        else:
            yield from _read_shard(path)


def _lines(path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a text file, read as bytes and decoded line by line: bytes that are not UTF-8
    are reported with their line (Python's own error names only an offset). A leading BOM is dropped."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} "
                                "of the line); save the file as UTF-8") from exc


def _not_bytes(row: dict, where: str) -> dict:
    """A JSONL or CSV row, refused if it sets `image_bytes`: those are the image a WebDataset shard carries."""
    if "image_bytes" in row:
        raise DataError(f"{where}: 'image_bytes' is reserved for images inside WebDataset shards; give the image "
                        "as a file path in 'image'")
    return row


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
                    sample["caption"] = _shard_text(data, f"{path}:{key}", member.name).strip()
                elif ext == "json":
                    try:
                        meta = json.loads(_shard_text(data, f"{path}:{key}", member.name))
                    except json.JSONDecodeError as exc:
                        raise DataError(f"{path}:{key}: {member.name} is not valid JSON: {exc.msg}") from exc
                    if not isinstance(meta, dict):
                        raise DataError(f"{path}:{key}: {member.name}: expected a JSON object")
                    sample.update({k: v for k, v in meta.items() if k in ("caption", "label", "lang", "id")})
    except tarfile.TarError as exc:
        raise DataError(f"{path}: not a readable WebDataset shard: {exc}") from exc
    for key, sample in samples.items():
        yield f"{path}:{key}", sample


def _shard_text(data: bytes, where: str, member: str) -> str:
    """A shard member's text, or a DataError naming `shard:key` when it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: {member} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at byte "
                        f"{exc.start + 1}); save it as UTF-8") from exc
