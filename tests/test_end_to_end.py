"""The quick tier's one end-to-end path, every part real: a 2-task stream trained as Ray Train jobs on 2 DeepSpeed
workers (tests/conftest.py `two_tasks`), registered in MLflow, promoted behind its gates (which indexes the
stream's galleries in Qdrant Edge with a Ray Data job), served by Ray Serve and searched over gRPC.

The second path starts a stream from an existing model instead: a checkpoint registered as version 0, served with no
training, then trained on.

It replaces the session's shared served app, so the collection puts it after every test that uses that app."""

import numpy as np
import pytest

from clipstream import models
from clipstream.cli import main
from clipstream.index import open_index
from clipstream.promotion import history, promote
from clipstream.registry import PRODUCTION, Registry
from clipstream.runtime import free_port
from clipstream.training.data.task import Task
from tests.services.conftest import wait_serving

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def serving(two_tasks, tmp_path_factory):
    """The trained stream promoted to version 2 and served on a port of its own."""
    from ray import serve

    from clipstream.services import app
    from clipstream.services.client import Client

    trained, _, second = two_tasks
    settings = trained.model_copy(update={"grpc_port": free_port(), "serve_encoder_cpus": 0, "serve_search_cpus": 0,
                                          "index_ray_min_rows": 0})  # (the galleries embedded as Ray Data jobs)
    promoted = promote(settings, second.version)
    serve.shutdown()  # the shared app (its users ran before this module), if it ran
    app.start(settings)
    with Client(f"127.0.0.1:{settings.grpc_port}") as client:
        yield settings, client, promoted
    serve.shutdown()


def test_the_promoted_version_serves_its_stream_over_grpc(serving, two_tasks, stream, monkeypatch, capsys):
    settings, client, promoted = serving
    *_, second = two_tasks
    registry = Registry(settings)
    assert registry.resolve(PRODUCTION).version == second.version == "2"
    assert promoted["from_version"] == "" and not promoted["forced"] and all(g.passed for g in promoted["gates"])
    assert [(h["from_version"], h["to_version"]) for h in history(settings)] == [("", "2")]

    # the galleries promotion put in place: both tasks of the lineage, under version 2
    with open_index(settings) as index:
        state = index.state()
    tasks = [Task.load(d) for d in stream]
    assert {name: entry["model_version"] for name, entry in state["tasks"].items()} == {t.name: "2" for t in tasks}
    test_rows = {t.name: t.check("test").rows for t in tasks}
    assert {n: e["counts"]["image"] for n, e in state["tasks"].items()} == {n: len(r) for n, r in test_rows.items()}

    # serving: healthy (once the replicas have loaded the version and opened the gallery), queries encoded by the
    # production version exactly as the exported model encodes them
    wait_serving(client.channel)
    bundle = models.load_exported(registry.resolve("2").folder)
    captions = [r["caption"] for r in test_rows[tasks[1].name]]
    vectors, version = client.encode_text(captions)
    assert version == "2" and np.allclose(vectors, bundle.embed_texts(captions), atol=1e-5)

    # search over gRPC ranks the stored gallery as the model does in process: task-known and task-unknown
    images = {t.name: bundle.embed_images([t.root / r["image"] for r in test_rows[t.name]]) for t in tasks}
    for task in ("", tasks[1].name):
        scope = [tasks[1].name] if task else list(test_rows)
        ids = [r["id"] for name in scope for r in test_rows[name]]
        gallery = np.concatenate([images[name] for name in scope])
        for caption, query in zip(captions[:4], vectors[:4]):
            hits = client.search(text=caption, task=task, k=5)
            assert {h["model_version"] for h in hits} == {"2"} and {h["query_model_version"] for h in hits} == {"2"}
            scores = gallery @ query
            expected = [ids[i] for i in np.argsort(-scores)[:5]]
            assert hits[0]["item_id"] == expected[0], (task, caption)
            assert np.allclose([h["score"] for h in hits], np.sort(scores)[::-1][:5], atol=1e-4)

    # every test caption finds its own image in the top 5 through the service exactly when the version does in process
    # (how much the quick tier's 2-epoch model learns varies from run to run, around 1.5x chance on these 24 pairs:
    # learning is what the method benchmarks measure, with intervals; here, that serving ranks as the model does)
    rows = test_rows[tasks[1].name]
    found = [r["id"] in [h["item_id"] for h in client.search(text=r["caption"], task=tasks[1].name, k=5)] for r in rows]
    ranked = [[rows[i]["id"] for i in np.argsort(-(images[tasks[1].name] @ query))[:5]] for query in vectors]
    assert found == [r["id"] in top for r, top in zip(rows, ranked)] and any(found)

    # the command line reads the same service
    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)
    assert main(["search", captions[0], "--task", tasks[1].name, "-k", "3"]) == 0
    out = capsys.readouterr().out
    assert f"task-known ({tasks[1].name}), encoded by version 2" in out and len(out.strip().splitlines()) == 5
    assert main(["status"]) == 0
    assert "production v2" in capsys.readouterr().out


