"""Contract suite for services.index: every test runs on Qdrant Edge and on qdrant-client's local mode.

Local mode (`QdrantClient(location=":memory:")`) supports collections, aliases and batch queries, but
accepts payload indexes without creating them (`payload_schema` stays empty, with a UserWarning), so the
server payload-index test records the create_payload_index calls instead.
"""

import copy
import hashlib
import json
import re
import subprocess
import sys
import threading
import time
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
from qdrant_client import QdrantClient

from clipstream.index import (
    MODALITIES,
    PAYLOAD_INDEXES,
    EdgeIndex,
    ServerIndex,
    TaskVectors,
    VectorIndexError,
    open_index,
    point_id,
)

pytestmark = [pytest.mark.filterwarnings("ignore:Payload indexes have no effect:UserWarning"),
              pytest.mark.filterwarnings("ignore:Failed to obtain server version:UserWarning")]
DIM = 16
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["edge", "server"])
def make(request, tmp_path):
    """make(lineage="shared") opens an index of the parametrised backend on this test's one storage."""
    client = QdrantClient(location=":memory:") if request.param == "server" else None
    opened = []

    def _make(lineage="shared", fields=None):
        if client is None:
            idx = EdgeIndex(tmp_path / "edge", lineage=lineage, fields=fields)
        else:
            idx = ServerIndex(client, lineage=lineage, fields=fields)
        opened.append(idx)
        return idx

    yield _make
    for idx in opened:
        idx.close()


@pytest.fixture
def index(make):
    return make()


def tv(task, version, n=20, dim=DIM, task_index=None, scale=3.0):
    """Deterministic, deliberately unnormalised vectors for (task, version)."""
    rng = np.random.default_rng(zlib.crc32(f"{task}/{version}/{n}/{dim}".encode()))
    return TaskVectors(task=task, task_index=task_index if task_index is not None else ord(task[-1]) % 10,
                       model_version=version, item_ids=[f"{task}-{i:03d}" for i in range(n)],
                       image=scale * rng.standard_normal((n, dim)) + 1.0, text=scale * rng.standard_normal((n, dim)),
                       captions=[f"a photo of {task} number {i}" for i in range(n)])


def unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def checksums(idx, task):
    return {m: {i: (hashlib.sha256(b).hexdigest(), p) for i, (b, p) in idx.points(task, m).items()} for m in MODALITIES}


def stored_generations(idx):
    """Generations physically present in storage (not just published)."""
    if isinstance(idx, EdgeIndex):
        return {int(p.name[1:]) for p in idx._dir.glob("g*")}
    pattern = re.compile(rf"^{idx.name}-{idx.lineage}-g(\d+)-(image|text)$")
    return {int(m.group(1)) for c in idx.client.get_collections().collections if (m := pattern.match(c.name))}


def brute(gallery, query, k):
    """Top-k (item_id, cosine) over {item_id: raw vector}."""
    ids = list(gallery)
    scores = unit(np.stack([gallery[i] for i in ids])) @ unit(query)
    order = np.argsort(-scores)[:k]
    return [ids[j] for j in order], scores[order]


def gallery_of(tasks, modality):
    return {i: getattr(t, modality)[r] for t in tasks for r, i in enumerate(t.item_ids)}


def ranking(hits):
    return [(h.item_id, round(h.score, 5)) for h in hits]


def test_point_id_is_deterministic_and_distinct():
    assert point_id("x", "image", "1", "shared") == point_id("x", "image", "1", "shared")
    assert len({point_id("x", m, v, l) for m in MODALITIES for v in "12" for l in ("shared", "txt2im")}) == 8


def test_open_index_picks_the_backend(settings):
    edge = open_index(settings)
    assert isinstance(edge, EdgeIndex) and edge.name == settings.stream
    assert edge._dir == settings.qdrant_path / settings.stream / "shared"
    remote = open_index(settings.model_copy(update={"qdrant_url": "http://127.0.0.1:1"}), name="other")
    assert isinstance(remote, ServerIndex) and remote.name == "other" and remote._owns_client
    remote.close()


def test_append_touches_only_its_task(index):
    index.append(tv("a", "1"))
    index.append(tv("b", "2"))
    before = {t: checksums(index, t) for t in "ab"}
    state = index.append(tv("c", "3"))
    assert {t: checksums(index, t) for t in "ab"} == before  # vector bytes and payload unchanged
    assert state["generation"] == 1 and set(state["tasks"]) == {"a", "b", "c"}
    new = index.points("c", "text")
    assert set(new) == set(tv("c", "3").item_ids) and {p["task"] for _, p in new.values()} == {"c"}
    assert state["tasks"]["c"]["counts"] == {"image": 20, "text": 20}
    json.dumps(index.state())


def test_versions_under_both_policies(index):
    versions = {"a": "1", "b": "2", "c": "3"}
    for t, v in versions.items():
        index.append(tv(t, v))
    for t, v in versions.items():
        for m in MODALITIES:
            payloads = [p for _, p in index.points(t, m).values()]
            assert {(p["model_version"], p["index_generation"], p["task"], p["modality"]) for p in payloads} \
                == {(v, 1, t, m)}
            assert all(p["lineage"] == "shared" and p["split"] == "test" and p["indexed_at"] for p in payloads)
            assert all(("caption" in p) == (m == "text") for p in payloads)
    assert stored_generations(index) == {1}
    state = index.reindex([tv(t, "9") for t in versions])
    assert state["generation"] == 2 and {s["model_version"] for s in state["tasks"].values()} == {"9"}
    for t in versions:
        for m in MODALITIES:
            assert {(p["model_version"], p["index_generation"]) for _, p in index.points(t, m).values()} == {("9", 2)}
    assert stored_generations(index) == {2}  # Edge: g1 segment dirs deleted; server: g1 collections deleted
    hits = index.search(np.ones(DIM), "image", k=60)
    assert len(hits) == 60 and {(h.model_version, h.index_generation) for h in hits} == {("9", 2)}


