"""Streams of real, openly licensed emoji: `clipstream data stream NAME --out DIR`.

Sources (npm packages, fetched by `clipstream data fetch`, given here as their unpacked `package/` roots): Twemoji
and Noto PNGs (emoji-datasource-twitter/-google, 64 px), OpenMoji SVGs (colour and black line), Tabler icons (PNG +
icons.json) and the captions, emojibase-data: the Unicode CLDR label and tags of every emoji in 28 locales.

One table joins them by codepoint sequence (uppercase hex, dash-joined, FE0F dropped: emoji-datasource writes
`2764-FE0F` where emojibase and OpenMoji write `2764`), with emojibase as the authority on what an emoji is: its CLDR
group (components and regional indicators are not concepts) and its base, skin-tone variants mapping to theirs.

Protocol, shared by every stream and recorded in each task.yaml's `metadata`:
- split: `test_fraction` of the base concepts of each CLDR group, drawn with `seed`, are test concepts for every
  stream; no task trains on them (nor on their skin-tone variants), and the pretraining corpus holds none of them.
- captions: a test image has one pair, its CLDR label in the task's locale ("red apple", "flag: Japan"); a train
  image has its label plus up to TAG_CAPTIONS captions of up to TAGS_PER_CAPTION of its CLDR tags, drawn per image.
- skins: train images include every skin-tone variant (captioned with its own label: variants have no tags); the
  test gallery holds the base image only, so it is not dominated by near-copies that differ in one colour.
- identical images: sets draw some concepts alike (a territory's flag as its country's); a train image whose file is
  byte-identical to a test concept's in the same style is left out of training.
- images: RGB PNGs of `image_size` px, each composited onto white: the line-art styles draw black strokes on
  transparency, and one background for every style keeps the background from telling styles apart.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from clipstream import console
from clipstream.training.data.importers import Pair, import_task
from clipstream.training.data.sources import SOURCES
from clipstream.training.data.task import DataError, Task

STREAMS = ("emoji-styles", "emoji-groups", "emoji-languages", "pretrain")
DEFAULT_LANGS = ("en", "de", "ja", "hi", "ru", "zh")
STYLES = {  # style -> (source, image folder, emoji-datasource's vendor: its PNGs; "" for OpenMoji's SVGs)
    "twemoji": ("twemoji", "img/twitter/64", "twitter"), "noto": ("noto", "img/google/64", "google"),
    "openmoji": ("openmoji", "color/svg", ""), "openmoji-black": ("openmoji", "black/svg", "")}
GROUP_TASKS = {"smileys-people": ("smileys-emotion", "people-body"), "animals-nature": ("animals-nature",),
               "food-drink": ("food-drink",), "travel-places": ("travel-places",),
               "activities-objects": ("activities", "objects"), "symbols-flags": ("symbols", "flags")}
NOT_CONCEPTS = ("component",)  # skin-tone swatches and hair parts: pieces of emoji, not emoji
TAG_CAPTIONS, TAGS_PER_CAPTION = 2, 3
# version 0's colour styles, no stream's, as Iconify's packages: (style, package, how it names an icon: "chars" the flat
# Fluent set's chars.json (its 3D set shares the names), "label" the English CLDR label's slug, "squashed" that slug
# without its hyphens)
ICONIFY_STYLES = (("fluent-flat", "@iconify-json/fluent-emoji-flat", "chars"),
                  ("fluent-3d", "@iconify-json/fluent-emoji", "chars"), ("emojione", "@iconify-json/emojione", "label"),
                  ("emojione-v1", "@iconify-json/emojione-v1", "label"), ("noto-v1", "@iconify-json/noto-v1", "label"),
                  ("fxemoji", "@iconify-json/fxemoji", "squashed"),
                  ("streamline", "@iconify-json/streamline-emojis", "label"))
COLOUR_STYLES = tuple(style for style, _, _ in ICONIFY_STYLES)
ICONIFY_SOURCES = tuple(dict.fromkeys(s.name for _, package, _ in ICONIFY_STYLES for s in SOURCES.values()
                                      if package in {p.name for p in s.packages}))
GALLERY_FRACTION = 0.1  # of the pretraining corpus: its own test, as `data import` holds out by default
TARGET_TEST_PAIRS = 500  # a gallery smaller than this is reported: its Rm moves by points from a few items
# `clipstream demo`'s short stream: German, then English captions of the same Twemoji (English last: three of its four
# searches are English), over a seeded few concepts of three groups. Not one of STREAMS (`data stream`): it trains on
# the concepts its searches look for (query -> the English label of the emoji it should find), whatever the shared
# split says, so its scores are not the other streams'.
DEMO_STREAM, DEMO_LANGS = "emoji-demo", ("de", "en")
DEMO_GROUPS, DEMO_CONCEPTS = ("food-drink", "animals-nature", "flags"), 150
DEMO_SEARCHES = {"red apple": "red apple", "dog face": "dog face", "flag: Japan": "flag: Japan",
                 "roter Apfel": "red apple"}


@dataclass
class Catalogue:
    groups: dict[str, str]  # base concept -> CLDR group
    bases: dict[str, str]  # codepoints of every image (base or skin variant) -> its base
    captions: dict[str, dict[str, tuple[str, list[str]]]]  # locale -> codepoints -> (label, tags)
    images: dict[str, dict[str, Path]] = field(default_factory=dict)  # style -> codepoints -> file


@dataclass
class Written:
    task: Task
    counts: dict
    seconds: float

    def summary(self) -> dict:
        return {"task": self.task.name, "path": str(self.task.root), **self.counts, "seconds": round(self.seconds, 1)}


def codepoints(hexcode: str) -> str:
    return "-".join(p for p in hexcode.upper().split("-") if p != "FE0F")


def packages(stream: str) -> list[tuple[str, str]]:
    """(source, npm package) of every package `stream` reads: the roots `write_stream` takes, keyed by package."""
    needs = {"emoji-styles": ("twemoji", "noto", "openmoji"), "emoji-groups": ("twemoji",),
             "emoji-languages": ("twemoji",), DEMO_STREAM: ("twemoji",), "pretrain": ("openmoji", "tabler", *ICONIFY_SOURCES)
             }[stream] + ("emoji-captions",)
    return [(s, p.name) for s in needs for p in SOURCES[s].packages]


def locales(captions: Path) -> list[str]:
    return sorted(p.parent.name for p in captions.glob("*/data.json"))


def _known_locales(captions: Path, langs: Iterable[str]) -> list[str]:
    have, wanted = locales(captions), list(dict.fromkeys(langs))
    missing = [lang for lang in wanted if lang not in have]
    if missing:
        raise DataError(f"the emoji captions have no locale {missing[0]!r}; choose from {', '.join(have)}")
    return wanted


def read_catalogue(captions: Path, langs: Iterable[str], styles: dict[str, Path]) -> Catalogue:
    """The emoji of emojibase-data at `captions` with their labels and tags in `langs` (English always: the split and
    `caption_en` read it) and their images in `styles` (style -> its package root)."""
    wanted = _known_locales(captions, ["en", *langs])
    names = json.loads((captions / "meta" / "groups.json").read_text(encoding="utf-8"))["groups"]
    cat = Catalogue({}, {}, {})
    for lang in wanted:
        table = cat.captions[lang] = {}
        for entry in json.loads((captions / lang / "data.json").read_text(encoding="utf-8")):
            group = names.get(str(entry.get("group")))
            if group is None or group in NOT_CONCEPTS:
                continue
            base = codepoints(entry["hexcode"])
            cat.groups[base] = group
            for each in [entry, *entry.get("skins", [])]:
                cat.bases[codepoints(each["hexcode"])] = base
                table[codepoints(each["hexcode"])] = (" ".join(each["label"].split()), list(each.get("tags", [])))
    for style, root in styles.items():
        cat.images[style] = {k: f for k, f in _style_images(style, root).items() if k in cat.bases}
    return cat


def _style_images(style: str, root: Path) -> dict[str, Path]:
    _, folder, vendor = STYLES[style]
    if vendor:  # emoji-datasource: one entry per base, its skin tones under skin_variations
        found = {}
        for entry in json.loads((root / "emoji.json").read_text(encoding="utf-8")):
            for each in [entry, *(entry.get("skin_variations") or {}).values()]:
                if each.get(f"has_img_{vendor}"):
                    found[codepoints(each["unified"])] = root / folder / each["image"]
        return found
    entries = json.loads((root / "data" / "openmoji.json").read_text(encoding="utf-8"))
    return {codepoints(e["hexcode"]): root / folder / f"{e['hexcode']}.svg" for e in entries}


def iconify_images(root: Path, names: dict[str, str]) -> dict[str, str]:
    """An Iconify icon set's images (its `icons.json`) as SVG documents, keyed by the codepoints `names` gives each
    icon name (an alias draws its parent)."""
    data = json.loads((root / "icons.json").read_text(encoding="utf-8"))
    icons, aliases = data["icons"], data.get("aliases", {})
    found = {}
    for name in [*icons, *aliases]:
        icon = icons.get(name) or icons.get(aliases[name].get("parent"), {})
        if name in names and "body" in icon:
            box = [icon.get(k, data.get(k, d)) for k, d in (("left", 0), ("top", 0), ("width", 16), ("height", 16))]
            found.setdefault(names[name], f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="{" ".join(map(str, box))}">'
                                          f'{icon["body"]}</svg>')
    return found


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def held_out(strata: dict[str, list[str]], fraction: float, seed: int) -> set[str]:
    """A seeded `fraction` of each stratum's keys; each stratum drawn with its own RNG, so adding a group or a source
    does not move the others' draws."""
    if not 0 < fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {fraction}")
    return {k for name, keys in sorted(strata.items())
            for k in random.Random(f"{seed}:{name}").sample(sorted(keys), round(fraction * len(keys)))}


