"""Tests for the synthetic P9D-like benchmark generator (training/data/synth.py)."""
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from clipstream.training.data.synth import COLOURS, P9D_SHARES, POSITIONS, synthesize

SMALL = {"tasks": 2, "train_pairs": 200, "test_per_task": 16, "image_size": 16, "progress": False}


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def _rows(tdir: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (tdir / f"{split}.jsonl").read_text().splitlines()]


def _words(rows) -> set[str]:
    return {w for r in rows for w in re.findall(r"[a-z0-9]+", r["caption"])}


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> list[Path]:
    return synthesize(tmp_path_factory.mktemp("synth") / "bench", progress=False)  # defaults: 4 tasks + digits


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = synthesize(tmp_path / "a", seed=3, **SMALL)
    b = synthesize(tmp_path / "b", seed=3, **SMALL)
    c = synthesize(tmp_path / "c", seed=4, **SMALL)
    assert [p.name for p in a] == [p.name for p in b] == [p.name for p in c]
    assert _tree_hash(tmp_path / "a") == _tree_hash(tmp_path / "b")
    assert _tree_hash(tmp_path / "a") != _tree_hash(tmp_path / "c")
    assert (a[0] / "train.jsonl").read_bytes() != (c[0] / "train.jsonl").read_bytes()


def test_layout_and_rows(bench):
    assert [p.name for p in bench] == ["task-00-household", "task-01-furnishing", "task-02-food",
                                       "task-03-beauty", "task-04-digits"]
    ids = []
    for i, tdir in enumerate(bench):
        meta = yaml.safe_load((tdir / "task.yaml").read_text())
        assert meta["name"] == tdir.name and meta["kind"] == "domain" and meta["index"] == i
        assert meta["description"] and meta["splits"] == {"train": "train.jsonl", "test": "test.jsonl"}
        assert 6 <= len(meta["classes"]) <= 10
        for split in ("train", "test"):
            rows = _rows(tdir, split)
            assert len({r["image"] for r in rows}) == len(rows)
            for r in rows:
                assert set(r) == {"id", "image", "caption", "label"}
                assert r["id"].startswith(f"{tdir.name}-{split}-") and r["image"].startswith(f"images/{split}/")
                assert r["label"] in meta["classes"]
                assert re.search(rf"\b{r['label']}\b", r["caption"])
                with Image.open(tdir / r["image"]) as im:
                    assert im.format == "PNG" and im.mode == "RGB" and im.size == (32, 32)
            ids += [r["id"] for r in rows]
    assert len(ids) == len(set(ids))


def test_task_sizes_follow_p9d_shares_and_classes_are_long_tailed(bench):
    sizes = [len(_rows(t, "train")) for t in bench]
    shares = np.array(P9D_SHARES[:4]) / sum(P9D_SHARES[:4])
    assert sum(sizes[:4]) == 2000
    np.testing.assert_allclose(np.array(sizes[:4]) / 2000, shares, atol=1e-3)
    assert sizes[4] == round(P9D_SHARES[4] / sum(P9D_SHARES[:4]) * 2000)
    assert all(len(_rows(t, "test")) == 64 for t in bench)

    largest = bench[int(np.argmax(sizes[:4]))]
    counts = sorted(Counter(r["label"] for r in _rows(largest, "train")).values(), reverse=True)
    meta = yaml.safe_load((largest / "task.yaml").read_text())
    assert len(counts) == len(meta["classes"])  # every class present
    assert counts[0] == counts[1]  # head plateau
    assert 4 <= counts[0] / counts[-1] <= 20  # decay to about 1/10


def test_vocabularies_disjoint_but_attribute_words_shared(bench):
    labels = [{r["label"] for r in _rows(t, "train") + _rows(t, "test")} for t in bench]
    words = [_words(_rows(t, "train")) for t in bench]
    for i in range(len(bench)):
        for j in range(len(bench)):
            if i != j:
                assert not labels[i] & labels[j]
                assert not labels[i] & words[j], "a class word leaks into another task's captions"
    for w in words:  # digits included: colours and backgrounds are shared words
        assert set(COLOURS) <= w and {"striped", "dotted", "checkered", "plain"} <= w
    for w in words[:4]:
        assert {"small", "large", "top", "bottom", "left", "right", "centre"} <= w


