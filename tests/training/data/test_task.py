"""Tests for task loading and validation (training/data/task.py): every data error names its file and row."""
import csv
import io
import json
import os
import re
import tarfile
import warnings
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


@pytest.mark.parametrize("key, hint", [("knd", " (did you mean 'kind'?)"), ("split", " (did you mean 'splits'?)"),
                                       ("owner", "")])
def test_an_unknown_key_is_refused_with_the_closest_one(tmp_path, key, hint):
    """A typo is not read as the default (`knd: language` used to train as a domain task)."""
    root = make_task(tmp_path / "t", meta={key: "language"})
    raises([root / "task.yaml", f"unknown key {key!r}{hint}; task.yaml takes name, kind, splits"], Task.load, root)
    make_task(root, meta={"metadata": {"owner": "vision team", "license": "CC-BY-4.0"}})
    assert Task.load(root).meta["metadata"]["owner"] == "vision team"  # free-form notes have their own key


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


def test_webdataset_brace_ranges_name_shards_as_webdataset_does(tmp_path):
    root = tmp_path / "w"
    shards = [write_shard(root / f"shards/{k:03d}.tar", [(f"s{k}", png_bytes(k), {"txt": f"shard {k}".encode()})])
              for k in range(4)]
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "shards/{000..002}.tar",
                                                                           "test": "shards/{003,003}.tar"}}))
    task = Task.load(root)
    assert task.split("train").files == tuple(shards[:3]) and task.split("test").files == (shards[3],)
    assert sorted(r["caption"] for r in task.check("train").rows) == ["shard 0", "shard 1", "shard 2"]
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "{shards,../x}/000.tar"}}))
    raises([root / "task.yaml", "leaves the task directory"], Task.load, root)  # every expansion stays inside


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


# --- paths that leave the task directory (refused under any policy, from the path alone) ---------------

def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels (a one-row image body): what a decompression bomb
    shows before decoding, made in microseconds."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1)))
            + chunk(b"IEND", b""))


def _task_with_rows(root: Path, rows: list[dict], fmt: str = "jsonl") -> Path:
    """make_task, for rows whose image may lie outside `root` (not written then)."""
    make_task(root, {"train": [r for r in rows if not r["image"].startswith(("/", ".."))]}, fmt=fmt)
    (root / f"train.{fmt}").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("policy", ["fail", "skip"])
@pytest.mark.parametrize("image, reason", [
    ("../outside.png", "'..' climbs out of it"),
    ("images/../../outside.png", "'..' climbs out of it"),
    ("/etc/hostname", "it is absolute"),
    ("file:///etc/hostname", "it is a URI"),
])
def test_an_image_path_out_of_the_task_is_refused_whatever_the_policy(tmp_path, image, reason, policy):
    (tmp_path / "outside.png").write_bytes(png_bytes(0))  # it exists: still refused
    root = _task_with_rows(tmp_path / "t", [*default_rows(1), dict(default_rows(2)[1], image=image)])
    msg = raises([f"{root / 'train.jsonl'}:2: image path {image!r} leaves the task directory {root}", reason,
                  "'train-1'"], Task.load(root).check, "train", on_bad_image=policy)
    assert "skip" not in msg  # not a bad image that skipping would cure


def test_a_symlink_out_gives_the_same_message_whether_or_not_its_target_exists(tmp_path):
    root = make_task(tmp_path / "t")
    secret = tmp_path / "secret.png"
    secret.write_bytes(png_bytes(0))
    link = root / "images/train/1.png"
    link.unlink()
    link.symlink_to(secret)
    task = Task.load(root)
    expected = [f"{root / 'train.jsonl'}:2: image path 'images/train/1.png' leaves the task directory {root}",
                "a symlink on the way points out of it"]
    exists = raises(expected, task.check, "train")
    secret.unlink()
    assert raises(expected, task.check, "train", on_bad_image="skip") == exists  # no oracle for outside files
    with pytest.raises(DataError, match="leaves the task directory"):
        task.data_sha()


