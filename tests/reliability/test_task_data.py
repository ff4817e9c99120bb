"""Task data cannot reach out of its directory or crash the command: every bad input to `clipstream data check`
is one line on stderr naming the file and row, exit 2, and the task directory is left as it was (issue 14,
reliability and security)."""

import hashlib
import io
import json
import os
import struct
import zlib
from pathlib import Path

import pytest
import yaml
from PIL import Image

from clipstream.cli import main


def png(size: int = 8, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG header declaring width x height pixels over a one-row body: a decompression bomb as the
    decoder first sees it, a few hundred bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1)))
            + chunk(b"IEND", b""))


def make_task(root: Path, fmt: str = "jsonl") -> Path:
    """A small valid task: three train rows, their PNGs under images/, the split file and task.yaml."""
    rows = [{"id": f"r{k}", "image": f"images/{k}.png", "caption": f"a picture number {k}"} for k in range(3)]
    (root / "images").mkdir(parents=True)
    for k, row in enumerate(rows):
        (root / row["image"]).write_bytes(png(colour=(60 * k, 30, 30)))
    # and a test split of its own files (what a test here breaks is in train)
    tests = [{"id": f"t{k}", "image": f"test-images/{k}.png", "caption": f"a test picture {k}"} for k in range(2)]
    (root / "test-images").mkdir()
    for k, row in enumerate(tests):
        (root / row["image"]).write_bytes(png(colour=(30, 60 * k, 30)))
    for split, split_rows in (("train", rows), ("test", tests)):
        if fmt == "jsonl":
            (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
        else:
            (root / f"{split}.csv").write_text("id,image,caption\n" + "".join(
                f"{r['id']},{r['image']},{r['caption']}\n" for r in split_rows))
    (root / "task.yaml").write_text(yaml.safe_dump({"name": "t", "kind": "domain",
                                                    "splits": {"train": f"train.{fmt}", "test": f"test.{fmt}"}}))
    return root


def set_row(root: Path, line: int, **changes) -> None:
    """Change fields of the row on `line` (1-based) of train.jsonl."""
    lines = (root / "train.jsonl").read_text().splitlines()
    lines[line - 1] = json.dumps({**json.loads(lines[line - 1]), **changes})
    (root / "train.jsonl").write_text("\n".join(lines) + "\n")


def snapshot(root: Path) -> dict:
    """Every entry under root: a file's sha256, a symlink's target (not followed), a folder."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def check(capsys, root: Path, code: int = 2) -> str:
    """`clipstream data check --task root` as a user runs it: the exit code, and the one stderr line."""
    before = snapshot(root)
    assert main(["data", "check", "--task", str(root)]) == code
    err = capsys.readouterr().err
    assert snapshot(root) == before, "data check changed the task directory"
    if code == 0:
        assert err == ""
        return ""
    assert "Traceback" not in err and err.startswith("clipstream: error: ") and err.count("\n") == 1, err
    return err.strip()


# Each case: (name, how to break a fresh task at root (given tmp_path), the parts its error line must hold).
# {root} in a part is the task directory.
def _outside(root: Path) -> Path:
    (root.parent / "outside.png").write_bytes(png())
    return root.parent / "outside.png"


def _symlink_file(root, tmp_path):
    (root / "images/1.png").unlink()
    (root / "images/1.png").symlink_to(_outside(root))


def _symlink_folder(root, tmp_path):
    (root / "images").rename(tmp_path / "elsewhere")
    (root / "images").symlink_to(tmp_path / "elsewhere")


def _manifest(text: str):
    return lambda root, tmp_path: (root / "task.yaml").write_text(text)


def _image_bytes(data: bytes):
    return lambda root, tmp_path: (root / "images/1.png").write_bytes(data)


def _jsonl_bytes(old: bytes, new: bytes):
    def edit(root, tmp_path):
        (root / "train.jsonl").write_bytes((root / "train.jsonl").read_bytes().replace(old, new))
    return edit


_PNG = png(64, (10, 200, 10))
_LEAVES = "leaves the task directory {root}"
CASES = [
    ("dotdot path", lambda root, _: (_outside(root), set_row(root, 2, image="../outside.png")),
     ["{root}/train.jsonl:2: image path '../outside.png'", _LEAVES, "'..' climbs out of it"]),
    ("absolute path", lambda root, _: set_row(root, 2, image=str(_outside(root))),
     ["{root}/train.jsonl:2: image path '/", _LEAVES, "it is absolute"]),
    ("symlink out", _symlink_file, ["{root}/train.jsonl:2: image path 'images/1.png'", _LEAVES, "symlink"]),
    ("symlinked folder out", _symlink_folder, ["{root}/train.jsonl:1: image path 'images/0.png'", _LEAVES, "symlink"]),
    ("glob out", _manifest("name: t\nsplits: {train: ../other/*.jsonl}\n"),
     ["{root}/task.yaml: split 'train': pattern '../other/*.jsonl'", _LEAVES]),
    ("absolute glob", _manifest("name: t\nsplits: {train: /etc/*.conf}\n"),
     ["{root}/task.yaml: split 'train': pattern '/etc/*.conf'", _LEAVES, "absolute"]),
    ("name with slash", _manifest("name: a/b\nsplits: {train: train.jsonl}\n"),
     ["{root}/task.yaml: task name 'a/b' is not allowed", "letters, digits"]),
    ("name with dotdot", _manifest("name: ..\nsplits: {train: train.jsonl}\n"),
     ["{root}/task.yaml: task name '..' is not allowed", "without '..'"]),
    ("non-UTF-8 JSONL row", _jsonl_bytes(b"number 2", b"num\xe9ro 2"),
     ["{root}/train.jsonl:3: not valid UTF-8", "0xe9"]),
    ("NUL in a caption", lambda root, _: set_row(root, 2, caption="a red\x00cup"),
     ["{root}/train.jsonl:2: caption of id 'r1'", "U+0000", "control character"]),
    ("not YAML", _manifest("name: t\nsplits: {train: [unclosed\n"), ["{root}/task.yaml:", "not valid YAML"]),
    ("a list, not a mapping", _manifest("- name\n- splits\n"), ["{root}/task.yaml: expected a mapping, got list"]),
    ("no name", _manifest("splits: {train: train.jsonl}\n"), ["{root}/task.yaml: missing required key 'name'"]),
    ("duplicate ids", lambda root, _: set_row(root, 3, id="r0"),
     ["{root}/train.jsonl:3: duplicate id 'r0'", "first at {root}/train.jsonl:1"]),
    ("zero-byte image", _image_bytes(b""), ["{root}/train.jsonl:2: corrupt image images/1.png", "cannot identify"]),
    ("truncated PNG", _image_bytes(_PNG[: len(_PNG) // 2]),
     ["{root}/train.jsonl:2: corrupt image images/1.png", "runcated"]),
    ("decompression bomb", _image_bytes(png_declaring(20000, 20000)),
     ["{root}/train.jsonl:2: image images/1.png too large", "400,000,000 pixels", "downscale"]),
    ("PIL-warning-sized image", _image_bytes(png_declaring(10000, 10000)),
     ["{root}/train.jsonl:2: image images/1.png too large", "100,000,000 pixels"]),
    ("text named .png", _image_bytes(b"hello, I am not a picture\n"),
     ["{root}/train.jsonl:2: corrupt image images/1.png", "cannot identify"]),
]


@pytest.mark.parametrize("name, breaks, parts", CASES, ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_error_line_naming_where(tmp_path, capsys, name, breaks, parts):
    root = make_task(tmp_path / "t")
    assert check(capsys, root, 0) == ""  # valid before the change
    capsys.readouterr()
    breaks(root, tmp_path)
    err = check(capsys, root)
    for part in parts:
        assert part.format(root=root) in err, f"{part.format(root=root)!r} not in {err!r}"


def test_a_non_utf8_csv_row_names_its_line(tmp_path, capsys):
    root = make_task(tmp_path / "c", fmt="csv")
    (root / "train.csv").write_bytes((root / "train.csv").read_bytes().replace(b"number 1", b"num\xff 1"))
    err = check(capsys, root)
    assert f"{root}/train.csv:3: not valid UTF-8" in err and "0xff" in err


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_symlink_out_says_the_same_whether_or_not_its_target_exists(tmp_path, capsys, policy):
    """No existence oracle: the answer for a link to an outside file is decided before looking at the file."""
    root = make_task(tmp_path / "t")
    _symlink_file(root, tmp_path)
    argv = ["data", "check", "--task", str(root), "--on-bad-image", policy]
    assert main(argv) == 2
    exists = capsys.readouterr().err
    (root.parent / "outside.png").unlink()
    assert main(argv) == 2
    assert capsys.readouterr().err == exists
    (root / "images/1.png").unlink()
    (root / "images/1.png").symlink_to("/nonexistent/dir/x.png")
    assert main(argv) == 2
    assert capsys.readouterr().err == exists  # a link into a folder that is not there either
    assert "Traceback" not in exists and "symlink" in exists and exists.count("\n") == 1


def test_a_one_pixel_image_is_valid_input(tmp_path, capsys):
    root = make_task(tmp_path / "t")
    (root / "images/1.png").write_bytes(png(1))
    check(capsys, root, 0)
    assert main(["data", "check", "--task", str(root)]) == 0
    assert capsys.readouterr().out == "t test: 2 rows ok, 0 skipped\nt train: 3 rows ok, 0 skipped\n"


def test_under_skip_bad_images_are_skipped_but_paths_out_are_not(tmp_path, capsys):
    root = make_task(tmp_path / "t")
    (root / "images/1.png").write_bytes(png_declaring(20000, 20000))
    assert main(["data", "check", "--task", str(root), "--on-bad-image", "skip"]) == 0
    out = capsys.readouterr().out
    assert "t train: 2 rows ok, 1 skipped" in out and f"{root}/train.jsonl:2: image images/1.png too large" in out
    set_row(root, 3, image="../outside.png")
    assert main(["data", "check", "--task", str(root), "--on-bad-image", "skip"]) == 2
    assert "leaves the task directory" in capsys.readouterr().err
