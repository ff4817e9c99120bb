"""Deterministic synthetic continual-learning benchmark (a CPU stand-in for P9D).

Why: CTP's P9D stream (Zhu et al., ICCV 2023, arXiv:2308.07146) is a sequence of product domains with disjoint object
vocabularies whose images and captions still share attributes and words. That regime is what lets
knowledge transfer between tasks and be forgotten: a probe with fully disjoint tasks forgot under every
method, and distillation only helps when new data still says something about old tasks. Here every domain task
draws its own figure classes in its own visual style, while colour, size, position and background
words are the same in all tasks. Task sizes follow the P9D shares, and class counts are long-tailed
(a plateau, then a decay to about 1/10). A last task of real handwritten digits (scikit-learn's
bundled `load_digits`) adds a shift of image distribution that keeps the colour and background
words. Beside the stream, a held-out domain with its own style and classes (only a test split) measures
zero-shot transfer: no version trains on it, yet its attribute words are the ones the stream teaches; and a
held-out digits set (digit images the stream never sees) measures zero-shot classification of the digit classes.

`synthesize_languages` writes the other kind of stream: the same images captioned in K synthetic
languages, each a word-for-word remapping of the English caption grammar, so what changes from task to
task is the text side only.
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from functools import cache
from itertools import product
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageDraw

from clipstream import console

P9D_SHARES = (0.217, 0.233, 0.040, 0.037, 0.067, 0.085, 0.090, 0.098, 0.132)  # task-size shares of P9D (CTP's dataset table)

DOMAINS = {
    "household": ("cup", "lamp", "broom", "bucket", "kettle", "clock", "candle", "vase"),
    "furnishing": ("chair", "sofa", "table", "shelf", "bed", "mirror", "rug", "stool", "wardrobe"),
    "food": ("apple", "bread", "cheese", "carrot", "pizza", "cake", "egg"),
    "beauty": ("lipstick", "perfume", "comb", "lotion", "mascara", "soap", "razor"),
    "clothing": ("shirt", "hat", "shoe", "sock", "scarf", "glove", "dress", "jacket", "belt", "coat"),
    "auto": ("tyre", "wrench", "wiper", "battery", "headlight", "jack", "horn", "seatbelt"),
    "parenting": ("bottle", "rattle", "pacifier", "crib", "stroller", "bib", "diaper", "teddy"),
    "outdoor": ("tent", "kayak", "compass", "lantern", "backpack", "axe", "rope", "canteen", "hammock"),
    "electronics": ("phone", "laptop", "camera", "speaker", "headphones", "keyboard", "mouse", "router"),
}
# The zero-shot domain: a style and classes that are in no stream (not in DOMAINS, no suffixed copy either).
HELD_OUT = ("toys", ("kite", "yoyo", "drum", "puzzle", "robot", "doll", "ball", "whistle"))
_HELD_OUT_INDEX = 2**16  # its silhouettes' offset and random stream: past any stream, so `tasks` does not change it
# Shared attributes: the same words (and the same drawing) in every task.
COLOURS = {
    "red": (220, 40, 40), "orange": (240, 140, 20), "yellow": (235, 210, 30), "green": (40, 160, 60),
    "blue": (40, 80, 220), "purple": (140, 60, 190), "pink": (240, 110, 180), "black": (30, 30, 30),
}
SIZES = {"small": 0.22, "large": 0.38}  # half-extent of the figure, as a fraction of the image side
POSITIONS = {"top left": (0.3, 0.3), "top right": (0.7, 0.3), "centre": (0.5, 0.5),
             "bottom left": (0.3, 0.7), "bottom right": (0.7, 0.7)}
BACKGROUNDS = ("plain", "striped", "dotted", "checkered")
TEMPLATES = (
    "a {size} {colour} {obj} in the {pos} on a {bg} background",
    "a photo of a {size} {colour} {obj} in the {pos} on a {bg} background",
    "there is a {size} {colour} {obj} in the {pos}, on a {bg} background",
    "a {bg} background with a {size} {colour} {obj} in the {pos}",
)
DIGIT_TEMPLATES = (
    "a handwritten {colour} digit {obj} on a {bg} background",
    "a photo of a handwritten {colour} digit {obj} on a {bg} background",
)
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
HELD_OUT_DIGITS = "zero-shot-digits"
# Its prompts say what its captions say of a class ("a handwritten ... digit seven"), as open_clip's per-dataset templates
DIGIT_PROMPTS = ("a handwritten digit {}.", "a photo of a handwritten digit {}.", "the digit {}.")
MIN_TASK_PAIRS = 40
# The scripts of the synthetic languages: (consonants, vowels, syllables per word at most). They share no
# character, so two languages share subword pieces if they have one script, and across scripts only their
# loanwords. Letters are chosen for CLIP's BPE, which the models use with a 32-token context: an accented
# vowel here is one token (most non-ASCII letters, Cyrillic and Greek included, are two: captions of 80-100
# tokens), and a "diacritic" syllable is still two, hence its monosyllables: every caption fits.
SCRIPTS = {
    "latin": ("bdfgklmnprstvz", "aeiou", 2),
    "diacritic": ("chjqwxy", "áäéëíóöøúüàè", 1),
}
LANG_CODES = ("en", *(f"x{c}" for c in "abcdefghijklmnopqrstuvwxyz"))  # English, then private-use-like codes
LOANWORD_SHARE = 0.15  # of the content words (slot fillers), spelled as in English in every language
_DIGITS_TOTAL, _DIGITS_MAX_TEST = 1797, 1500  # load_digits size; every digit has >= 174 images
_SS = 2  # figures are drawn at _SS x the image size, then box-downsampled (anti-aliasing)


def _polygon(k: int, inner: float | None = None, phase: float = np.pi / 2) -> np.ndarray:
    """Regular k-gon (a star if `inner` is given) on the unit circle."""
    n = 2 * k if inner else k
    t = phase + np.arange(n) * 2 * np.pi / n
    r = np.where(np.arange(n) % 2, inner, 1.0) if inner else np.ones(n)
    return np.c_[r * np.cos(t), -r * np.sin(t)]


_ARC = np.linspace(0, np.pi, 17)
_BASES = (  # body silhouettes; class j of task i uses _BASES[(j + 3 i) % 10]
    _polygon(32), _polygon(3), _polygon(4, phase=np.pi / 4), _polygon(5), _polygon(6),
    _polygon(5, inner=0.45),
    np.array([(-.3, -1), (.3, -1), (.3, -.3), (1, -.3), (1, .3), (.3, .3), (.3, 1), (-.3, 1),
              (-.3, .3), (-1, .3), (-1, -.3), (-.3, -.3)]),  # plus
    np.array([(-.5, -1), (.5, -1), (1, 1), (-1, 1)]),  # trapezoid
    np.c_[np.cos(_ARC), 0.5 - 1.5 * np.sin(_ARC)],  # dome
    np.array([(-1, -1), (1, -1), (.2, 0), (1, 1), (-1, 1), (-.2, 0)]),  # hourglass
)


@cache
def _figure(label: str, base: int) -> tuple[tuple[str, np.ndarray], ...]:
    """A class's fixed figure: a body plus 1-2 accessories, seeded by its name, within the unit square."""
    rng = np.random.default_rng(zlib.crc32(label.encode()))
    parts = [("fill", _BASES[base] * rng.permutation([1.0, rng.uniform(0.6, 1.0)]))]  # random aspect
    for kind in sorted(rng.choice(5, size=rng.integers(1, 3), replace=False)):
        a = rng.uniform(0, 2 * np.pi)
        d = np.array([np.cos(a), np.sin(a)])
        if kind == 0:  # handle
            parts.append(("line", np.array([0.5 * d, 1.3 * d])))
        elif kind == 1:  # loop
            parts.append(("line", d + 0.35 * _polygon(12)[[*range(12), 0]]))
        elif kind == 2:  # knob
            parts.append(("dark", 0.9 * d + 0.25 * _polygon(12)))
        elif kind == 3:  # band across the body
            y = rng.uniform(-0.4, 0.4)
            parts.append(("line", np.array([(-0.7, y), (0.7, y)])))
        else:  # legs
            parts += [("line", np.array([(-s * 0.5, 0.8), (-s * 0.7, 1.3)])) for s in (1, -1)]
    extent = max(np.abs(p).max() for _, p in parts)
    return tuple((kind, p / extent) for kind, p in parts)


