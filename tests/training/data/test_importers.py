"""`clipstream data import`: each format from small files in its real schema becomes a task that loads and checks;
its bad inputs are one line and exit 2, and write nothing."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from clipstream.cli import main
from clipstream.training.data.task import Task


def _png(k: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (24, 24), (40 * k % 255, 90, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def images(tmp_path):
    """Eight PNGs under a dataset folder outside any task: a user's own dataset root."""
    root = tmp_path / "dataset" / "photos"
    root.mkdir(parents=True)
    for k in range(8):
        (root / f"{k}.png").write_bytes(_png(k))
    return root


def _imported(capsys, tmp_path, *argv) -> Task:
    out = tmp_path / "task"
    assert main(["data", "import", *argv, "--out", str(out)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"{out}: task 'task', pairs ")
    task = Task.load(out)
    for split in task.splits:
        task.check(split)  # (import checked it too)
    return task


def _captions(task: Task, split: str) -> list[str]:
    return [r["caption"] for r in task.check(split).rows]


def test_open_clip_csv_tab_separated_with_its_default_columns(tmp_path, images, capsys):
    source = images.parent / "train.csv"  # open_clip's --csv-separator default is a tab, whatever the suffix
    source.write_text("filepath\ttitle\n" + "".join(f"photos/{k}.png\ta photo number {k}\n" for k in range(8)))
    task = _imported(capsys, tmp_path, "csv", str(source))
    assert set(task.splits) == {"train", "test"}
    assert len(_captions(task, "train")) == 7 and len(_captions(task, "test")) == 1  # a seeded 10%, at least one
    assert sorted(_captions(task, "train") + _captions(task, "test")) == [f"a photo number {k}" for k in range(8)]
    # ids name the task: two imported tasks share the vector index, where ids must not collide across tasks
    ids = [str(r["id"]) for split in task.splits for r in task.check(split).rows]
    assert sorted(ids) == sorted(f"task-{split}-{k:07d}" for split, n in (("train", 7), ("test", 1)) for k in range(n))


def test_csv_with_commas_named_columns_and_an_image_root(tmp_path, images, capsys):
    source = tmp_path / "elsewhere.csv"
    source.write_text("path,text,other\n" + "".join(f"{k}.png,\"a photo, number {k}\",x\n" for k in range(8)))
    task = _imported(capsys, tmp_path, "csv", str(source), "--img-key", "path", "--caption-key", "text",
                     "--image-root", str(images), "--split", "test")
    assert list(task.splits) == ["test"] and "a photo, number 3" in _captions(task, "test")


def test_jsonl_and_parquet_with_paths_bytes_and_hugging_face_images(tmp_path, images, capsys):
    source = images.parent / "pairs.jsonl"
    source.write_text("".join(json.dumps({"image": f"photos/{k}.png", "caption": f"cap {k}"}) + "\n" for k in range(8)))
    assert len(_captions(_imported(capsys, tmp_path, "jsonl", str(source), "--split", "test"), "test")) == 8

    table = pa.table({"image": [{"bytes": _png(k), "path": None} for k in range(4)],  # Hugging Face's Image feature
                      "text": [f"hf {k}" for k in range(4)]})
    pq.write_table(table, tmp_path / "hf.parquet")
    task = _imported(capsys, tmp_path / "hf", "parquet", str(tmp_path / "hf.parquet"), "--caption-key", "text",
                     "--split", "test")
    rows = task.check("test").rows
    assert [r["caption"] for r in rows] == [f"hf {k}" for k in range(4)]
    assert all((task.root / r["image"]).read_bytes() == _png(k) for k, r in enumerate(rows))


def test_coco_captions_keep_every_caption_of_an_image_on_one_side(tmp_path, images, capsys):
    coco = {"images": [{"id": 100 + k, "file_name": f"{k}.png"} for k in range(8)],
            "annotations": [{"id": n, "image_id": 100 + k, "caption": f"image {k} caption {c}"}
                            for n, (k, c) in enumerate((k, c) for k in range(8) for c in range(5))]}
    source = tmp_path / "captions_train2017.json"
    source.write_text(json.dumps(coco))
    task = _imported(capsys, tmp_path, "coco", str(source), "--image-root", str(images), "--test-fraction", "0.25")
    test, train = (task.check(s).rows for s in ("test", "train"))
    assert len(test) == 10 and len(train) == 30  # 2 of 8 images, 5 captions each
    assert not {r["image"] for r in test} & {r["image"] for r in train}
    assert len({r["image"] for r in test + train}) == 8  # one file per image, however many captions


def test_karpathy_splits_are_kept(tmp_path, images, capsys):
    splits = ["train", "restval", "val", "test", "train", "test", "train", "val"]
    data = {"dataset": "flickr30k", "images": [{"filename": f"{k}.png", "split": splits[k],
                                                "sentences": [{"raw": f"k{k} s{s}"} for s in range(2)]}
                                               for k in range(8)]}
    source = tmp_path / "dataset_flickr30k.json"
    source.write_text(json.dumps(data))
    task = _imported(capsys, tmp_path, "karpathy", str(source), "--image-root", str(images))
    assert {s: len(task.check(s).rows) for s in task.splits} == {"test": 4, "train": 8, "val": 4}


@pytest.mark.parametrize("fmt, content, message", [
    ("csv", "filepath\tcaption\nphotos/0.png\tx\n", "no column 'title' (has filepath, caption"),
    ("csv", "filepath\ttitle\nphotos/99.png\tx\n", "image 'photos/99.png' not found"),
    ("csv", "filepath\ttitle\nphotos/0.png\t  \n", "empty caption"),
    ("coco", '{"images": [], "annotations": [{"image_id": 7, "caption": "x"}]}', "names image_id 7"),
    ("karpathy", '{"images": [{"filename": "0.png", "split": "dev", "sentences": []}]}', "has split 'dev'"),
    ("coco", "[1, 2]", "not a coco captions file"),
    ("csv", "filepath\ttitle\nphotos/notes.png\tx\n", "corrupt image")])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, images, capsys, fmt, content, message):
    (images / "notes.png").write_text("not an image")  # found, but the check after writing refuses it
    source = images.parent / f"bad.{'json' if fmt in ('coco', 'karpathy') else 'csv'}"
    source.write_text(content)
    out = tmp_path / "task"
    assert main(["data", "import", fmt, str(source), "--out", str(out), "--image-root", str(images.parent)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("clipstream: error: ") and message in err[0], err
    assert not out.exists()


def test_a_folder_that_is_not_empty_is_not_imported_into(tmp_path, images, capsys):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "keep.txt").write_text("mine")
    source = images.parent / "train.tsv"
    source.write_text("filepath\ttitle\nphotos/0.png\ta\nphotos/1.png\tb\n")
    assert main(["data", "import", "tsv", str(source), "--out", str(tmp_path / "task")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "task").iterdir()] == ["keep.txt"]