def test_version_0_from_a_checkpoint_is_indexed_promoted_served_and_trained_on(ray_cluster, stream, tmp_path, monkeypatch,
                                                                              capsys):
    """The issue's proof, from the command line: a checkpoint in open_clip's trainer format registered as version 0
    (`register --from`), indexed, promoted and served over gRPC with no training; then `train` on top of it, whose
    R matrix keeps row 0. (After the test above: it replaces that test's served app with its own.)"""
    import grpc
    import torch
    from ray import serve

    from clipstream.services import app
    from clipstream.services.client import Client
    from clipstream.settings import Settings
    from clipstream.training.data.synth import held_out_task
    from clipstream.training.evaluate import BASELINE, ResultMatrix
    from tests.conftest import FAST

    settings = Settings(home=tmp_path / "home", grpc_port=free_port(), serve_encoder_cpus=0,
                        serve_search_cpus=0).ensure_dirs()
    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)
    torch.manual_seed(7)
    pretrained = models.create("clipstream-vit-tiny")
    checkpoint = tmp_path / "epoch_32.pt"  # as open_clip's trainer saves it (the DDP-wrapped model's state)
    torch.save({"epoch": 32, "state_dict": {f"module.{k}": v for k, v in pretrained.model.state_dict().items()}},
               checkpoint)
    tasks = [Task.load(d) for d in stream]

    assert main(["register", "--from", f"clipstream-vit-tiny:{checkpoint}", "--evaluate", *map(str, stream),
                 "--zero-shot", str(held_out_task(stream[0].parent)), "--alias", "start"]) == 0
    assert "registered version 1 (alias candidate)" in capsys.readouterr().out
    assert main(["index", "--version", "start", "--task", str(stream[0])]) == 0
    assert main(["promote", "start"]) == 0  # (puts the rest of its gallery in place: the tasks of its row 0)
    assert "production: none -> v1 [promote]" in capsys.readouterr().out
    with open_index(settings) as index:
        assert {n: t["model_version"] for n, t in index.state()["tasks"].items()} == {t.name: "1" for t in tasks}

    serve.shutdown()  # the app of the test above
    app.start(settings)
    try:
        with Client(f"127.0.0.1:{settings.grpc_port}") as client:
            wait_serving(client.channel)
            rows = {t.name: t.check("test").rows for t in tasks}
            images = {t.name: pretrained.embed_images([t.root / r["image"] for r in rows[t.name]]) for t in tasks}
            caption = rows[tasks[0].name][0]["caption"]
            query = pretrained.embed_texts([caption])[0]
            for task in (tasks[0].name, ""):  # task-known, then task-unknown over both galleries
                scope = [task] if task else list(rows)
                ids = [r["id"] for name in scope for r in rows[name]]
                scores = np.concatenate([images[name] for name in scope]) @ query
                hits = client.search(text=caption, task=task, k=3)
                assert [h["item_id"] for h in hits] == [ids[i] for i in np.argsort(-scores)[:3]], task
                assert {h["model_version"] for h in hits} == {h["query_model_version"] for h in hits} == {"1"}
            # it knows the pretrained model's language (English), and no other
            vectors, version = client.encode_text([caption], language="en")
            assert version == "1" and np.allclose(vectors[0], query, atol=1e-5)
            with pytest.raises(grpc.RpcError) as refused:
                client.encode_text([caption], language="xa")
            assert "model version 1 was not trained on language 'xa' (it knows en;" in refused.value.details()
            assert client.status()["consistent"]
    finally:
        serve.shutdown()

    assert main(["train", "--task", str(stream[0]), "--parent", "start", *[f"--set={o}" for o in FAST],
                 "--set=train.epochs=1"]) == 0
    out = capsys.readouterr().out
    assert f"{BASELINE} " in out and "registered version 2" in out
    trained = Registry(settings).resolve("2")
    assert trained.tags["parent_version"] == "1" and trained.tags["task_index"] == "0"
    known = ResultMatrix.from_dict(trained.manifest["matrix"]["known"])
    assert known.shown()[0] == [BASELINE, tasks[0].name] and known.baseline == \
        ResultMatrix.from_dict(Registry(settings).resolve("1").manifest["matrix"]["known"]).baseline
    assert len(trained.manifest["zero_shot"]["Rm"]) == 2  # zero-shot retention measured from version 0