def test_a_symlinked_folder_out_is_refused_and_one_inside_is_fine(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train").rename(tmp_path / "elsewhere")
    (root / "images/train").symlink_to(tmp_path / "elsewhere")
    raises([f"{root / 'train.jsonl'}:1: image path 'images/train/0.png' leaves the task directory",
            "symlink"], Task.load(root).check, "train")
    (root / "images/train").unlink()
    (tmp_path / "elsewhere").rename(root / "real")
    (root / "images/train").symlink_to(root / "real")  # a symlink that stays inside
    assert len(Task.load(root).check("train").rows) == 4


def test_an_image_that_is_a_symlink_inside_the_task_is_read_through_it(tmp_path):
    """A symlinked file is never read by the plain-path read (opened without following links): the full check
    decides, and a link that stays inside reads and hashes as the file it names."""
    root = make_task(tmp_path / "t")
    before = Task.load(root).data_sha()
    (root / "images/train/1.png").rename(root / "images/kept.png")
    (root / "images/train/1.png").symlink_to(root / "images/kept.png")
    task = Task.load(root)
    assert len(task.check("train").rows) == 4
    assert task.data_sha() == before  # the same bytes through the link


def test_a_dotdot_that_stays_inside_is_fine(tmp_path):
    rows = default_rows(2)
    make_task(tmp_path / "t", {"train": rows})
    rows[1]["image"] = "images/../images/train/./1.png"
    (tmp_path / "t/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(Task.load(tmp_path / "t").check("train").rows) == 2


def test_a_path_out_is_refused_for_a_task_by_uri_and_in_ray_data_batches(tmp_path):
    from clipstream.training.data.task import UnsafePath, image_source

    root = make_task(tmp_path / "t")
    for image in ("../t/images/train/0.png", "/etc/hostname", "images/../images/train/0.png"):
        with pytest.raises(UnsafePath, match="leaves the task directory"):
            image_source("memory://bucket/t", image)
    with pytest.raises(UnsafePath, match="'..' climbs out of it"):
        image_source(root.as_uri(), "../t/images/train/0.png")
    (root / "link.png").symlink_to("/etc/hostname")
    with pytest.raises(UnsafePath, match="symlink"):  # file:// is the local filesystem: its symlinks count
        image_source(root.as_uri(), "link.png")
    with pytest.raises(UnsafePath, match="symlink"):
        image_source(str(root), "link.png")
    assert image_source(str(root), "images/train/0.png") == root / "images/train/0.png"
    # WebDataset member names are keys inside the shard, never opened as paths
    assert image_source(str(root), "../../x.png", b"bytes") == b"bytes"


@pytest.mark.parametrize("pattern, reason", [
    ("../other/*.jsonl", "'..' climbs out of it"), ("/tmp/*.jsonl", "it is absolute"),
    ("s3://bucket/*.jsonl", "it is a URI"), ("shards/../../*.jsonl", "'..' climbs out of it"),
])
def test_a_split_pattern_out_of_the_task_is_refused(tmp_path, pattern, reason):
    make_task(tmp_path / "other")
    root = make_task(tmp_path / "t", meta={"splits": {"train": pattern}})
    raises([root / "task.yaml", "'train'", f"pattern {pattern!r} leaves the task directory", reason], Task.load, root)


def test_a_split_file_that_is_a_symlink_out_is_refused(tmp_path):
    other = make_task(tmp_path / "other")
    root = make_task(tmp_path / "t", meta={"splits": {"train": "*.jsonl"}})
    (root / "z.jsonl").symlink_to(other / "train.jsonl")
    raises([root / "task.yaml", "'train'", "z.jsonl", "leaves the task directory", "symlink"], Task.load, root)


# --- task names -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a/b", "..", "a..b", "../evil", "-dash-first", ".hidden", "x" * 65, "with space",
                                  "tab\t", "", "ünïcode", ["a"], None, True])
def test_task_names_outside_the_rule_are_refused(tmp_path, name):
    root = make_task(tmp_path / "t", name=name)
    raises([root / "task.yaml", f"task name {name!r} is not allowed", "letters, digits"], Task.load, root)


