"""`clipstream data stream`: the emoji streams and the pretraining corpus, from small folders in the real layouts of
emoji-datasource, OpenMoji, Tabler and emojibase-data: one concept split for all of them, skin tones with their
base, captions in the task's locale, the protocol and licences in task.yaml, tasks that load and check."""

import hashlib
import io
import json

import pytest
import yaml
from PIL import Image

from clipstream.cli import main
from clipstream.training.data import emoji
from clipstream.training.data.task import DataError, Task

GROUPS = {0: "smileys-emotion", 1: "people-body", 2: "component", 3: "animals-nature", 4: "food-drink",
          5: "travel-places", 6: "activities", 7: "objects", 8: "symbols", 9: "flags"}
NORWAY, SVALBARD = "1F1F3-1F1F4", "1F1F8-1F1EF"  # two flags every set draws alike
WAVE, SKINS = "1F44B", ("1F44B-1F3FB", "1F44B-1F3FC")


def _png(rgb, size: int = 8) -> bytes:
    buffer = io.BytesIO()
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))  # transparent, as emoji PNGs are around the glyph
    image.paste((*rgb, 255), (2, 2, size - 2, size - 2))
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _svg(rgb, radius: int) -> str:
    return (f'<svg viewBox="0 0 72 72" xmlns="http://www.w3.org/2000/svg"><circle cx="36" cy="36" r="{radius}" '
            f'fill="rgb{tuple(rgb)}" stroke="#000000" stroke-width="2"/></svg>')


def _entries() -> list[dict]:
    """emojibase-data's entries: four concepts in each CLDR group (two flags), skin tones on the waving hand, the
    red heart as emojibase writes it (no FE0F), a component and a regional indicator (neither a concept)."""
    found = []
    for g, group in GROUPS.items():
        if group == "component":
            found.append({"hexcode": "1F3FB", "label": "light skin tone", "group": g})
            continue
        keys = [NORWAY, SVALBARD] if group == "flags" else [f"1F{g}{j}0" for j in range(4)]
        keys[0] = {"people-body": WAVE, "symbols": "2764"}.get(group, keys[0])
        for j, key in enumerate(keys):
            found.append({"hexcode": key, "label": f"{group.replace('-', ' ')} {'abcd'[j]}", "group": g, "subgroup": g,
                          "tags": [f"{group}", f"tag{j}a", f"tag{j}b", f"tag{j}c", f"tag{j}d"]})
    wave = next(e for e in found if e["hexcode"] == WAVE)
    wave["skins"] = [{"hexcode": s, "label": f"{wave['label']}: tone {t}", "group": 1} for t, s in enumerate(SKINS)]
    found.append({"hexcode": "1F1E6", "label": "regional indicator A"})
    return found


