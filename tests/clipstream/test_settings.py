"""Tests for clipstream.settings: defaults, CLIPSTREAM_* env vars, the YAML file, and their priority."""
import json
import os
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from clipstream.settings import Settings


@pytest.fixture(autouse=True)
def clean_env(tmp_path, monkeypatch):
    """Every test runs in an empty cwd with no CLIPSTREAM_* variables."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("CLIPSTREAM_"):
            monkeypatch.delenv(name)
    return tmp_path


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def test_defaults_live_under_home_in_cwd(tmp_path):
    s = Settings()
    home = tmp_path / ".clipstream"
    assert s.home == home and s.home.is_absolute()
    assert s.data_dir == home / "data"
    assert s.runs_dir == str(home / "runs")
    assert s.qdrant_path == home / "qdrant"
    assert s.qdrant_url is None and s.qdrant_api_key is None and s.ray_address is None
    assert s.mlflow_tracking_uri == f"sqlite:///{home / 'mlflow.db'}"
    assert s.mlflow_artifact_root == str(home / "mlartifacts")
    assert s.grpc_port == 9000
    assert s.stream == "clipstream"
    assert s.embedded_registry
    assert not home.exists()  # building settings creates nothing


def test_defaults_follow_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPSTREAM_HOME", "relhome")
    s = Settings()
    assert s.home == tmp_path / "relhome"
    assert s.qdrant_path == tmp_path / "relhome" / "qdrant"
    assert s.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'relhome' / 'mlflow.db'}"


def test_ensure_dirs(tmp_path):
    s = Settings(home=tmp_path / "h").ensure_dirs()
    assert (tmp_path / "h").is_dir() and s.data_dir.is_dir() and s.runs_path.is_dir()


def test_env_overrides(monkeypatch):
    monkeypatch.setenv("CLIPSTREAM_GRPC_PORT", "9123")
    monkeypatch.setenv("CLIPSTREAM_QDRANT_URL", "http://qdrant:6333")
    monkeypatch.setenv("CLIPSTREAM_MLFLOW_TRACKING_URI", "http://mlflow:5000")
    s = Settings()
    assert s.grpc_port == 9123 and isinstance(s.grpc_port, int)
    assert s.qdrant_url == "http://qdrant:6333"
    assert s.mlflow_tracking_uri == "http://mlflow:5000"
    assert not s.embedded_registry


def test_yaml_via_clipstream_config(tmp_path, monkeypatch):
    cfg = write_yaml(tmp_path / "elsewhere.yaml", {"grpc_port": 9500, "stream": "mystream",
                                                   "qdrant_url": "http://q:6333"})
    monkeypatch.setenv("CLIPSTREAM_CONFIG", str(cfg))
    s = Settings()
    assert (s.grpc_port, s.stream, s.qdrant_url) == (9500, "mystream", "http://q:6333")


def test_yaml_in_cwd(tmp_path):
    write_yaml(tmp_path / "clipstream.yaml", {"grpc_port": 9600, "home": str(tmp_path / "yhome")})
    s = Settings()
    assert s.grpc_port == 9600
    assert s.home == tmp_path / "yhome"
    assert s.qdrant_path == tmp_path / "yhome" / "qdrant"


def test_clipstream_config_wins_over_cwd_file(tmp_path, monkeypatch):
    write_yaml(tmp_path / "clipstream.yaml", {"grpc_port": 9600})
    monkeypatch.setenv("CLIPSTREAM_CONFIG", str(write_yaml(tmp_path / "other.yaml", {"grpc_port": 9700})))
    assert Settings().grpc_port == 9700


def test_priority_kwargs_over_env_over_yaml(tmp_path, monkeypatch):
    write_yaml(tmp_path / "clipstream.yaml", {"grpc_port": 9600, "stream": "from-yaml", "ray_address": "auto"})
    monkeypatch.setenv("CLIPSTREAM_GRPC_PORT", "9601")
    monkeypatch.setenv("CLIPSTREAM_STREAM", "from-env")
    s = Settings()
    assert s.grpc_port == 9601  # env beats yaml
    assert s.stream == "from-env"
    assert s.ray_address == "auto"  # yaml still fills what env leaves out
    s = Settings(grpc_port=9602)
    assert s.grpc_port == 9602  # kwargs beat env
    assert s.stream == "from-env"


@pytest.mark.parametrize("port", ["0", "70000", "x", "-1"])
def test_invalid_port_from_env(monkeypatch, port):
    monkeypatch.setenv("CLIPSTREAM_GRPC_PORT", port)
    with pytest.raises(ValidationError, match="grpc_port"):
        Settings()


@pytest.mark.parametrize("port", [0, 70000, "x", 65536])
def test_invalid_port_from_kwargs(port):
    with pytest.raises(ValidationError, match="grpc_port"):
        Settings(grpc_port=port)


def test_port_bounds_are_inclusive():
    assert Settings(grpc_port=1).grpc_port == 1
    assert Settings(grpc_port=65535).grpc_port == 65535


def test_invalid_port_from_yaml(tmp_path):
    write_yaml(tmp_path / "clipstream.yaml", {"grpc_port": 70000})
    with pytest.raises(ValidationError, match="grpc_port"):
        Settings()


def test_unknown_yaml_key_rejected(tmp_path):
    write_yaml(tmp_path / "clipstream.yaml", {"grpc_port": 9001, "qdrant_ulr": "http://typo:6333"})
    with pytest.raises(ValidationError, match="qdrant_ulr"):
        Settings()


def test_unknown_kwarg_rejected():
    with pytest.raises(ValidationError, match="grpc_prot"):
        Settings(grpc_prot=1)


def test_missing_config_file_names_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope" / "clipstream.yaml"
    monkeypatch.setenv("CLIPSTREAM_CONFIG", str(missing))
    with pytest.raises(FileNotFoundError, match=str(missing)):
        Settings()


def test_env_round_trips(tmp_path, monkeypatch):
    original = Settings(home=tmp_path / "h", grpc_port=9444, qdrant_url="http://q:6333", qdrant_api_key="k",
                        ray_address="ray://head:10001", stream="s2", mlflow_tracking_uri="http://m:5000")
    env = original.env()
    assert all(k.startswith("CLIPSTREAM_") and isinstance(v, str) for k, v in env.items())
    assert env["CLIPSTREAM_GRPC_PORT"] == "9444"
    assert env["CLIPSTREAM_HOME"] == str(tmp_path / "h")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # cwd must not matter
    assert Settings() == original


def test_env_round_trips_defaults_and_skips_none(tmp_path, monkeypatch):
    original = Settings()
    env = original.env()
    assert "CLIPSTREAM_QDRANT_URL" not in env and "CLIPSTREAM_RAY_ADDRESS" not in env
    # every derived default is spelled out, so a child process in another cwd sees the same paths
    assert env["CLIPSTREAM_QDRANT_PATH"] == str(tmp_path / ".clipstream" / "qdrant")
    assert env["CLIPSTREAM_MLFLOW_TRACKING_URI"] == original.mlflow_tracking_uri
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(other)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert Settings() == original


@pytest.mark.component
def test_importing_settings_loads_nothing_heavier_than_pydantic():
    """Reading settings is what every entry point does first: it must not pay for the vector index, a model
    framework, Ray or MLflow (a fresh interpreter, so what earlier tests imported does not count)."""
    import subprocess
    import sys

    heavy = ("torch", "ray", "mlflow", "open_clip", "qdrant_edge", "numpy", "grpc", "pandas", "clipstream.index",
             "clipstream.registry", "clipstream.models")
    code = f"import clipstream.settings, sys; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
    from clipstream import index, settings

    assert (index.NO_REINDEX, index.REINDEX, index.POLICIES) == (settings.NO_REINDEX, settings.REINDEX, settings.POLICIES)


@pytest.mark.parametrize("uri", ["s3://bucket/prefix", "gs://bucket/runs/", "file:///srv/runs"])
def test_runs_dir_uri_stays_a_uri(tmp_path, monkeypatch, uri):
    """Ray Train's storage_path takes URIs (pyarrow): Path() would make s3://bucket/prefix the local folder
    s3:/bucket/prefix. The URI reaches child processes unchanged and ensure_dirs makes no local folder of it."""
    monkeypatch.setenv("CLIPSTREAM_RUNS_DIR", uri)
    s = Settings(home=tmp_path / "h").ensure_dirs()
    assert s.runs_dir == uri and s.env()["CLIPSTREAM_RUNS_DIR"] == uri
    assert str(s.runs_path / "x").startswith(uri.rstrip("/")) and str(s.runs_path / "x").endswith("/x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"] and not list(tmp_path.rglob("s3:*"))
    assert Settings(runs_dir="relative/runs").runs_dir == str(tmp_path / "relative/runs")  # a path: absolute
    assert Settings(runs_dir=tmp_path / "p").runs_dir == str(tmp_path / "p")


def test_effective_settings_name_where_each_came_from(tmp_path, monkeypatch):
    from clipstream.settings import effective

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLIPSTREAM_GRPC_PORT", "9123")
    monkeypatch.setenv("CLIPSTREAM_API_KEY", "s3cret")
    write_yaml(tmp_path / "clipstream.yaml", {"stream": "news"})
    rows = {r["setting"]: r for r in effective(Settings())}
    assert rows["grpc_port"] == {"setting": "grpc_port", "value": 9123, "source": "CLIPSTREAM_GRPC_PORT"}
    assert rows["stream"]["value"] == "news" and rows["stream"]["source"] == "clipstream.yaml"
    assert rows["home"]["source"] == "default" and rows["data_dir"]["value"] == str(tmp_path / ".clipstream" / "data")
    assert rows["api_key"]["value"] == "(set)" and "s3cret" not in str(rows)  # a secret is never shown
    assert set(rows) == set(Settings.model_fields)


def test_an_unknown_clipstream_variable_is_named_with_the_closest_setting(monkeypatch, capsys):
    from clipstream.cli import main
    from clipstream.settings import unknown_variables

    env = {"CLIPSTREAM_GRPC_PROT": "1", "CLIPSTREAM_HOME": "x", "CLIPSTREAM_CONFIG": "y", "CLIPSTREAM_ZZZ": "z",
           "OTHER": "1"}
    assert unknown_variables(env) == [("CLIPSTREAM_GRPC_PROT", "CLIPSTREAM_GRPC_PORT"), ("CLIPSTREAM_ZZZ", None)]
    monkeypatch.setenv("CLIPSTREAM_STREM", "news")
    assert main(["config", "--json"]) == 0
    captured = capsys.readouterr()
    assert "clipstream: warning: CLIPSTREAM_STREM is not a setting, ignored (did you mean CLIPSTREAM_STREAM?)" \
        in captured.err
    found = json.loads(captured.out)
    assert found["unknown_variables"] == [{"variable": "CLIPSTREAM_STREM", "did_you_mean": "CLIPSTREAM_STREAM"}]
    assert next(r for r in found["settings"] if r["setting"] == "stream")["value"] == "clipstream"  # ignored
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("state lives under ") and "CLIPSTREAM_HOME to keep one" in out


def test_a_list_setting_reaches_a_child_process_as_json(monkeypatch):
    """`Settings.env()` is how Ray workers see the driver's settings: a list must parse back (not a Python repr)."""
    env = Settings(image_roots=["/data/images", "s3://bucket/imgs"]).env()
    assert env["CLIPSTREAM_IMAGE_ROOTS"] == '["/data/images", "s3://bucket/imgs"]'
    monkeypatch.setenv("CLIPSTREAM_IMAGE_ROOTS", env["CLIPSTREAM_IMAGE_ROOTS"])
    assert Settings().image_roots == ["/data/images", "s3://bucket/imgs"]


def test_the_serve_app_names_an_application_and_its_route(monkeypatch):
    assert Settings().serve_app == "clipstream"
    monkeypatch.setenv("CLIPSTREAM_SERVE_APP", "side-2_b")
    assert Settings().serve_app == "side-2_b"
    for wrong in ("", "-side", "a/b", "a b", "side#1", "x" * 64):
        with pytest.raises(ValidationError, match="name the application with letters, digits, '-' and '_'") as err:
            Settings(serve_app=wrong)
        assert err.value.errors()[0]["loc"] == ("serve_app",)


def test_a_bad_serve_app_is_one_line_and_exit_2(monkeypatch, capsys):
    from clipstream.cli import main

    monkeypatch.setenv("CLIPSTREAM_SERVE_APP", "a/b")
    assert main(["health"]) == 2
    assert capsys.readouterr().err.strip() == ("clipstream: error: serve_app: 'a/b': name the application with "
                                               "letters, digits, '-' and '_' (up to 63, starting with a letter or "
                                               "digit); it is also its route prefix, /NAME")