def test_captions_describe_the_drawing(bench):
    """The named colour is drawn, larger for 'large', in the named part of the image."""
    frac = {"small": [], "large": []}
    hits = total = 0
    for tdir in bench[:4]:
        for r in _rows(tdir, "test"):
            colour = next(c for c in COLOURS if re.search(rf"\b{c}\b", r["caption"]))
            size = "large" if " large " in r["caption"] else "small"
            pos = next(p for p in POSITIONS if f"in the {p}" in r["caption"])
            img = np.asarray(Image.open(tdir / r["image"]), dtype=float)
            mask = np.linalg.norm(img - np.array(COLOURS[colour]), axis=-1) < 60
            frac[size].append(mask.mean())
            total += 1
            if mask.mean() > 0.01:
                ys, xs = np.nonzero(mask)
                cy, cx = (ys.mean() + 0.5) / 32, (xs.mean() + 0.5) / 32
                hits += abs(cx - POSITIONS[pos][0]) < 0.15 and abs(cy - POSITIONS[pos][1]) < 0.15
    assert hits / total > 0.9
    assert np.mean(frac["large"]) > 1.8 * np.mean(frac["small"])


def test_test_split_is_fresh_and_captions_distinct(bench):
    for tdir in bench:
        train, test = _rows(tdir, "train"), _rows(tdir, "test")
        captions = [r["caption"] for r in test]
        assert len(set(captions)) >= 0.95 * len(captions)
        assert len(Counter(r["label"] for r in test)) == len(yaml.safe_load((tdir / "task.yaml").read_text())["classes"])
        train_bytes = {(tdir / r["image"]).read_bytes() for r in train}
        assert not any((tdir / r["image"]).read_bytes() in train_bytes for r in test)


def test_digits_task_has_real_digits(bench):
    """Every image is a coloured load_digits sample of its label; test samples are not train samples."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = x - x.mean(1, keepdims=True)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    digits = bench[-1]
    assert digits.name.endswith("-digits")
    matched = {}
    for split in ("train", "test"):
        rows = _rows(digits, split)
        assert {r["label"] for r in rows} == set(names)
        matched[split] = []
        for r in rows:
            colour = next(c for c in COLOURS if re.search(rf"\b{c}\b", r["caption"]))
            img = np.asarray(Image.open(digits / r["image"]), dtype=float)
            ink = 1 - np.linalg.norm(img - np.array(COLOURS[colour]), axis=-1) / 255  # ink in the named colour
            a = ink.reshape(8, 4, 8, 4).mean((1, 3)).ravel()  # back to 8x8
            corr = x @ ((a - a.mean()) / np.linalg.norm(a - a.mean()))
            k = int(corr.argmax())
            assert corr[k] > 0.85 and names[y[k]] == r["label"]
            matched[split].append(k)
    assert len(set(matched["test"])) == len(matched["test"])
    assert not set(matched["test"]) & set(matched["train"])


@pytest.mark.parametrize("kwargs, match", [
    ({"tasks": 0}, "tasks"),
    ({"image_size": 8}, "image_size"),
    ({"tasks": 4, "train_pairs": 300}, "train_pairs"),
    ({"test_per_task": 0}, "test_per_task"),
    ({"test_per_task": 1700}, "test_per_task"),
])
def test_bad_arguments_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthesize(tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_refuses_non_empty_out_but_accepts_empty_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match=re.escape(str(out))):
        synthesize(out, **SMALL)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(synthesize(empty, **SMALL)) == 3


def test_progress_bar_counts_pairs(tmp_path, capsys):
    synthesize(tmp_path / "quiet", digits=False, **SMALL)
    assert capsys.readouterr().err == ""
    synthesize(tmp_path / "loud", digits=False, **{**SMALL, "progress": True})
    assert "232/232" in capsys.readouterr().err  # 200 train + 2 x 16 test
