"""Tests for the Ray Data pipeline (training/data/reader.py): task splits to model-ready tensors."""
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import open_clip
import pytest
import ray.data
import yaml
from PIL import Image

from clipstream import models
from clipstream.training.data.reader import read_split, training_dataset
from clipstream.training.data.task import DataError, Task

pytestmark = pytest.mark.component  # Ray Data pipelines on the session's Ray instance

ARCH = "clipstream-vit-tiny"


@pytest.fixture(scope="module")
def bundle():
    return models.create(ARCH)


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.get_tokenizer(ARCH)


def _png(k: int, size: int = 20) -> bytes:
    """A small image whose pixels depend on k (a gradient plus a k-coloured square), so every row differs."""
    rng = np.random.default_rng(k)
    arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def make_task(root: Path, n: int, prefix: str, fmt: str = "jsonl") -> Path:
    root.mkdir(parents=True)
    rows = []
    for k in range(n):
        rel = f"images/{k:03d}.png"
        (root / "images").mkdir(exist_ok=True)
        (root / rel).write_bytes(_png(hash((prefix, k)) % 10_000))
        rows.append({"id": f"{prefix}-{k:03d}", "image": rel, "caption": f"{prefix} caption number {k}",
                     "label": f"c{k % 3}"})
    if fmt == "jsonl":
        (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        (root / "train.csv").write_text("id,image,caption,label\n" + "".join(
            f"{r['id']},{r['image']},{r['caption']},{r['label']}\n" for r in rows))
    (root / "task.yaml").write_text(yaml.safe_dump({"name": prefix, "splits": {"train": f"train.{fmt}"}}))
    return root


def make_wds_task(root: Path, n: int) -> Path:
    """Two shards; samples k % 4 in (0, 1) carry KEY.txt, the others KEY.json {"caption": ...}. Shard 1 is
    written the way `tar -C dir .` writes, with `./KEY.*` member names."""
    (root / "shards").mkdir(parents=True)
    for shard in range(2):
        with tarfile.open(root / f"shards/train-{shard}.tar", "w") as tar:
            for k in range(shard, n, 2):
                key = f"./w{k:03d}" if shard else f"s0/w{k:03d}"
                extra = (("txt", f"webdataset caption {k}".encode()) if k % 4 < 2 else
                         ("json", json.dumps({"caption": f"webdataset caption {k}"}).encode()))
                for name, data in ((f"{key}.png", _png(1000 + k)), (f"{key}.{extra[0]}", extra[1])):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "wds", "splits": {"train": "shards/*.tar"}}))
    return root


def CFG(bundle) -> dict:
    """What the job hands the reader: the model's preprocess_cfg (the transforms are built in the map tasks)."""
    return bundle.model.visual.preprocess_cfg


def expected(task: Task, rows: list[dict], preprocess, tokenizer) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """caption -> (image tensor, tokens) computed directly from the files."""
    out = {}
    for row in rows:
        data = row.get("image_bytes") or (task.root / row["image"]).read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            image = preprocess(img.convert("RGB")).numpy()
        out[row["caption"]] = (image, tokenizer([row["caption"]]).numpy()[0])
    return out


def collect(ds) -> list[dict]:
    return list(ds.iter_rows())


def match_rows(got: list[dict], want: dict[str, tuple[np.ndarray, np.ndarray]], tokenizer) -> None:
    """Every output row is exactly one expected (image, text) pair, and every pair appears once."""
    by_tokens = {tuple(tok.tolist()): (cap, img) for cap, (img, tok) in want.items()}
    assert len(by_tokens) == len(want)  # distinct captions give distinct token rows
    seen = []
    for row in got:
        key = tuple(np.asarray(row["text"]).tolist())
        assert key in by_tokens, "output text row is not the tokenisation of any expected caption"
        caption, image = by_tokens[key]
        assert np.allclose(np.asarray(row["image"]), image, atol=1e-5), f"image of {caption!r} differs"
        seen.append(caption)
    assert sorted(seen) == sorted(want)


def test_jsonl_rows_match_direct_transform_and_tokenizer(ray_cluster, tmp_path, bundle, tokenizer):
    task = Task.load(make_task(tmp_path / "a", 12, "alpha"))
    rows = task.check("train").rows
    got = collect(training_dataset([(task, set())], CFG(bundle), ARCH, augment=False))
    assert len(got) == 12
    for row in got:
        image, text = np.asarray(row["image"]), np.asarray(row["text"])
        assert image.dtype == np.float32 and image.shape == (3, 32, 32)
        assert text.dtype == np.int64 and text.shape == (32,)
    match_rows(got, expected(task, rows, bundle.preprocess_val, tokenizer), tokenizer)


def test_a_task_by_uri_goes_through_the_same_pipeline(ray_cluster, tmp_path, bundle, tokenizer):
    """Ray Data reads the split files by URI (pyarrow filesystems) and the map tasks read the images by URI
    (fsspec): what a cluster job does with s3:// or gs:// tasks, here with file://."""
    root = make_task(tmp_path / "a", 6, "alpha")
    task = Task.load(root.as_uri())
    assert all(str(f).startswith("file://") for f in task.split("train").files)
    got = collect(training_dataset([(task, set())], CFG(bundle), ARCH, augment=False))
    match_rows(got, expected(Task.load(root), task.check("train").rows, bundle.preprocess_val, tokenizer), tokenizer)