def concept_split(cat: Catalogue, seed: int, test_fraction: float) -> set[str]:
    """The test concepts of every stream: `test_fraction` of each CLDR group's base concepts."""
    strata = defaultdict(list)
    for base, group in cat.groups.items():
        strata[group].append(base)
    return held_out(strata, test_fraction, seed)


def demo_concepts(cat: Catalogue, seed: int) -> tuple[set[str], set[str]]:
    """The demo stream's base concepts, and those of them its searches look for: these, and a seeded draw of the
    others of DEMO_GROUPS up to DEMO_CONCEPTS."""
    searched = {k for k, (label, _) in cat.captions["en"].items()
                if label in DEMO_SEARCHES.values() and cat.bases[k] == k}
    pool = sorted(k for k, group in cat.groups.items() if group in DEMO_GROUPS and k not in searched)
    drawn = random.Random(f"{seed}:{DEMO_STREAM}").sample(pool, max(0, min(len(pool), DEMO_CONCEPTS - len(searched))))
    return searched | set(drawn), searched


def captions_for(label: str, tags: list[str], seed: int, where: str, test: bool) -> list[str]:
    """A test image's one caption (its label), or a train image's label and up to TAG_CAPTIONS tag captions."""
    if test:
        return [label]
    tags = [t for t in dict.fromkeys(" ".join(str(t).split()) for t in tags) if t and t != label]  # (Tabler has numbers)
    rng, found = random.Random(f"{seed}:{where}"), [label]
    for _ in range(TAG_CAPTIONS if tags else 0):
        drawn = sorted(rng.sample(range(len(tags)), min(TAGS_PER_CAPTION, len(tags))))  # in the tags' own order
        caption = ", ".join(tags[i] for i in drawn)
        if caption not in found:  # (a few tags give the same caption twice)
            found.append(caption)
    return found


