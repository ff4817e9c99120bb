"""Dependencies down or damaged: an artifact missing or truncated is caught by the checksums taken at
registration (nothing loads it, nothing promotes it), and an MLflow server or a vector store that does not
answer is one line on the CLI, quickly, with nothing half-done."""

import re
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from clipstream.cli import main
from clipstream.promotion import promote
from clipstream.registry import CHECKSUMS, Registry, RegistryError
from clipstream.runtime import free_port
from tests.conftest import register_version


def artifact_file(settings, version: str, name: str) -> Path:
    """The stored file `name` of `version`'s checkpoint, in the registry's artifact store (a local folder here)."""
    from urllib.parse import urlparse

    registry = Registry(settings)
    uri = registry.client.get_model_version_download_uri(settings.stream, version)
    path = Path(urlparse(uri).path) / "artifacts" / "checkpoint" / name
    assert path.is_file(), path
    return path


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_artifact_is_never_loaded_or_promoted(settings, stream, damage, capsys):
    v1 = register_version(settings, 401, task_dirs=stream[:1])
    promote(settings, v1, index=False)
    v2 = register_version(settings, 402, task_dirs=stream, parent=v1)
    assert "open_clip_model.safetensors" in Registry(settings).resolve(v2, download=False).tags[CHECKSUMS]
    weights = artifact_file(settings, v2, "open_clip_model.safetensors")
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()
    with pytest.raises(RegistryError, match=f"open_clip_model.safetensors {'differs' if damage == 'truncated' else 'missing'}"):
        Registry(settings).resolve(v2)
    assert not (settings.home / "cache" / settings.stream / f"v{v2}-{Registry(settings).resolve(v2, download=False).run_id}").exists()
    capsys.readouterr()  # (what registering printed)
    assert main(["promote", v2, "--no-index"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "incomplete or altered" in err and "Traceback" not in err, err
    assert Registry(settings).number("production") == v1  # the alias never points at it


def test_an_mlflow_server_that_does_not_answer_is_one_line_quickly(settings, monkeypatch, capsys):
    from urllib3.util.retry import Retry

    backoffs = []  # the pauses between MLflow's retries: counted in the time a user waits, not waited here
    monkeypatch.setattr(Retry, "sleep", lambda retry, response=None: backoffs.append(retry.get_backoff_time()))
    monkeypatch.setenv("CLIPSTREAM_MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    tic = time.monotonic()
    assert main(["runs"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("clipstream: error:") and "Traceback" not in err, err
    assert "127.0.0.1" in err and time.monotonic() - tic + sum(backoffs) < 60, backoffs


def test_a_vector_store_that_does_not_answer_is_one_line(settings, stream, monkeypatch, capsys):
    v1 = register_version(settings, 403, task_dirs=stream[:1])
    monkeypatch.setenv("CLIPSTREAM_QDRANT_URL", f"http://127.0.0.1:{free_port()}")
    capsys.readouterr()
    assert main(["index", "--version", v1, "--task", str(stream[0])]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("clipstream: error:") and "Traceback" not in err, err


@contextmanager
def sqlite_reports_a_lock_at_once():
    """MLflow's SQL store waits out SQLite's busy timeout before it reports a locked database (its own `PRAGMA
    busy_timeout = 20000` on every session: 20 s); within the block SQLite reports the lock at once, with the same
    error. Yields the PRAGMAs it shortened: none means MLflow no longer waits that way, and the test says so."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    shortened = []

    def at_once(conn, cursor, statement, parameters, context, executemany):
        if re.match(r"\s*PRAGMA\s+busy_timeout\b", statement, re.IGNORECASE):
            shortened.append(statement)
            statement = "PRAGMA busy_timeout = 0"
        return statement, parameters

    event.listen(Engine, "before_cursor_execute", at_once, retval=True)
    try:
        yield shortened
    finally:
        event.remove(Engine, "before_cursor_execute", at_once)


def test_a_locked_registry_database_is_one_line_and_changes_nothing(settings, stream, capsys):
    """Another process holding the SQLite registry's write lock (a long migration, a stuck writer): a command that
    must write reports it in one line (exit 1), and nothing was registered or moved."""
    import sqlite3

    v1 = register_version(settings, 404, task_dirs=stream[:1])
    db = settings.mlflow_tracking_uri.removeprefix("sqlite:///")
    holder = sqlite3.connect(db, timeout=0, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        capsys.readouterr()
        with sqlite_reports_a_lock_at_once() as shortened:
            assert main(["promote", v1, "--no-index"]) == 1
        assert shortened, "MLflow set no SQLite busy timeout: how does it wait on a locked database now?"
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("clipstream: error:") and "locked" in err and "Traceback" not in err, err
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert Registry(settings).promotions() == [] and Registry(settings).lock_holder() is None
    with pytest.raises(RegistryError):
        Registry(settings).number("production")