@pytest.mark.parametrize("name", ["t", "task-00-household", "zero-shot-toys", "task-03-lang-xa", "v1.0_x", "x" * 64,
                                  2024])
def test_task_names_within_the_rule_load(tmp_path, name):
    assert Task.load(make_task(tmp_path / "t", name=name)).name == str(name)


def test_every_synthetic_task_name_is_within_the_rule(tmp_path):
    from clipstream.training.data.synth import DOMAINS, HELD_OUT, LANG_CODES
    from clipstream.training.data.task import NAME_RULE

    names = [f"task-{i:02d}-{d}{i // len(DOMAINS) + 1 if i >= len(DOMAINS) else ''}"
             for i, d in enumerate(list(DOMAINS) * 3)]
    names += ["task-99-digits", f"zero-shot-{HELD_OUT[0]}", *(f"task-{i:02d}-lang-{c}" for i, c in enumerate(LANG_CODES))]
    assert all(NAME_RULE.fullmatch(n) and ".." not in n for n in names), names


# --- text: UTF-8 and no control characters ------------------------------------------------------------

def test_non_utf8_jsonl_row_names_its_line(tmp_path):
    root = make_task(tmp_path / "t")
    lines = (root / "train.jsonl").read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"number 2", b"num\xe9ro 2")  # Latin-1, not UTF-8
    (root / "train.jsonl").write_bytes(b"".join(lines))
    raises([f"{root / 'train.jsonl'}:3: not valid UTF-8", "0xe9", "save the file as UTF-8"],
           Task.load(root).check, "train")


def test_non_utf8_csv_row_names_its_line(tmp_path):
    root = make_task(tmp_path / "c", fmt="csv")
    data = (root / "train.csv").read_bytes().replace(b"number 3", b"num\xff 3")
    (root / "train.csv").write_bytes(data)
    raises([f"{root / 'train.csv'}:5: not valid UTF-8", "0xff"], Task.load(root).check, "train")


def test_a_utf8_bom_is_accepted(tmp_path):
    for fmt in ("jsonl", "csv"):
        root = make_task(tmp_path / fmt, fmt=fmt)
        path = root / f"train.{fmt}"
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        assert Task.load(root).check("train").rows == default_rows(4)


def test_non_utf8_task_yaml_names_its_line(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "task.yaml").write_bytes(b"name: t\ndescription: caf\xe9\nsplits: {train: train.jsonl}\n")
    raises([f"{root / 'task.yaml'}:2: not valid UTF-8"], Task.load, root)


def test_invalid_yaml_names_its_line_on_one_line(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "task.yaml").write_text("name: t\nsplits: {train: train.jsonl\n")
    msg = raises([f"{root / 'task.yaml'}:", "not valid YAML"], Task.load, root)
    assert "\n" not in msg


@pytest.mark.parametrize("field, value", [("caption", "a red\x00cup"), ("caption", "two\nlines"),
                                          ("caption", "bell\x07"), ("id", "train-\x1b1"), ("caption_en", "a\rb"),
                                          ("caption", "del\x7f")])
def test_control_characters_in_text_fields_are_refused(tmp_path, field, value):
    rows = default_rows(3)
    rows[2][field] = value
    root = make_task(tmp_path / "t", {"train": rows})
    raises([f"{root / 'train.jsonl'}:3: {field} of id", f"U+{ord(next(c for c in value if ord(c) < 32 or ord(c) == 127)):04X}",
            "control character"], Task.load(root).check, "train", on_bad_image="skip")


def test_a_tab_in_a_caption_is_fine(tmp_path):
    rows = default_rows(2)
    rows[0]["caption"] = "a red\tcup"
    assert Task.load(make_task(tmp_path / "t", {"train": rows})).check("train").rows == rows


def test_a_nul_in_a_csv_caption_names_its_line(tmp_path):
    root = make_task(tmp_path / "c", fmt="csv")
    (root / "train.csv").write_bytes((root / "train.csv").read_bytes().replace(b"number 1", b"num\x00ber 1"))
    raises([f"{root / 'train.csv'}:3: caption of id 'train-1'", "U+0000"], Task.load(root).check, "train")