def test_skip_ids_are_dropped_and_bad_images_never_decoded(ray_cluster, tmp_path, bundle, tokenizer):
    root = make_task(tmp_path / "a", 10, "alpha")
    (root / "images/004.png").write_bytes(b"corrupt")
    (root / "images/007.png").unlink()
    task = Task.load(root)
    with pytest.raises(DataError):
        task.check("train")
    check = task.check("train", on_bad_image="skip")
    assert check.skipped_ids == {"alpha-004", "alpha-007"}
    ds = training_dataset([(task, check.skipped_ids)], CFG(bundle), ARCH, augment=False)
    got = collect(ds)
    assert len(got) == 8
    match_rows(got, expected(task, check.rows, bundle.preprocess_val, tokenizer), tokenizer)


def test_skip_ids_drop_good_rows_too(ray_cluster, tmp_path, bundle, tokenizer):
    task = Task.load(make_task(tmp_path / "a", 6, "alpha"))
    skip = ["alpha-000", "alpha-005", "not-an-id"]
    got = collect(training_dataset([(task, skip)], CFG(bundle), ARCH, augment=False))
    rows = [r for r in task.check("train").rows if r["id"] not in skip]
    assert len(got) == 4
    match_rows(got, expected(task, rows, bundle.preprocess_val, tokenizer), tokenizer)


def test_union_of_two_tasks(ray_cluster, tmp_path, bundle, tokenizer):
    a = Task.load(make_task(tmp_path / "a", 7, "alpha"))
    b = Task.load(make_task(tmp_path / "b", 5, "beta", fmt="csv"))
    ds = training_dataset([(a, {"alpha-001"}), (b, ())], CFG(bundle), ARCH, augment=False)
    got = collect(ds)
    assert len(got) == 6 + 5
    want = expected(a, [r for r in a.check("train").rows if r["id"] != "alpha-001"], bundle.preprocess_val, tokenizer)
    want.update(expected(b, b.check("train").rows, bundle.preprocess_val, tokenizer))
    match_rows(got, want, tokenizer)


def test_train_transform_gives_right_shape(ray_cluster, tmp_path, bundle, tokenizer):
    task = Task.load(make_task(tmp_path / "a", 5, "alpha"))
    got = collect(training_dataset([(task, ())], CFG(bundle), ARCH))
    assert len(got) == 5
    tokens = sorted(tuple(np.asarray(r["text"]).tolist()) for r in got)
    assert tokens == sorted(tuple(t) for t in tokenizer([r["caption"] for r in task.check("train").rows]).numpy().tolist())
    for row in got:
        image = np.asarray(row["image"])
        assert image.dtype == np.float32 and image.shape == (3, 32, 32) and np.isfinite(image).all()


def test_webdataset_split_through_the_pipeline(ray_cluster, tmp_path, bundle, tokenizer):
    task = Task.load(make_wds_task(tmp_path / "w", 9))
    rows = task.check("train").rows
    assert len(rows) == 9

    raw = read_split(task, "train").take_all()
    assert sorted(str(r["id"]) for r in raw) == sorted(r["id"] for r in rows)
    assert sorted(str(r["caption"]) for r in raw) == sorted(f"webdataset caption {k}" for k in range(9))

    # w003 sits in the `./`-named shard: the ids Task.check reports are the ids the pipeline skips
    got = collect(training_dataset([(task, {"w003"})], CFG(bundle), ARCH, augment=False))
    assert len(got) == 8
    want = expected(task, [r for r in rows if r["id"] != "w003"], bundle.preprocess_val, tokenizer)
    match_rows(got, want, tokenizer)


def test_read_split_unknown_split(ray_cluster, tmp_path):
    task = Task.load(make_task(tmp_path / "a", 2, "alpha"))
    with pytest.raises(DataError, match="'test'"):
        read_split(task, "test")


@pytest.fixture
def ordered():
    """Ray Data's preserve_order for this test's executions, as the training job sets it when deterministic."""
    options = ray.data.DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, True
    yield
    options.preserve_order = before


def test_a_seed_fixes_the_augmented_rows_and_their_order(ray_cluster, tmp_path, bundle, ordered):
    a = Task.load(make_task(tmp_path / "a", 7, "alpha"))
    b = Task.load(make_task(tmp_path / "b", 5, "beta", fmt="csv"))

    def rows(seed):
        got = collect(training_dataset([(a, ()), (b, ())], CFG(bundle), ARCH, seed=seed))
        return [(tuple(np.asarray(r["text"]).tolist()), np.asarray(r["image"])) for r in got]

    first, again, other = rows(7), rows(7), rows(8)
    assert len(first) == 12
    assert [t for t, _ in first] == [t for t, _ in again]  # the same rows in the same order
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(first, again))  # cropped the same way
    crops = dict(other)
    assert any(not np.array_equal(image, crops[t]) for t, image in first)  # another seed, other crops