@cache
def _style(name: str) -> dict:
    """A task's fixed visual style: background tint, pattern geometry, stroke, noise, palette bias."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    tint = rng.uniform(190, 245, 3)
    return {"tint": tint, "pattern": tint * rng.uniform(0.7, 0.85),
            "angle": rng.choice([0, np.pi / 2, np.pi / 4, 3 * np.pi / 4]), "period": rng.uniform(5, 8),
            "stroke": rng.choice([1.0, 1.5, 2.0, 2.5]), "noise": rng.uniform(2, 6),
            "palette": (p := 1 + 3 * rng.dirichlet(np.ones(len(COLOURS)))) / p.sum()}


def _background(bg: str, style: dict, rng: np.random.Generator, w: int) -> np.ndarray:
    y, x = np.mgrid[0:w, 0:w] + rng.uniform(0, w, (2, 1, 1))  # random pattern phase
    p = style["period"] * w / 32
    if bg == "striped":
        mask = ((x * np.cos(style["angle"]) + y * np.sin(style["angle"])) / p) % 1 < 0.5
    elif bg == "dotted":
        mask = (x % p - p / 2) ** 2 + (y % p - p / 2) ** 2 < (p / 4) ** 2
    elif bg == "checkered":
        mask = (x // p + y // p) % 2 == 1
    else:
        mask = np.zeros((w, w), bool)
    return np.where(mask[..., None], style["pattern"], style["tint"])


def _finish(canvas: np.ndarray | Image.Image, style: dict, rng: np.random.Generator) -> Image.Image:
    """Downsample the supersampled canvas and add a little pixel noise."""
    img = canvas if isinstance(canvas, Image.Image) else Image.fromarray(canvas.astype(np.uint8))
    arr = np.asarray(img.reduce(_SS), dtype=np.float64)
    return Image.fromarray(np.clip(arr + rng.normal(0, style["noise"], arr.shape), 0, 255).astype(np.uint8))


def _draw(label: str, base: int, attrs: tuple, style: dict, rng: np.random.Generator, size: int) -> Image.Image:
    colour, size_word, pos, bg = attrs
    w = size * _SS
    img = Image.fromarray(_background(bg, style, rng, w).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    t = rng.uniform(-0.3, 0.3)
    rot = np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]]) * SIZES[size_word] * w * rng.uniform(0.9, 1.1)
    centre = (np.array(POSITIONS[pos]) + rng.uniform(-0.03, 0.03, 2)) * w
    ink = np.clip(np.array(COLOURS[colour]) + rng.integers(-12, 13, 3), 0, 255)
    fill, dark = tuple(int(c) for c in ink), tuple(int(c) for c in ink // 2)
    stroke = max(1, round(style["stroke"] * w / 32))
    for kind, pts in _figure(label, base):
        xy = [tuple(p) for p in (pts @ rot.T + centre).tolist()]
        if kind == "fill":
            draw.polygon(xy, fill=fill, outline=dark, width=max(1, stroke // 2))
        elif kind == "dark":
            draw.polygon(xy, fill=dark)
        else:
            draw.line(xy, fill=dark, width=stroke, joint="curve")
    return _finish(img, style, rng)


def _allocate(total: int, weights) -> np.ndarray:
    """Split `total` in proportion to `weights` (largest remainder)."""
    q = total * np.asarray(weights, float) / np.sum(weights)
    n = np.floor(q).astype(int)
    n[np.argsort(n - q, kind="stable")[: total - n.sum()]] += 1
    return n


def _long_tail(n_classes: int, total: int) -> np.ndarray:
    """Per-class counts: a plateau over the first ~40% of classes, then a decay to 1/10; at least 1 each."""
    k = np.arange(n_classes)
    plateau = max(1, round(0.4 * n_classes))
    w = np.where(k < plateau, 1.0, 0.1 ** ((k - plateau + 1) / max(1, n_classes - plateau)))
    return 1 + _allocate(total - n_classes, w)


def _attrs(rng: np.random.Generator, palette) -> tuple:
    """Random (colour, size, position, background) for a training pair; colours follow the task's palette bias."""
    return (list(COLOURS)[rng.choice(len(COLOURS), p=palette)], list(SIZES)[rng.integers(len(SIZES))],
            list(POSITIONS)[rng.integers(len(POSITIONS))], BACKGROUNDS[rng.integers(len(BACKGROUNDS))])


