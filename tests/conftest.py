"""Shared fixtures: one local Ray cluster per session, isolated clipstream homes, a tiny synthetic stream."""

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from clipstream.services.app import serving_environment
    from clipstream.settings import Settings
    from clipstream.training.job import init_ray

    serving_environment()  # the tests serve with the settings `clipstream serve` uses
    init_ray(Settings(ray_address=None), num_cpus=2)
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


STREAM_FAST = ["train.epochs=1", "train.micro_batch=8", "train.log_every=1", "train.max_failures=0",
               "train.warmup_steps=1"]


@pytest.fixture(scope="session")
def three_tasks(tmp_path_factory):
    """Three synthetic domain tasks, made once per session."""
    from clipstream.training.data.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("three") / "data", tasks=3, seed=5, train_pairs=800, test_per_task=12,
                      digits=False, progress=False)


# Compositions of shipped presets, as a user would add them (Settings.presets): each stream test then checks
# several methods' state at once, each on its own loss terms (one `penalty`, one `distill`: they never
# collide), and the second composes a shipped composition (ctp_er) with two more methods.
OWN_PRESETS = """
mas_lwf:
  inherit_from: [mas, lwf]
ewc_modx_ctp_er:
  inherit_from: [ewc, modx, ctp_er]
"""


@pytest.fixture(scope="session")
def trained_stream(ray_cluster, three_tasks, tmp_path_factory):
    """trained_stream(method, zero_stage) -> (settings, task dirs): `three_tasks` trained in turn from the CLI
    (`clipstream train --parent ...`), versions 1..3 of their own registry. Trained once per session for each
    (method, stage), so the tests that only need *a* trained stream (indexing) reuse one that a method's
    stream test trains anyway. `method` may be one of OWN_PRESETS."""
    from clipstream.cli import main
    from clipstream.settings import Settings

    done = {}
    presets = tmp_path_factory.mktemp("presets") / "presets.yaml"
    presets.write_text(OWN_PRESETS)

    def train(method: str, stage: int):
        if (method, stage) not in done:
            home = tmp_path_factory.mktemp(f"{method}-zero{stage}") / "home"
            settings = Settings(home=home, presets=presets).ensure_dirs()
            extra = ["method.er.buffer_pairs=40"] if "er" in method.split("_") else []
            with pytest.MonkeyPatch.context() as env:
                for name, value in settings.env().items():
                    env.setenv(name, value)
                for i, folder in enumerate(three_tasks):
                    args = ["train", "--task", str(folder), "--method", method, "--workers", "2"]
                    for item in [*STREAM_FAST, f"train.zero_stage={stage}", *extra]:
                        args += ["--set", item]
                    assert main(args + (["--parent", str(i)] if i else [])) == 0
            done[(method, stage)] = settings
        return done[(method, stage)], three_tasks

    return train


def register_version(settings, seed: int, alias: str | None = None, task_dirs=(), aa: float = 50.0,
                     forgetting: float = 0.0, parent: str = "") -> str:
    """Register a version made without training: a real tiny open_clip model (weights from `seed`) whose
    lineage is `task_dirs`, with the given run metrics, really registered in MLflow."""
    import json

    import mlflow
    import torch

    from clipstream import models
    from clipstream.registry import MANIFEST, Registry
    from clipstream.training.data.task import Task

    torch.manual_seed(seed)
    tasks = [Task.load(d) for d in task_dirs]
    lineage = [{"task": t.name, "path": str(t.root), "data_sha": "sha-" + t.name} for t in tasks]
    folder = settings.home / f"export-{seed}" / "checkpoint"
    models.export(models.create("clipstream-vit-tiny"), folder)
    torch.save({}, folder / "method_state.pt")
    (folder / MANIFEST).write_text(json.dumps({"lineage": lineage, "matrix": {}}))
    tags = {"task": tasks[-1].name if tasks else f"t{seed}", "task_index": str(max(len(tasks) - 1, 0)),
            "method": "finetune", "parent_version": parent, "data_sha": lineage[-1]["data_sha"] if tasks else "x"}
    registry = Registry(settings)
    with registry.run(f"seed-{seed}", tags):
        mlflow.log_metrics({"known/AA": aa, "known/forgetting": forgetting})
        version = registry.register(folder, tags)
    if alias:
        registry.set_alias(alias, version)
    return version


def _gloo_process(worker, rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    queue.put((rank, worker(rank, world)))
    dist.destroy_process_group()


def on_gloo(worker, world: int = 2) -> dict:
    """{rank: worker(rank, world)} from `world` real processes in one gloo group. Workers return numpy
    arrays or numbers, not tensors: a tensor crosses processes through shared memory that dies with it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_process, args=(worker, r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results
