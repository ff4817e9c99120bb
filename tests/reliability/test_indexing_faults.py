"""`clipstream index` killed mid-way (a real SIGKILL of the real command in a child process) leaves the serving
generation as it was until the switch, leaves the writer lock free, and the same command run again ends with
the point set (ids, vectors, payloads) that a clean run makes: on Qdrant Edge and on qdrant-client's local mode
(the server API)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from clipstream.cli import main
from clipstream.index import MODALITIES, EdgeIndex, open_index
from clipstream.indexing import index_task
from clipstream.settings import Settings
from tests.conftest import register_version

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Payload indexes have no effect:UserWarning"),
              pytest.mark.filterwarnings("ignore:Failed to obtain server version:UserWarning")]
REPO = Path(__file__).resolve().parents[2]
POLICIES = ("no-reindex", "reindex")
UPSERTS = 8  # batches of 4 points stored before the kill: a task's images (6 batches) and a third of its texts

# The child dies at one step of the real command (SIGKILL: no finally blocks, no atexit, no lock release).
# The patches only wrap library calls the index makes; the command itself runs unchanged.
CHILD = """
import os, signal, sys
import qdrant_edge
from qdrant_client import QdrantClient
from clipstream import index
from clipstream.cli import main

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

step, argv = sys.argv[1], sys.argv[2:]
index.BATCH = 4  # several upserts per segment, so the kill falls between two of them
if step.startswith("upload:"):  # after N point batches are stored, before anything is published
    left = [int(step.split(":")[1])]
    def upserted():
        left[0] -= 1
        if left[0] < 0:
            die()
    class Ops:  # qdrant_edge's classes are immutable: wrap the module's names instead
        create_field_index = staticmethod(qdrant_edge.UpdateOperation.create_field_index)
        @staticmethod
        def upsert_points(points, _real=qdrant_edge.UpdateOperation.upsert_points):
            upserted()
            return _real(points)
    qdrant_edge.UpdateOperation = Ops
    upsert = QdrantClient.upsert
    def counted(self, collection_name, *args, **kwargs):
        if not collection_name.endswith("-state"):
            upserted()
        return upsert(self, collection_name, *args, **kwargs)
    QdrantClient.upsert = counted
elif step == "switch":  # a reindex's every segment written and verified; the switch itself not made
    replace = os.replace
    def replace_or_die(src, dst, *args, **kwargs):  # Edge: the new manifest is written and fsynced, not renamed
        if str(dst).endswith("manifest.json"):
            die()
        return replace(src, dst, *args, **kwargs)
    os.replace = replace_or_die
    QdrantClient.update_collection_aliases = die  # server: generation g+1's state stored, aliases not moved
elif step == "cleanup":  # switched; the previous generation's storage not dropped yet
    for cls in (index.EdgeIndex, index.ServerIndex):
        def publish_then_die(self, new, _real=cls._publish):
            _real(self, new)
            die()
        cls._publish = publish_then_die
sys.exit(main(argv))
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, stream):
    """A registry with version 1 (task 0) and version 2 (tasks 0 and 1), and per backend an index holding
    task 0 under version 1 (generation 1): the state each killed command starts from, copied per test."""
    root = tmp_path_factory.mktemp("indexing-faults")
    with pytest.MonkeyPatch.context() as mp:
        for name in list(os.environ):
            if name.startswith("CLIPSTREAM_"):
                mp.delenv(name)
        mp.chdir(root)
        base = Settings(home=root / "home").ensure_dirs()
        v1 = register_version(base, 411, task_dirs=stream[:1])
        v2 = register_version(base, 412, task_dirs=stream, parent=v1)
        starts, clean = {}, {}
        for backend in ("edge", "server"):
            start = on(base, backend, root / f"start-{backend}")
            index_task(start, v1, stream[0], "no-reindex")
            starts[backend] = (start, point_set(start))
            for policy in POLICIES:  # the clean run: the same command on a copy that nothing interrupted
                done = copy_index(start, on(base, backend, root / f"clean-{backend}-{policy}"))
                index_task(done, v2, stream[1], policy)
                clean[backend, policy] = point_set(done)
    return {"base": base, "v2": v2, "task": stream[1], "starts": starts, "clean": clean}