def _untested(keys: list[str], cat: Catalogue, style: str, test: set[str]) -> list[str]:
    """`keys` less the train images whose file is byte-identical to a test concept's in `style`: sets draw some
    concepts alike (flags of territories as their country's, Twemoji's families, OpenMoji's "student" and "man
    student"), and training on such a picture would be training on a test image under another caption."""
    digest = {k: hashlib.sha256(f.encode() if isinstance(f, str) else f.read_bytes()).digest()
              for k, f in cat.images[style].items()}
    tested = {digest[k] for k in test if k in digest}
    return [k for k in keys if cat.bases[k] in test or digest[k] not in tested]


def render(source: Path | str, size: int) -> Image.Image:
    """`source` (a PNG or SVG file, or an SVG document as text) as a `size`-px RGB image on white; SVGs drawn at that
    size (crisp at any size)."""
    if isinstance(source, str) or source.suffix.lower() == ".svg":
        import cairosvg  # (cairosvg's default refuses external files and entities an SVG may name)

        drawn = {"bytestring": source.encode()} if isinstance(source, str) else {"url": str(source)}
        source = io.BytesIO(cairosvg.svg2png(**drawn, output_width=size, output_height=size))
    with Image.open(source) as opened:
        image = opened.convert("RGBA")
    flat = Image.new("RGBA", image.size, "white")
    flat.alpha_composite(image)  # before resizing: resampling RGBA unpremultiplied darkens the edges
    flat = flat.convert("RGB")
    return flat if flat.size == (size, size) else flat.resize((size, size), Image.LANCZOS)


