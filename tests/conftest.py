"""Shared fixtures: one local Ray cluster per session, isolated clipstream homes, a tiny synthetic stream."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# DeepSpeed compiles its CPU communication op on first use into TORCH_EXTENSIONS_DIR, by default one folder in
# HOME for every venv: clones side by side (each with its venv) rebuilt it in turn at every job's start, minutes
# each on a loaded machine. Each venv keeps its own build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from clipstream.runtime import init_ray
    from clipstream.services import binding
    from clipstream.services.app import serving_environment
    from clipstream.settings import Settings

    serving_environment()  # the tests serve with the settings `clipstream serve` uses
    init_ray(Settings(ray_address=None), num_cpus=2, setup_hook=binding.install)
    yield ray
    ray.shutdown()


@pytest.fixture
def settings(tmp_path, monkeypatch):
    """Settings whose every embedded default lives under this test's tmp_path."""
    from clipstream.settings import Settings

    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("CLIPSTREAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CLIPSTREAM_HOME", str(tmp_path / "home"))
    return Settings().ensure_dirs()


@pytest.fixture(scope="session")
def stream(tmp_path_factory):
    """Two small synthetic domain tasks (no digits), made once per session."""
    from clipstream.training.data.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("stream") / "data", tasks=2, seed=3, train_pairs=256,
                      test_per_task=24, digits=False, progress=False)


# ---- tiers: `make test` runs everything not marked `slow`; `make test-all` (CI) runs everything -------------------
# A test that starts (or shares) Ray, Serve, a training job, a cluster or a CLI subprocess says which tier it is in:
#   component  the quick tier: it shares the session's one Ray instance and served app, or runs a short CLI process
#   e2e        the quick tier's one end-to-end path (tests/test_end_to_end.py and the checks on what it trained)
#   slow       the full tier only: the method streams, faults, the local cluster, the demo, the load test
TIERS = ("component", "e2e", "slow")
# fixture -> the tiers a test that uses it (directly or through another fixture) may be in
COSTLY = {"ray_cluster": TIERS, "served": TIERS, "indexed": TIERS, "cli_process": TIERS, "two_tasks": ("e2e", "slow"),
          "trained_stream": ("slow",), "cluster_session": ("slow",)}


def tier_problem(name: str, fixtures, markers) -> str | None:
    """Why a test with these fixtures and marker names breaks the tier rules (None when it does not)."""
    tiers = [m for m in TIERS if m in markers]
    if len(tiers) > 1:
        return f"{name} carries several tier markers {tiers}: one only"
    for fixture in (f for f in COSTLY if f in fixtures):
        if not tiers:
            return (f"{name} uses `{fixture}` (Ray, Serve, a training job, a cluster or a CLI process) without a tier "
                    f"marker: add @pytest.mark.{' / '.join(COSTLY[fixture])} (tests/conftest.py TIERS)")
        if tiers[0] not in COSTLY[fixture]:
            return f"{name} uses `{fixture}`, which belongs to tier {' / '.join(COSTLY[fixture])}, not {tiers[0]}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "stream(method, stage): the test uses that trained stream (tests/streams.py)")
    config.addinivalue_line("markers", "cluster: the test uses the session's local cluster (tests/cluster.py)")
    for tier, text in (("component", "quick tier, shares the session's Ray / served app or runs a CLI process"),
                       ("e2e", "quick tier, the one end-to-end path"), ("slow", "full tier only (make test-all)")):
        config.addinivalue_line("markers", f"{tier}: {text} (tests/conftest.py TIERS)")