def on(base: Settings, backend: str, where: Path) -> Settings:
    """`base` with its index stored at `where` on `backend`."""
    if backend == "edge":
        return base.model_copy(update={"qdrant_path": where, "qdrant_url": None})
    return base.model_copy(update={"qdrant_url": f"local:{where}"})


def location(settings: Settings) -> Path:
    return Path(settings.qdrant_url.removeprefix("local:")) if settings.qdrant_url else settings.qdrant_path


def copy_index(src: Settings, dest: Settings) -> Settings:
    shutil.copytree(location(src), location(dest))
    return dest


def point_set(settings: Settings) -> dict:
    """What a reader (`open_index`, as Search opens it) serves, and what storage holds under the serving
    generation (read from storage itself, so a point of an unpublished task counts too). Points are digested
    as the sorted (id, vector rounded to 1e-5, canonical JSON payload without indexed_at); "content" also
    without index_generation (a build number, not what a point says)."""
    with open_index(settings) as index:
        state = index.state()
        served = [(item, m, v, p) for t in state["tasks"] for m in MODALITIES
                  for item, (v, p) in index.points(t, m).items()]
        stored = list(_stored(index, state))

    def digest(rows, drop=("indexed_at",)):
        return hashlib.sha256(repr(sorted(
            (str(key), np.round(np.frombuffer(v, np.float32) if isinstance(v, bytes) else np.asarray(v, np.float32),
                                5).tobytes(), json.dumps({k: x for k, x in p.items() if k not in drop}, sort_keys=True))
            for key, v, p in rows)).encode()).hexdigest()

    tasks = {t: {k: x for k, x in e.items() if k != "indexed_at"} for t, e in state["tasks"].items()}
    return {"generation": state["generation"], "query_version": state["query_version"], "tasks": tasks,
            "served": digest([((item, m), v, p) for item, m, v, p in served]),
            "served_content": digest([((item, m), v, p) for item, m, v, p in served], ("indexed_at", "index_generation")),
            "stored_points": len(stored),
            "stored": digest(stored), "content": digest(stored, ("indexed_at", "index_generation"))}


def _stored(index, state: dict):
    """(id, vector, payload) of every point the serving generation's storage holds."""
    if isinstance(index, EdgeIndex):
        for refs in index._read()["segments"].values():
            for ref in refs.values():
                shard, offset = index._open(ref)[0], None
                while True:
                    records, offset = shard.scroll(index._qe.ScrollRequest(offset=offset, limit=1024,
                                                                           with_payload=True, with_vector=True))
                    yield from ((r.id, r.vector, r.payload) for r in records)
                    if offset is None:
                        break
        return
    if state["generation"]:
        for modality in MODALITIES:  # the whole collection: a point of an unpublished task would show here
            for r in index._records(index._coll(state["generation"], modality), None, vectors=True):
                yield r.id, r.vector, r.payload


def leftovers(settings: Settings) -> dict:
    """Storage the serving state does not reference (what a failed or interrupted write leaves behind)."""
    with open_index(settings) as index:
        state = index._read()
        if isinstance(index, EdgeIndex):
            live = {r for refs in state["segments"].values() for r in refs.values()}
            on_disk = {f"{p.parent.name}/{p.name}" for p in index._dir.glob("g*/*")}
            return {"segments": sorted(on_disk - live),
                    "generations": sorted({p.name for p in index._dir.glob("g*")} - {f"g{state['generation']}"}),
                    "manifests": sorted(p.name for p in index._dir.glob(".manifest.*"))}
        gen = state["generation"]
        want = {index._coll(gen, m) for m in MODALITIES} | {index._state_coll} if gen else set()
        states = {r.id for r in index._records(index._state_coll, None, vectors=False)} \
            if index.client.collection_exists(index._state_coll) else set()
        unpublished = [r.id for m in MODALITIES if gen for r in index._records(index._coll(gen, m), None, False)
                       if r.payload["task"] not in state["tasks"]]
        return {"collections": sorted({c.name for c in index.client.get_collections().collections} - want),
                "states": sorted(states - {gen}), "unpublished points": len(unpublished)}


