"""The built wheel installs one top-level package, `clipstream`, with the repository's folders inside it."""

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "protos", "clipstream", "training", "services", "benchmarks")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources as a clean checkout has them (so the build leaves nothing in the
    checkout): without the gRPC stubs `make` generates, which the build itself must make."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__", "results", "*_pb2*")}
                                       if (ROOT / name).is_dir() else {}))
    assert not list((src / "clipstream" / "v1").glob("*_pb2*"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    return next(out.glob("clipstream_continual-*.whl"))


@pytest.mark.component
def test_the_wheel_has_clipstream_as_its_only_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"clipstream"}
    for folder, package in (("training", "clipstream/training"), ("services", "clipstream/services"),
                            ("benchmarks", "clipstream/benchmarks")):
        expected = {f"{package}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).rglob("*.py")
                    if "client-dist" not in p.parts}  # (the client's own distribution: links to these files)
        assert expected <= set(names), f"{folder}/ is not fully in the wheel: {sorted(expected - set(names))[:3]}"
    for data in ("clipstream/model_configs/clipstream-vit-tiny.json", "clipstream/training/methods/presets.yaml",
                 "clipstream/v1/encoder_pb2.py", "clipstream/v1/search_pb2_grpc.py", "clipstream/v1/admin_pb2.pyi",
                 "clipstream/mlflow_model.py",
                 "clipstream/cli/__main__.py", "clipstream/cli/render.py", "clipstream/runtime.py"):
        assert data in names
    assert not [n for n in names if "/results/" in n or n.startswith("tests/")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "clipstream = clipstream.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.component
def test_the_unpacked_wheel_imports_from_itself_and_puts_no_generic_package_on_the_path(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = (
        "import importlib.util, clipstream.training.job, clipstream.services.app, clipstream.cli, "
        "clipstream.benchmarks.report\n"
        "print(clipstream.training.job.__file__)\n"
        "print([n for n in ('training', 'services', 'benchmarks') if importlib.util.find_spec(n)])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    job_file, generic = done.stdout.splitlines()[-2:]  # (after whatever the imports print)
    assert Path(job_file).is_relative_to(tmp_path / "site" / "clipstream" / "training")
    assert generic == "[]"


# clipstream-client (services/client-dist): the client and the stubs alone, and what they import
CLIENT_FILES = {"clipstream/__init__.py", "clipstream/console.py", "clipstream/settings.py",
                "clipstream/services/__init__.py", "clipstream/services/client.py", "clipstream/v1/__init__.py",
                *(f"clipstream/v1/{proto}_pb2{kind}" for proto in ("encoder", "search", "admin")
                  for kind in (".py", ".pyi", "_grpc.py"))}
CLIENT_DEPENDENCIES = {"grpcio", "grpcio-health-checking", "grpcio-status", "protobuf", "numpy", "tqdm",
                       "pydantic-settings", "pyyaml"}


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory) -> Path:
    """clipstream-client's wheel built from a copy of a clean checkout (its links kept as links, no stubs)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"symlinks": True, "ignore": shutil.ignore_patterns(
            "__pycache__", "results", "*_pb2*", "build", "*.egg-info")} if (ROOT / name).is_dir() else {}))
    assert (src / "services/client-dist/clipstream/services/client.py").is_symlink()
    assert not list((src / "services/client-dist/clipstream/v1").glob("*_pb2*"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src / "services" / "client-dist")], check=True, capture_output=True)
    return next(out.glob("clipstream_client-*.whl"))


@pytest.mark.component
def test_the_client_wheel_holds_the_client_and_the_stubs_alone(client_wheel):
    from email.parser import Parser

    from packaging.requirements import Requirement

    wheel = zipfile.ZipFile(client_wheel)
    assert {n for n in wheel.namelist() if ".dist-info/" not in n} == CLIENT_FILES
    assert wheel.read("clipstream/services/client.py") == (ROOT / "services/client.py").read_bytes()  # one copy
    metadata = Parser().parsestr(wheel.read(next(n for n in wheel.namelist() if n.endswith("/METADATA"))).decode())
    assert metadata["Name"] == "clipstream-client"
    assert {Requirement(r).name for r in metadata.get_all("Requires-Dist")} == CLIENT_DEPENDENCIES


def installed_closure(names: set[str]) -> set[str]:
    """`names` and what they require, transitively, as installed here (extras and other platforms' markers left out)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    seen, todo = set(), list(names)
    while todo:
        dist = distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


@pytest.mark.component
def test_the_client_wheel_runs_with_its_declared_dependencies_alone(client_wheel, tmp_path):
    """As `pip install clipstream-client` leaves a fresh environment: the wheel and the installed closure of its
    Requires-Dist, nothing else (no torch, Ray, MLflow, DeepSpeed), where a client made from the environment calls a
    port nobody serves and gets the typed error."""
    import socket
    from importlib.metadata import distribution

    zipfile.ZipFile(client_wheel).extractall(tmp_path / "site")
    deps = tmp_path / "deps"
    deps.mkdir()
    for name in installed_closure(CLIENT_DEPENDENCIES):
        dist = distribution(name)
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (deps / top).exists():
                (deps / top).symlink_to(Path(dist.locate_file(top)))
    with socket.socket() as s:  # a port that was free a moment ago: nobody answers there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    probe = textwrap.dedent("""
        import importlib.util
        assert [m for m in ("torch", "ray", "mlflow", "deepspeed", "open_clip") if importlib.util.find_spec(m)] == []
        import grpc
        from clipstream.services.client import AsyncClient, Client, Unavailable
        with Client.from_env(timeout_s=10, retries=0) as client:  # (no retries: refused at once)
            try:
                client.status()
            except Unavailable as exc:
                assert isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE
                print("unavailable")
    """)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": f"{tmp_path / 'site'}:{deps}",
           "CLIPSTREAM_SERVER": f"grpc://127.0.0.1:{port}"}
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("unavailable")
