"""Shared fixtures: one local Ray cluster per session, isolated clipstream homes, a tiny synthetic stream."""

import os
import sys
import threading
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

    from clipstream.services.app import ray_for_serving
    from clipstream.settings import Settings

    ray_for_serving(Settings(ray_address=None), num_cpus=2)  # as `clipstream serve` starts it: the tests serve on it
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def empty_registry(tmp_path_factory) -> Path:
    """MLflow's SQLite store with its schema made and nothing in it: what the first command in a new home makes
    (its migrations take ~1 s), made once and copied into each test's home."""
    from clipstream.registry import Registry
    from clipstream.settings import Settings

    settings = Settings(home=tmp_path_factory.mktemp("empty-registry") / "home").ensure_dirs()
    assert Registry(settings).versions() == []
    return settings.home / "mlflow.db"


@pytest.fixture
def settings(tmp_path, monkeypatch, empty_registry):
    """Settings whose every embedded default lives under this test's tmp_path (the registry's store a copy of the
    session's empty one)."""
    import shutil

    from clipstream.settings import Settings

    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("CLIPSTREAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CLIPSTREAM_HOME", str(tmp_path / "home"))
    settings = Settings().ensure_dirs()
    shutil.copyfile(empty_registry, settings.home / empty_registry.name)
    return settings


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
          "trained_stream": ("slow",), "cluster_session": ("slow",),
          # what the Kubernetes and packaging tests share: helm / kubectl renders, checkov's findings, built wheels
          **dict.fromkeys(("renders", "chart", "overlays", "findings", "wheel", "client_wheel"), TIERS)}


def tier_problem(name: str, fixtures, markers) -> str | None:
    """Why a test with these fixtures and marker names breaks the tier rules (None when it does not)."""
    tiers = [m for m in TIERS if m in markers]
    if len(tiers) > 1:
        return f"{name} carries several tier markers {tiers}: one only"
    if tiers == ["e2e"] and "two_tasks" not in fixtures:
        return f"{name} is marked e2e without using `two_tasks`: the e2e tier is the one trained world's checks"
    for fixture in (f for f in COSTLY if f in fixtures):
        if not tiers:
            return (f"{name} uses `{fixture}` (Ray, Serve, a training job, a cluster or a costly process) without a "
                    f"tier marker: add @pytest.mark.{' / '.join(COSTLY[fixture])} (tests/conftest.py TIERS)")
        if tiers[0] not in COSTLY[fixture]:
            return f"{name} uses `{fixture}`, which belongs to tier {' / '.join(COSTLY[fixture])}, not {tiers[0]}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "stream(method, stage): the test uses that trained stream (tests/streams.py)")
    for tier, text in (("component", "quick tier, shares the session's Ray / served app or runs a CLI process"),
                       ("e2e", "quick tier, the one end-to-end path"), ("slow", "full tier only (make test-all)")):
        config.addinivalue_line("markers", f"{tier}: {text} (tests/conftest.py TIERS)")


