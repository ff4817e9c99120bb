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

from clipstream.training.data.synth import (
    COLOURS,
    DIGIT_NAMES,
    DIGIT_PROMPTS,
    DOMAINS,
    HELD_OUT,
    HELD_OUT_DIGITS,
    P9D_SHARES,
    POSITIONS,
    TEMPLATES,
    _digits_split,
    _held_out_digit_indices,
    held_out_task,
    held_out_tasks,
    synthesize,
    synthesize_languages,
)
from clipstream.training.data.task import Task

SMALL = {"tasks": 2, "train_pairs": 200, "test_per_task": 16, "image_size": 16, "progress": False}
LANG_SMALL = {"train_pairs": 60, "test_per_task": 8, "image_size": 16, "progress": False}


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


def _meta(tdir: Path) -> dict:
    return yaml.safe_load((tdir / "task.yaml").read_text())


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
    assert "264/264" in capsys.readouterr().err  # 200 train + 2 x 16 test + 16 held-out test + 16 held-out digits
    synthesize_languages(tmp_path / "langs", 2, **LANG_SMALL)
    assert capsys.readouterr().err == ""
    synthesize_languages(tmp_path / "langs-loud", 2, **{**LANG_SMALL, "progress": True})
    assert "136/136" in capsys.readouterr().err  # 2 languages x (60 train + 8 test)


# The held-out zero-shot task.

def test_held_out_task_is_a_test_only_domain_outside_the_stream(bench):
    out = bench[0].parent
    tdir = held_out_task(out)
    assert tdir == out / f"zero-shot-{HELD_OUT[0]}" and tdir not in bench
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in bench), tdir.name, HELD_OUT_DIGITS])
    assert held_out_tasks(out) == [tdir, out / HELD_OUT_DIGITS]
    meta = _meta(tdir)
    assert meta["kind"] == "domain" and meta["held_out"] is True and "index" not in meta
    assert "zero-shot" in meta["description"].lower() and "no version trains on it" in meta["description"]
    assert meta["splits"] == {"test": "test.jsonl"} and meta["classes"] == list(HELD_OUT[1])
    assert sorted(p.name for p in tdir.iterdir()) == ["images", "task.yaml", "test.jsonl"]
    assert [p.name for p in (tdir / "images").iterdir()] == ["test"]
    task = Task.load(tdir)
    assert task.kind == "domain" and task.index is None and task.meta["held_out"] is True
    rows = task.check("test").rows
    assert len(rows) == 64 and {r["label"] for r in rows} == set(HELD_OUT[1])  # test_per_task pairs, every class

    stream_rows = [r for t in bench for split in ("train", "test") for r in _rows(t, split)]
    assert not set(HELD_OUT[1]) & {c for t in bench for c in _meta(t)["classes"]}
    assert not set(HELD_OUT[1]) & _words(stream_rows), "a held-out class word is in the stream's captions"
    assert _words(rows) - set(HELD_OUT[1]) <= _words(stream_rows)  # every other word is one the stream teaches
    assert HELD_OUT[0] not in DOMAINS
    held_out_pixels = np.stack([np.asarray(Image.open(tdir / r["image"]), float).mean((0, 1)) for r in rows])
    for t in bench[:4]:  # its own style: another background tint than any stream domain
        pixels = np.stack([np.asarray(Image.open(t / r["image"]), float).mean((0, 1)) for r in _rows(t, "test")])
        assert np.abs(np.median(held_out_pixels, 0) - np.median(pixels, 0)).max() > 3


def test_held_out_classes_stay_disjoint_when_the_stream_wraps_the_domains(tmp_path):
    """tasks >= 10 reuse DOMAINS with suffixes; the held-out task is the same whatever the stream's length."""
    kw = {"seed": 2, "test_per_task": 8, "image_size": 16, "digits": False, "progress": False}
    long = synthesize(tmp_path / "long", tasks=10, train_pairs=1320, **kw)
    synthesize(tmp_path / "short", tasks=1, train_pairs=60, **kw)
    assert [p.name for p in long][-1] == "task-09-household2"
    stream_classes = {c for t in long for c in _meta(t)["classes"]}
    assert len(stream_classes) == sum(map(len, DOMAINS.values())) + len(DOMAINS["household"])
    assert not set(_meta(held_out_task(tmp_path / "long"))["classes"]) & stream_classes
    assert not set(HELD_OUT[1]) & {c for classes in DOMAINS.values() for c in classes}
    assert not any(c[-1].isdigit() for c in HELD_OUT[1])  # so no suffixed stream class can equal one
    assert _tree_hash(held_out_task(tmp_path / "long")) == _tree_hash(held_out_task(tmp_path / "short"))
    assert Task.load(held_out_task(tmp_path / "short")).check("test").rows


