"""The quick tier's one end-to-end path, every part real, on the session's one trained world (tests/conftest.py
`two_tasks`): a checkpoint in open_clip's trainer format registered as version 0 (`clipstream register --from`) and
two tasks trained on top of it as Ray Train jobs on 2 DeepSpeed workers, registered in MLflow. Here: version 0
indexed and promoted from the command line and served over gRPC with no training, then the trained stream promoted
behind its gates while serving (which indexes its galleries in Qdrant Edge with a Ray Data job) and served in its
place without a restart: one deploy, an application of its own beside the session's shared one on its proxy,
deleted (only it) at the end."""

import shutil
import time

import grpc
import numpy as np
import pytest

from clipstream import models
from clipstream.cli import main
from clipstream.index import open_index
from clipstream.promotion import history, promote
from clipstream.registry import PRODUCTION, Registry
from clipstream.training.data.task import Task
from tests.services.conftest import side_app, wait_serving

pytestmark = pytest.mark.e2e


def test_version_0_is_served_then_the_stream_trained_on_it_is_promoted_live_and_served(served, two_tasks, stream,
                                                                                      tmp_path, monkeypatch, capsys):
    from clipstream.services.client import Client
    from clipstream.settings import Settings

    trained, version0, _, last = two_tasks
    # promotion writes aliases, history and galleries: in a copy of the stream's registry (the same versions and
    # artifacts), so that the stream stays as trained for tests/training/test_job.py
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(trained.home / "mlflow.db", home / "mlflow.db")
    # reindex: a trained version's galleries replace version 0's (under no-reindex each task would keep the vectors
    # of the version that indexed it first); embedded as Ray Data jobs
    settings = Settings(home=home, grpc_port=served[0].grpc_port, serve_app="e2e", serve_encoder_cpus=0,
                        serve_search_cpus=0, index_policy="reindex", index_ray_min_rows=0).ensure_dirs()
    for name, value in settings.env().items():  # the command line reads the same settings
        monkeypatch.setenv(name, value)
    tasks = [Task.load(d) for d in stream]
    test_rows = {t.name: t.check("test").rows for t in tasks}

    # version 0, untrained: indexed, then promoted (which puts the rest of its gallery in place: its row 0's tasks)
    assert version0.version == "1" and version0.tags["method"] == "pretrained"
    assert main(["index", "--version", "start", "--task", str(stream[0])]) == 0
    assert main(["promote", "start"]) == 0
    assert "production: none -> v1 [promote]" in capsys.readouterr().out
    with open_index(settings) as index:
        assert {n: t["model_version"] for n, t in index.state()["tasks"].items()} == {t.name: "1" for t in tasks}

    with side_app(settings) as target, Client(target, application=settings.serve_app) as client:
        # served with no training: search over gRPC ranks as the checkpoint's model does in process
        wait_serving(client.channel)
        pretrained = models.load_exported(Registry(settings).resolve("1").folder)
        images = {t.name: pretrained.embed_images([t.root / r["image"] for r in test_rows[t.name]]) for t in tasks}
        caption = test_rows[tasks[0].name][0]["caption"]
        query = pretrained.embed_texts([caption])[0]
        for task in (tasks[0].name, ""):  # task-known, then task-unknown over both galleries
            scope = [task] if task else list(test_rows)
            ids = [r["id"] for name in scope for r in test_rows[name]]
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

        # the stream trained on top of it, promoted behind its gates while the app serves: its galleries put in
        # place, then the alias moved, which the serving replicas follow without a restart
        promoted = promote(settings, last.version)
        registry = Registry(settings)
        assert registry.resolve(PRODUCTION).version == last.version == "3"
        assert promoted["from_version"] == "1" and not promoted["forced"] and all(g.passed for g in promoted["gates"])
        assert [(h["from_version"], h["to_version"]) for h in history(settings)] == [("", "1"), ("1", "3")]
        with open_index(settings) as index:
            state = index.state()
        assert {name: entry["model_version"] for name, entry in state["tasks"].items()} == {t.name: "3" for t in tasks}
        assert {n: e["counts"]["image"] for n, e in state["tasks"].items()} == {n: len(r) for n, r in test_rows.items()}
        deadline = time.monotonic() + 30  # (the Encoder re-reads the alias every 2 s)
        while client.encode_text(["a cup"])[1] != "3":
            assert time.monotonic() < deadline, "serving did not follow the promotion to version 3"
            time.sleep(0.2)
        wait_serving(client.channel)

        # queries encoded by the production version exactly as the exported model encodes them
        bundle = models.load_exported(registry.resolve("3").folder)
        captions = [r["caption"] for r in test_rows[tasks[1].name]]
        vectors, version = client.encode_text(captions)
        assert version == "3" and np.allclose(vectors, bundle.embed_texts(captions), atol=1e-5)

        # search over gRPC ranks the stored gallery as the model does in process: task-known and task-unknown
        images = {t.name: bundle.embed_images([t.root / r["image"] for r in test_rows[t.name]]) for t in tasks}
        for task in ("", tasks[1].name):
            scope = [tasks[1].name] if task else list(test_rows)
            ids = [r["id"] for name in scope for r in test_rows[name]]
            gallery = np.concatenate([images[name] for name in scope])
            for caption, query in zip(captions[:4], vectors[:4]):
                hits = client.search(text=caption, task=task, k=5)
                assert {h["model_version"] for h in hits} == {"3"} and {h["query_model_version"] for h in hits} == {"3"}
                scores = gallery @ query
                expected = [ids[i] for i in np.argsort(-scores)[:5]]
                assert hits[0]["item_id"] == expected[0], (task, caption)
                assert np.allclose([h["score"] for h in hits], np.sort(scores)[::-1][:5], atol=1e-4)

        # every test caption finds its own image in the top 5 through the service exactly when the version does in
        # process (how much the quick tier's 2-epoch model learns varies from run to run: learning is what the method
        # benchmarks measure, with intervals; here, that serving ranks as the model does)
        rows = test_rows[tasks[1].name]
        found = [r["id"] in [h["item_id"] for h in client.search(text=r["caption"], task=tasks[1].name, k=5)]
                 for r in rows]
        ranked = [[rows[i]["id"] for i in np.argsort(-(images[tasks[1].name] @ query))[:5]] for query in vectors]
        assert found == [r["id"] in top for r, top in zip(rows, ranked)] and any(found)

        # the command line reads the same service (it names the settings' application)
        assert main(["search", captions[0], "--task", tasks[1].name, "-k", "3"]) == 0
        out = capsys.readouterr().out
        assert f"task-known ({tasks[1].name}), encoded by version 3" in out and len(out.strip().splitlines()) == 5
        assert main(["status"]) == 0
        assert "production v3" in capsys.readouterr().out
