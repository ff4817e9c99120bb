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
