"""Tests for task loading and validation (training/data/task.py): every data error names its file and row."""
import csv
import io
import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml
from PIL import Image

from clipstream.training.data.task import Check, DataError, Task

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]


def png_bytes(k: int, size: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), COLOURS[k % len(COLOURS)]).save(buf, format="PNG")
    return buf.getvalue()


def default_rows(n: int, split: str = "train") -> list[dict]:
    return [{"id": f"{split}-{k}", "image": f"images/{split}/{k}.png", "caption": f"a picture number {k}",
             "label": f"class{k % 2}"} for k in range(n)]


def make_task(root: Path, rows: dict | None = None, *, name: str = "tiny", kind: str = "domain",
              fmt: str = "jsonl", meta: dict | None = None) -> Path:
    """A task dir: one PNG per row (at the row's `image`), the split files, and task.yaml."""
    rows = {"train": default_rows(4), "test": default_rows(2, "test")} if rows is None else rows
    root.mkdir(parents=True, exist_ok=True)
    for split_rows in rows.values():
        for k, row in enumerate(split_rows):
            if row.get("image"):
                path = root / row["image"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(png_bytes(k))
    for split, split_rows in rows.items():
        if fmt == "jsonl":
            (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
        else:
            with open(root / f"{split}.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=["id", "image", "caption", "label"])
                writer.writeheader()
                writer.writerows(split_rows)
    manifest = {"name": name, "kind": kind, "index": 0, "splits": {s: f"{s}.{fmt}" for s in rows}}
    manifest.update(meta or {})
    (root / "task.yaml").write_text(yaml.safe_dump(manifest))
    return root


def write_shard(path: Path, samples: list[tuple[str, bytes, dict]]) -> Path:
    """A WebDataset .tar: for each (key, image bytes, {ext: bytes}) member KEY.png plus KEY.<ext> files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, image, extra in samples:
            for name, data in [(f"{key}.png", image), *((f"{key}.{ext}", d) for ext, d in extra.items())]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def raises(match_parts, fn, *args, **kwargs) -> str:
    """Call fn expecting a DataError whose message contains every part; return the message."""
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_parts:
        assert str(part) in msg, f"{part!r} not in {msg!r}"
    return msg


# --- loading the manifest ---------------------------------------------------------------------------

def test_load_reads_manifest(tmp_path):
    root = make_task(tmp_path / "t", meta={"index": 3, "description": "hello"})
    task = Task.load(root)
    assert task.name == "tiny" and task.kind == "domain" and task.index == 3
    assert task.root == root.absolute()
    assert set(task.splits) == {"train", "test"}
    assert task.split("train").format == "jsonl"
    assert task.split("train").files == (root / "train.jsonl",)
    assert task.meta["description"] == "hello"


def test_kind_defaults_to_domain_and_language_is_accepted(tmp_path):
    root = make_task(tmp_path / "t")
    meta = yaml.safe_load((root / "task.yaml").read_text())
    del meta["kind"]
    (root / "task.yaml").write_text(yaml.safe_dump(meta))
    assert Task.load(root).kind == "domain"
    meta["kind"] = "language"
    (root / "task.yaml").write_text(yaml.safe_dump(meta))
    assert Task.load(root).kind == "language"


def test_missing_task_dir(tmp_path):
    raises([tmp_path / "nope", "not found"], Task.load, tmp_path / "nope")


def test_missing_task_yaml(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    raises([root / "task.yaml", "missing task.yaml"], Task.load, root)


def test_invalid_yaml(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "task.yaml").write_text("name: [unclosed\nsplits: {train: train.jsonl\n")
    raises([root / "task.yaml", "not valid YAML"], Task.load, root)


def test_manifest_not_a_mapping(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "task.yaml").write_text("- a\n- b\n")
    raises([root / "task.yaml", "mapping"], Task.load, root)


@pytest.mark.parametrize("key", ["name", "splits"])
def test_missing_required_key(tmp_path, key):
    root = make_task(tmp_path / "t")
    meta = yaml.safe_load((root / "task.yaml").read_text())
    del meta[key]
    (root / "task.yaml").write_text(yaml.safe_dump(meta))
    raises([root / "task.yaml", f"missing required key {key!r}"], Task.load, root)


def test_bad_kind(tmp_path):
    root = make_task(tmp_path / "t", kind="vibes")
    raises([root / "task.yaml", "kind", "'vibes'"], Task.load, root)


@pytest.mark.parametrize("splits", [{}, ["train.jsonl"], "train.jsonl"])
def test_splits_must_be_a_nonempty_mapping(tmp_path, splits):
    root = make_task(tmp_path / "t", meta={"splits": splits})
    raises([root / "task.yaml", "splits"], Task.load, root)


def test_split_glob_matching_nothing(tmp_path):
    root = make_task(tmp_path / "t", meta={"splits": {"train": "train.jsonl", "extra": "shards/*.tar"}})
    raises([root / "task.yaml", "'extra'", "no file matches", root / "shards/*.tar"], Task.load, root)


def test_split_with_mixed_or_unknown_suffix(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "notes.txt").write_text("x")
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "t", "splits": {"train": "notes.txt"}}))
    raises([root / "task.yaml", "'train'", ".txt"], Task.load, root)


def test_split_naming_no_file(tmp_path):
    root = make_task(tmp_path / "t", meta={"splits": {"train": None}})
    raises([root / "task.yaml", "'train'", "names no file"], Task.load, root)


def test_split_spec_as_mapping_with_glob(tmp_path):
    rows = {"a": default_rows(2, "a"), "b": default_rows(3, "b")}
    root = make_task(tmp_path / "t", rows)
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "t", "splits": {"train": {"path": "*.jsonl"}}}))
    task = Task.load(root)
    assert task.split("train").files == (root / "a.jsonl", root / "b.jsonl")
    assert [r["id"] for r in task.check("train").rows] == ["a-0", "a-1", "b-0", "b-1", "b-2"]


def test_unknown_split_name(tmp_path):
    task = Task.load(make_task(tmp_path / "t"))
    msg = raises(["'valid'", "tiny"], task.check, "valid")
    assert "test" in msg and "train" in msg  # lists the splits it has
    raises(["'valid'"], task.split, "valid")


def test_bad_policy_string(tmp_path):
    task = Task.load(make_task(tmp_path / "t"))
    with pytest.raises(ValueError, match="on_bad_image") as info:
        task.check("train", on_bad_image="ignore")
    assert not isinstance(info.value, DataError)


# --- checking rows ----------------------------------------------------------------------------------

def test_check_returns_all_rows_in_order(tmp_path):
    task = Task.load(make_task(tmp_path / "t"))
    check = task.check("train")
    assert isinstance(check, Check)
    assert check.rows == default_rows(4)
    assert check.skipped == [] and check.skipped_ids == set()


def test_missing_image_file_fail_and_skip(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train/2.png").unlink()
    task = Task.load(root)
    raises([f"{root / 'train.jsonl'}:3", "image not found", root / "images/train/2.png", "'train-2'"],
           task.check, "train")
    check = task.check("train", on_bad_image="skip")
    assert [r["id"] for r in check.rows] == ["train-0", "train-1", "train-3"]
    assert check.skipped_ids == {"train-2"}
    assert len(check.skipped) == 1 and check.skipped[0].startswith(f"{root / 'train.jsonl'}:3: image not found")


def test_corrupt_image_fails_naming_file_row_and_id(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train/1.png").write_bytes(b"this is not a png at all" * 10)
    task = Task.load(root)
    msg = raises([f"{root / 'train.jsonl'}:2:", "corrupt image", "images/train/1.png", "'train-1'", "skip"],
                 task.check, "train")
    assert "train-0" not in msg


def test_corrupt_image_skipped_under_skip_policy(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train/1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    check = Task.load(root).check("train", on_bad_image="skip")
    assert [r["id"] for r in check.rows] == ["train-0", "train-2", "train-3"]
    assert check.rows == [r for r in default_rows(4) if r["id"] != "train-1"]
    assert check.skipped_ids == {"train-1"}
    assert len(check.skipped) == 1
    assert check.skipped[0].startswith(f"{root / 'train.jsonl'}:2: corrupt image images/train/1.png")


def test_missing_image_field(tmp_path):
    rows = default_rows(3)
    del rows[1]["image"]
    root = make_task(tmp_path / "t", {"train": rows})
    raises([f"{root / 'train.jsonl'}:2", "missing image field"], Task.load(root).check, "train")
    check = Task.load(root).check("train", on_bad_image="skip")
    assert check.skipped_ids == {"train-1"}


@pytest.mark.parametrize("caption", ["", "   \t ", None])
def test_empty_caption(tmp_path, caption):
    rows = default_rows(3)
    if caption is None:
        del rows[2]["caption"]
    else:
        rows[2]["caption"] = caption
    root = make_task(tmp_path / "t", {"train": rows})
    task = Task.load(root)
    raises([f"{root / 'train.jsonl'}:3", "empty caption", "'train-2'"], task.check, "train")
    # the skip policy is about images only: a bad caption still fails
    raises([f"{root / 'train.jsonl'}:3", "empty caption"], task.check, "train", on_bad_image="skip")


def test_missing_id(tmp_path):
    rows = default_rows(3)
    rows[1]["id"] = ""
    root = make_task(tmp_path / "t", {"train": rows})
    raises([f"{root / 'train.jsonl'}:2", "missing id"], Task.load(root).check, "train")


def test_duplicate_id_names_both_locations(tmp_path):
    rows = default_rows(4)
    rows[3]["id"] = "train-1"
    root = make_task(tmp_path / "t", {"train": rows})
    f = root / "train.jsonl"
    msg = raises([f"{f}:4", "duplicate id 'train-1'", f"first at {f}:2"], Task.load(root).check, "train")
    assert msg.startswith(f"{f}:4:")


def test_duplicate_id_across_files_of_a_split(tmp_path):
    rows = {"a": default_rows(2, "a"), "b": [dict(default_rows(1, "b")[0], id="a-1")]}
    root = make_task(tmp_path / "t", rows)
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "t", "splits": {"train": "*.jsonl"}}))
    raises([f"{root / 'b.jsonl'}:1", "duplicate id 'a-1'", f"{root / 'a.jsonl'}:2"], Task.load(root).check, "train")


def test_empty_split_file(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "test.jsonl").write_text("")
    raises([root / "test.jsonl", "'test'", "no usable rows"], Task.load(root).check, "test")


def test_blank_lines_are_ignored_but_line_numbers_kept(tmp_path):
    root = make_task(tmp_path / "t")
    lines = (root / "train.jsonl").read_text().splitlines()
    broken = dict(json.loads(lines[2]), caption=" ")
    (root / "train.jsonl").write_text("\n".join([lines[0], "", lines[1], "   ", json.dumps(broken)]) + "\n")
    raises([f"{root / 'train.jsonl'}:5", "empty caption"], Task.load(root).check, "train")


def test_split_where_every_row_is_skipped(tmp_path):
    root = make_task(tmp_path / "t")
    for k in range(2):
        (root / f"images/test/{k}.png").write_bytes(b"junk")
    task = Task.load(root)
    raises([root / "test.jsonl", "'test'", "no usable rows"], task.check, "test", on_bad_image="skip")
    assert len(task.check("train", on_bad_image="skip").rows) == 4  # the other split is unaffected


def test_invalid_json_line(tmp_path):
    root = make_task(tmp_path / "t")
    lines = (root / "train.jsonl").read_text().splitlines()
    lines[1] = '{"id": "train-1", "image": '
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")
    raises([f"{root / 'train.jsonl'}:2", "not valid JSON"], Task.load(root).check, "train")


def test_json_line_not_an_object(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "train.jsonl").write_text((root / "train.jsonl").read_text() + '["a", "list"]\n')
    raises([f"{root / 'train.jsonl'}:5", "JSON object"], Task.load(root).check, "train")


# --- CSV ----------------------------------------------------------------------------------------------

def test_csv_split_reads_same_rows_as_jsonl(tmp_path):
    rows = {"train": default_rows(5)}
    rows["train"][2]["caption"] = 'a "quoted", comma caption'
    jtask = Task.load(make_task(tmp_path / "j", rows))
    ctask = Task.load(make_task(tmp_path / "c", rows, fmt="csv"))
    assert ctask.split("train").format == "csv"
    assert ctask.check("train").rows == jtask.check("train").rows == rows["train"]


def test_csv_errors_name_file_and_line(tmp_path):
    rows = default_rows(3)
    rows[1]["caption"] = " "
    root = make_task(tmp_path / "c", {"train": rows}, fmt="csv")
    # header is line 1, so the second data row is line 3
    raises([f"{root / 'train.csv'}:3", "empty caption", "'train-1'"], Task.load(root).check, "train")


def test_csv_missing_header_columns(tmp_path):
    root = make_task(tmp_path / "c", fmt="csv")
    (root / "train.csv").write_text("id,img,text\ntrain-0,images/train/0.png,hello\n")
    msg = raises([f"{root / 'train.csv'}:1", "CSV header"], Task.load(root).check, "train")
    assert "caption" in msg and "image" in msg and "'id'" not in msg


# --- WebDataset -------------------------------------------------------------------------------------

def test_webdataset_shard_read_with_ids_and_captions(tmp_path):
    root = tmp_path / "w"
    shard = write_shard(root / "shards/train-000.tar", [
        ("s/a0", png_bytes(0), {"txt": b"  a red square  \n"}),
        ("s/a1", png_bytes(1), {"json": json.dumps({"caption": "a green square", "label": "green"}).encode()}),
    ])
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "shards/*.tar"}}))
    task = Task.load(root)
    assert task.split("train").format == "webdataset" and task.split("train").files == (shard,)
    check = task.check("train")
    got = {r["id"]: r for r in check.rows}
    assert set(got) == {"a0", "a1"}
    assert got["a0"]["caption"] == "a red square"
    assert got["a1"]["caption"] == "a green square" and got["a1"]["label"] == "green"
    assert got["a0"]["image_bytes"] == png_bytes(0)


def test_webdataset_corrupt_image_and_missing_caption(tmp_path):
    root = tmp_path / "w"
    shard = write_shard(root / "train.tar", [
        ("k0", png_bytes(0), {"txt": b"fine"}),
        ("k1", b"not an image", {"txt": b"broken"}),
    ])
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "train.tar"}}))
    task = Task.load(root)
    raises([f"{shard}:k1", "corrupt image", "'k1'"], task.check, "train")
    check = task.check("train", on_bad_image="skip")
    assert [r["id"] for r in check.rows] == ["k0"] and check.skipped_ids == {"k1"}
    assert check.skipped[0].startswith(f"{shard}:k1:")

    write_shard(shard, [("k0", png_bytes(0), {"txt": b"fine"}), ("k2", png_bytes(2), {})])
    raises([f"{shard}:k2", "empty caption"], Task.load(root).check, "train")


def test_unreadable_shard(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    (root / "train.tar").write_bytes(b"definitely not a tar file" * 100)
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "train.tar"}}))
    raises([root / "train.tar", "WebDataset"], Task.load(root).check, "train")


# --- data_sha ---------------------------------------------------------------------------------------

def test_data_sha_stable_and_content_sensitive(tmp_path):
    root = make_task(tmp_path / "t")
    sha = Task.load(root).data_sha()
    assert re.fullmatch(r"[0-9a-f]{64}", sha)
    assert Task.load(root).data_sha() == sha
    assert Task.load(root).data_sha() == Task.load(root).data_sha()

    # same content in another directory: same hash (paths are relative)
    other = make_task(tmp_path / "copy")
    assert Task.load(other).data_sha() == sha

    # one image's bytes change (a test-split image: every split counts)
    (root / "images/test/1.png").write_bytes(png_bytes(4))
    sha_img = Task.load(root).data_sha()
    assert sha_img != sha

    # one caption changes
    rows = default_rows(4)
    rows[0]["caption"] = "a picture number zero"
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sha_cap = Task.load(root).data_sha()
    assert sha_cap not in (sha, sha_img)

    # restoring the content restores the hash
    (root / "images/test/1.png").write_bytes(png_bytes(1))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in default_rows(4)))
    assert Task.load(root).data_sha() == sha


def test_data_sha_covers_manifest_and_webdataset_images(tmp_path):
    root = make_task(tmp_path / "t")
    sha = Task.load(root).data_sha()
    meta = yaml.safe_load((root / "task.yaml").read_text())
    meta["index"] = 7
    (root / "task.yaml").write_text(yaml.safe_dump(meta))
    assert Task.load(root).data_sha() != sha

    w = tmp_path / "w"
    write_shard(w / "train.tar", [("k0", png_bytes(0), {"txt": b"cap"})])
    (w / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "train.tar"}}))
    wsha = Task.load(w).data_sha()
    write_shard(w / "train.tar", [("k0", png_bytes(3), {"txt": b"cap"})])
    assert Task.load(w).data_sha() != wsha


def test_webdataset_keys_follow_webdataset_convention(tmp_path):
    """The key is everything before the first dot of the *file name*: `tar -C dir .` writes `./KEY.png`,
    and shard folders may contain dots; both must still pair KEY.png with KEY.txt (as Ray's reader does)."""
    root = tmp_path / "w"
    write_shard(root / "train.tar", [
        ("./x0", png_bytes(0), {"txt": b"first"}),
        ("v1.0/x1", png_bytes(1), {"json": json.dumps({"caption": "second"}).encode()}),
    ])
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "train.tar"}}))
    rows = Task.load(root).check("train").rows
    assert sorted((r["id"], r["caption"]) for r in rows) == [("x0", "first"), ("x1", "second")]
    assert all(r["image_bytes"][:8] == b"\x89PNG\r\n\x1a\n" for r in rows)