def test_csv_rows_with_more_fields_than_the_header_or_broken_quoting(tmp_path):
    root = make_task(tmp_path / "c", fmt="csv")
    (root / "train.csv").write_text("id,image,caption\ntrain-0,images/train/0.png,fine\n"
                                    "train-1,images/train/1.png,red, green\n")
    raises([f"{root / 'train.csv'}:3", "more field(s) than the header", "quote"], Task.load(root).check, "train")
    (root / "train.csv").write_text("id,image,caption\ntrain-0,images/train/0.png," + "x" * 200_000 + "\n")
    raises([f"{root / 'train.csv'}:2", "not valid CSV"], Task.load(root).check, "train")


@pytest.mark.parametrize("field, value, message", [
    ("id", ["a"], "id must be a string"), ("caption", ["a"], "caption must be a string"),
    ("image", 7, "image must be a path"), ("image_bytes", "QUJD", "'image_bytes' is reserved"),
])
def test_rows_with_fields_of_the_wrong_type_are_refused(tmp_path, field, value, message):
    rows = default_rows(2)
    root = make_task(tmp_path / "t", {"train": rows})
    rows[1][field] = value
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raises([f"{root / 'train.jsonl'}:2", message], Task.load(root).check, "train", on_bad_image="skip")


def test_webdataset_text_that_is_not_utf8_or_json_names_shard_and_key(tmp_path):
    root = tmp_path / "w"
    root.mkdir()
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "w", "splits": {"train": "train.tar"}}))
    for extra, message in [({"txt": b"caf\xe9"}, "k1.txt is not valid UTF-8"),
                           ({"json": b'{"caption": "caf\xe9"}'}, "k1.json is not valid UTF-8"),
                           ({"json": b"{not json"}, "k1.json is not valid JSON"),
                           ({"json": b'["a"]'}, "k1.json: expected a JSON object")]:
        shard = write_shard(root / "train.tar", [("k0", png_bytes(0), {"txt": b"fine"}), ("k1", png_bytes(1), extra)])
        raises([f"{shard}:k1: {message}"], Task.load(root).check, "train")


# --- images: size limit, truncation ---------------------------------------------------------------------

def test_an_image_declaring_too_many_pixels_is_a_bad_image(tmp_path):
    from clipstream.training.data.task import MAX_IMAGE_PIXELS

    root = make_task(tmp_path / "t")
    (root / "images/train/1.png").write_bytes(png_declaring(5000, 5000))  # above ours, below PIL's limit
    (root / "images/train/2.png").write_bytes(png_declaring(20000, 20000))  # above PIL's (an error there)
    (root / "images/train/3.png").write_bytes(png_declaring(10000, 10000))  # between PIL's warning and error
    assert len(png_declaring(20000, 20000)) < 100_000
    task = Task.load(root)
    raises([f"{root / 'train.jsonl'}:2: image images/train/1.png too large: 5000x5000 pixels",
            f"{MAX_IMAGE_PIXELS:,}", "downscale"], task.check, "train")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning leaks out
        check = task.check("train", on_bad_image="skip")
    assert check.skipped_ids == {"train-1", "train-2", "train-3"}
    assert "400,000,000 pixels" in check.skipped[1] and "100,000,000 pixels" in check.skipped[2]


@pytest.mark.parametrize("cut", [0.5, 0.9])
def test_a_truncated_png_is_a_corrupt_image(tmp_path, cut):
    root = make_task(tmp_path / "t")
    data = png_bytes(1, size=64)
    (root / "images/train/1.png").write_bytes(data[:int(len(data) * cut)])
    raises([f"{root / 'train.jsonl'}:2: corrupt image images/train/1.png", "runcated"], Task.load(root).check, "train")