class _Renderer:
    """Renders each (style, image) once into a folder beside the tasks: tasks that share an image hard-link one file."""

    def __init__(self, folder: Path, size: int, progress: bool):
        self.folder, self.size, self.progress, self.done, self.undrawable = folder, size, progress, {}, []

    def __call__(self, items: list[tuple[str, str, Path | str]], desc: str) -> dict[tuple[str, str], Path]:
        """The rendered file of each (style, key, source); an SVG given as text that cairo cannot draw is left out
        (`self.undrawable`): a few of Fluent's 3D emoji ask cairo for more memory than it will give."""
        todo = [i for i in dict.fromkeys(items) if i[:2] not in self.done]
        for style, key, source in console.bar(iterable=todo, desc=desc, unit="img", disable=not self.progress):
            if isinstance(source, Path) and not source.is_file():
                raise DataError(f"{source}: image missing from the package; fetch it again (`clipstream data fetch "
                                "--refetch`)")
            path = self.folder / f"{style}-{key}.png"
            try:
                image = render(source, self.size)
            except MemoryError:
                if isinstance(source, Path):
                    raise
                self.undrawable.append((style, key))
                continue
            image.save(path, format="PNG")
            self.done[style, key] = path
        return self.done


def _version(root: Path) -> str:
    found = root / "package.json"
    return json.loads(found.read_text(encoding="utf-8")).get("version", "?") if found.is_file() else "?"


def _sources(roots: dict[str, Path], names: Iterable[str]) -> list[dict]:
    return [{"source": s, "packages": [f"{p.name}@{_version(roots[p.name])}" for p in SOURCES[s].packages],
             "licence": SOURCES[s].licence, "attribution": SOURCES[s].attribution, "homepage": SOURCES[s].homepage}
            for s in dict.fromkeys(names)]


def _protocol(seed: int, test_fraction: float, size: int, test: set[str], cat: Catalogue) -> dict:
    return {
        "split": {"seed": seed, "test_fraction": test_fraction, "unit": "base emoji concept (codepoints without "
                  "FE0F); skin-tone variants follow their base", "stratified_by": "CLDR group",
                  "concepts": len(cat.groups), "test_concepts_all_streams": len(test),
                  "why": "held out of every emoji stream's training and of the pretraining corpus: test scores are "
                         "on concepts no version trained on"},
        "captions": {"test": "one pair per image: its CLDR label in the task's locale",
                     "train": f"the CLDR label, plus up to {TAG_CAPTIONS} captions of up to {TAGS_PER_CAPTION} of its "
                              f"CLDR tags (', '-joined, in the tags' order), drawn with random.Random('{seed}:"
                              "<locale>:<codepoints>')"},
        "label": "each row's: the English CLDR label of its image's base concept (an icon's name words)",
        "skins": "train: every skin-tone variant's image, captioned with its own label; test: the base image only",
        "identical_images": "a train image byte-identical to a test concept's image of the same style is left out "
                            "(territory flags drawn as their country's, families drawn alike)",
        "images": f"{size}x{size} RGB PNG composited onto white (PNG alpha and SVG transparency alike); SVGs "
                  "rasterised by cairosvg at that size, PNGs resized with Lanczos",
    }


