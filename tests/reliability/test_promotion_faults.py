"""Promotion killed at each step converges when run again (alias, history and gallery agree), and promotions
are serialised by the stream's lock: real SIGKILLs of a real `promote` in a child process, a real MLflow registry."""

import os
import subprocess
import sys
import threading

import pytest

from clipstream.index import open_index
from clipstream.promotion import PromotionError, history, promote, rollback
from clipstream.registry import PENDING, Registry
from tests.conftest import register_version

pytestmark = pytest.mark.slow  # faults: `make test-all`

# the child patches the step after which it dies: SIGKILL, no cleanup, no finally blocks
CHILD = """
import os, signal, sys
from clipstream import promotion, registry
from clipstream.settings import Settings

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

step = sys.argv[2]
if step == "after-gates":  # before the gallery is put in place
    promotion.put_lineage = die
elif step == "after-indexing":  # gallery in place, record pending, alias not moved
    registry.Registry.set_alias = die
elif step == "after-alias":  # alias moved, record still pending
    move = registry.Registry.set_alias
    def move_then_die(self, *args):
        move(self, *args)
        die()
    registry.Registry.set_alias = move_then_die
promotion.promote(Settings(), sys.argv[1])
"""


@pytest.fixture
def two(settings, stream):
    v1 = register_version(settings, 301, task_dirs=stream[:1])
    v2 = register_version(settings, 302, task_dirs=stream, parent=v1)
    promote(settings, v1)
    return v1, v2


def agree(settings) -> str:
    """Alias, history and gallery name the same version; that version."""
    alias = Registry(settings).number("production")
    with open_index(settings) as index:
        pinned = index.state()["query_version"]
    assert history(settings)[-1]["to_version"] == alias == pinned, (history(settings)[-1], alias, pinned)
    return alias


@pytest.mark.parametrize("step", ["after-gates", "after-indexing", "after-alias"])
def test_a_promotion_killed_at_any_step_converges_on_rerun(settings, two, step):
    v1, v2 = two
    killed = subprocess.run([sys.executable, "-c", CHILD, v2, step], capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-2000:]
    try:
        promote(settings, v2)  # what the user does next: run the same command again
    except PromotionError as exc:  # only when the killed one had already moved the alias: it took effect
        assert step == "after-alias" and [g.name for g in exc.gates if not g.passed] == ["not-production"]
    assert agree(settings) == v2
    records = Registry(settings).promotions(settled=False)
    assert [r["state"] for r in records if r["to_version"] == v2] == (["done"] if step != "after-indexing"
                                                                      else ["aborted", "done"])
    assert PENDING not in {r["state"] for r in records}
    rollback(settings)  # and the history still rolls back to the right version
    assert agree(settings) == v1


def test_concurrent_promotions_are_serialised_and_the_loser_is_told(settings, two):
    v1, v2 = two
    results = []

    def attempt():
        try:
            results.append(promote(settings, v2)["to_version"])
        except PromotionError as exc:
            results.append(str(exc))

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(v2) == 1, results
    loser = next(r for r in results if r != v2)
    assert "holds the stream's lock" in loser or "not-production" in loser
    assert [r["to_version"] for r in history(settings)] == [v1, v2] and agree(settings) == v2


def test_a_held_lock_refuses_and_a_dead_holders_lock_is_taken_over(settings, two):
    v1, v2 = two
    registry = Registry(settings)
    with registry.lock("test"):
        with pytest.raises(PromotionError, match=f"holds the stream's lock \\(pid {os.getpid()}"):
            promote(settings, v2)
    assert registry.number("production") == v1  # nothing moved
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    registry.client.create_registered_model(f"{settings.stream}-lock", tags={
        "purpose": "promotion", "host": os.uname().nodename, "pid": dead.stdout.strip(), "since": "9e12"})
    promote(settings, v2)  # its holder is gone: the lock is taken over
    assert agree(settings) == v2


def test_a_production_alias_moved_in_mlflow_is_followed_index_first_and_recorded(settings, two, capsys):
    """The way MLflow users promote (its client or UI) bypasses gates and indexing: the follower (`clipstream
    follow`, run by `clipstream serve`) puts the gallery in place, and only then do queries switch."""
    from mlflow import MlflowClient

    from clipstream.cli import main
    from clipstream.promotion import follow

    v1, v2 = two
    MlflowClient(settings.mlflow_tracking_uri).set_registered_model_alias(settings.stream, "production", v2)
    with open_index(settings) as index:
        assert index.state()["query_version"] == v1  # Search follows the gallery's pin: still v1's queries
    assert main(["follow", "--once"]) == 0
    assert f"production: v{v1} -> v{v2} [mlflow]" in capsys.readouterr().out
    assert agree(settings) == v2
    assert history(settings)[-1]["reason"] == "mlflow" and follow(settings) is None  # done, and only once