def writer_lock_free(settings: Settings) -> None:
    """The writer lock is taken within seconds, with no manual cleanup (opening the index takes qdrant-client
    local mode's own storage lock, which is a writer lock too)."""
    taken = threading.Event()

    def take():
        with open_index(settings) as index, index._writing():
            pass
        taken.set()  # once released too: the caller opens the index next (local mode allows one client at a time)

    threading.Thread(target=take, daemon=True).start()
    assert taken.wait(60), "the writer lock is still held after its holder was killed"


def kill_at(settings: Settings, step: str, argv: list[str]) -> None:
    """Run `clipstream index ...` in a child that SIGKILLs itself at `step`; returns once it is gone, and
    anything it started with it (it runs in a session of its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLIPSTREAM_")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, step, *argv], cwd=REPO, env={**env, **settings.env()},
                             start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL, f"the child was not killed at {step}: rc {child.returncode}\n{err[-3000:]}"
    left = _session(child.pid)
    for pid in left:  # only what the child started
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the killed command left processes running: {left}"


def _session(sid: int, wait: float = 10.0) -> dict[int, str]:
    """pid -> command line of the processes still in session `sid` after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        alive = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    alive[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")[:200]
            except (OSError, IndexError):
                continue  # gone meanwhile
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def served(points: dict) -> dict:
    """What a reader gets, without what storage holds besides."""
    return {k: v for k, v in points.items() if k not in ("stored_points", "stored", "content")}


@pytest.mark.parametrize("backend, policy, step", [
    ("edge", "no-reindex", "upload"),  # a segment half written into the serving generation's directory
    ("edge", "reindex", "switch"),  # generation 2 built and its manifest written, not renamed into place
    ("edge", "reindex", "cleanup"),  # generation 2 published, generation 1 still on disk
    ("server", "no-reindex", "upload"),  # points of an unpublished task in the serving collections
    ("server", "reindex", "switch"),  # generation 2's state stored, aliases still on generation 1
    ("server", "reindex", "cleanup"),  # aliases on generation 2, generation 1's collections and state left
])
def test_a_killed_index_command_converges_on_rerun(world, backend, policy, step, tmp_path, monkeypatch):
    start, before = world["starts"][backend]
    settings = copy_index(start, on(world["base"], backend, tmp_path / "index"))
    argv = ["index", "--version", world["v2"], "--task", str(world["task"]), "--policy", policy]
    kill_at(settings, f"upload:{UPSERTS}" if step == "upload" else step, argv)

    clean = world["clean"][backend, policy]
    writer_lock_free(settings)
    if step != "cleanup":  # readers still get the previous generation, point for point
        assert served(point_set(settings)) == served(before)
    else:  # switched: readers get the new generation whole; the old one's storage goes at the next write
        assert point_set(settings) == clean
    assert any(leftovers(settings).values())  # the kill did leave work behind for the rerun to clear

    for name, value in settings.env().items():
        monkeypatch.setenv(name, value)
    if not settings.qdrant_url:
        monkeypatch.delenv("CLIPSTREAM_QDRANT_URL", raising=False)
    assert main(argv) == 0  # what the user does next: run the same command again
    after = point_set(settings)
    if step != "cleanup":
        assert after == clean
    else:  # the killed run had completed its reindex, so the rerun is a second one: generation + 1, same points
        assert after["generation"] == clean["generation"] + 1
        assert {k: v for k, v in after.items() if k not in ("generation", "served", "stored")} == \
               {k: v for k, v in clean.items() if k not in ("generation", "served", "stored")}
    assert not any(leftovers(settings).values()), leftovers(settings)
    writer_lock_free(settings)
