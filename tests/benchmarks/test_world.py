"""`clipstream bench world`: its words-and-pixels floor on small made-up tasks (it finds what shared words and
pixels point to, and is chance where they point nowhere), its table rows, the preset's image size, the candidates'
probe, and bad options refused before anything runs."""

import io

from PIL import Image

from clipstream.benchmarks import world
from clipstream.training.data.importers import Pair, import_task


COLOURS = {"red": (220, 20, 20), "blue": (20, 20, 220), "green": (20, 200, 20), "yellow": (230, 230, 20),
           "grey": (128, 128, 128), "purple": (128, 0, 128)}


def _task(root, name, rows, split):
    # pixels that differ in layout as well as colour (the floor centres each thumbnail: a flat colour would be zero)
    pairs = []
    for n, (caption, colour) in enumerate(rows):
        image = Image.new("RGB", (8, 8), "white")
        image.paste(COLOURS[colour], (0, 0, 8, 4))
        image.putpixel((n % 8, 4 + n // 8 % 4), (0, 0, 0))  # (every image its own: identical ones are one positive)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pairs.append(Pair(f"{name}:{n}", buffer.getvalue(), caption, split, f"{name}-{n}"))
    import_task(pairs, root / name, name, split=split)
    return root / name


def test_the_floor_follows_the_words_a_query_shares_with_the_corpus_to_their_pictures(tmp_path):
    corpus = _task(tmp_path, "corpus", [("red apple", "red"), ("blue car", "blue"), ("green tree", "green"),
                                        ("yellow sun", "yellow")], "train")
    task = _task(tmp_path, "unseen", [("apple pie", "red"), ("car park", "blue"), ("tree house", "green"),
                                      ("sun hat", "yellow")], "test")
    from clipstream.training.data.task import Task

    [scores] = world.floor_scores(corpus, [Task.load(task)], seed=0).values()
    # each query shares one word with one corpus pair, whose picture is its own image's: first, both ways
    assert scores == {f"{d}_R@{k}": 100.0 for d in ("i2t", "t2i") for k in (1, 5, 10)}


def test_the_floor_is_chance_where_no_word_is_shared(tmp_path):
    corpus = _task(tmp_path, "corpus", [("red apple", "red")], "train")
    gallery = [(f"thing {n}", colour) for n, colour in enumerate(COLOURS)] * 5
    task = _task(tmp_path, "unseen", [(f"other {n}", c) for n, (_, c) in enumerate(gallery)], "test")
    from clipstream.training.data.task import Task

    [scores] = world.floor_scores(corpus, [Task.load(task)], seed=0).values()
    # every query scores every image 0: the random tie-break ranks its own image uniformly (30 images)
    assert scores["t2i_R@1"] < 20 and 10 <= scores["t2i_R@10"] <= 60


def test_rows_put_version_0_beside_its_floors_and_chance(tmp_path):
    task = _task(tmp_path, "t", [(f"c{n}", "red") for n in range(20)], "test")
    from clipstream.training.data.task import Task

    metrics = {f"{d}_R@{k}": float(k) for d in ("i2t", "t2i") for k in (1, 5, 10)}
    rows = world._rows(Task.load(task), metrics, metrics)
    assert [r[2] for r in rows] == ["version 0", "words and pixels (floor)", "chance"]
    assert rows[0][-1] == "**10.0**" and rows[2][3:] == ["5.0", "25.0", "50.0", "50.0"]


def test_the_preset_names_a_model_whose_image_size_the_streams_are_written_at():
    from clipstream.training import methods

    arch = methods.resolve(world.PRESET)["model"]["arch"]
    assert world._image_size(arch) == 32


def test_a_probe_trains_its_model_for_the_seconds_it_is_given(tmp_path):
    import time

    import torch

    from clipstream import models
    from clipstream.training import methods
    from clipstream.training.data.task import Task

    corpus = Task.load(_task(tmp_path, "corpus", [(f"{c} thing {n}", c) for n in range(8) for c in COLOURS], "train"))
    train = {**methods.resolve(world.PRESET)["train"], "micro_batch": 8}
    torch.manual_seed(0)
    before = models.create("clipstream-vit-tiny").model.state_dict()
    tic = time.perf_counter()
    trained = world.probe("clipstream-vit-tiny", corpus, train, seconds=3)
    took = time.perf_counter() - tic
    assert 3 <= took < 3 + 20  # (model creation and the loader's worker start-up besides)
    after = trained["bundle"].model.state_dict()
    assert not torch.equal(before["visual.proj"], after["visual.proj"]) and not trained["bundle"].model.training
    assert trained["rate"] > 0 and trained["epochs"] > 0
    assert trained["params"] == sum(p.numel() for p in trained["bundle"].model.parameters())


def test_bad_options_are_refused_before_anything_is_fetched_or_trained(monkeypatch):
    import pytest

    monkeypatch.setattr(world, "data", lambda *a, **k: pytest.fail("fetched before checking the options"))
    with pytest.raises(ValueError, match="--streams: unknown emoji-colours; choose from emoji-styles"):
        world.main(["--streams", "emoji-styles,emoji-colours"])
    with pytest.raises(ValueError, match="--candidates -1: give the minutes"):
        world.main(["--candidates", "-1"])


def test_the_candidates_are_the_presets_model_with_one_change_each():
    from clipstream.training import methods

    configs = world.candidate_configs(methods.resolve(world.PRESET)["model"]["arch"])
    preset = configs.pop("preset")
    assert preset["vision_cfg"]["image_size"] == 32 and set(configs) == {"48 px", "width 192", "8+8 layers"}
    assert configs["48 px"] == {**preset, "vision_cfg": {**preset["vision_cfg"], "image_size": 48}}
    assert configs["8+8 layers"]["text_cfg"] == {**preset["text_cfg"], "layers": 8}
    wide = configs["width 192"]
    assert (wide["embed_dim"], wide["vision_cfg"]["width"], wide["text_cfg"]["width"]) == (192, 192, 192)
    assert wide["vision_cfg"]["patch_size"] == preset["vision_cfg"]["patch_size"]  # (the rest as the preset's)