def test_query_version_follows_the_gallery(make):
    index = make()
    with pytest.raises(VectorIndexError, match="empty"):
        index.pin("1")
    assert index.state()["query_version"] is None
    assert index.append(tv("a", "1"))["query_version"] == "1"  # the first gallery pins its own version
    assert index.append(tv("b", "2"))["query_version"] == "1"  # a no-reindex append keeps the pinned encoder
    before = checksums(index, "a")
    assert index.pin("2")["query_version"] == "2" and make().state()["query_version"] == "2"  # published
    assert checksums(index, "a") == before and index.state()["generation"] == 1  # pinning moves no vector
    assert index.reindex([tv("a", "3"), tv("b", "3")])["query_version"] == "3"  # switched with the gallery


def test_task_known_search(index):
    tasks = [tv("a", "1"), tv("b", "2"), tv("c", "3")]
    for t in tasks:
        index.append(t)
    q = np.random.default_rng(0).standard_normal(DIM)
    for m in MODALITIES:
        hits = index.search(q, m, task="b", k=7)
        assert len(hits) == 7 and {(h.task, h.modality, h.model_version) for h in hits} == {("b", m, "2")}
        ids, scores = brute(gallery_of(tasks[1:2], m), q, 7)
        assert [h.item_id for h in hits] == ids
        np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-5)
        assert all((h.caption is not None) == (m == "text") for h in hits)
    assert index.search(q, "text", task="a", k=1)[0].caption.startswith("a photo of a")


def test_task_unknown_equals_brute_force(index):
    tasks = [tv("a", "1"), tv("b", "2", n=25), tv("c", "3", n=15)]
    for t in tasks:
        index.append(t)
    queries = np.random.default_rng(1).standard_normal((5, DIM))
    for m in MODALITIES:
        batch = index.search_batch(queries, m, k=30)
        for q, hits in zip(queries, batch):
            ids, scores = brute(gallery_of(tasks, m), q, 30)
            assert [h.item_id for h in hits] == ids
            np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-5)
            assert ranking(index.search(q, m, k=30)) == ranking(hits)
        assert len({h.task for h in batch[0]}) > 1  # one ranking really spans tasks


def test_stored_vectors_are_unit_norm(index):
    t = tv("a", "1", scale=50.0)
    index.append(t)
    for m in MODALITIES:
        stored = index.points("a", m)
        vecs = np.stack([np.frombuffer(stored[i][0], dtype=np.float32) for i in t.item_ids])
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(vecs, unit(getattr(t, m)), atol=1e-5)


def test_wrong_dimension_and_bad_vectors_refused_without_change(index):
    index.append(tv("a", "1"))
    before, state = checksums(index, "a"), index.state()
    with pytest.raises(VectorIndexError, match=r"dimension 8.*dimension 16"):
        index.append(tv("b", "2", dim=8))
    with pytest.raises(VectorIndexError, match=r"dimension 8.*dimension 16"):
        index.search(np.ones(8), "image")
    with pytest.raises(VectorIndexError, match="dimension 8"):
        index.search_batch(np.ones((3, 8)), "text")
    bad = tv("b", "2")
    bad.image[3] = 0.0
    with pytest.raises(VectorIndexError, match="zero vector at row 3"):
        index.append(bad)
    bad = tv("b", "2")
    bad.text[1, 2] = np.nan
    with pytest.raises(VectorIndexError, match="NaN"):
        index.append(bad)
    bad = tv("b", "2")
    bad.image_uris = ["/only/one.png"]
    with pytest.raises(VectorIndexError, match="image_uris must be one string per image row"):
        index.append(bad)
    with pytest.raises(VectorIndexError, match="zero vector"):
        index.search(np.zeros(DIM), "image")
    with pytest.raises(VectorIndexError, match="NaN or infinite"):
        index.search(np.full(DIM, np.inf), "image")
    assert index.state() == state and checksums(index, "a") == before


def test_lineages_are_separate(make):
    shared, other = make(), make("txt2im")
    shared.append(tv("a", "1"))
    assert other.state()["tasks"] == {} and other.state()["lineage"] == "txt2im"
    with pytest.raises(VectorIndexError, match="empty"):
        other.search(np.ones(DIM), "image")
    other.append(tv("z", "7"))
    assert set(shared.state()["tasks"]) == {"a"} and set(other.state()["tasks"]) == {"z"}
    assert {(h.lineage, h.task) for h in shared.search(np.ones(DIM), "image", k=50)} == {("shared", "a")}
    assert {(h.lineage, h.task) for h in other.search(np.ones(DIM), "text", k=50)} == {("txt2im", "z")}
    with pytest.raises(VectorIndexError, match="unknown task 'a'"):
        other.search(np.ones(DIM), "image", task="a")
    for bad in ("audio", "images", None):
        with pytest.raises(VectorIndexError, match="target_modality"):
            shared.search(np.ones(DIM), bad)
    with pytest.raises(VectorIndexError, match="lineage"):
        make("no/slash")


def test_concurrent_searches_never_mix_generations(index):
    names = ["a", "b", "c", "d"]
    index.reindex([tv(t, "1") for t in names])
    q = np.random.default_rng(2).standard_normal(DIM)
    seen, errors, started, stop = [], [], threading.Event(), threading.Event()

    def reader():
        try:
            i = after = 0
            while after < 4:  # keeps searching until a few searches after the last switch
                after += stop.is_set()
                hits = index.search(q, "image", k=40) if i % 2 else index.search(q, "text", task=names[i % 4], k=5)
                seen.append({(h.index_generation, h.model_version) for h in hits})
                started.set()
                i += 1
                time.sleep(0.0005)  # a busy loop would starve the writer thread of the GIL
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait(10)
    index.reindex([tv(t, "2") for t in names])
    index.reindex([tv(t, "3") for t in names])
    stop.set()
    thread.join(30)
    assert not errors, errors
    assert all(len(s) == 1 for s in seen)  # never two generations/versions in one result
    kinds = set().union(*seen)
    assert kinds <= {(1, "1"), (2, "2"), (3, "3")} and {(1, "1"), (3, "3")} <= kinds