def test_held_out_false_writes_none(tmp_path):
    dirs = synthesize(tmp_path / "out", held_out=False, **SMALL)
    assert held_out_task(tmp_path / "out") is None and held_out_tasks(tmp_path / "out") == []
    assert sorted((tmp_path / "out").iterdir()) == dirs


# Languages as tasks: the same images captioned in K languages.

def _tokens(caption: str) -> list[str]:
    return re.findall(r"\w+|,", caption)


def _word_map(rows) -> tuple[dict, bool]:
    """The English -> language word map that a language's rows imply, and whether it reverses the word order;
    fails unless one reading (forward or reversed) maps every English word to one word in every row."""
    for reverse in (False, True):
        mapping = {}
        for r in rows:
            en, said = _tokens(r["caption_en"]), _tokens(r["caption"])
            if len(en) != len(said):
                break
            if any(mapping.setdefault(a, b) != b for a, b in zip(en, said[::-1] if reverse else said)):
                break
        else:
            return mapping, reverse
    pytest.fail(f"{rows[0]['lang']}: no word-for-word reading of {rows[0]['caption']!r}")


@pytest.fixture(scope="module")
def langs(tmp_path_factory) -> list[Path]:
    return synthesize_languages(tmp_path_factory.mktemp("langs") / "out", 6, seed=1, **LANG_SMALL)


def _all_rows(tdir: Path) -> list[dict]:
    return _rows(tdir, "train") + _rows(tdir, "test")


def test_language_tasks_layout_and_rows(langs):
    codes = ["en", "xa", "xb", "xc", "xd", "xe"]
    assert [p.name for p in langs] == [f"task-{i:02d}-lang-{c}" for i, c in enumerate(codes)]
    assert sorted(p.name for p in langs[0].parent.iterdir()) == [p.name for p in langs]  # no held-out task here
    for i, (tdir, code) in enumerate(zip(langs, codes)):
        meta = _meta(tdir)
        assert meta["kind"] == "language" and meta["lang"] == code and meta["index"] == i and meta["description"]
        assert meta["splits"] == {"train": "train.jsonl", "test": "test.jsonl"}
        assert meta["classes"] == list(DOMAINS["household"])
        task = Task.load(tdir)
        assert task.kind == "language" and task.index == i
        assert len(task.check("train").rows) == 60 and len(task.check("test").rows) == 8
        for split in ("train", "test"):
            for r in _rows(tdir, split):
                assert list(r) == ["id", "image", "caption", "caption_en", "lang", "label"]
                assert r["id"].startswith(f"{tdir.name}-{split}-") and r["image"].startswith(f"images/{split}/")
                assert r["lang"] == code and r["label"] in meta["classes"]
                assert re.search(rf"\b{r['label']}\b", r["caption_en"])
                assert (tdir / r["image"]).resolve().is_relative_to(tdir.resolve())


def test_every_language_shows_the_same_images(langs):
    for split in ("train", "test"):
        rows = [_rows(t, split) for t in langs]
        for k in range(len(rows[0])):
            same = [r[k] for r in rows]
            assert len({r["id"].removeprefix(t.name) for r, t in zip(same, langs)}) == 1
            assert len({(t / r["image"]).read_bytes() for r, t in zip(same, langs)}) == 1
            assert len({(r["caption_en"], r["label"]) for r in same}) == 1
            assert len({r["caption"] for r in same}) == len(langs), "two languages caption an image alike"


def test_english_is_the_caption_grammar_verbatim(langs):
    word = "[a-z ]+"  # the templates have no other regex syntax
    patterns = [re.compile(t.format(size=word, colour=word, obj=word, pos=word, bg=word) + "$") for t in TEMPLATES]
    for r in _all_rows(langs[0]):
        assert r["caption"] == r["caption_en"]
        assert any(p.match(r["caption"]) for p in patterns), r["caption"]
    mapping, reverse = _word_map(_all_rows(langs[0]))
    assert not reverse and all(a == b for a, b in mapping.items())


def test_word_maps_are_bijections_with_shared_loanwords_and_some_reversed_order(langs):
    maps = [_word_map(_all_rows(t)) for t in langs]
    english = set(maps[0][0])
    grammar = {w for t in TEMPLATES for w in re.findall(r"\w+", re.sub(r"\{\w+\}", "", t))}
    content = english - grammar - {","}
    loans = []
    for tdir, (mapping, reverse) in zip(langs[1:], maps[1:]):
        assert set(mapping) == english  # the rows use every word, so the whole map is checked
        assert len(set(mapping.values())) == len(mapping), f"{tdir.name}: two English words, one word"
        assert all(mapping[w] != w for w in grammar), "function words map too"
        kept = {w for w, said in mapping.items() if said == w} - {","}
        assert kept <= content and not {mapping[w] for w in english - kept - {","}} & english  # no false friends
        assert _meta(tdir)["metadata"]["word_order"] == ("reversed" if reverse else "forward")
        loans.append(kept)
    assert all(kept == loans[0] for kept in loans), "loanwords are spelled alike in every language"
    assert 0.1 <= len(loans[0]) / len(content) <= 0.2
    assert any(reverse for _, reverse in maps) and not all(reverse for _, reverse in maps[1:])


