"""Shared fixtures: one local Ray cluster per session, isolated clipstream homes, a tiny synthetic stream."""

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from clipstream.settings import Settings
    from training.job import init_ray

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
    from training.data.synth import synthesize

    return synthesize(tmp_path_factory.mktemp("stream") / "data", tasks=2, seed=3, train_pairs=256,
                      test_per_task=24, digits=False, progress=False)
