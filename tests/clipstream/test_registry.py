"""Registry references that appear later: a stream's RayJobs are applied at once, and each waits for the
alias its parent's job sets (`clipstream train --wait-parent`)."""

import threading
import time

import pytest

from clipstream.registry import Registry, RegistryError


@pytest.fixture
def registry(settings):
    registry = Registry(settings)
    registry.client.create_registered_model(registry.name)
    return registry


def _new_version(registry) -> str:
    return str(registry.client.create_model_version(registry.name, source="file:///nowhere").version)


def test_resolve_waits_for_an_alias_set_later(registry):
    version = _new_version(registry)
    later = threading.Timer(1.0, registry.set_alias, ("s1-1", version))
    later.start()
    tic = time.monotonic()
    try:
        found = registry.resolve("@s1-1", download=False, wait_s=30, poll_s=0.2)
    finally:
        later.cancel()
    assert found.version == version and "s1-1" in found.aliases
    assert 0.9 < time.monotonic() - tic < 10


def test_resolve_gives_up_with_a_clear_error(registry):
    tic = time.monotonic()
    with pytest.raises(RegistryError, match=r"@s1-9: no such model version .* after waiting 1 s: did the job"):
        registry.resolve("@s1-9", download=False, wait_s=1, poll_s=0.2)
    assert 0.8 < time.monotonic() - tic < 5
    with pytest.raises(RegistryError, match="no such model version") as err:  # no wait: at once, plain message
        registry.resolve("@s1-9", download=False)
    assert "waiting" not in str(err.value)


def test_constructing_a_registry_leaves_the_process_as_it_was(settings):
    import os

    import mlflow

    environ, uri = dict(os.environ), mlflow.get_tracking_uri()
    registry = Registry(settings)
    registry.experiment_id()  # (and using it)
    assert dict(os.environ) == environ and mlflow.get_tracking_uri() == uri != settings.mlflow_tracking_uri


def test_a_run_logs_through_its_id_and_registers_without_an_active_run(settings, stream):
    import mlflow

    from tests.conftest import register_version

    registry = Registry(settings)
    with registry.run("logged", {"task": "t"}) as run_id:
        assert mlflow.active_run() is None
        log = registry.log(run_id)
        log.log_metrics({"known/AA": 12.5})
        log.log_metrics({"loss": 2.0}, step=3)
        log.log_params({"workers": 2})
        log.log_dict({"a": 1}, "config.json")
        log.set_tag("model_version", "7")
    run = registry.client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "logged"
    assert run.data.metrics == {"known/AA": 12.5, "loss": 2.0} and run.data.params == {"workers": "2"}
    assert run.data.tags["task"] == "t" and run.data.tags["model_version"] == "7"
    assert [m.step for m in log.metric_history("loss")] == [3]
    assert [a.path for a in registry.client.list_artifacts(run_id)] == ["config.json"]
    with pytest.raises(ZeroDivisionError), registry.run("failed", {}) as failed:
        raise ZeroDivisionError
    assert registry.client.get_run(failed).info.status == "FAILED"

    version = register_version(settings, seed=1, task_dirs=[stream[0]], aa=40.0)  # (a pyfunc, logged by run id)
    found = registry.resolve(version)
    assert registry.run_metrics(found.run_id)["known/AA"] == 40.0 and found.folder.is_dir()
    assert [a.path for a in registry.client.list_artifacts(found.run_id)] == ["model"]
    assert mlflow.active_run() is None


def test_serving_lookups_keep_the_last_version_while_the_registry_does_not_answer(registry, settings, monkeypatch,
                                                                                  caplog):
    """An alias as the Encoder looks it up (alias_ttl_s): answered at once from what was last seen, checked again in
    the background; while MLflow does not answer (here: a client of a port nothing listens on), the version last
    seen is served, one warning per outage, checks back off; once it answers, a moved alias is followed."""
    import logging

    from mlflow import MlflowClient

    from clipstream.registry import RegistryUnavailable
    from clipstream.runtime import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # (a refused connection fails at once)
    caplog.set_level(logging.WARNING, logger="clipstream.registry")
    v1, v2 = _new_version(registry), _new_version(registry)
    registry.set_alias("production", v1)
    serving = Registry(settings, alias_ttl_s=0.1)
    assert serving.number() == v1 and serving.staleness_s() == 0
    answering, serving.client = serving.client, MlflowClient(f"http://127.0.0.1:{free_port()}")

    deadline, calls, slowest = time.monotonic() + 10, 0, 0.0
    while serving.stale_since is None or calls < 40:
        tic = time.monotonic()
        assert serving.number() == v1
        slowest, calls = max(slowest, time.monotonic() - tic), calls + 1
        assert time.monotonic() < deadline, "the lookups never found the registry down"
        time.sleep(0.05)
    assert slowest < 0.5  # no lookup waited on the registry
    assert serving.staleness_s() > 0 and 1 <= serving._failed_checks < calls / 4  # backing off: not one per 0.1 s
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 == len(caplog.records)
    assert "does not answer" in caplog.records[0].message and f"version {v1}" in caplog.records[0].message
    with pytest.raises(RegistryUnavailable, match="did not answer"):  # nothing seen yet: the caller hears why
        serving.number("other-alias")

    registry.set_alias("production", v2)
    serving.client = answering
    deadline = time.monotonic() + 15
    while serving.number() != v2:
        assert time.monotonic() < deadline, "the moved alias was not followed once the registry answered"
        time.sleep(0.05)
    assert serving.stale_since is None and "answers again" in caplog.records[-1].message