def test_search_retries_when_its_snapshot_was_dropped(make, monkeypatch):
    """A reader holding a stale state (another process switched and dropped it) retries on the new one."""
    reader, writer = make(), make()
    writer.append(tv("a", "1"))
    stale = copy.deepcopy(reader._read())
    writer.reindex([tv("a", "2")])
    reads = []

    def first_stale(self):
        reads.append(1)
        return stale if len(reads) == 1 else type(self)._read(self)

    monkeypatch.setattr(reader, "_read", types.MethodType(first_stale, reader))
    hits = reader.search(np.ones(DIM), "image", k=5)
    assert len(reads) >= 2 and {(h.model_version, h.index_generation) for h in hits} == {("2", 2)}


def test_one_task_reindex_equals_no_reindex(make):
    noreindex, reindexed = make("noreindex"), make("reindex")
    noreindex.append(tv("a", "1"))
    reindexed.reindex([tv("a", "1")])
    queries = np.random.default_rng(3).standard_normal((4, DIM))
    for m in MODALITIES:
        for task in ("a", None):
            got = [list(map(ranking, idx.search_batch(queries, m, task=task, k=20))) for idx in (noreindex, reindexed)]
            assert got[0] == got[1]


def test_reappend_is_idempotent(index):
    index.append(tv("a", "1"))
    index.append(tv("b", "2"))
    before, others = index.points("a", "image"), checksums(index, "b")
    state = index.append(tv("a", "1"))
    assert state["generation"] == 1 and state["tasks"]["a"]["counts"] == {"image": 20, "text": 20}
    after = index.points("a", "image")
    assert sorted(after) == sorted(before) and checksums(index, "b") == others
    # same vectors (local mode re-normalises an overwritten point, which may move its last bit)
    np.testing.assert_allclose([np.frombuffer(after[i][0], np.float32) for i in before],
                               [np.frombuffer(before[i][0], np.float32) for i in before], atol=1e-6)
    assert len(index.search(np.ones(DIM), "image", k=100)) == 40  # no duplicates
    assert len(index.append(tv("a", "1", n=12))["tasks"]) == 2  # a rerun with fewer items replaces the task
    assert len(index.points("a", "text")) == 12 and len(index.search(np.ones(DIM), "text", k=100)) == 32
    if isinstance(index, EdgeIndex):  # replaced segments are deleted, never left behind
        assert len([p for p in index._dir.glob("g1/*")]) == 4


def test_append_under_another_version_refused(index):
    index.append(tv("a", "1"))
    before = checksums(index, "a")
    with pytest.raises(VectorIndexError, match="reindex"):
        index.append(tv("a", "2"))
    assert checksums(index, "a") == before and index.state()["tasks"]["a"]["model_version"] == "1"
    with pytest.raises(VectorIndexError, match="already used by task .a. under version 1"):
        index.append(TaskVectors("b", 1, "1", ["a-000"], np.ones((1, DIM)), np.ones((1, DIM)), ["x"]))