def test_a_one_pixel_image_is_fine(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train/1.png").write_bytes(png_bytes(1, size=1))
    assert len(Task.load(root).check("train").rows) == 4



def test_a_symlink_loop_is_an_error_not_a_crash(tmp_path):
    root = make_task(tmp_path / "t")
    (root / "images/train/1.png").unlink()
    (root / "images/train/1.png").symlink_to("1.png")
    raises([f"{root / 'train.jsonl'}:2: image path 'images/train/1.png' cannot be resolved"],
           Task.load(root).check, "train", on_bad_image="skip")


# ---- classes and labels (zero-shot classification prompts the class names)

def test_classes_and_templates_are_read_and_a_task_without_them_has_none(tmp_path):
    task = Task.load(make_task(tmp_path / "a", meta={"classes": ["class0", "class1"], "templates": ["a {}."]}))
    assert task.classes == ["class0", "class1"] and task.templates == ["a {}."]
    assert len(task.check("test").rows) == 2  # every label is one of the classes
    plain = Task.load(make_task(tmp_path / "b"))
    assert plain.classes is None and plain.templates is None
    assert len(plain.check("test").rows) == 2  # no classes: labels are not checked
    numbered = Task.load(make_task(tmp_path / "c", rows={"test": [{**r, "label": k} for k, r in enumerate(
        default_rows(2, "test"))]}, meta={"classes": [0, 1]}))
    assert numbered.classes == ["0", "1"] and len(numbered.check("test").rows) == 2  # names compared as text


def test_a_label_not_in_the_classes_is_one_error_naming_file_row_and_id(tmp_path):
    rows = default_rows(3, "test")
    rows[2]["label"] = "clas1"
    root = make_task(tmp_path / "t", rows={"test": rows}, meta={"classes": ["class0", "class1"]})
    with pytest.raises(DataError) as err:
        Task.load(root).check("test")
    message = str(err.value)
    assert message.startswith(f"{root / 'test.jsonl'}:3: label 'clas1' of id 'test-2' is not one of the task's classes")
    assert "class0, class1" in message and "\n" not in message


@pytest.mark.parametrize("meta, problem", [
    ({"classes": "class0"}, "classes must be a non-empty list"),
    ({"classes": []}, "classes must be a non-empty list"),
    ({"classes": ["a", ""]}, "classes must be a non-empty list"),
    ({"classes": ["a", True]}, "classes must be a non-empty list"),
    ({"classes": ["a", "b", "a"]}, "classes names 'a' more than once"),
    ({"classes": ["a"], "templates": ["a photo"]}, "templates must be a non-empty list of prompts"),
    ({"classes": ["a"], "templates": ["{} and {}"]}, "templates must be a non-empty list of prompts"),
    ({"templates": ["a {}."]}, "templates given without classes"),
])
def test_bad_classes_or_templates_are_refused_at_load(tmp_path, meta, problem):
    root = make_task(tmp_path / "t", meta=meta)
    with pytest.raises(DataError, match=re.escape(f"{root / 'task.yaml'}: {problem}")):
        Task.load(root)


def test_images_checked_and_hashed_on_threads_give_what_one_loop_gives(tmp_path, monkeypatch):
    """Past 2 × threads rows the images are opened, verified and hashed on a pool (a task on object storage; forced
    here on a local one): the rows kept, the digest and the first bad row reported (in row order, not in the order
    the threads finish) are those of one loop."""
    from clipstream.training.data import task as task_module

    monkeypatch.setattr(task_module, "LOCAL_THREADS", 4)
    root = make_task(tmp_path / "t", {"train": default_rows(60), "test": default_rows(2, "test")})
    threaded = Task.load(root)
    rows, digest = [r["id"] for r in threaded.check("train").rows], threaded.data_sha()
    monkeypatch.setattr(task_module, "LOCAL_THREADS", 1)  # one loop
    assert [r["id"] for r in Task.load(root).check("train").rows] == rows and len(rows) == 60
    assert Task.load(root).data_sha() == digest
    monkeypatch.setattr(task_module, "LOCAL_THREADS", 4)
    for k in (41, 17):  # two corrupt images: the earlier row is the one reported
        (root / f"images/train/{k}.png").write_bytes(b"not a png")
    raises([f"{root / 'train.jsonl'}:18: corrupt image"], Task.load(root).check, "train")
    skipped = Task.load(root).check("train", "skip")
    assert len(skipped.rows) == 58 and skipped.skipped_ids == {"train-17", "train-41"}


def test_images_outside_the_task_only_under_roots_the_user_allows(tmp_path, monkeypatch):
    """A row may name an image by absolute path or URI only under a root in CLIPSTREAM_IMAGE_ROOTS (none by default):
    a dataset kept where it is, a link in it that points out still refused, a neighbour with a common prefix too."""
    monkeypatch.delenv("CLIPSTREAM_IMAGE_ROOTS", raising=False)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "a.png").write_bytes(png_bytes(0))
    (tmp_path / "dataset2").mkdir()
    (tmp_path / "dataset2" / "b.png").write_bytes(png_bytes(1))
    (tmp_path / "secret.png").write_bytes(png_bytes(2))
    (dataset / "link.png").symlink_to(tmp_path / "secret.png")
    rows = [{"id": "r0", "image": str(dataset / "a.png"), "caption": "outside"},
            {"id": "r1", "image": f"file://{dataset}/a.png", "caption": "by URI"}]
    root = make_task(tmp_path / "t", {"train": rows, "test": default_rows(2, "test")})
    raises(["image path", "it is absolute", "allow the folder it is in with CLIPSTREAM_IMAGE_ROOTS"],
           Task.load(root).check, "train")

    monkeypatch.setenv("CLIPSTREAM_IMAGE_ROOTS", json.dumps([str(dataset), f"file://{dataset}"]))
    task = Task.load(root)
    assert [r["id"] for r in task.check("train").rows] == ["r0", "r1"]
    assert task.image(rows[0]) == dataset / "a.png" and task.image(rows[1]) == png_bytes(0)
    for image in (str(dataset / "link.png"), str(tmp_path / "dataset2" / "b.png"),
                  f"file://{dataset}/../secret.png"):
        make_task(root, {"train": [{"id": "x", "image": image, "caption": "out"}], "test": default_rows(2, "test")})
        raises(["image path", "leaves the task directory"], Task.load(root).check, "train")


