"""Catalogues: items users add to the index themselves (SearchService.AddItems), beside the galleries of the tasks a
version was trained on. The index holds their vectors (`clipstream.index`, kind `catalogue`); this store keeps the
items as they were given (text, image bytes, metadata) so that a reindex can embed them again with a new version:
CATALOGUE_DIR/STREAM/NAME/items.jsonl, one item per line, and images/SHA256, each image once by its content
(Settings catalogue_dir: HOME/catalogues by default, or an object-store URI every pod that serves or promotes
reaches).

The writer (AddItems, DeleteItems, a reindex) holds the stream's lock (`Registry.lock`), so a promotion never
re-embeds a catalogue while its items change.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from clipstream.index import CATALOGUE, TaskVectors
from clipstream.roots import location

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
ITEM_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/+-]{0,127}$")
TASK_INDEX = 10_000  # a catalogue's place among the indexed tasks: after any trained task


class CatalogueError(ValueError):
    """A bad catalogue name or item; nothing stored has changed."""


@dataclass
class Item:
    item_id: str
    text: str = ""
    image: str = ""  # the stored image's content name (its sha256), "" for none
    image_uri: str = ""  # where image hits say the image is: the URI the user gave, else the stored file
    metadata: dict = field(default_factory=dict)


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise CatalogueError(f"catalogue name {name!r}: use 1-63 lowercase letters, digits, '.', '_' or '-', starting "
                             "with a letter or digit")
    return name


def check_item_id(item_id: str) -> str:
    if not isinstance(item_id, str) or not ITEM_ID.match(item_id):
        raise CatalogueError(f"item id {item_id!r}: use 1-128 letters, digits or _ . : @ / + -, starting with a "
                             "letter or digit")
    return item_id


class Catalogue:
    """One catalogue's stored items."""

    def __init__(self, root, name: str):
        """`root`: the stream's catalogues, a folder or a URI (fsspec's filesystems, through UPath)."""
        self.name, self.root = check_name(name), location(str(root)) / name
        self._items = self.root / "items.jsonl"

    @classmethod
    def of(cls, settings, name: str) -> "Catalogue":
        return cls(f"{settings.catalogue_dir.rstrip('/')}/{settings.stream}", name)

    def items(self) -> dict[str, Item]:
        """item id -> item, in the order they were first added."""
        if not self._items.is_file():
            return {}
        out = {}
        for line in self._items.read_text().splitlines():
            if line.strip():
                item = Item(**json.loads(line))
                out[item.item_id] = item
        return out

    def image_path(self, item: Item):
        return self.root / "images" / item.image

    def read_image(self, item: Item) -> bytes:
        return self.image_path(item).read_bytes()

    def put_image(self, data: bytes) -> str:
        """Store an image's bytes once (by content); returns its content name."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.root / "images" / digest
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic(path, data)
        return digest

    def write(self, items: dict[str, Item]) -> None:
        """Replace the stored items with `items` in one atomic switch (images no item names any more are removed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        _atomic(self._items, "".join(json.dumps(asdict(i), sort_keys=True) + "\n" for i in items.values()).encode())
        used = {i.image for i in items.values() if i.image}
        for path in (self.root / "images").glob("*") if (self.root / "images").is_dir() else ():
            if path.name not in used and not path.name.startswith("."):
                path.unlink(missing_ok=True)


def vectors(name: str, version: str, items: list[Item], image_vectors: np.ndarray, text_vectors: np.ndarray
            ) -> TaskVectors:
    """The index's form of a catalogue's `items` embedded by `version`: `image_vectors` are the rows of the items with
    an image, `text_vectors` of those with a text, in `items`' order."""
    with_image, with_text = [i for i in items if i.image], [i for i in items if i.text]
    dim = (image_vectors if len(with_image) else text_vectors).shape[1]
    return TaskVectors(name, TASK_INDEX, version, [i.item_id for i in items],
                       np.asarray(image_vectors, np.float32).reshape(-1, dim),
                       np.asarray(text_vectors, np.float32).reshape(-1, dim), [i.text for i in with_text],
                       split=CATALOGUE, image_uris=[i.image_uri for i in with_image], kind=CATALOGUE,
                       metadata=[i.metadata for i in items], image_ids=[i.item_id for i in with_image],
                       text_ids=[i.item_id for i in with_text])


def _atomic(path, data: bytes) -> None:
    """Write `path` whole or not at all: a local file through a renamed temporary one; an object store's object in
    one put (atomic there already)."""
    if not isinstance(path, Path):
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