def test_failed_reindex_leaves_serving_generation(index, monkeypatch):
    for t, v in (("a", "1"), ("b", "2")):
        index.append(tv(t, v))
    q = np.random.default_rng(4).standard_normal((3, DIM))
    state, results = index.state(), [list(map(ranking, index.search_batch(q, m, k=15))) for m in MODALITIES]

    def unchanged():
        assert index.state() == state
        assert [list(map(ranking, index.search_batch(q, m, k=15))) for m in MODALITIES] == results

    bad_dim = [tv("a", "5"), tv("b", "5", dim=12)]
    with pytest.raises(VectorIndexError, match=r"dimension 12.*dimension 16"):
        index.reindex(bad_dim)
    short = tv("b", "5")
    short.captions = short.captions[:-1]
    with pytest.raises(VectorIndexError, match="lengths differ"):
        index.reindex([tv("a", "5"), short])
    with pytest.raises(VectorIndexError, match="one model version"):
        index.reindex([tv("a", "5"), tv("b", "6")])
    unchanged()
    assert stored_generations(index) == {1}

    write, calls = type(index)._write, []

    def crash_on_second(self, *args):  # Edge writes a reindex as one segment per modality: the text one fails
        calls.append(args[1:3])
        if len(calls) == 2:
            raise OSError("disk full")
        return write(self, *args)

    monkeypatch.setattr(type(index), "_write", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        index.reindex([tv("a", "5"), tv("b", "5")])
    monkeypatch.undo()
    assert stored_generations(index) == {1, 2}  # a half-built g2 exists on storage but is never served
    unchanged()
    state = index.reindex([tv("a", "5"), tv("b", "5")])
    assert state["generation"] == 2 and stored_generations(index) == {2}
    assert state["tasks"]["b"]["counts"] == {"image": 20, "text": 20}
    assert {h.model_version for h in index.search(np.ones(DIM), "image", k=40)} == {"5"}


def unreferenced(idx):
    """Storage under the serving generation that its state does not name: Edge segments, server points."""
    state = idx._read()
    if isinstance(idx, EdgeIndex):
        live = {r for refs in state["segments"].values() for r in refs.values()}
        return sorted({f"{p.parent.name}/{p.name}" for p in idx._dir.glob("g*/*")} - live)
    return sorted(str(r.id) for m in MODALITIES for r in idx._records(idx._coll(state["generation"], m), None, False)
                  if r.payload["task"] not in state["tasks"])


def test_a_failed_append_is_cleared_by_the_next_write(index, monkeypatch):
    index.append(tv("a", "1"))
    state, before = index.state(), checksums(index, "a")

    def fail(self, new):
        raise OSError("disk full")

    monkeypatch.setattr(type(index), "_publish", fail)
    with pytest.raises(OSError, match="disk full"):
        index.append(tv("b", "2"))  # every point of b stored, its state never published
    monkeypatch.undo()
    assert index.state() == state and checksums(index, "a") == before
    assert unreferenced(index) and len(index.search(np.ones(DIM), "text", k=100)) == 20  # stored, never served
    index.append(tv("c", "3"))  # another task, not a rerun: b's points still go
    assert set(index.state()["tasks"]) == {"a", "c"} and unreferenced(index) == []
    assert {h.item_id[0] for h in index.search(np.ones(DIM), "image", k=100)} == {"a", "c"}


def test_input_errors(index):
    with pytest.raises(VectorIndexError, match="empty"):
        index.search(np.ones(DIM), "image")
    with pytest.raises(VectorIndexError, match="non-empty list of TaskVectors"):
        index.reindex([])
    with pytest.raises(VectorIndexError, match="non-empty list of TaskVectors"):
        index.reindex([{"task": "a"}])
    index.append(tv("a", "1"))
    index.append(tv("b", "2"))
    with pytest.raises(VectorIndexError, match=r"unknown task 'zz'; indexed tasks: \['a', 'b'\]"):
        index.search(np.ones(DIM), "image", task="zz")
    with pytest.raises(VectorIndexError, match="unknown task"):
        index.points("zz", "image")
    for k in (0, -1, 1001, 2.5, True):
        with pytest.raises(VectorIndexError, match="k must be"):
            index.search(np.ones(DIM), "image", k=k)
    assert len(index.search(np.ones(DIM), "image", k=1000)) == 40
    with pytest.raises(VectorIndexError, match="TaskVectors"):
        index.append({"task": "c"})
    with pytest.raises(VectorIndexError, match="task twice"):
        index.reindex([tv("a", "3"), tv("a", "3")])
    with pytest.raises(VectorIndexError, match="unique across tasks"):
        index.reindex([tv("a", "3"), TaskVectors("c", 2, "3", ["a-001"], np.ones((1, DIM)), np.ones((1, DIM)), ["x"])])
    with pytest.raises(VectorIndexError, match="model_version"):
        index.append(TaskVectors("c", 2, "", ["x"], np.ones((1, DIM)), np.ones((1, DIM)), ["x"]))
    assert set(index.state()["tasks"]) == {"a", "b"}


def test_normalize_per_task_merge(index):
    """Task A's scores are uniformly high, task B has one outlier: raw picks A first, z-scores pick B's outlier."""
    q = np.eye(DIM)[0]

    def task(name, version, cosines):
        rows = np.stack([c * q + np.sqrt(1 - c * c) * np.eye(DIM)[j + 1] for j, c in enumerate(cosines)])
        return TaskVectors(name, 0 if name == "A" else 1, version, [f"{name}{j}" for j in range(len(cosines))],
                           rows, rows, [f"{name} {j}" for j in range(len(cosines))])

    index.append(task("A", "1", [0.9, 0.88, 0.86, 0.84]))
    index.append(task("B", "2", [0.6, 0.1, 0.0, -0.1]))
    raw = index.search(q, "image", k=3)
    assert [h.item_id for h in raw] == ["A0", "A1", "A2"]
    z = index.search(q, "image", k=3, normalize_per_task=True)
    # z(B0) = 1.68 > z(A0) = 1.34 > z(A1) = 0.45 > z(B1) = -0.20
    assert [h.item_id for h in z] == ["B0", "A0", "A1"]
    assert z[0].score == pytest.approx(0.6, abs=1e-5)  # the score stays the raw cosine
    assert [h.item_id for h in index.search(q, "image", task="B", k=2, normalize_per_task=True)] == ["B0", "B1"]


SEARCH_SCRIPT = """
import json, sys, numpy as np
from clipstream.index import EdgeIndex, TaskVectors
idx = EdgeIndex(sys.argv[1])
if sys.argv[2] == "append":
    rng = np.random.default_rng(9)
    idx.append(TaskVectors("late", 5, "6", [f"late-{i}" for i in range(10)], rng.standard_normal((10, 16)),
                           rng.standard_normal((10, 16)), ["late"] * 10))
hits = idx.search(np.ones(16), "text", k=50)
print(json.dumps([[h.item_id, round(h.score, 5), h.model_version] for h in hits]))
idx.close()
"""


def run_script(root, mode):
    out = subprocess.run([sys.executable, "-c", SEARCH_SCRIPT, str(root), mode], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.component
def test_edge_second_process_reads_and_writes(tmp_path):
    root = tmp_path / "edge"
    writer = EdgeIndex(root)
    writer.append(tv("a", "1"))
    writer.append(tv("b", "2"))
    mine = [[h.item_id, round(h.score, 5), h.model_version] for h in writer.search(np.ones(DIM), "text", k=50)]
    assert run_script(root, "search") == mine  # while this process still has the segments open
    writer.close()
    assert run_script(root, "search") == mine

    reader = EdgeIndex(root)  # opened before another process appends a task
    assert set(reader.state()["tasks"]) == {"a", "b"} and len(reader.search(np.ones(DIM), "image", k=100)) == 40
    other = run_script(root, "append")
    assert {h[0].split("-")[0] for h in other} == {"a", "b", "late"}
    assert set(reader.state()["tasks"]) == {"a", "b", "late"}
    hits = reader.search(np.ones(DIM), "text", task="late", k=20)
    assert len(hits) == 10 and {h.model_version for h in hits} == {"6"}
    assert [[h.item_id, round(h.score, 5), h.model_version] for h in reader.search(np.ones(DIM), "text", k=50)] == other
    reader.close()


def test_server_payload_indexes_before_upload(monkeypatch):
    client = QdrantClient(location=":memory:")
    log = []
    for method in ("create_payload_index", "upsert"):
        original = getattr(client, method)

        def spy(collection_name, *args, _original=original, _method=method, **kwargs):
            log.append((_method, collection_name, kwargs.get("field_name", args[0] if args else None),
                        kwargs.get("field_schema")))
            return _original(collection_name, *args, **kwargs)

        monkeypatch.setattr(client, method, spy)
    idx = ServerIndex(client, name="cs")
    idx.append(tv("a", "1"))
    idx.reindex([tv("a", "2")])
    collections = {c.name for c in client.get_collections().collections}
    assert collections == {"cs-shared-g2-image", "cs-shared-g2-text", "cs-shared-state"}
    assert {a.alias_name: a.collection_name for a in client.get_aliases().aliases} == \
           {"cs-shared-image": "cs-shared-g2-image", "cs-shared-text": "cs-shared-g2-text"}
    for coll in ("cs-shared-g1-image", "cs-shared-g1-text", "cs-shared-g2-image", "cs-shared-g2-text"):
        calls = [entry for entry in log if entry[1] == coll]
        indexes = {field: schema for method, _, field, schema in calls if method == "create_payload_index"}
        assert indexes == PAYLOAD_INDEXES
        first_upsert = next(i for i, entry in enumerate(calls) if entry[0] == "upsert")
        assert all(entry[0] == "create_payload_index" for entry in calls[:first_upsert]) and first_upsert == 4
    schema = client.get_collection("cs-shared-g2-image").payload_schema
    assert schema == {} or set(schema) == set(PAYLOAD_INDEXES)  # local mode keeps none; a server keeps all four


def clustered(task, version, n, dim=DIM, task_index=0):
    """One task of a gallery as an encoder makes it: the task's own direction plus noise, captions near images."""
    rng = np.random.default_rng(zlib.crc32(f"{task}/{version}/{n}".encode()))
    direction = rng.standard_normal(dim)
    image = direction + 0.6 * np.linalg.norm(direction) * unit(rng.standard_normal((n, dim)))
    return TaskVectors(task=task, task_index=task_index, model_version=version, item_ids=[f"{task}-{i}" for i in range(n)],
                       image=image, text=image + 0.2 * rng.standard_normal((n, dim)), captions=[f"{task} {i}" for i in range(n)])


def test_task_unknown_over_many_tasks_equals_exact_search(index):
    tasks = [tv(f"t{i:02d}", "1", n=12 + i, task_index=i) for i in range(12)]
    for t in tasks:
        index.append(t)
    queries = np.random.default_rng(5).standard_normal((8, DIM))
    for m in MODALITIES:
        for q, hits in zip(queries, index.search_batch(queries, m, k=10)):
            ids, scores = brute(gallery_of(tasks, m), q, 10)
            assert [h.item_id for h in hits] == ids  # small segments are scanned exactly: recall 1.0
            np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-5)


def test_edge_large_segments_get_hnsw_and_keep_recall(tmp_path, monkeypatch):
    """Segments above HNSW_FROM_KB are searched through an HNSW graph over int8 vectors, rescored in float32:
    the scores are exact cosines and, on a gallery shaped like an encoder's, recall@10 of exact search >= 0.99."""
    from clipstream import index as module

    monkeypatch.setattr(module, "HNSW_FROM_KB", 8)  # 8 KB of 16-d float32 vectors: segments over 128 points
    index = EdgeIndex(tmp_path / "edge")
    tasks = [clustered(f"d{i}", "1", 600, task_index=i) for i in range(4)]
    for t in tasks:
        index.append(t)
    shard, ef = index._open(index._read()["segments"]["d0"]["image"])
    assert shard.info().indexed_vectors_count == 600  # the graph was built (below the threshold it stays 0)
    assert ef == module.HNSW_EF  # a segment this small is searched with the base candidate list
    rng = np.random.default_rng(6)
    picks = [(int(t), int(rng.integers(0, 600))) for t in rng.integers(0, 4, 60)]
    queries = np.stack([tasks[t].text[r] for t, r in picks])
    recalls = []
    for (t, _), q, unknown, known in zip(picks, queries, index.search_batch(queries, "image", k=10),
                                         index.search_batch(queries, "image", task=f"d{0}", k=10)):
        ids, scores = brute(gallery_of(tasks, "image"), q, 10)
        recalls.append(len({h.item_id for h in unknown} & set(ids)) / 10)
        exact = {h.item_id: h.score for h in unknown}
        for i, s in zip(ids, scores):
            if i in exact:
                assert exact[i] == pytest.approx(s, abs=1e-5)  # rescored: the stored float32 cosine
        assert {h.task for h in known} == {"d0"}
    assert np.mean(recalls) >= 0.99


def test_append_reads_no_other_task(make, monkeypatch):
    """An append checks its item ids against the other tasks by id lookups, never by reading their points:
    its cost follows the new task's size, not the index's."""
    index = make()
    for i in range(3):
        index.append(tv(f"t{i}", "1", n=30 + 10 * i, task_index=i))
    reads = []
    monkeypatch.setattr(type(index), "_scroll", lambda *a, **k: reads.append(a[2:]) or iter(()))
    monkeypatch.setattr(type(index), "points", lambda self, *a: reads.append(a) or {})
    state = index.append(tv("t3", "1", n=25, task_index=3))
    assert set(state["tasks"]) == {"t0", "t1", "t2", "t3"} and reads == []
    with pytest.raises(VectorIndexError, match=r"item ids \['t1-017'\] of task 't4' are already used by task 't1'"):
        index.append(TaskVectors("t4", 4, "1", ["new-0", "t1-017"], np.ones((2, DIM)), np.ones((2, DIM)), ["x", "y"]))
    assert reads == [] and set(index.state()["tasks"]) == {"t0", "t1", "t2", "t3"}


def test_duplicate_ids_refused_across_tasks_but_not_across_versions_or_reruns(make):
    index = make()
    index.reindex([tv("a", "1", n=40), tv("b", "1", n=40)])
    before = index.state()
    for clash in (["a-039"], ["zz", "b-000", "a-001"]):
        with pytest.raises(VectorIndexError, match="already used by task"):
            index.append(TaskVectors("c", 2, "1", clash, np.ones((len(clash), DIM)), np.ones((len(clash), DIM)),
                                     ["x"] * len(clash)))
    assert index.state() == before
    index.append(TaskVectors("c", 2, "2", ["a-000"], np.ones((1, DIM)), np.ones((1, DIM)), ["x"]))  # another version
    assert index.append(tv("a", "1", n=40))["tasks"]["a"]["counts"] == {"image": 40, "text": 40}  # a rerun of a task
    assert len(index.search(np.ones(DIM), "image", k=1000)) == 81  # and no point twice


def test_a_reindexed_generation_serves_each_task_alone_and_after_a_task_is_appended_again(make):
    """Edge writes a reindexed generation as one segment per modality (one graph for task-unknown): task-known
    still sees only its task, task-unknown equals exact search, and a task appended again afterwards is served
    from its new points only (the merged segment keeps the old copy, filtered out)."""
    index = make()
    tasks = [tv(f"r{i}", "1", n=15 + i, task_index=i) for i in range(4)]
    index.reindex(tasks)
    if isinstance(index, EdgeIndex):
        refs = index._read()["segments"]
        assert len({refs[t.task]["image"] for t in tasks}) == 1 and len({refs[t.task]["text"] for t in tasks}) == 1
    q = np.random.default_rng(9).standard_normal(DIM)
    same_as_exact(index.search(q, "text", k=30), brute(gallery_of(tasks, "text"), q, 30))
    for t in tasks:
        hits = index.search(q, "image", task=t.task, k=100)
        assert {h.task for h in hits} == {t.task} and len(hits) == len(t.item_ids)
    again = tv("r2", "1", n=9, task_index=2)  # the same task, fewer items: a rerun of its indexing
    index.append(again)
    now = [tasks[0], tasks[1], again, tasks[3]]
    assert set(index.points("r2", "image")) == set(again.item_ids)
    hits = index.search(q, "image", k=1000)
    assert len(hits) == sum(len(t.item_ids) for t in now)
    same_as_exact(hits[:20], brute(gallery_of(now, "image"), q, 20))
    with pytest.raises(VectorIndexError, match="already used by task 'r1'"):
        index.append(TaskVectors("x", 9, "1", ["r1-003"], np.ones((1, DIM)), np.ones((1, DIM)), ["x"]))


def same_as_exact(hits, exact):
    ids, scores = exact
    assert [h.item_id for h in hits] == ids
    np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-5)