# --- tasks addressed by URI (s3://, gs://, file://: fsspec through universal-pathlib) -------------------

@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_task_by_uri_reads_like_the_local_one(tmp_path, fmt):
    root = make_task(tmp_path / "t", fmt=fmt)
    local, remote = Task.load(root), Task.load(root.as_uri())
    assert str(remote.root) == root.as_uri() and remote.name == local.name
    assert remote.check("train").rows == local.check("train").rows
    assert remote.data_sha() == local.data_sha()
    assert Task.load(str(remote.root)).data_sha() == local.data_sha()  # a lineage entry's path loads again
    assert remote.image(remote.check("train").rows[0]) == (root / "images/train/0.png").read_bytes()


def test_a_task_by_uri_reports_missing_images_and_files(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train/2.png").unlink()
    raises(["train.jsonl:3", "image not found", "images/train/2.png"], Task.load(root.as_uri()).check, "train")
    raises(["task directory not found"], Task.load, (tmp_path / "nope").as_uri())
    (root / "task.yaml").unlink()
    raises(["missing task.yaml"], Task.load, root.as_uri())


def test_a_webdataset_task_by_uri(tmp_path):
    root = tmp_path / "w"
    write_shard(root / "shards/0.tar", [(f"k{i}", png_bytes(i), {"txt": f"caption {i}".encode()}) for i in range(3)])
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "shards/*.tar"}}))
    rows = Task.load(root.as_uri()).check("train").rows
    assert [r["caption"] for r in rows] == ["caption 0", "caption 1", "caption 2"]
