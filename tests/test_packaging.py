"""The built wheel installs one top-level package, `clipstream`, with the repository's folders inside it."""

import os
import shutil
import subprocess
import sys
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
    return next(out.glob("clipstream-*.whl"))


def test_the_wheel_has_clipstream_as_its_only_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"clipstream"}
    for folder, package in (("training", "clipstream/training"), ("services", "clipstream/services"),
                            ("benchmarks", "clipstream/benchmarks")):
        expected = {f"{package}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).rglob("*.py")}
        assert expected <= set(names), f"{folder}/ is not fully in the wheel: {sorted(expected - set(names))[:3]}"
    for data in ("clipstream/model_configs/clipstream-vit-tiny.json", "clipstream/training/methods/presets.yaml",
                 "clipstream/v1/encoder_pb2.py", "clipstream/v1/search_pb2_grpc.py", "clipstream/v1/admin_pb2.pyi",
                 "clipstream/mlflow_model.py",
                 "clipstream/cli/__main__.py", "clipstream/cli/render.py", "clipstream/runtime.py"):
        assert data in names
    assert not [n for n in names if "/results/" in n or n.startswith("tests/")]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "clipstream = clipstream.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


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