def test_compact_merges_appended_segments_and_keeps_every_point(make):
    """Appends write a segment per task (on Edge); compact merges them into one per modality, with every point's
    vector and payload (its own model version) as they were, after a reindex and a task appended again too; a
    Qdrant server merges its own segments, so compact changes nothing there."""
    index = make()
    index.reindex([tv("a", "1", n=30, task_index=0), tv("b", "1", n=25, task_index=1)])
    index.append(tv("b", "1", n=12, task_index=1))  # again, fewer items: the merged segment keeps the old copy
    index.append(tv("c", "2", n=18, task_index=2))
    index.append(tv("d", "3", n=21, task_index=3))
    edge = isinstance(index, EdgeIndex)
    assert index.segments() == (4 if edge else 1)
    q = np.random.default_rng(11).standard_normal((3, DIM))
    hits = {m: [ranking(h) for h in index.search_batch(q, m, k=100)] for m in MODALITIES}
    # (after a search: qdrant-client's local mode rewrites the last bits of some stored vectors on the first one)
    before = {t: checksums(index, t) for t in "abcd"}
    state = index.state()
    after = index.compact()
    assert index.segments() == 1 and after == state  # same tasks, counts, versions and generation
    if edge:
        assert len({refs[m] for refs in index._read()["segments"].values() for m in MODALITIES}) == 2
        assert len(list((index._dir / "g1").iterdir())) == 2  # the per-task segments are gone from disk
    assert {t: checksums(index, t) for t in "abcd"} == before
    assert {m: [ranking(h) for h in index.search_batch(q, m, k=100)] for m in MODALITIES} == hits
    assert [h.task for h in index.search(q[0], "text", task="c", k=100)] == ["c"] * 18
    assert index.compact() == state  # nothing left to merge
    index.append(tv("e", "1", n=10, task_index=4))  # appends go on after a compaction
    assert index.segments() == (2 if edge else 1) and len(index.search(q[0], "image", k=1000)) == 30 + 12 + 18 + 21 + 10


