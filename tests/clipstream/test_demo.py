"""`clipstream demo`'s emoji world, in process: its stream (written from the small source folders of
tests/training/data/test_emoji.py), the catalogue it searches and its hits by name, and the one line that sends it to
the synthetic world when the npm registry cannot be reached. The real run (fetch, training, serving, the searches
each finding their emoji): tests/benchmarks/test_first_run.py."""

import pytest

from clipstream.cli import demo, main
from clipstream.cli.parser import parser
from clipstream.cli.render import format_hits
from clipstream.training.data import emoji, sources
from tests.training.data.test_emoji import roots  # noqa: F401  (the fixture: the packages in their real layouts)

SEED, FRACTION = 3, 0.5


def _labels(tasks, split: str) -> set[str]:
    return {r["label"] for t in tasks for r in t.check(split).rows}


@pytest.fixture
def searched(roots, monkeypatch):  # noqa: F811
    """The demo's searches on the small folders: one for a concept the shared split holds out, one for a trained one;
    6 of the 10 concepts of food-drink, animals-nature and flags."""
    cat = emoji.read_catalogue(roots["emojibase-data"], ["de"], {})
    test = emoji.concept_split(cat, SEED, FRACTION)
    label = {k: cat.captions["en"][k][0] for k in cat.groups}
    held = min(label[k] for k in test if cat.groups[k] == "food-drink")
    trained = min(label[k] for k in cat.groups if cat.groups[k] == "animals-nature" and k not in test)
    monkeypatch.setattr(emoji, "DEMO_SEARCHES", {"a held-out one": held, "ein trainiertes": trained})
    monkeypatch.setattr(emoji, "DEMO_CONCEPTS", 6)
    return {"held": held, "trained": trained, "test": {label[k] for k in test}}


def test_the_demo_stream_is_german_then_english_of_a_few_concepts_its_searched_ones_trained_on(roots, searched, tmp_path):  # noqa: F811
    written = emoji.write_stream(emoji.DEMO_STREAM, tmp_path / "demo", roots, seed=SEED, test_fraction=FRACTION,
                                 image_size=32, progress=False)
    tasks = [w.task for w in written]
    assert [t.name for t in tasks] == ["emoji-demo-00-de", "emoji-demo-01-en"]
    assert [(t.kind, t.meta["lang"]) for t in tasks] == [("language", "de"), ("language", "en")]
    assert all(r["caption"].startswith("auf Deutsch ") for r in tasks[0].check("train").rows)
    for split in ("train", "test"):  # the same concepts in both tasks, on the same side
        assert _labels(tasks[:1], split) == _labels(tasks[1:], split)
    concepts = _labels(tasks, "train") | _labels(tasks, "test")
    assert len(concepts) == 6 and all(c.startswith(("food drink", "animals nature", "flags")) for c in concepts)
    # the searched ones are trained on, the one the shared split holds out too; the rest of the split stands
    assert {searched["held"], searched["trained"]} <= _labels(tasks, "train")
    assert _labels(tasks, "test") and _labels(tasks, "test") <= searched["test"] - {searched["held"]}
    note = tasks[0].meta["metadata"]["protocol"]["split"]["demo"]
    assert searched["held"] in note and searched["trained"] in note
    again = emoji.write_stream(emoji.DEMO_STREAM, tmp_path / "again", roots, seed=SEED, test_fraction=FRACTION,
                               image_size=32, progress=False)
    assert _labels([w.task for w in again], "train") == _labels(tasks, "train")  # seeded


def test_the_demo_searches_each_image_once_and_names_its_hits(roots, searched, tmp_path):  # noqa: F811
    written = emoji.write_stream(emoji.DEMO_STREAM, tmp_path / "demo", roots, seed=SEED, test_fraction=FRACTION,
                                 image_size=32, progress=False)
    items = demo.gallery(written[-1].task.root)
    assert len(items) == len({i["item_id"] for i in items}) == len({i["image"] for i in items}) == 6
    assert all(i["image"].is_file() for i in items)
    assert {i["label"] for i in items} == _labels([written[-1].task], "train") | _labels([written[-1].task], "test")
    names = {i["item_id"]: i["label"] for i in items}
    first = items[0]["item_id"]
    hits = [{"item_id": first, "task": "demo-emoji-v2", "score": 0.9, "model_version": "2", "index_generation": 1,
             "caption": None, "image_uri": "/x.png", "query_model_version": "2"}]
    shown = format_hits(hits, "red apple", "demo-emoji-v2", names=names).splitlines()
    assert shown[0] == "query 'red apple', task-known (demo-emoji-v2), encoded by version 2"
    assert shown[1].endswith("name") and shown[2].endswith(f"  {names[first]}")
    assert format_hits(hits, "q", None).splitlines()[2].endswith("  /x.png")  # without names: as before


def _registry_down(settings, names, **options):
    raise sources.RegistryError("emoji-datasource-twitter@16.0.0: the npm registry at http://127.0.0.1:9 cannot be "
                                "reached (Connection refused): check the network, or set CLIPSTREAM_NPM_REGISTRY to a\n"
                                "mirror")


def test_a_registry_that_cannot_be_reached_is_one_line_and_the_synthetic_world(settings, monkeypatch, capsys):
    monkeypatch.setattr(sources, "fetch", _registry_down)
    assert demo.emoji_roots(settings) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("clipstream demo: emoji-datasource-twitter@16.0.0: the npm "
                                                   "registry at http://127.0.0.1:9 cannot be reached")
    assert err.rstrip().endswith(demo.FALLBACK)

    class Synthesised(Exception):
        pass

    made = []

    def synthesize(out, tasks, seed):  # the synthetic world chosen: no further (training is the real run's)
        made.append(tasks)
        raise Synthesised

    from clipstream.training.data import synth

    monkeypatch.setattr(synth, "synthesize", synthesize)
    with pytest.raises(Synthesised):
        demo._demo(parser().parse_args(["demo", "--no-serve", "--out", str(settings.home / "d")]))
    assert made == [demo.SYNTHETIC_TASKS]
    out, err = capsys.readouterr()
    assert err.count(demo.FALLBACK) == 1 and len(err.strip().splitlines()) == 1
    assert f"== synthesising {demo.SYNTHETIC_TASKS} domain tasks + the digits task under" in out


def test_the_emoji_world_refuses_tasks_before_fetching_anything(settings, monkeypatch, capsys):
    monkeypatch.setattr(sources, "fetch", lambda *a, **k: pytest.fail("fetched"))
    assert main(["demo", "--tasks", "2", "--no-serve"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--tasks sets the synthetic world's domain tasks" in err