_BACKGROUND = pytest.StashKey()  # marker name -> the session of work it starts (start/stop, see below)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """Refuse tests without their tier; start the work that another process does while the suite runs: the method
    streams train in a background process started now (tests/streams.py), filling the cores that the other
    tests' start-ups leave idle; their tests, wherever they come, wait for it. The order of the tests is pytest's."""
    problems = [p for p in (tier_problem(i.nodeid, i.fixturenames, {m.name for m in i.iter_markers()}) for i in items) if p]
    if problems:
        raise pytest.UsageError("tests without their tier (tests/conftest.py):\n  " + "\n  ".join(problems))
    if config.option.collectonly:
        return
    from tests.streams import StreamSession

    streams = list(dict.fromkeys(tuple(m.args) for i in items for m in i.iter_markers("stream")))
    config.stash[_BACKGROUND] = {"stream": StreamSession(streams, config.rootpath).start()} if streams else {}


def pytest_unconfigure(config):
    """Stop what the session started in the background (its own processes, by their handles); a leftover is
    said here."""
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


@pytest.fixture(scope="module")
def cluster_session(request):
    """The local cluster with its two training jobs submitted (tests/cluster.py), for the module that uses it and
    stopped after it: it starts when the background streams are done, since both beside each other oversubscribe
    the cores (tests/cluster.py)."""
    from tests.cluster import ClusterSession

    streams = request.config.stash.get(_BACKGROUND, {}).get("stream")
    if streams is not None:
        streams.finished()
    session = ClusterSession().start()
    yield session
    left = session.stop()
    assert not left, f"the local cluster left processes behind: {left}"


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
    """The quick tier's one trained world, made once per session, runs_dir a file:// URI: a checkpoint in open_clip's
    trainer format registered as version 1 with `clipstream register --from` (a version 0: untrained, its row 0 on
    both tasks and the held-out zero-shot task, alias `start`), then two Ray Train jobs on 2 DeepSpeed workers on top
    of it: version 2 (finetune, deterministic, parent `start`) and version 3 (joint at ZeRO 3, its child, found
    through the alias the first set, as `clipstream k8s stream` chains its jobs). Returns (settings, version 0 as the
    registry resolves it, first, second), shared read-only."""
    import torch

    from clipstream import models
    from clipstream.cli import main
    from clipstream.registry import Registry
    from clipstream.settings import Settings
    from clipstream.training.data.synth import held_out_task
    from clipstream.training.job import run_task

    root = tmp_path_factory.mktemp("two-tasks")
    # runs_dir a URI (a real file:// filesystem through fsspec and pyarrow, as s3:// goes): the parents reach the
    # workers and the checkpoints go through it
    settings = Settings(home=root / "home", runs_dir=(root / "store").as_uri()).ensure_dirs()
    torch.manual_seed(7)
    checkpoint = root / "epoch_32.pt"  # as open_clip's trainer saves it (the DDP-wrapped model's state)
    torch.save({"epoch": 32, "state_dict": {f"module.{k}": v for k, v in
                                            models.create("clipstream-vit-tiny").model.state_dict().items()}},
               checkpoint)
    with pytest.MonkeyPatch.context() as env:  # the command line reads the settings from the environment
        env.chdir(root)  # (test_job checks that nothing was made beside home and store)
        for name in [n for n in os.environ if n.startswith("CLIPSTREAM_")]:
            env.delenv(name)
        for name, value in settings.env().items():
            env.setenv(name, value)
        assert main(["register", "--from", f"clipstream-vit-tiny:{checkpoint}", "--evaluate", *map(str, stream),
                     "--zero-shot", str(held_out_task(stream[0].parent)), "--alias", "start"]) == 0
        first = run_task(stream[0], "finetune", "start", workers=2, overrides=DETERMINISTIC, settings=settings,
                         aliases=["s1-1"])
        second = run_task(stream[1], "joint", "models:/clipstream@s1-1", workers=2, settings=settings,
                          wait_parent_s=60, overrides=[*FAST, "train.zero_stage=3"])  # (Ray Train's path at ZeRO 3)
    return settings, Registry(settings).resolve("start"), first, second


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


# Programs whose start costs seconds (an interpreter importing the stack; the Kubernetes, lint and packaging tools):
# a test that starts one, itself or through any helper, says its tier. Cheap programs libraries start on their own
# (git for MLflow's source version, ldconfig for ctypes) do not count.
COSTLY_PROGRAMS = ("python", "helm", "kubectl", "checkov", "buf", "npm", "pip", "docker", "ray")
_started: list[str] = []  # what the running test started (reset by _tier_guard)


def costly_program(argv) -> str | None:
    """The name of the costly program a process's argv starts (a path's last part, `python3.11` as `python`), else
    None."""
    argv = [argv] if isinstance(argv, (str, bytes, os.PathLike)) else list(argv or [])
    name = Path(os.fsdecode(argv[0])).name if argv else ""
    return name if name.startswith(COSTLY_PROGRAMS) else None


def _audit(event: str, args) -> None:
    # (the main thread's only: what runs the test, not a thread an earlier test left behind)
    if event == "subprocess.Popen" and threading.current_thread() is threading.main_thread():
        name = costly_program(args[0] or args[1])  # (executable, args, cwd, env)
        if name:
            _started.append(name)


def _spawned_interpreter(spawnv_passfds):
    """multiprocessing's spawn start (a gloo group's processes) starts an interpreter without an audit event."""
    def spawn(path, args, passfds):
        if threading.current_thread() is threading.main_thread():
            _started.append("python (multiprocessing)")
        return spawnv_passfds(path, args, passfds)
    spawn.recording = _started
    return spawn


import multiprocessing.util  # noqa: E402

# Installed once: test modules import this file again as `tests.conftest` (pytest loads it as `conftest`), and that
# copy must neither record twice nor keep a list of its own. An audit hook cannot be removed: it only appends a name.
if not hasattr(multiprocessing.util.spawnv_passfds, "recording"):
    sys.addaudithook(_audit)
    multiprocessing.util.spawnv_passfds = _spawned_interpreter(multiprocessing.util.spawnv_passfds)


@pytest.fixture(autouse=True)
def _tier_guard(request):
    """A test without a tier marker that starts Ray itself (not through a fixture the collection check sees), or a
    costly process (COSTLY_PROGRAMS: a CLI process, a gloo group, a wheel build, helm, checkov), fails: the quick
    tier's budget is kept by knowing what costs."""
    started = multiprocessing.util.spawnv_passfds.recording  # (the list of the copy that installed the recording)
    ray = sys.modules.get("ray")
    before = bool(ray and ray.is_initialized())
    started.clear()
    yield started
    ray = sys.modules.get("ray")
    problem = guard_problem(request.node.nodeid, any(request.node.get_closest_marker(t) for t in TIERS),
                            not before and bool(ray and ray.is_initialized()), started)
    if problem:
        pytest.fail(problem)


def guard_problem(name: str, tiered: bool, started_ray: bool, started: list[str]) -> str | None:
    """Why a test that ran so breaks the tier rules (None when it does not)."""
    if tiered:
        return None
    if started_ray:
        return f"{name} started Ray without a tier marker (tests/conftest.py TIERS)"
    if started:
        return (f"{name} started {', '.join(sorted(set(started)))} without a tier marker: add @pytest.mark.component "
                "(or slow) (tests/conftest.py COSTLY_PROGRAMS)")
    return None


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
# the services and reliability tests share it; a test that needs an app of its own deploys it beside this one,
# tests/services/conftest.py `side_app`)
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
    app.serve(settings)
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