def test_a_failed_compaction_leaves_the_segments_served(tmp_path, monkeypatch):
    index = EdgeIndex(tmp_path / "edge")
    for i in range(3):
        index.append(tv(f"t{i}", "1", n=15, task_index=i))
    before, published = {t: checksums(index, t) for t in ("t0", "t1", "t2")}, index._read()

    def short(self, ref, tasks):
        return {t: 0 for t in tasks}

    monkeypatch.setattr(EdgeIndex, "_counts", short)
    with pytest.raises(VectorIndexError, match="compaction: task 't0' image: stored 0 points, expected 15"):
        index.compact()
    monkeypatch.undo()
    assert index._read() == published and index.segments() == 3
    assert {t: checksums(index, t) for t in ("t0", "t1", "t2")} == before
    assert index.compact()["tasks"] == published["tasks"] and not unreferenced(index)  # the half-written one swept


def test_a_larger_segment_is_searched_with_a_longer_candidate_list(tmp_path, monkeypatch):
    """hnsw_ef grows with the segment past HNSW_EF_POINTS points (recall at a fixed hnsw_ef falls as the graph
    grows), and every search of that segment uses it."""
    from clipstream import index as module

    monkeypatch.setattr(module, "HNSW_EF_POINTS", 100)
    monkeypatch.setattr(module, "HNSW_FROM_KB", 1)  # 1 KB of 16-d float32 vectors: every segment here has a graph
    index = EdgeIndex(tmp_path / "edge")
    index.reindex([tv("big", "1", n=300, task_index=0), tv("b", "1", n=100, task_index=1)])
    index.append(tv("small", "1", n=40, task_index=2))
    segments = index._read()["segments"]
    assert index._open(segments["big"]["image"])[1] == 4 * module.HNSW_EF  # 400 points, 4 x HNSW_EF_POINTS
    assert index._open(segments["small"]["image"])[1] == module.HNSW_EF  # below it: the base
    asked = []
    real = module.EdgeIndex._open

    def spy(self, ref):
        shard, ef = real(self, ref)
        query = shard.query_batch
        wrapper = type("Spy", (), {"query_batch": lambda _, req: asked.append(ef) or query(req)})()
        return wrapper, ef

    monkeypatch.setattr(module.EdgeIndex, "_open", spy)
    assert len(index.search(np.ones(DIM), "image", k=5)) == 5
    assert sorted(asked) == [module.HNSW_EF, 4 * module.HNSW_EF]