def _distinct(rng: np.random.Generator, combos: list, labels: list) -> list:
    """One attribute combination per test label, distinct within each label while there are enough."""
    per = {c: iter(rng.permutation(len(combos))) for c in sorted(set(labels))}
    out = []
    for c in labels:
        k = next(per[c], None)
        out.append(combos[k if k is not None else rng.integers(len(combos))])
    return out


def _domain_task(name: str, classes: tuple, index: int, n_train: int, n_test: int, seed: int, size: int):
    style = _style(name)
    bases = {c: (j + 3 * index) % len(_BASES) for j, c in enumerate(classes)}
    rng = np.random.default_rng([seed, index])
    order = [classes[j] for j in rng.permutation(len(classes))]  # which classes are head vs tail
    counts = _long_tail(len(classes), n_train) if n_train else ()  # n_train=0: a test-only task (the held-out one)
    train = [c for c, n in zip(order, counts) for _ in range(n)]
    train = [train[j] for j in rng.permutation(len(train))]
    test = [order[j % len(order)] for j in range(n_test)]
    combos = list(product(COLOURS, SIZES, POSITIONS, BACKGROUNDS))

    def pairs(labels, attrs):
        for c, a in zip(labels, attrs):
            caption = TEMPLATES[rng.integers(len(TEMPLATES))].format(
                size=a[1], colour=a[0], obj=c, pos=a[2], bg=a[3])
            yield _draw(c, bases[c], a, style, rng, size), caption, c

    return {"train": pairs(train, [_attrs(rng, style["palette"]) for _ in train]),
            "test": pairs(test, _distinct(rng, combos, test))}


