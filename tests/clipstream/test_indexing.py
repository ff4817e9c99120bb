"""The indexing job: a 3-task stream's versions (registered in MLflow without training: indexing needs versions and
their lineage, not trained weights), indexed from the CLI under both policies on both backends, and evaluation
through the index checked against the in-memory evaluator."""

import hashlib
import shutil

import numpy as np
import pytest

from clipstream import models
from clipstream.cli import main
from clipstream.index import open_index
from clipstream.indexing import evaluate_through_index, index_task
from clipstream.registry import Registry
from clipstream.training import evaluate
from clipstream.training.data.task import DataError, Task

pytestmark = pytest.mark.component  # Ray Data jobs on the session's Ray instance

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Versions 1..3 of a stream over three small synthetic tasks, each version's lineage the tasks up to its own
    (registered as `clipstream train` registers them, with models made without training)."""
    from clipstream.settings import Settings
    from clipstream.training.data.synth import synthesize
    from tests.conftest import register_version

    root = tmp_path_factory.mktemp("indexing")
    dirs = synthesize(root / "data", tasks=3, seed=5, train_pairs=800, test_per_task=12, digits=False, held_out=False,
                      progress=False)
    settings = Settings(home=root / "home").ensure_dirs()
    for k in range(3):
        register_version(settings, seed=k + 1, task_dirs=dirs[:k + 1], parent=str(k) if k else "")
    return settings, dirs


def _checksums(index, task):
    return {m: hashlib.sha256(repr(sorted(index.points(task, m).items())).encode()).hexdigest() for m in ("image", "text")}


def _backend(settings, backend, tmp_path, ray: bool = False):
    """Settings for a fresh index on `backend`; galleries embedded as Ray Data jobs when `ray`, else (they are
    small) in the calling process."""
    update = {"index_ray_min_rows": 0} if ray else {}
    if backend == "edge":
        return settings.model_copy(update={**update, "qdrant_path": tmp_path / "edge"})
    return settings.model_copy(update={**update, "qdrant_url": f"local:{tmp_path / 'server'}"})


@pytest.mark.parametrize("backend", ["edge", "server"])
def test_no_reindex_appends_each_task_with_its_own_version(trained, backend, tmp_path, monkeypatch, capsys):
    settings, dirs = trained
    settings = _backend(settings, backend, tmp_path)
    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)
    before = None
    for version, folder in zip(("1", "2", "3"), dirs):
        assert main(["index", "--version", version, "--task", str(folder), "--policy", "no-reindex"]) == 0
        index = open_index(settings)
        try:
            if before is not None:
                assert _checksums(index, "task-00-household") == before  # earlier points untouched
            before = _checksums(index, "task-00-household")
            state = index.state()
        finally:
            index.close()
    assert state["generation"] == 1
    assert {t: e["model_version"] for t, e in state["tasks"].items()} == {
        "task-00-household": "1", "task-01-furnishing": "2", "task-02-food": "3"}
    with open_index(settings) as index:  # each image point names the task's image file
        task = Task.load(dirs[0])
        files = {str(r["id"]): str(task.root / r["image"]) for r in task.check("test").rows}
        dim = index.state()["dim"]
        hits = index.search(np.full(dim, dim ** -0.5, np.float32), "image", "task-00-household", 5)
        assert hits and all(h.image_uri == files[h.item_id] for h in hits)
    assert "task-02-food" in capsys.readouterr().out
    assert Registry(settings).resolve("3", download=False).tags["index_policy"] == "no-reindex"

    # evaluation through the index: old galleries from old versions, queries from version 3
    assert main(["eval", "--version", "3", "--through-index"]) == 0
    assert "through the index" in capsys.readouterr().out


@pytest.mark.parametrize("backend, ray", [("edge", True), ("server", False)])
def test_reindex_matches_the_in_memory_evaluator(trained, backend, ray, tmp_path, monkeypatch, request):
    settings, dirs = trained
    if ray:  # the galleries embedded by Ray Data jobs on the session's Ray instance
        request.getfixturevalue("ray_cluster")
    settings = _backend(settings, backend, tmp_path, ray)
    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)
    assert main(["index", "--version", "1", "--task", str(dirs[0])]) == 0
    assert main(["index", "--version", "3", "--task", str(dirs[2]), "--policy", "reindex"]) == 0
    with open_index(settings) as index:
        state = index.state()
    assert state["generation"] == 2
    assert {e["model_version"] for e in state["tasks"].values()} == {"3"}
    assert list(state["tasks"]) == ["task-00-household", "task-02-food"]

    bundle = models.load_exported(Registry(settings).resolve("3").folder)
    tasks = [Task.load(dirs[0]), Task.load(dirs[2])]
    index = open_index(settings)
    try:
        through = evaluate_through_index(index, bundle, tasks)
    finally:
        index.close()
    direct = evaluate.evaluate_seen([evaluate.embed_task(bundle, t) for t in tasks])
    for mode in ("known", "unknown"):
        for name in direct[mode]:
            assert through[mode][name] == pytest.approx(direct[mode][name], abs=1e-9), (mode, name)


def test_the_index_and_the_evaluation_agree_on_a_language_stream_under_both_policies(tmp_path):
    """A language stream (the same images in every task, each task its own copy of the files): ranked through a
    Qdrant index under each policy, the scores are the in-memory evaluator's (reindex: `evaluate_seen`; no-reindex:
    each task's gallery as its own version embedded it, the rows `job.evaluate_version` logs): one rule of
    positives, the same image in another language's gallery a hit. Under reindex the union's copies of an image are
    one image: text->image task-unknown R@1 is the task-known one."""
    from dataclasses import replace

    from clipstream.indexing import put_lineage
    from clipstream.settings import Settings
    from clipstream.training.data.synth import synthesize_languages
    from tests.conftest import register_version

    dirs = synthesize_languages(tmp_path / "langs", 2, seed=1, train_pairs=40, test_per_task=12, progress=False)
    settings = Settings(home=tmp_path / "home").ensure_dirs()
    for k in range(2):
        register_version(settings, seed=k + 1, task_dirs=dirs[:k + 1], parent=str(k) if k else "")
    registry = Registry(settings)
    no_reindex = settings.model_copy(update={"qdrant_path": tmp_path / "no-reindex"})
    for k, folder in enumerate(dirs):
        index_task(no_reindex, str(k + 1), folder, "no-reindex")
    reindex = settings.model_copy(update={"qdrant_path": tmp_path / "reindex", "index_policy": "reindex"})
    put_lineage(reindex, registry.resolve("2"))

    bundles = [models.load_exported(registry.resolve(str(k + 1)).folder) for k in range(2)]
    tasks = [Task.load(d) for d in dirs]
    queries = evaluate.embed_tasks(bundles[-1], tasks)
    own = [evaluate.embed_task(b, t) for b, t in zip(bundles, tasks)]
    expected = {"reindex": evaluate.evaluate_seen(queries),
                "no-reindex": evaluate.evaluate_seen(queries, [replace(q, img=o.img, txt=o.txt)
                                                               for q, o in zip(queries, own)])}
    for policy, where in (("reindex", reindex), ("no-reindex", no_reindex)):
        with open_index(where) as index:
            through = evaluate_through_index(index, bundles[-1], tasks)
        for mode in ("known", "unknown"):
            for name in expected[policy][mode]:
                assert through[mode][name] == pytest.approx(expected[policy][mode][name], abs=1e-9), (policy, mode)
    for name, scores in expected["reindex"]["unknown"].items():
        assert scores["t2i_R@1"] == expected["reindex"]["known"][name]["t2i_R@1"]


def test_reindex_is_refused_when_an_indexed_tasks_data_is_gone(trained, tmp_path):
    settings, dirs = trained
    settings = _backend(settings, "edge", tmp_path)
    index_task(settings, "2", dirs[0], "no-reindex")
    moved = tmp_path / "moved"
    shutil.move(str(dirs[0]), moved)
    try:
        with pytest.raises(DataError, match="reindex refused: the raw data of task 'task-00-household' is gone"):
            index_task(settings, "2", dirs[1], "reindex")
    finally:
        shutil.move(str(moved), dirs[0])
    index = open_index(settings)
    try:
        assert index.state()["generation"] == 1 and list(index.state()["tasks"]) == ["task-00-household"]
    finally:
        index.close()


def test_indexing_a_task_the_version_never_saw_is_refused(trained, tmp_path):
    settings, dirs = trained
    with pytest.raises(ValueError, match="version 1 was not trained through task 'task-02-food'"):
        index_task(_backend(settings, "edge", tmp_path), "1", dirs[2], "no-reindex")
    with pytest.raises(ValueError, match="policy must be one of"):
        index_task(settings, "1", dirs[0], "sometimes")


def test_reindex_reuses_stored_image_vectors_only_when_they_come_from_the_same_image_tower(trained, tmp_path):
    from dataclasses import replace

    from clipstream.indexing import _regallery

    settings, dirs = trained
    settings = _backend(settings, "edge", tmp_path)
    index_task(settings, "1", dirs[0], "no-reindex")
    registry = Registry(settings)
    v3 = registry.resolve("3")
    assert v3.image_tower == "3"  # a version that trained its image tower (as EWC, Mod-X and CTP do)
    # a version that kept version 1's image tower (as CLL-CLIP versions keep their parent's), and one that kept
    # version 2's: the stored vectors (made by version 1) are the first's, not the second's
    same, other = (replace(v3, tags={**v3.tags, "image_tower": t}) for t in ("1", "2"))
    lineage = {e["task"]: (i, e) for i, e in enumerate(v3.lineage)}
    with open_index(settings) as index:
        stored = index.points("task-00-household", "image")
        reused = _regallery(index, registry, same, "task-00-household", lineage, "test", settings.index_ray_min_rows)
        fresh = _regallery(index, registry, other, "task-00-household", lineage, "test", settings.index_ray_min_rows)
        measured = _regallery(index, registry, same, "task-00-household", lineage, "test", settings.index_ray_min_rows,
                              reuse_images=False)
    assert [reused.image[i].tobytes() for i in range(len(reused.item_ids))] == [stored[i][0] for i in reused.item_ids]
    assert not (fresh.image == reused.image).all()  # version 3's own image tower embeds differently
    assert (fresh.image == measured.image).all()
    assert (fresh.text == reused.text).all()  # text is always re-embedded by the new version


def test_the_ray_data_job_and_the_in_process_path_embed_alike(trained, ray_cluster):
    """Small galleries skip the Ray Data job (Settings.index_ray_min_rows): both paths give one gallery."""
    from clipstream.indexing import embed_gallery

    settings, dirs = trained
    version, task = Registry(settings).resolve("2"), Task.load(dirs[1])
    by_ray = embed_gallery(version, task, 1, ray_min_rows=0)
    here = embed_gallery(version, task, 1, ray_min_rows=10**6)
    assert by_ray.item_ids == here.item_ids and by_ray.captions == here.captions and len(here.item_ids) == 12
    assert np.allclose(by_ray.image, here.image, atol=1e-6) and np.allclose(by_ray.text, here.text, atol=1e-6)


def test_embedding_actors_asking_more_gpus_than_the_cluster_has_are_refused_before_the_job(trained, ray_cluster):
    from clipstream.indexing import embed_gallery

    settings, dirs = trained
    version, task = Registry(settings).resolve("2"), Task.load(dirs[1])
    with pytest.raises(ValueError, match="index_gpus=1 but the cluster has 0 GPUs: lower CLIPSTREAM_INDEX_GPUS"):
        embed_gallery(version, task, 1, ray_min_rows=0, gpus=1)
    with pytest.raises(ValueError, match="fp16 needs a GPU"):  # refused here, not in every Ray task
        embed_gallery(version, task, 1, ray_min_rows=0, precision="fp16")


def _gallery_task(root, n: int, fmt: str) -> Task:
    """A task whose test split has n pairs, as image files + jsonl or as two WebDataset shards."""
    import io
    import json
    import tarfile

    import yaml
    from PIL import Image

    def png(k):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(buf, format="PNG")
        return buf.getvalue()

    root.mkdir(parents=True)
    if fmt == "jsonl":
        (root / "images").mkdir()
        for k in range(n):
            (root / f"images/{k}.png").write_bytes(png(k))
        (root / "test.jsonl").write_text("".join(json.dumps({"id": f"g{k:03d}", "image": f"images/{k}.png",
                                                             "caption": f"caption {k}"}) + "\n" for k in range(n)))
        split = "test.jsonl"
    else:
        (root / "shards").mkdir()
        for shard in range(2):
            with tarfile.open(root / f"shards/test-{shard}.tar", "w") as tar:
                for k in range(shard, n, 2):
                    for name, data in ((f"g{k:03d}.png", png(k)), (f"g{k:03d}.txt", f"caption {k}".encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        split = "shards/*.tar"
    (root / "task.yaml").write_text(yaml.safe_dump({"name": f"gallery-{fmt}", "splits": {"test": split}}))
    return Task.load(root)


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset"])
def test_a_gallery_of_several_blocks_is_embedded_by_a_pool_of_actors_in_the_splits_order(ray_cluster, tmp_path, fmt,
                                                                                       monkeypatch):
    """The Ray Data job cuts the split into blocks that a pool of actors (one per CPU) embeds in any order; the
    gallery comes back in the split's row order, each row with its own vectors, as the in-process path gives it."""
    from types import SimpleNamespace

    from clipstream import indexing

    monkeypatch.setattr(indexing, "BLOCK_ROWS", 20)  # 70 pairs: 4 blocks over the session's 2 CPUs
    folder = tmp_path / "model"
    models.export(models.create("clipstream-vit-tiny"), folder)
    version = SimpleNamespace(folder=folder, version="7")
    task = _gallery_task(tmp_path / "task", 70, fmt)
    by_ray = indexing.embed_gallery(version, task, 0, ray_min_rows=0)
    here = indexing.embed_gallery(version, task, 0, ray_min_rows=10**6)
    assert by_ray.item_ids == here.item_ids == [str(r["id"]) for r in task.check("test").rows]
    assert sorted(by_ray.item_ids) == [f"g{k:03d}" for k in range(70)] and by_ray.model_version == "7"
    assert by_ray.captions == here.captions
    assert np.allclose(by_ray.image, here.image, atol=1e-5) and np.allclose(by_ray.text, here.text, atol=1e-5)
    # the job turns Ray Data's per-operator CPU reservation off for itself only: other datasets keep the default
    assert ray_cluster.data.DataContext.get_current().op_resource_reservation_enabled