def test_a_segment_below_the_graph_threshold_is_scanned_exactly(tmp_path):
    """A segment under HNSW_FROM_KB has no graph and is scanned: every task-unknown search returns the exact top k
    with the exact cosines."""
    index = EdgeIndex(tmp_path / "edge")
    tasks = [clustered(f"d{i}", "1", 300, task_index=i) for i in range(3)]
    for t in tasks:
        index.append(t)
    shard, _ = index._open(index._read()["segments"]["d1"]["image"])
    assert shard.info().indexed_vectors_count == 0
    queries = np.stack([t.text[r] for t in tasks for r in (0, 150, 299)])
    for q, hits in zip(queries, index.search_batch(queries, "image", k=10)):
        ids, scores = brute(gallery_of(tasks, "image"), q, 10)
        assert [h.item_id for h in hits] == list(ids)
        np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-6)


FIELDS = {"brand": "keyword", "price": "float", "year": "integer", "size": "keyword"}


def catalogue(version, items, dim=DIM, task="shop"):
    """A catalogue's TaskVectors from {item_id: (has image, has text, metadata)}; deterministic vectors per item."""
    def vec(i, m):
        return np.random.default_rng(zlib.crc32(f"{i}/{m}/{version}".encode())).standard_normal(dim)

    image_ids = [i for i, (img, _, _) in items.items() if img]
    text_ids = [i for i, (_, txt, _) in items.items() if txt]
    return TaskVectors(task, 9, version, list(items), np.array([vec(i, "image") for i in image_ids]).reshape(-1, dim),
                       np.array([vec(i, "text") for i in text_ids]).reshape(-1, dim), [f"caption {i}" for i in text_ids],
                       split="catalogue", image_uris=[f"/imgs/{i}.png" for i in image_ids], kind="catalogue",
                       metadata=[m for _, _, m in items.values()], image_ids=image_ids, text_ids=text_ids)


def unchanged(idx, task, before) -> bool:
    """The task holds the same points as `before` ({modality: idx.points()}): payloads equal, vectors to float32
    precision (qdrant-client's local mode rewrites a stored vector's last bits when it first searches it)."""
    now = {m: idx.points(task, m) for m in MODALITIES}
    return all(now[m].keys() == before[m].keys() and all(
        now[m][i][1] == p and np.allclose(np.frombuffer(now[m][i][0], np.float32), np.frombuffer(v, np.float32),
                                          atol=1e-6) for i, (v, p) in before[m].items()) for m in MODALITIES)


def test_a_catalogue_takes_items_replaces_them_by_id_and_deletes_them(make):
    idx = make(fields=FIELDS)
    idx.append(tv("a", "1"))
    before = {m: idx.points("a", m) for m in MODALITIES}
    idx.upsert(catalogue("1", {"i1": (True, True, {"brand": "acme"}), "i2": (True, False, {"price": 3}),
                               "i3": (False, True, {})}))
    state = idx.state()
    assert state["tasks"]["shop"]["counts"] == {"image": 2, "text": 2} and state["tasks"]["shop"]["kind"] == "catalogue"
    # again: i2 replaced (now text only, other fields), i4 added, i1 and i3 kept as they were
    i1 = idx.points("shop", "image")["i1"]
    idx.upsert(catalogue("1", {"i2": (False, True, {"brand": "zed", "year": 2020.0}), "i4": (True, True, {})}))
    images, texts = idx.points("shop", "image"), idx.points("shop", "text")
    assert set(images) == {"i1", "i4"} and set(texts) == {"i1", "i2", "i3", "i4"}
    assert np.allclose(np.frombuffer(images["i1"][0], np.float32), np.frombuffer(i1[0], np.float32), atol=1e-6)
    assert texts["i2"][1]["meta"] == {"brand": "zed", "year": 2020} and images["i1"][1]["meta"] == {"brand": "acme"}
    assert images["i4"][1]["image_uri"] == "/imgs/i4.png" and texts["i3"][1]["caption"] == "caption i3"
    hit = idx.search(np.frombuffer(texts["i2"][0], np.float32), "text", "shop", k=1)[0]
    assert (hit.item_id, hit.metadata, round(hit.score, 4)) == ("i2", {"brand": "zed", "year": 2020}, 1.0)
    assert idx.delete("shop", ["i1", "nope"])[1] == ["nope"]
    assert idx.state()["tasks"]["shop"]["counts"] == {"image": 1, "text": 3}
    state, missing = idx.delete("shop", ["i2", "i3", "i4"])
    assert missing == [] and "shop" not in state["tasks"] and "shop" not in idx.state()["tasks"]
    assert unchanged(idx, "a", before)  # the trained task's gallery never moved
    assert [h.task for h in idx.search(unit(np.ones(DIM)), "image", None, k=50)] == ["a"] * 20
    # a catalogue item may take any id, a trained task's included: its point is its catalogue's own
    idx.upsert(catalogue("1", {"a-001": (True, True, {})}))
    assert unchanged(idx, "a", before) and set(idx.points("shop", "image")) == {"a-001"}
    idx.append(tv("a", "1"))  # and the task, indexed again, does not clash with it
    assert idx.state()["tasks"]["a"]["counts"] == {"image": 20, "text": 20}
    assert set(idx.points("shop", "text")) == {"a-001"}
    # merged into one segment with the task (Edge), the catalogue keeps its points and still takes items
    kept = idx.points("shop", "image")
    idx.compact()
    assert idx.points("shop", "image").keys() == kept.keys() and idx.state()["tasks"]["shop"]["kind"] == "catalogue"
    idx.upsert(catalogue("1", {"z": (False, True, {"brand": "zed"})}))
    assert set(idx.points("shop", "text")) == {"a-001", "z"} and set(idx.points("a", "image")) == set(before["image"])