_BACKGROUND = pytest.StashKey()  # marker name -> the session of work it starts (start/stop, see below)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Work that other processes do, and the tests that wait for it run last: the method streams train in a
    background process started now (tests/streams.py), while the other tests fill the cores that their
    start-ups leave idle; the local cluster (tests/cluster.py) starts when the first cluster test needs it,
    after everything else. Each is a session object with `start()` (returns at once) and `stop()` (returns
    what it left running)."""
    problems = [p for p in (tier_problem(i.nodeid, i.fixturenames, {m.name for m in i.iter_markers()}) for i in items) if p]
    if problems:
        raise pytest.UsageError("tests without their tier (tests/conftest.py):\n  " + "\n  ".join(problems))
    if config.option.collectonly:
        return
    from tests.cluster import ClusterSession
    from tests.streams import StreamSession

    background = {}
    streams = list(dict.fromkeys(tuple(m.args) for i in items for m in i.iter_markers("stream")))
    if streams:
        background["stream"] = StreamSession(streams, config.rootpath).start()
    if any(i.get_closest_marker("cluster") for i in items):
        background["cluster"] = ClusterSession()  # started by the fixture
    config.stash[_BACKGROUND] = background

    def waits(item) -> float:
        # the end-to-end path after every test that uses the shared served app (its last test replaces that app,
        # and promotes the stream the other e2e tests check as trained)
        return (3 if item.get_closest_marker("cluster") else 2 if item.get_closest_marker("stream")
                else 1.5 if item.path.name == "test_end_to_end.py" else 1 if item.get_closest_marker("e2e") else 0)
    items.sort(key=waits)  # stable: the order within each group is kept


def pytest_unconfigure(config):
    """Stop what the session started in the background (its own processes, by their handles). A leftover is
    said here; test_local_cluster asserts there is none."""
    import warnings

    for marker, work in config.stash.get(_BACKGROUND, {}).items():
        left = work.stop()
        if left:
            warnings.warn(f"the background work of @pytest.mark.{marker} left processes behind: {left}")


def _background(request, marker: str):
    started = request.config.stash.get(_BACKGROUND, {}).get(marker)
    if started is None:
        pytest.fail(f"a test that uses this fixture must carry @pytest.mark.{marker}, which starts its work")
    return started


@pytest.fixture(scope="session")
def cluster_session(request):
    """The session's local cluster with its two training jobs submitted (tests/cluster.py); a test that uses it
    must carry the `cluster` marker."""
    return _background(request, "cluster").start()


@pytest.fixture(scope="session")
def trained_stream(request):
    """trained_stream(method, stage) -> (settings, task dirs): three synthetic tasks trained in turn from the
    CLI, versions 1..3 of their own registry (tests/streams.py), waited for. A test that calls it must carry
    the marker `stream(method, stage)`, which starts the training right after collection."""
    from clipstream.settings import Settings
    from tests import streams

    def train(method: str, stage: int):
        started = _background(request, "stream")
        if (method, stage) not in started.streams:
            pytest.fail(f"a test that uses trained_stream({method!r}, {stage}) must carry "
                        f"@pytest.mark.stream({method!r}, {stage})")
        try:
            home = started.trained(method, stage)
        except RuntimeError as exc:
            pytest.fail(str(exc))
        return Settings(home=home, presets=started.root / "presets.yaml"), streams.tasks_of(started.root, method)

    return train


# the quick tier's training settings: 2 epochs of 16-pair micro batches, no retries
FAST = ["train.epochs=2", "train.micro_batch=16", "train.log_every=2", "train.max_failures=0"]
DETERMINISTIC = [*FAST, "train.deterministic=true"]


@pytest.fixture(scope="session")
def two_tasks(ray_cluster, stream, tmp_path_factory):
    """The quick tier's one trained stream, trained once per session as Ray Train jobs on 2 DeepSpeed workers:
    version 1 (finetune, deterministic, with the held-out zero-shot task) and version 2 (joint, its child, found
    through the alias the first set, as `clipstream k8s stream` chains its jobs)."""
    from clipstream.settings import Settings
    from clipstream.training.data.synth import held_out_task
    from clipstream.training.job import run_task

    settings = Settings(home=tmp_path_factory.mktemp("two-tasks") / "home").ensure_dirs()
    first = run_task(stream[0], "finetune", None, workers=2, overrides=DETERMINISTIC, settings=settings,
                     aliases=["s1-1"], zero_shot=[held_out_task(stream[0].parent)])
    second = run_task(stream[1], "joint", "models:/clipstream@s1-1", workers=2, overrides=FAST, settings=settings,
                      wait_parent_s=60)
    return settings, first, second


@pytest.fixture
def cli_process(tmp_path):
    """cli_process(*args, env=None, **kwargs) -> CompletedProcess: `clipstream ARGS` as a process of its own (the
    console script's module), output captured, run in this test's tmp_path unless `cwd` is given."""
    import subprocess
    import sys

    def run(*args, env=None, **kwargs):
        kwargs.setdefault("cwd", tmp_path)
        return subprocess.run([sys.executable, "-m", "clipstream.cli", *map(str, args)], capture_output=True,
                              text=True, check=False, env=env, **kwargs)
    return run


@pytest.fixture(autouse=True)
def _tier_guard(request):
    """A test without a tier marker that starts Ray itself (not through a fixture the collection check sees) fails."""
    import sys

    ray = sys.modules.get("ray")
    before = bool(ray and ray.is_initialized())
    yield
    ray = sys.modules.get("ray")
    if not before and ray and ray.is_initialized() and not any(request.node.get_closest_marker(t) for t in TIERS):
        pytest.fail(f"{request.node.nodeid} started Ray without a tier marker (tests/conftest.py TIERS)")


def register_version(settings, seed: int, alias: str | None = None, task_dirs=(), aa: float = 50.0,
                     forgetting: float = 0.0, parent: str = "", model=None, state: dict | None = None) -> str:
    """Register a version made without training: a real tiny open_clip model (weights from `seed`, or the
    exported folder `model`) whose lineage is `task_dirs` and whose method state is `state`, with the given run
    metrics, really registered in MLflow."""
    import json

    import torch

    from clipstream import models
    from clipstream.registry import MANIFEST, Registry
    from clipstream.training.data.task import Task
    from clipstream.training.methods.state import STATE_FILE, save_state

    torch.manual_seed(seed)
    tasks = [Task.load(d) for d in task_dirs]
    lineage = [{"task": t.name, "path": str(t.root), "data_sha": "sha-" + t.name,
                **({"lang": t.meta["lang"]} if t.meta.get("lang") else {})} for t in tasks]
    folder = settings.home / f"export-{seed}" / "checkpoint"
    models.export(models.load_exported(model) if model else models.create("clipstream-vit-tiny"), folder)
    save_state(state or {}, folder / STATE_FILE)
    (folder / MANIFEST).write_text(json.dumps({"lineage": lineage, "matrix": {}}))
    tags = {"task": tasks[-1].name if tasks else f"t{seed}", "task_index": str(max(len(tasks) - 1, 0)),
            "method": "finetune", "parent_version": parent, "data_sha": lineage[-1]["data_sha"] if tasks else "x"}
    registry = Registry(settings)
    with registry.run(f"seed-{seed}", tags) as run_id:
        registry.log(run_id).log_metrics({"known/AA": aa, "known/forgetting": forgetting})
        version = registry.register(folder, tags, run_id=run_id)
    if alias:
        registry.set_alias(alias, version)
    return version


def _gloo_process(worker, rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    queue.put((rank, worker(rank, world)))
    dist.destroy_process_group()


def on_gloo(worker, world: int = 2, timeout_s: float = 600) -> dict:
    """{rank: worker(rank, world)} from `world` real processes in one gloo group. Workers return numpy
    arrays or numbers, not tensors: a tensor crosses processes through shared memory that dies with it. A worker
    that has not answered in `timeout_s` fails the test, and every worker is stopped (one left blocked in a
    collective, or on a result nobody reads, would hang the test session at exit)."""
    import torch.multiprocessing as mp

    from clipstream.runtime import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_process, args=(worker, r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        import queue as queues
        import time

        results, deadline = {}, time.monotonic() + timeout_s
        while len(results) < world:
            try:
                rank, value = queue.get(timeout=1.0)
                results[rank] = value
                continue
            except queues.Empty:
                pass
            # a worker that raised exits without an answer (its traceback is on stderr): fail now, not at the timeout
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a gloo worker exited with {dead[0]} before answering (its traceback is above)"
            assert time.monotonic() < deadline, f"the gloo workers did not answer in {timeout_s:g} s"
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


# ---- the served app: one real Ray Serve app on loopback gRPC for every test that calls it (session-wide, so
# the services and reliability tests share it; tests/services/conftest.py orders the module that replaces it)
@pytest.fixture(scope="session")
def served(ray_cluster, tmp_path_factory):
    import grpc
    from ray import serve

    from clipstream.runtime import free_port
    from clipstream.services import app
    from clipstream.settings import Settings
    from clipstream.v1 import encoder_pb2_grpc

    # no CPU reserved: the session's 2-CPU Ray cluster must still fit the training tests that follow
    home = tmp_path_factory.mktemp("serve")
    settings = Settings(home=home / "home", grpc_port=free_port(), serve_max_items=8,
                        serve_max_text_chars=100, serve_max_image_bytes=200_000, serve_batch_size=16,
                        serve_encoder_cpus=0, serve_search_cpus=0, image_roots=[str(home / "images")],
                        index_fields={"brand": "keyword", "price": "float", "stock": "integer"}).ensure_dirs()
    v1 = register_version(settings, seed=1, alias="production")
    v2 = register_version(settings, seed=2)
    app.start(settings)
    channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    yield settings, channel, encoder_pb2_grpc.EncoderServiceStub(channel), (v1, v2)
    channel.close()
    serve.shutdown()


COLOURS = ["red", "navy", "green", "yellow", "purple", "orange"]


@pytest.fixture(scope="session")
def indexed(served):
    """Two tasks of coloured squares indexed with version 1 (the production version)."""
    settings, channel, _, (v1, _) = served
    from clipstream.index import TaskVectors, open_index
    from clipstream.registry import Registry
    from clipstream.v1 import search_pb2_grpc
    from tests.services.conftest import png

    bundle = Registry(settings).load(v1)
    with open_index(settings) as index:
        for t, task in enumerate(("squares", "discs")):
            captions = [f"a {c} {task[:-1]} {t}" for c in COLOURS]
            img, txt = bundle.embed_images([png(c) for c in COLOURS]), bundle.embed_texts(captions)
            index.append(TaskVectors(task, t, v1, [f"{task}-{i}" for i in range(len(COLOURS))], img, txt, captions,
                                     image_uris=[f"s3://bucket/{task}/{i}.png" for i in range(len(COLOURS))]))
    return settings, search_pb2_grpc.SearchServiceStub(channel), bundle, v1