def _pieces(words) -> set[str]:
    return {w[i:i + n] for w in words for n in (2, 3) for i in range(len(w) - n + 1)}


def test_languages_of_one_script_share_subword_pieces_others_only_loanwords(langs):
    maps = [_word_map(_all_rows(t))[0] for t in langs[1:]]
    scripts = [_meta(t)["metadata"]["script"] for t in langs[1:]]
    own = [{said for w, said in m.items() if said != w} for m in maps]  # the pseudo-words
    assert len(set(scripts)) >= 2 and any(scripts.count(s) >= 2 for s in scripts)
    assert any(re.search(r"[^\x00-\x7f]", "".join(words)) for words in own)  # a script of accented letters
    for i in range(len(maps)):
        for j in range(i + 1, len(maps)):
            shared = _pieces(own[i]) & _pieces(own[j])
            if scripts[i] == scripts[j]:
                assert shared and own[i] != own[j]
            else:
                assert not shared and not set("".join(own[i])) & set("".join(own[j]))


def test_languages_are_deterministic_and_seeded(tmp_path, langs):
    """The same seed gives the same files (the first K languages of a longer run too); another seed, other maps."""
    again = synthesize_languages(tmp_path / "again", 3, seed=1, **LANG_SMALL)
    assert [p.name for p in again] == [p.name for p in langs[:3]]
    assert [_tree_hash(p) for p in again] == [_tree_hash(p) for p in langs[:3]]
    other = synthesize_languages(tmp_path / "other", 3, seed=2, **LANG_SMALL)
    for a, b in zip(langs[1:3], other[1:]):
        assert (a / "train.jsonl").read_bytes() != (b / "train.jsonl").read_bytes()
        ma, mb = _word_map(_all_rows(a))[0], _word_map(_all_rows(b))[0]
        assert sum(ma[w] != mb[w] for w in ma) > len(ma) / 2


@pytest.mark.parametrize("kwargs, match", [
    ({"languages": 0}, "languages"),
    ({"languages": 28}, "languages"),
    ({"languages": 2, "train_pairs": 10}, "train_pairs"),
    ({"languages": 2, "test_per_task": 0}, "test_per_task"),
    ({"languages": 2, "image_size": 8}, "image_size"),
])
def test_bad_language_arguments_raise(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        synthesize_languages(tmp_path / "out", **{**LANG_SMALL, **kwargs})
    assert not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("precious")
    with pytest.raises(ValueError, match="non-empty"):
        synthesize_languages(tmp_path / "full", 2, **LANG_SMALL)


def test_held_out_digits_are_labelled_balanced_and_none_of_the_streams_digit_images(bench):
    out = bench[0].parent
    tdir = out / HELD_OUT_DIGITS
    task = Task.load(tdir)
    assert task.meta["held_out"] is True and task.classes == list(DIGIT_NAMES) and task.templates == list(DIGIT_PROMPTS)
    rows = task.check("test").rows  # every label is one of its classes
    assert len(rows) == 64 and Counter(r["label"] for r in rows) == Counter({d: 7 if d in DIGIT_NAMES[:4] else 6
                                                                          for d in DIGIT_NAMES})
    assert all(f"digit {r['label']} " in r["caption"] for r in rows)
    stream_digits = bench[-1]  # the stream's digits task: labelled, with the same class names
    assert _meta(stream_digits)["classes"] == list(DIGIT_NAMES)
    assert {r["label"] for split in ("train", "test") for r in _rows(stream_digits, split)} == set(DIGIT_NAMES)

    from sklearn.datasets import load_digits

    y = load_digits().target
    index, n_train = len(bench) - 1, len(_rows(stream_digits, "train"))
    train, test = _digits_split(y, np.random.default_rng([0, index]), n_train, 64)  # the stream's own split, seed 0
    assert [DIGIT_NAMES[y[i]] for i in test] == [r["label"] for r in _rows(stream_digits, "test")]
    held = _held_out_digit_indices(y, 64, 0, (index, n_train, 64))
    assert [DIGIT_NAMES[y[i]] for i in held] == [r["label"] for r in rows]  # the images the held-out set drew
    assert len(set(held)) == 64 and not set(held) & (set(train) | set(test))
    # a stream that takes nearly every digit image: the held-out set still never shares one, it only shrinks
    big = _held_out_digit_indices(y, 500, 0, (index, 1200, 500))
    train, test = _digits_split(y, np.random.default_rng([0, index]), 1200, 500)
    assert len(big) == len(y) - 1700 and not set(big) & (set(train) | set(test))