def _digits_split(y: np.ndarray, rng: np.random.Generator, n_train: int, n_test: int) -> tuple[list, list]:
    """The digits task's (train, test) image indices: a balanced test split, train drawn from the rest."""
    by_label = [rng.permutation(np.flatnonzero(y == d)) for d in range(10)]
    test = [int(by_label[j % 10][j // 10]) for j in range(n_test)]
    train = rng.permutation(np.setdiff1d(np.arange(len(y)), test))[:n_train].tolist()
    return train, test


def _digit_pairs(x: np.ndarray, y: np.ndarray, idx, attrs, style: dict, rng: np.random.Generator, size: int):
    """(image, caption, class name) of the digit images `idx`, each in its (colour, background) of `attrs`."""
    w = size * _SS
    for i, (colour, bg) in zip(idx, attrs):
        glyph = Image.fromarray((x[i].reshape(8, 8) * 255 / 16).astype(np.uint8)).resize((w, w), Image.BILINEAR)
        alpha = np.asarray(glyph, dtype=np.float64)[..., None] / 255
        canvas = _background(bg, style, rng, w) * (1 - alpha) + np.array(COLOURS[colour]) * alpha
        name = DIGIT_NAMES[y[i]]
        caption = DIGIT_TEMPLATES[rng.integers(len(DIGIT_TEMPLATES))].format(colour=colour, obj=name, bg=bg)
        yield _finish(canvas, style, rng), caption, name


def _digits_task(index: int, n_train: int, n_test: int, seed: int, size: int):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    style = _style("digits")
    rng = np.random.default_rng([seed, index])
    train, test = _digits_split(y, rng, n_train, n_test)
    combos = list(product(COLOURS, BACKGROUNDS))
    train_attrs = [_attrs(rng, style["palette"]) for _ in train]
    return {"train": _digit_pairs(x, y, train, [(a[0], a[3]) for a in train_attrs], style, rng, size),
            "test": _digit_pairs(x, y, test, _distinct(rng, combos, [int(y[i]) for i in test]), style, rng, size)}


def _held_out_digit_indices(y: np.ndarray, n: int, seed: int, stream: tuple[int, int, int] | None) -> list[int]:
    """`n` digit images (fewer if fewer are left), classes in turn, that the stream's digits task (`stream` = its
    (index, n_train, n_test), None if the stream has none) neither trains nor tests on."""
    used: list = []
    if stream is not None:  # the stream's own split, drawn again as `_digits_task` draws it
        train, test = _digits_split(y, np.random.default_rng([seed, stream[0]]), stream[1], stream[2])
        used = train + test
    rng = np.random.default_rng([seed, _HELD_OUT_INDEX + 1])
    left = [rng.permutation(np.setdiff1d(np.flatnonzero(y == d), used)) for d in range(10)]
    return [int(c[k]) for k in range(max(map(len, left))) for c in left if k < len(c)][:n]


def _held_out_digits(n: int, seed: int, size: int, stream: tuple[int, int, int] | None) -> dict:
    """The held-out digits set (`_held_out_digit_indices`), drawn as the digits task draws its test split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    idx = _held_out_digit_indices(y, n, seed, stream)
    rng = np.random.default_rng([seed, _HELD_OUT_INDEX + 2])
    combos = list(product(COLOURS, BACKGROUNDS))
    return {"test": _digit_pairs(x, y, idx, _distinct(rng, combos, [int(y[i]) for i in idx]), _style("digits"), rng,
                                 size)}


@dataclass(frozen=True)
class _Language:
    code: str
    script: str
    reversed: bool  # word order
    words: dict[str, str]  # English word -> this language's word (a bijection)

    def say(self, caption_en: str) -> str:
        tokens = ["," if t == "," else self.words[t] for t in re.findall(r"\w+|,", caption_en)]
        return " ".join(tokens[::-1] if self.reversed else tokens).replace(" ,", ",")


def _languages(n: int, classes: tuple, seed: int) -> list[_Language]:
    """English and n - 1 remappings of its caption words: language i takes script i - 1 (cycling), languages
    2-3, 6-7, ... reverse the word order; pseudo-words are syllables from the language's own two thirds of its
    script's syllables, drawn with (seed, code), so two languages of one script share some but not all."""
    grammar = {w for t in TEMPLATES for w in re.findall(r"\w+", re.sub(r"\{\w+\}", "", t))}  # function words too
    content = sorted({*COLOURS, *SIZES, *(w for p in POSITIONS for w in p.split()), *BACKGROUNDS, *classes})
    vocab = sorted(grammar | set(content))
    rng = np.random.default_rng([seed, zlib.crc32(b"loanwords")])
    loans = {content[j] for j in rng.choice(len(content), round(LOANWORD_SHARE * len(content)), replace=False)}
    langs = [_Language("en", "latin", False, {w: w for w in vocab})]
    for i in range(1, n):
        code, script = LANG_CODES[i], list(SCRIPTS)[(i - 1) % len(SCRIPTS)]
        rng = np.random.default_rng([seed, zlib.crc32(code.encode())])
        consonants, vowels, longest = SCRIPTS[script]
        syllables = ["".join(cv) for cv in product(consonants, vowels)]
        own = [syllables[j] for j in rng.choice(len(syllables), 2 * len(syllables) // 3, replace=False)]
        words, taken = {}, set(vocab)  # no pseudo-word spells an English word (no false friends)
        for w in vocab:
            word = w
            while word in taken and w not in loans:
                word = "".join(own[j] for j in rng.integers(len(own), size=rng.integers(1, longest + 1)))
            words[w] = word
            taken.add(word)
        langs.append(_Language(code, script, i // 2 % 2 == 1, words))
    return langs


def _write_task(tdir: Path, meta: dict, splits: dict, bar, lang: _Language | None = None) -> None:
    """Write a task's manifest, images and rows; with `lang`, the pairs' English captions are said in it."""
    tdir.mkdir(parents=True)
    (tdir / "task.yaml").write_text(yaml.safe_dump(meta, sort_keys=False), encoding="utf-8")
    for split, pairs in splits.items():
        (tdir / "images" / split).mkdir(parents=True)
        with open(tdir / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for k, (img, caption, label) in enumerate(pairs):
                rel = f"images/{split}/{k:06d}.png"
                img.save(tdir / rel, format="PNG")
                row = {"id": f"{tdir.name}-{split}-{k:06d}", "image": rel, "caption": caption}
                if lang is not None:
                    row |= {"caption": lang.say(caption), "caption_en": caption, "lang": lang.code}
                f.write(json.dumps({**row, "label": label}, ensure_ascii=False) + "\n")
                bar.update()


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"refusing to write into non-empty {out}")


def synthesize(out: str | Path, tasks: int = 4, seed: int = 0, *, image_size: int = 32,
               train_pairs: int = 2000, test_per_task: int = 64, digits: bool = True, held_out: bool = True,
               progress: bool = True) -> list[Path]:
    """Write `tasks` domain tasks (+ the digits task if digits=True, as the LAST task) under `out`; return the task dirs in stream order.

    The domain tasks share `train_pairs` in the P9D shares; the digits task gets the next share at
    the same scale (capped by the images left after its test split). With held_out=True, the zero-shot
    tasks are written too, outside the stream: `test_per_task` test pairs of the HELD_OUT domain, and as many
    held-out digits (`zero-shot-digits`: images the stream's digits task neither trains nor tests on). They are
    not returned; `held_out_tasks(out)` finds them. Every row carries its class as `label`, every task.yaml the
    task's `classes` (zero-shot classification prompts them; the digits' with `templates` of their own).
    """
    out = Path(out)
    if tasks < 1:
        raise ValueError(f"tasks must be >= 1, got {tasks}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    if test_per_task < 1:
        raise ValueError(f"test_per_task must be >= 1, got {test_per_task}")
    if digits and test_per_task > _DIGITS_MAX_TEST:
        raise ValueError(f"test_per_task={test_per_task} leaves too few digit images; use <= {_DIGITS_MAX_TEST}")
    shares = [P9D_SHARES[i % len(P9D_SHARES)] for i in range(tasks)]
    sizes = _allocate(max(train_pairs, 0), shares)
    if sizes.min() < MIN_TASK_PAIRS:
        raise ValueError(f"train_pairs={train_pairs} is too small for {tasks} tasks: the P9D shares give "
                         f"task sizes {sizes.tolist()}, need >= {MIN_TASK_PAIRS} pairs per task")
    _check_out(out)
    share = P9D_SHARES[tasks % len(P9D_SHARES)] * train_pairs / sum(shares)
    # the held-out digits are set aside before the stream's digits task takes its share (a large share, e.g. of one
    # domain task's stream, would otherwise take every image the test split leaves)
    n_held_digits = (min(test_per_task, _DIGITS_TOTAL - test_per_task * digits - MIN_TASK_PAIRS * digits)
                     if held_out else 0)
    n_digits = (min(max(MIN_TASK_PAIRS, round(share)), _DIGITS_TOTAL - test_per_task - n_held_digits)
                if digits else 0)
    if held_out and n_held_digits < 1:
        raise ValueError(f"test_per_task={test_per_task} leaves no digit image for the held-out digits set; lower "
                         "test_per_task or pass held_out=False")
    total = int(sizes.sum()) + n_digits + (tasks + digits + held_out) * test_per_task + n_held_digits

    dirs = []
    with console.bar(total=total, desc="synth", unit="pair", disable=not progress) as bar:
        for i in range(tasks):
            base = list(DOMAINS)[i % len(DOMAINS)]
            suffix = str(i // len(DOMAINS) + 1) if i >= len(DOMAINS) else ""
            name, classes = base + suffix, tuple(c + suffix for c in DOMAINS[base])
            tdir = out / f"task-{i:02d}-{name}"
            meta = {"name": tdir.name, "kind": "domain", "index": i,
                    "description": f"Synthetic '{name}' domain: {len(classes)} object classes drawn as figures, "
                                   "with colour, size, position and background words shared by all tasks.",
                    "splits": {"train": "train.jsonl", "test": "test.jsonl"}, "classes": list(classes)}
            _write_task(tdir, meta, _domain_task(name, classes, i, int(sizes[i]), test_per_task, seed, image_size), bar)
            dirs.append(tdir)
        if digits:
            tdir = out / f"task-{tasks:02d}-digits"
            meta = {"name": tdir.name, "kind": "domain", "index": tasks,
                    "description": "Handwritten digits (scikit-learn load_digits, 8x8) upscaled, with coloured ink "
                                   "on the shared background patterns.",
                    "splits": {"train": "train.jsonl", "test": "test.jsonl"}, "classes": list(DIGIT_NAMES)}
            _write_task(tdir, meta, _digits_task(tasks, n_digits, test_per_task, seed, image_size), bar)
            dirs.append(tdir)
        if held_out:
            name, classes = HELD_OUT
            tdir = out / f"zero-shot-{name}"
            meta = {"name": tdir.name, "kind": "domain", "held_out": True,
                    "description": f"Zero-shot set, held out: no version trains on it. Synthetic '{name}' domain in "
                                   f"its own style, {len(classes)} object classes that no stream task has, with the "
                                   "colour, size, position and background words the stream teaches.",
                    "splits": {"test": "test.jsonl"}, "classes": list(classes)}
            test = _domain_task(name, classes, _HELD_OUT_INDEX, 0, test_per_task, seed, image_size)["test"]
            _write_task(tdir, meta, {"test": test}, bar)
            tdir = out / HELD_OUT_DIGITS
            meta = {"name": tdir.name, "kind": "domain", "held_out": True,
                    "description": "Zero-shot set, held out: no version trains on it. Handwritten digits (scikit-learn "
                                   "load_digits) drawn as the digits task draws them, none of its images.",
                    "splits": {"test": "test.jsonl"}, "classes": list(DIGIT_NAMES), "templates": list(DIGIT_PROMPTS)}
            _write_task(tdir, meta, _held_out_digits(n_held_digits, seed, image_size,
                                                     (tasks, n_digits, test_per_task) if digits else None), bar)
    return dirs


def held_out_task(out: str | Path) -> Path | None:
    """The zero-shot task `synthesize` wrote under `out`, or None if it wrote none."""
    tdir = Path(out) / f"zero-shot-{HELD_OUT[0]}"
    return tdir if (tdir / "task.yaml").is_file() else None


def held_out_tasks(out: str | Path) -> list[Path]:
    """Every zero-shot task `synthesize` wrote under `out` (the held-out domain, the held-out digits)."""
    return [t for t in (Path(out) / f"zero-shot-{HELD_OUT[0]}", Path(out) / HELD_OUT_DIGITS) if (t / "task.yaml").is_file()]


def synthesize_languages(out: str | Path, languages: int, seed: int = 0, *, image_size: int = 32,
                         train_pairs: int = 600, test_per_task: int = 48, progress: bool = True) -> list[Path]:
    """Write `languages` language tasks under `out`: the same images (the first domain's) captioned in English,
    then in synthetic languages; return the task dirs in stream order.

    Every task has `train_pairs` train and `test_per_task` test pairs, row k of a split showing the same image
    in every task; rows carry `caption_en`, the English caption, and `lang`. A language is a bijective word
    map of English: ~15% of the content words are loanwords spelled alike everywhere, the rest pseudo-words
    in the language's script, and languages 2-3, 6-7, ... reverse the word order.
    """
    out = Path(out)
    if not 1 <= languages <= len(LANG_CODES):
        raise ValueError(f"languages must be between 1 and {len(LANG_CODES)} (codes {LANG_CODES[0]}, "
                         f"{LANG_CODES[1]}..{LANG_CODES[-1]}), got {languages}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    if train_pairs < MIN_TASK_PAIRS:
        raise ValueError(f"train_pairs must be >= {MIN_TASK_PAIRS}, got {train_pairs}")
    if test_per_task < 1:
        raise ValueError(f"test_per_task must be >= 1, got {test_per_task}")
    _check_out(out)
    name, classes = next(iter(DOMAINS.items()))

    dirs = []
    with console.bar(total=languages * (train_pairs + test_per_task), desc="synth", unit="pair", disable=not progress) as bar:
        pairs = {split: list(gen) for split, gen in  # drawn once: every language shows the same pixels
                 _domain_task(name, classes, 0, train_pairs, test_per_task, seed, image_size).items()}
        for i, lang in enumerate(_languages(languages, classes, seed)):
            tdir = out / f"task-{i:02d}-lang-{lang.code}"
            said = ("English captions" if i == 0 else f"Captions in synthetic language '{lang.code}' ({lang.script} "
                    f"script, {'reversed' if lang.reversed else 'English'} word order; the English caption grammar "
                    "word for word, some content words kept as loanwords)")
            meta = {"name": tdir.name, "kind": "language", "lang": lang.code, "index": i,
                    "description": f"{said} of the same '{name}' images as every language task.",
                    "splits": {"train": "train.jsonl", "test": "test.jsonl"}, "classes": list(classes),
                    "metadata": {"script": lang.script, "word_order": "reversed" if lang.reversed else "forward"}}
            _write_task(tdir, meta, pairs, bar, lang)
            dirs.append(tdir)
    return dirs