def _write_json(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """The packages' roots (npm name -> `package/`), each in its real layout, with a package.json for its version."""
    top = tmp_path_factory.mktemp("sources")
    roots = {name: top / name.replace("/", "+") / "package" for name in (
        "emojibase-data", "emoji-datasource-twitter", "emoji-datasource-google", "openmoji", "@tabler/icons-png",
        "@tabler/icons", *(package for _, package, _ in emoji.ICONIFY_STYLES))}
    for name, root in roots.items():
        _write_json(root / "package.json", {"name": name, "version": "1.2.3"})
    entries = _entries()
    captions = roots["emojibase-data"]
    _write_json(captions / "meta" / "groups.json", {"groups": {str(g): n for g, n in GROUPS.items()}})
    for locale, word in (("en", ""), ("de", "auf Deutsch ")):
        localised = json.loads(json.dumps(entries))
        for e in [*localised, *(s for base in localised for s in base.get("skins", []))]:
            e["label"] = word + e["label"]
            e["tags"] = [word + t for t in e.get("tags", [])]
        _write_json(captions / locale / "data.json", localised)
    for n, (package, vendor) in enumerate((("emoji-datasource-twitter", "twitter"),
                                           ("emoji-datasource-google", "google"))):
        listed = []
        for e in entries:
            if "group" not in e:
                continue
            unified = "2764-FE0F" if e["hexcode"] == "2764" else e["hexcode"]  # emoji-datasource keeps FE0F
            row = {"unified": unified, "image": f"{unified.lower()}.png", f"has_img_{vendor}": True,
                   "skin_variations": {s["hexcode"].split("-")[-1]: {"unified": s["hexcode"], f"has_img_{vendor}": True,
                                                                     "image": f"{s['hexcode'].lower()}.png"}
                                       for s in e.get("skins", [])}}
            listed.append(row)
            for each in [row, *row["skin_variations"].values()]:
                same = each["unified"] in (NORWAY, SVALBARD)
                rgb = (200, 30, 30) if same else tuple(hashlib.sha256(f"{n}{each['unified']}".encode()).digest()[:3])
                (root := roots[package] / "img" / vendor / "64").mkdir(parents=True, exist_ok=True)
                (root / each["image"]).write_bytes(_png(rgb))
        _write_json(roots[package] / "emoji.json", listed)
    om = roots["openmoji"]
    listed = [{"hexcode": e["hexcode"], "annotation": e["label"], "group": GROUPS[e["group"]], "tags": "",
               "skintone_base_hexcode": ""} for e in entries if "group" in e]
    listed += [{"hexcode": s, "annotation": "", "group": "people-body", "tags": "", "skintone_base_hexcode": WAVE}
               for s in SKINS]
    _write_json(om / "data" / "openmoji.json", listed)
    for e in listed:
        for colour in ("color", "black"):
            digest = hashlib.sha256(e["hexcode"].encode()).digest()
            rgb = (0, 0, 0) if colour == "black" else tuple(digest[:3])
            (om / colour / "svg").mkdir(parents=True, exist_ok=True)
            (om / colour / "svg" / f"{e['hexcode']}.svg").write_text(_svg(rgb, 10 + digest[3] % 20))
    # Iconify's sets: SVG bodies in icons.json; Fluent's flat set names each icon's codepoints in chars.json (its 3D
    # set shares the names), the others name their icons as the English labels (Firefox OS's without hyphens); an
    # alias draws its parent
    concepts = [e for e in entries if "tags" in e]
    slug = {e["hexcode"]: e["label"].replace(" ", "-") for e in concepts}
    for n, (_, package, naming) in enumerate(emoji.ICONIFY_STYLES):
        icons = {slug[e["hexcode"]].replace("-", "" if naming == "squashed" else "-"): {
            "body": f'<circle cx="16" cy="16" r="{5 + 2 * n}" fill="rgb'
                    f'{tuple(hashlib.sha256((package + e["hexcode"]).encode()).digest()[:3])}"/>'} for e in concepts}
        first = next(iter(icons))
        _write_json(roots[package] / "icons.json", {"prefix": "x", "width": 32, "height": 32,
                                                    "icons": {f"renamed-{first}" if naming == "label" else
                                                              first: icons.pop(first), **icons},
                                                    "aliases": {first: {"parent": f"renamed-{first}"}}})
    _write_json(roots["@iconify-json/fluent-emoji-flat"] / "chars.json",
                {e["hexcode"].lower(): slug[e["hexcode"]] for e in concepts})
    # ten icons, and one named as each concept (`-2`: Tabler numbers its variants), some of them test concepts
    names = [f"icon-{k}" for k in range(10)] + [e["label"].replace(" ", "-") + "-2" for e in entries if "tags" in e]
    icons = {n: {"name": n, "category": "Shapes", "tags": ["shape", k, f"thing {k}"], "styles": {"outline": {}}}
             for k, n in enumerate(names)}
    _write_json(roots["@tabler/icons"] / "icons.json", icons)
    for style in ("outline", "filled"):
        (roots["@tabler/icons-png"] / "icons" / style).mkdir(parents=True)
        for k, name in enumerate(names if style == "outline" else names[:2]):
            (roots["@tabler/icons-png"] / "icons" / style / f"{name}.png").write_bytes(_png((k, 0, 0), 24))
    return roots


@pytest.fixture(scope="module")
def streams(roots, tmp_path_factory):
    """Every stream and the pretraining corpus, written once at 32 px with half the concepts held out."""
    top, options = tmp_path_factory.mktemp("streams"), {"seed": 3, "test_fraction": 0.5, "image_size": 32,
                                                         "progress": False}
    written = {name: emoji.write_stream(name, top / name, roots, langs=["de", "en"], **options)
               for name in emoji.STREAMS if name != "pretrain"}
    return written | {"pretrain": [emoji.pretrain_corpus(top / "pretrain", roots, **options)]}


def _rows(task: Task, split: str) -> list[dict]:
    return task.check(split).rows


def _concepts(task: Task, split: str) -> set[str]:
    """The base concepts of a split's rows, by their `label` (the base's English label)."""
    return {r["label"] for r in _rows(task, split)}


def _labels(roots, locale: str) -> dict[str, str]:
    """hexcode -> label of a locale, skin variants included."""
    data = json.loads((roots["emojibase-data"] / locale / "data.json").read_text(encoding="utf-8"))
    return {e["hexcode"]: e["label"] for e in [*data, *(s for e in data for s in e.get("skins", []))]}


def test_no_test_concept_is_trained_on_in_any_stream_or_the_pretraining_corpus(streams, roots):
    tasks = [w.task for written in streams.values() for w in written]
    trained = set().union(*(_concepts(t, "train") for t in tasks))
    tested = set().union(*(_concepts(t, "test") for t in tasks if t.meta["metadata"]["stream"] != "pretrain"))
    assert tested and not trained & tested
    en = _labels(roots, "en")
    held = [set(t.meta["metadata"]["test_concepts"]) for t in tasks if "test_concepts" in t.meta["metadata"]]
    assert {en[k] for k in set().union(*held)} == tested  # the recorded keys are the ones tested
    for t in tasks:  # the split is the seeded one, the same in every task
        assert t.meta["metadata"]["protocol"]["split"] == tasks[0].meta["metadata"]["protocol"]["split"]
        for split in t.splits:  # every image inside the task, decodable, of the requested size
            for r in _rows(t, split)[:5]:
                assert Image.open(t.root / r["image"]).size == (32, 32)
    # the components and the regional indicator are no concepts; the 16 others split in two per group
    assert len(trained & {en[k] for k in en}) + len(tested) == 4 * 8 + 2
    assert len(tested) == 2 * 8 + 1


def test_skin_tones_follow_their_base_and_stay_out_of_the_test_gallery(streams, roots):
    en = _labels(roots, "en")
    wave = en[WAVE]
    task = streams["emoji-styles"][0].task
    assert wave in _concepts(task, "train")  # (seed 3's draw; a test concept's variants are in no split at all: the
    # first test finds no concept on both sides, and a variant's row carries its base as `label`)
    trained = {r["caption"] for r in _rows(task, "train") if r["label"] == wave}
    assert {en[s] for s in SKINS} <= trained  # every variant trained on, under its own label
    for written in streams.values():
        for w in written:
            assert not {en[s] for s in SKINS} & {r["caption"] for r in _rows(w.task, "test")}


def test_captions_test_one_label_per_image_train_label_and_tags(streams, roots):
    task = streams["emoji-groups"][0].task
    test, train = _rows(task, "test"), _rows(task, "train")
    assert len(test) == len({r["image"] for r in test}) and all(r["caption"] == r["label"] for r in test)
    by_image = {}
    for r in train:
        by_image.setdefault(r["image"], []).append(r["caption"])
    tagged = [c for c in by_image.values() if len(c) > 1]
    assert tagged and all(len(c) <= 1 + emoji.TAG_CAPTIONS and len(c[1].split(", ")) <= emoji.TAGS_PER_CAPTION
                          for c in tagged)
    # written again with the same seed: the same captions
    assert emoji.captions_for("l", ["a", "b", "c", "d"], 3, "en:X", False) == \
        emoji.captions_for("l", ["a", "b", "c", "d"], 3, "en:X", False)


def test_styles_show_the_same_concepts_in_a_new_look(streams):
    tasks = [w.task for w in streams["emoji-styles"]]
    assert [t.meta["metadata"]["style"] for t in tasks] == ["twemoji", "noto", "openmoji"]
    assert {t.kind for t in tasks} == {"domain"} and [t.meta["index"] for t in tasks] == [0, 1, 2]
    assert len({frozenset(_concepts(t, "test")) for t in tasks}) == 1
    pixels = [Image.open(t.root / _rows(t, "test")[0]["image"]).convert("RGB").getpixel((16, 16)) for t in tasks]
    assert len(set(pixels)) == 3
    corner = Image.open(tasks[2].root / _rows(tasks[2], "test")[0]["image"]).getpixel((0, 0))
    assert corner == (255, 255, 255)  # transparency onto white


def test_groups_bring_new_concepts_task_after_task(streams):
    tasks = [w.task for w in streams["emoji-groups"]]
    assert [t.name.split("-", 3)[-1] for t in tasks] == list(emoji.GROUP_TASKS)
    seen = [_concepts(t, "train") | _concepts(t, "test") for t in tasks]
    assert all(not a & b for i, a in enumerate(seen) for b in seen[i + 1:])
    assert all(w.counts["test_pairs"] < emoji.TARGET_TEST_PAIRS for w in streams["emoji-groups"])


def test_languages_caption_the_same_images_in_each_locale(streams, roots):
    written = streams["emoji-languages"]
    de, en = _labels(roots, "de"), _labels(roots, "en")
    for w, locale, labels in zip(written, ("de", "en"), (de, en)):
        task = w.task
        assert (task.kind, task.meta["lang"]) == ("language", locale)
        rows = _rows(task, "test")
        assert {r["caption"] for r in rows} <= set(labels.values()) and {r["lang"] for r in rows} == {locale}
        assert all(r["caption_en"] in en.values() for split in task.splits for r in _rows(task, split))
    assert [len(_rows(w.task, "test")) for w in written] == [len(_rows(written[0].task, "test"))] * 2
    assert all(r["caption"].startswith("auf Deutsch ") for r in _rows(written[0].task, "train"))


def test_an_image_drawn_like_a_test_concepts_is_not_trained_on(streams, roots):
    """Norway and Svalbard share a flag: one of the two is a test concept, the other's image is not trained on."""
    en = _labels(roots, "en")
    flags = {en[NORWAY], en[SVALBARD]}
    for w in streams["emoji-styles"][:2]:  # the PNG styles draw them alike
        assert len(_concepts(w.task, "test") & flags) == 1 and not _concepts(w.task, "train") & flags


def test_pretraining_corpus_is_icons_and_train_concepts_in_styles_no_stream_shows(streams, roots):
    [written] = streams["pretrain"]
    task = written.task
    assert task.name == "emoji-pretrain" and set(task.splits) == {"train", "test"}
    labels = {r["label"] for split in task.splits for r in _rows(task, split)}
    icons = {f"icon {k}" for k in range(10)}
    assert icons <= labels
    assert "icon 0 filled" in {r["caption"] for split in task.splits for r in _rows(task, split)}
    stream_tests = set().union(*(_concepts(w.task, "test") for w in streams["emoji-styles"]))
    stream_trains = set().union(*(_concepts(w.task, "train") for w in streams["emoji-styles"]))
    named = {label.removesuffix(" 2") for label in labels - icons}  # an icon named as a concept, or its line art
    assert named == stream_trains and not named & stream_tests
    assert f"{len(stream_tests)} icon images left out" in task.meta["metadata"]["protocol"]["corpus"]
    # each emoji concept in every colour style no stream shows (Iconify's sets, an icon reached through an alias
    # included), and in OpenMoji's line art but where it is drawn like a test concept
    images = {}
    for split in task.splits:
        for r in _rows(task, split):
            images.setdefault(r["label"], set()).add(r["image"]) if r["label"] in named else None
    styles = len(emoji.COLOUR_STYLES)
    assert images.keys() == named and {len(found) for found in images.values()} == {styles, styles + 1}
    n = len(named)
    line_art = sum(len(found) == styles + 1 for found in images.values())
    assert ", ".join(f"{style} {n}" for style in emoji.COLOUR_STYLES) + f", openmoji-black {line_art}" \
        in task.meta["metadata"]["protocol"]["corpus"]


def test_task_yaml_records_protocol_sources_and_licences(streams):
    for written in streams.values():
        for w in written:
            meta = yaml.safe_load((w.task.root / "task.yaml").read_text(encoding="utf-8"))["metadata"]
            assert {"split", "captions", "images"} <= set(meta["protocol"])
            assert meta["protocol"]["split"]["seed"] == 3 and meta["protocol"]["split"]["test_fraction"] == 0.5
            assert meta["counts"] == w.counts and w.counts["test_pairs"] == len(_rows(w.task, "test"))
            sources = {s["source"]: s for s in meta["sources"]}
            assert "emoji-captions" in sources and all(s["licence"] and s["attribution"] for s in sources.values())
            assert all(p.endswith("@1.2.3") for s in sources.values() for p in s["packages"])
    styles = {s["source"]: s["licence"] for w in streams["emoji-styles"] for s in w.task.meta["metadata"]["sources"]}
    assert "CC-BY-4.0" in styles["twemoji"] and "Apache-2.0" in styles["noto"] and styles["openmoji"] == "CC-BY-SA-4.0"


def test_svg_is_rasterised_at_the_requested_size(roots):
    image = emoji.render(roots["openmoji"] / "color" / "svg" / f"{WAVE}.svg", 48)
    assert image.size == (48, 48) and image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


def test_a_locale_the_captions_lack_is_refused_and_writes_nothing(roots, tmp_path):
    with pytest.raises(DataError, match="no locale 'xx'.*choose from de, en"):
        emoji.write_stream("emoji-languages", tmp_path / "out", roots, langs=["en", "xx"], progress=False)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def fetched(roots, monkeypatch):
    """`data fetch` done: package_dir answers with the small folders."""
    from clipstream.training.data import sources

    monkeypatch.setattr(sources, "package_dir", lambda settings, name, package=None: roots[package])


def test_cli_writes_a_stream_and_prints_its_counts(fetched, tmp_path, capsys):
    out = tmp_path / "groups"
    assert main(["data", "stream", "emoji-groups", "--out", str(out), "--image-size", "24", "--test-fraction", "0.5",
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [t["task"] for t in printed["tasks"]] == [f"emoji-groups-{i:02d}-{g}" for i, g in enumerate(emoji.GROUP_TASKS)]
    for t in printed["tasks"]:
        assert main(["data", "check", "--task", t["path"]]) == 0
    capsys.readouterr()
    assert main(["data", "stream", "pretrain", "--out", str(tmp_path / "pre"), "--image-size", "24"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith(f"{tmp_path / 'pre' / 'emoji-pretrain'}: train ")
    assert "test galleries under 500 pairs: emoji-pretrain (" in printed.err


@pytest.mark.parametrize("argv, message", [
    (["emoji-languages", "--langs", "en", "xx"], "no locale 'xx'"),
    (["emoji-styles", "--langs", "de"], "--langs chooses the locales of emoji-languages"),
])
def test_cli_bad_input_is_one_line_exit_2(fetched, tmp_path, capsys, argv, message):
    assert main(["data", "stream", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_cli_refuses_a_folder_that_is_not_empty_and_leaves_it(fetched, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert main(["data", "stream", "pretrain", "--out", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_cli_unknown_stream_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["data", "stream", "emoji-colours", "--out", "x"])
    assert exit.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_cli_takes_every_stream_of_the_module():
    from clipstream.cli.parser import parser

    assert [parser().parse_args(["data", "stream", name, "--out", "x"]).name for name in emoji.STREAMS] == \
        list(emoji.STREAMS)