def _import(pairs: list[Pair], out: Path, meta: dict, started: float, **task) -> Written:
    splits = defaultdict(set)
    for p in pairs:
        splits[p.split].add(p.where.rsplit(":", 1)[0])
    counts = {f"{s}_pairs": sum(p.split == s for p in pairs) for s in ("train", "test")}
    counts |= {f"{s}_concepts": len(splits[s]) for s in ("train", "test")}
    counts["images"] = len({p.image for p in pairs})
    meta["counts"] = counts
    written = import_task(pairs, out, out.name, metadata=meta, **task)
    return Written(written, counts, time.monotonic() - started)


def write_stream(name: str, out: Path, roots: dict[str, Path], *, seed: int = 0, test_fraction: float = 0.27,
                 image_size: int = 64, langs: Iterable[str] = DEFAULT_LANGS, progress: bool = True) -> list[Written]:
    """Write the task folders of stream `name` under `out` (new or empty) from the package roots `roots` (npm package
    name -> its unpacked `package/` folder, `packages(name)` lists them); return them in stream order."""
    if name not in (*STREAMS, DEMO_STREAM):
        raise ValueError(f"unknown stream {name!r}: one of {', '.join(STREAMS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: write the stream into a new folder")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    langs = list(dict.fromkeys(langs)) if name == "emoji-languages" else list(DEMO_LANGS) if name == DEMO_STREAM \
        else ["en"]
    missing = [p for _, p in packages(name) if p not in roots]
    if missing:
        raise ValueError(f"no package root for {', '.join(missing)}")
    _known_locales(roots["emojibase-data"], langs)  # before anything is written
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix=".render-", dir=out))  # on the tasks' filesystem: hard links, not copies
    try:
        renderer = _Renderer(cache, image_size, progress)
        if name == "pretrain":
            return [_pretrain(out / "emoji-pretrain", roots, renderer, seed, test_fraction)]
        return _emoji_stream(name, out, roots, renderer, seed, test_fraction, langs)
    except BaseException:
        for child in [out] if created else list(out.iterdir()):  # (`out` was empty: all of it is this run's)
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _emoji_stream(name: str, out: Path, roots: dict, renderer: _Renderer, seed: int, test_fraction: float,
                  langs: list[str]) -> list[Written]:
    """One mechanism for the streams: a task is a (style, locale, CLDR groups) on the shared split."""
    specs = {"emoji-styles": [(s, "en", None) for s in ("twemoji", "noto", "openmoji")],
             "emoji-groups": [("twemoji", "en", g) for g in GROUP_TASKS],
             "emoji-languages": [("twemoji", lang, None) for lang in langs],
             DEMO_STREAM: [("twemoji", lang, None) for lang in langs]}[name]
    styles = {s: roots[SOURCES[STYLES[s][0]].packages[0].name] for s, _, _ in specs}
    cat = read_catalogue(roots["emojibase-data"], langs, styles)
    test = concept_split(cat, seed, test_fraction)
    # a stream's tasks share their concepts: those with a base image in every style it uses
    shared = set.intersection(*({cat.bases[k] for k in cat.images[s] if cat.bases[k] == k} for s in styles))
    languages = name in ("emoji-languages", DEMO_STREAM)
    if name == DEMO_STREAM:  # a few concepts, the searched ones trained on
        concepts, searched = demo_concepts(cat, seed)
        shared, test = shared & concepts, test - searched
    written = []
    for i, (style, lang, group) in enumerate(specs):
        started = time.monotonic()
        suffix = {"emoji-styles": style, "emoji-groups": group, "emoji-languages": lang, DEMO_STREAM: lang}[name]
        groups = GROUP_TASKS.get(group, tuple(set(cat.groups.values())))
        chosen = _untested([k for k in sorted(cat.images[style]) if cat.bases[k] in shared
                            and cat.groups[cat.bases[k]] in groups and (cat.bases[k] not in test or cat.bases[k] == k)],
                           cat, style, test)
        if name == DEMO_STREAM and searched - {cat.bases[k] for k in chosen}:  # (drawn like a test concept)
            raise DataError(f"the demo's searched emoji {sorted(searched - {cat.bases[k] for k in chosen})} would not "
                            "be trained on")
        files = renderer([(style, k, cat.images[style][k]) for k in chosen], f"{name}-{i:02d}-{suffix}")
        pairs = []
        for k in chosen:
            split = "test" if cat.bases[k] in test else "train"
            label, tags = cat.captions[lang][k]
            extra = {"label": cat.captions["en"][cat.bases[k]][0],
                     **({"caption_en": cat.captions["en"][k][0], "lang": lang} if languages else {})}
            pairs += [Pair(f"{cat.bases[k]}:{k}", files[style, k], c, split, str(files[style, k]), extra)
                      for c in captions_for(label, tags, seed, f"{lang}:{k}", split == "test")]
        source = STYLES[style][0]
        meta = {"stream": name, "style": style, "locale": lang, "cldr_groups": sorted(groups),
                "protocol": _protocol(seed, test_fraction, renderer.size, test, cat),
                "test_concepts": sorted({cat.bases[k] for k in chosen} & test),
                "sources": _sources(roots, [source, "emoji-captions"])}
        said = f"captions in {lang}" if languages else "English captions"
        if languages:  # (two locales' tags are not translations of each other: the label is)
            meta["protocol"]["captions"]["caption_en"] = "every row's: the image's English CLDR label"
        what = ', '.join(GROUP_TASKS.get(group, ['all CLDR groups']))
        if name == DEMO_STREAM:
            what = f"{len(shared)} concepts of {', '.join(DEMO_GROUPS)}"
            named = ", ".join(sorted(cat.captions["en"][k][0] for k in searched))
            meta["protocol"]["split"]["demo"] = (f"{what}: the searched ones ({named}) and a seeded draw of the "
                                                 "others; the searched ones are trained on whatever the shared split "
                                                 "says: this stream's test concepts are the shared split's, less those")
        written.append(_import(pairs, out / f"{name}-{i:02d}-{suffix}", meta, started, index=i,
                              kind="language" if languages else "domain", lang=lang if languages else None,
                              description=f"{style} emoji ({what}), {said} (CLDR labels and tags); task {i + 1} of "
                                          f"{len(specs)} of {name}"))
    return written