def test_check_then_data_sha_read_each_image_once(tmp_path, monkeypatch):
    """A job's driver checks a task and hashes it: each image file is opened once for both, and the hash is the one a
    fresh read of everything gives."""
    root = make_task(tmp_path / "t", {"train": default_rows(4), "test": default_rows(2, "test")})
    import builtins

    opened, real_open, real_os_open = [], io.open, os.open

    def counting_open(file, *args, **kwargs):  # pathlib's reads and PIL's opens alike (not a file descriptor's)
        if not isinstance(file, int):
            opened.append(Path(str(file)).name)
        return real_open(file, *args, **kwargs)

    def counting_os_open(file, *args, **kwargs):  # a local task's plain paths (opened without following symlinks)
        opened.append(Path(str(file)).name)
        return real_os_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(os, "open", counting_os_open)
    task = Task.load(root)
    task.check("train")
    task.check("test")
    first = task.data_sha()
    monkeypatch.undo()
    assert sorted(r for r in opened if r.endswith(".png")) == sorted(Path(r["image"]).name for r in
                                                                     default_rows(4) + default_rows(2, "test"))
    assert first == Task.load(root).data_sha()


def test_one_symlinked_folder_among_many_checked_is_still_refused(tmp_path):
    """The folders a check resolves are remembered; a path through a folder that leads out is still refused when
    paths through an honest sibling folder were checked before it."""
    rows = [dict(r, image=f"images/{'in' if k < 3 else 'out'}/{k}.png") for k, r in enumerate(default_rows(5))]
    root = make_task(tmp_path / "t", {"train": rows})
    (root / "images/out").rename(tmp_path / "elsewhere")
    (root / "images/out").symlink_to(tmp_path / "elsewhere")
    raises([f"{root / 'train.jsonl'}:4: image path 'images/out/3.png' leaves the task directory", "symlink"],
           Task.load(root).check, "train")