def test_promotion_keeps_catalogues_under_no_reindex_and_embeds_them_again_under_reindex(tmp_path):
    """Items users added (a catalogue) are no task of a lineage: putting a version's gallery in place keeps them as
    their version embedded them under no-reindex, and embeds them again from their stored items (images, texts,
    fields, URIs) under reindex, in the same atomic generation as the trained tasks."""
    from clipstream import catalogue
    from clipstream.indexing import put_lineage
    from clipstream.settings import Settings
    from clipstream.training.data.synth import synthesize
    from tests.conftest import register_version
    from tests.services.conftest import png

    dirs = synthesize(tmp_path / "tasks", tasks=2, seed=3, train_pairs=100, test_per_task=6, digits=False,
                      held_out=False, progress=False)
    settings = Settings(home=tmp_path / "home", index_fields={"brand": "keyword"}).ensure_dirs()
    for k in range(2):
        register_version(settings, seed=k + 1, task_dirs=dirs[:k + 1], parent=str(k) if k else "")
    registry = Registry(settings)
    v1, v2 = registry.resolve("1"), registry.resolve("2")
    put_lineage(settings, v1)
    store = catalogue.Catalogue.of(settings, "mugs")
    items = [catalogue.Item("m-0", text="a red mug", metadata={"brand": "acme"}),
             catalogue.Item("m-1", image=store.put_image(png("navy")), image_uri="https://shop/m-1.png"),
             catalogue.Item("m-2", text="a green mug", image=store.put_image(png("green")))]
    for it in items:
        it.image_uri = it.image_uri or (str(store.image_path(it)) if it.image else "")
    bundles = {v: models.load_exported(registry.resolve(v).folder) for v in ("1", "2")}

    def embedded(version):
        bundle = bundles[version]
        return catalogue.vectors("mugs", version, items, bundle.embed_images([store.image_path(i) for i in items
                                                                                if i.image]),
                                 bundle.embed_texts([i.text for i in items if i.text]))

    with open_index(settings) as index:
        index.upsert(embedded("1"))
    store.write({i.item_id: i for i in items})
    with open_index(settings) as index:
        kept = {m: index.points("mugs", m) for m in ("image", "text")}

    put_lineage(settings, v2)  # no-reindex: the new task appended, the catalogue as version 1 made it
    with open_index(settings) as index:
        state = index.state()
        assert state["tasks"]["mugs"]["model_version"] == "1" and state["query_version"] == "2"
        assert {m: index.points("mugs", m) for m in ("image", "text")} == kept

    reindex = settings.model_copy(update={"index_policy": "reindex"})
    put_lineage(reindex, v2)
    expected = embedded("2")
    with open_index(settings) as index:
        state = index.state()
        assert {t: m["model_version"] for t, m in state["tasks"].items()} == {
            dirs[0].name: "2", dirs[1].name: "2", "mugs": "2"} and state["generation"] == 2
        assert state["tasks"]["mugs"]["kind"] == "catalogue"
        for modality, rows in (("image", expected.image), ("text", expected.text)):
            points = index.points("mugs", modality)
            ids = expected.ids(modality)
            assert sorted(points) == sorted(ids)
            stored = np.stack([np.frombuffer(points[i][0], np.float32) for i in ids])
            np.testing.assert_allclose(stored, rows / np.linalg.norm(rows, axis=1, keepdims=True), atol=1e-5)
        assert index.points("mugs", "image")["m-1"][1]["image_uri"] == "https://shop/m-1.png"
        assert index.points("mugs", "text")["m-0"][1]["meta"] == {"brand": "acme"}
    # a rollback to version 1 under reindex carries the catalogue back too
    put_lineage(reindex, v1)
    with open_index(settings) as index:
        assert {t: m["model_version"] for t, m in index.state()["tasks"].items()} == {dirs[0].name: "1", "mugs": "1"}