def _plain(icon: str) -> str:
    """A Tabler icon's name as an emoji label would say it: `ice-cream-2` -> `ice cream`."""
    return re.sub(r"(-\d+)+$", "", icon.lower()).replace("-", " ")


def pretrain_corpus(out: Path, roots: dict[str, Path], **options) -> Written:
    """The one task for pretraining version 0, written as `out`/emoji-pretrain (`write_stream`'s options): Tabler
    icons (outline and filled) and OpenMoji's black line art of the TRAIN concepts (a style no stream uses), English;
    a seeded GALLERY_FRACTION of icons and concepts is its own test. It holds no test concept of any stream (checked),
    nor an icon named as one."""
    [written] = write_stream("pretrain", out, roots, **options)
    return written


def _pretrain(out: Path, roots: dict[str, Path], renderer: _Renderer, seed: int, test_fraction: float) -> Written:
    started = time.monotonic()
    cat = read_catalogue(roots["emojibase-data"], ["en"], {"openmoji-black": roots["openmoji"]})
    test = concept_split(cat, seed, test_fraction)
    emoji = [k for k in _untested([k for k in sorted(cat.images["openmoji-black"]) if cat.bases[k] == k], cat,
                                  "openmoji-black", test) if k not in test]
    chars = roots["@iconify-json/fluent-emoji-flat"] / "chars.json"
    by_label = {_slug(label): k for k, (label, _) in cat.captions["en"].items()}
    names = {"chars": {name: codepoints(hexcode) for hexcode, name in json.loads(chars.read_text("utf-8")).items()},
             "label": by_label, "squashed": {slug.replace("-", ""): k for slug, k in by_label.items()}}
    for style, package, naming in ICONIFY_STYLES:
        cat.images[style] = {k: svg for k, svg in iconify_images(roots[package], names[naming]).items() if k in cat.bases}
    colour = {style: [k for k in _untested(sorted(k for k in cat.images[style] if cat.bases[k] == k), cat, style, test)
                      if k not in test] for style in COLOUR_STYLES}
    png, meta_root = roots["@tabler/icons-png"], roots["@tabler/icons"]
    icons = json.loads((meta_root / "icons.json").read_text(encoding="utf-8"))
    # an icon named as a test concept ("skull", "rocket") is that concept in another style: not pretrained on either
    tested = {cat.captions["en"][k][0].lower() for k in test}
    found = sorted((style, f.stem, f) for style in ("outline", "filled") for f in (png / "icons" / style).glob("*.png"))
    drawn = [(s, n, f) for s, n, f in found if _plain(n) not in tested]
    concepts = sorted(set(emoji).union(*colour.values()))  # a gallery concept is held out in every style
    gallery = held_out({"tabler": sorted({n for _, n, _ in drawn}), "emoji": concepts}, GALLERY_FRACTION, seed)
    colour["openmoji-black"] = emoji
    files = renderer([(f"tabler-{s}", n, f) for s, n, f in drawn]
                     + [(style, k, cat.images[style][k]) for style, keys in colour.items() for k in keys], out.name)
    pairs = []
    for style, icon, _ in drawn:  # an icon's outline and filled images on the same side
        info = icons.get(icon, {})  # (an icon renamed since the PNGs were made: its file name is all there is)
        label = " ".join(icon.split("-")) + " filled" * (style == "filled")
        tags = [*info.get("tags", []), *([info["category"].lower()] if info.get("category") else [])]
        path = files[f"tabler-{style}", icon]
        split = "test" if icon in gallery else "train"
        pairs += [Pair(f"tabler-{icon}:{style}", path, c, split, str(path), {"label": " ".join(icon.split("-"))})
                  for c in captions_for(label, tags, seed, f"tabler:{style}:{icon}", split == "test")]
    for style, keys in colour.items():
        for k in keys:
            if (style, k) not in files:  # (undrawable)
                continue
            path, split = files[style, k], "test" if k in gallery else "train"
            pairs += [Pair(f"{k}:{k}", path, c, split, str(path), {"label": cat.captions["en"][k][0]})
                      for c in captions_for(*cat.captions["en"][k], seed, f"{style}:en:{k}", split == "test")]
    leaked = {p.where.split(":")[0] for p in pairs} & test
    if leaked:  # the corpus is version 0's training data: a stream test concept in it would void every test score
        raise RuntimeError(f"pretraining corpus holds stream test concepts {sorted(leaked)[:5]}")
    protocol = _protocol(seed, test_fraction, renderer.size, test, cat)
    protocol.pop("skins")  # (base images only: a line drawing shows no skin tone)
    counts = ", ".join(f"{style} {sum((style, k) in files for k in keys)}" for style, keys in colour.items())
    protocol["corpus"] = (f"Tabler icons (outline and filled; label: the icon's name words, + ' filled'; tags: its tags "
                          f"and category) and the emoji streams' train concepts in styles no stream shows: OpenMoji's "
                          f"black line art and the colour sets of Iconify's packages {', '.join(ICONIFY_SOURCES)} (base images, English; "
                          f"images per style: {counts}); no stream test concept; its own test: {GALLERY_FRACTION:.0%} of "
                          f"the icons and of the emoji concepts (in every style), drawn per source with seed {seed}; "
                          f"{len(found) - len(drawn)} icon images left out: named as a test concept (English label, case "
                          f"and a trailing number aside); {len(renderer.undrawable)} SVGs cairo could not draw")
    meta = {"stream": "pretrain", "protocol": protocol,
            "sources": _sources(roots, ["tabler", "openmoji", *ICONIFY_SOURCES, "emoji-captions"])}
    return _import(pairs, out, meta, started, description="pretraining corpus for version 0: Tabler icons and the emoji "
                  "streams' train concepts in styles no stream shows (OpenMoji line art and Iconify's colour sets), English")