def test_a_catalogue_refuses_what_would_mix_or_clash_and_changes_nothing(make):
    idx = make(fields=FIELDS)
    idx.append(tv("a", "1"))
    idx.upsert(catalogue("1", {"i1": (True, True, {})}))
    before = {t: {m: idx.points(t, m) for m in MODALITIES} for t in ("a", "shop")}
    refusals = [
        (lambda: idx.upsert(catalogue("1", {"x": (True, True, {})}, task="a")), "trained task's gallery"),
        (lambda: idx.upsert(catalogue("2", {"x": (True, True, {})})), "indexed under model version 1"),
        (lambda: idx.upsert(catalogue("1", {"x": (True, True, {"brnd": "acme"})})), "did you mean 'brand'"),
        (lambda: idx.upsert(catalogue("1", {"x": (True, True, {"year": "2020"})})), "declared integer, got str"),
        (lambda: idx.upsert(catalogue("1", {"x": (True, True, {"year": True})})), "declared integer, got bool"),
        (lambda: idx.upsert(catalogue("1", {"x": (False, False, {})})), "needs an image or a text"),
        (lambda: idx.upsert(tv("b", "1")), "catalogue's TaskVectors"),
        (lambda: idx.delete("a", ["a-001"]), "trained task's gallery"),
        (lambda: idx.delete("nope", ["x"]), "unknown catalogue"),
    ]
    for call, message in refusals:
        with pytest.raises(VectorIndexError, match=re.escape(message)):
            call()
    assert all(unchanged(idx, t, before[t]) for t in ("a", "shop"))


def test_search_filters_on_declared_fields_pages_and_thresholds(make):
    idx = make(fields=FIELDS)
    idx.append(tv("a", "1"))
    brands = ["acme", "zed", "acme", "bolt"] * 10
    items = {f"p{i:02d}": (True, True, {"brand": brands[i], "price": float(i), "year": 2000 + i % 3, "size": "SM"[i % 2]})
             for i in range(40)}
    idx.upsert(catalogue("1", items))
    images = {i: np.frombuffer(b, np.float32) for i, (b, _) in idx.points("shop", "image").items()}
    query = unit(np.random.default_rng(0).standard_normal(DIM))

    def expected(keep, k=40):
        return brute({i: v for i, v in images.items() if keep(items[i][2])}, query, k)[0]

    def got(where=None, **kw):
        return [h.item_id for h in idx.search(query, "image", "shop", k=kw.pop("k", 40), where=where, **kw)]

    assert got({"brand": "acme"}) == expected(lambda m: m["brand"] == "acme")
    assert got({"brand": ["zed", "bolt"], "size": "M"}) == expected(lambda m: m["brand"] in ("zed", "bolt")
                                                                     and m["size"] == "M")
    assert got({"price": {"gte": 5, "lte": 20.5}, "year": 2001}) == expected(lambda m: 5 <= m["price"] <= 20.5
                                                                            and m["year"] == 2001)
    # task-unknown too: the trained task's points carry no fields, so a filter leaves only catalogue items
    assert {h.task for h in idx.search(query, "image", None, k=50, where={"brand": "acme"})} == {"shop"}
    # pages: offset + k walks one ranking; a threshold cuts it at a cosine
    ranking_ = got()
    assert [i for o in range(0, 40, 7) for i in got(k=7, offset=o)] == ranking_
    hits = idx.search(query, "image", "shop", k=40, score_threshold=0.1)
    assert hits and all(h.score >= 0.1 for h in hits) and [h.item_id for h in hits] == ranking_[:len(hits)]
    for where, message in [({"brnd": "acme"}, "did you mean 'brand'"), ({"brand": 3}, "declared keyword"),
                           ({"price": 3.0}, "filtered by a range"), ({"brand": {"gte": 1}}, "a range is"),
                           ({"year": {"gte": "x"}}, "finite numbers"), ("brand=acme", "expected a mapping")]:
        with pytest.raises(VectorIndexError, match=re.escape(message)):
            got(where)
    for kw, message in [({"offset": -1}, "offset must be"), ({"offset": 9_999, "k": 10}, "offset must be"),
                        ({"score_threshold": 2.0}, "score_threshold must be")]:
        with pytest.raises(VectorIndexError, match=message):
            got(**kw)
