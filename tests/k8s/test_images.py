"""The cluster image (k8s/images/Dockerfile): linted by the real hadolint, every COPY source present in the
build context, the versions it installs equal to the ones the tests run, non-root and compiler-free.
`docker build` cannot run on these machines, so this is what can be checked without it."""

import fnmatch
import re
import subprocess
from importlib.metadata import version

import pytest
import tomllib
from k8s_checks import REPO, tool
from packaging.requirements import Requirement

DOCKERFILE = REPO / "k8s/images/Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines
            if line and not line.startswith("#")]


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(instruction)
    return out


def arg_defaults() -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path (or one of its parent folders) decides."""
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            ignored = not negated
    return ignored


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_hadolint_is_clean():
    out = subprocess.run([tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_copied_path_exists_and_is_in_the_build_context():
    copies = [a.split() for op, a in instructions() if op == "COPY" and "--from" not in a]
    assert copies, "the build stage copies the sources"
    for args in copies:
        for source in [a for a in args if not a.startswith("--")][:-1]:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert not dockerignored(source), f"COPY {source}: excluded by .dockerignore"
    # every tracked file of the package's folders reaches the build (else the wheel silently lacks it)
    tracked = subprocess.run(["git", "ls-files", "clipstream", "training", "services", "benchmarks", "protos"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    missing = [f for f in tracked if dockerignored(f) and not f.startswith("benchmarks/results/")]
    assert not missing, f".dockerignore drops package files: {missing}"
    for private in (".venv/bin/python", ".clipstream/mlflow.db", ".git/config", "clipstream/v1/encoder_pb2.py",
                    "tests/conftest.py"):
        assert dockerignored(private), f"{private} would be sent to the docker daemon"


def test_versions_match_the_tested_environment():
    args = arg_defaults()
    assert args["VERSION"] == pyproject()["project"]["version"], "image tags come from the package version"
    assert args["RAY_VERSION"] == version("ray"), "the image's Ray must be the Ray the project runs"
    (ray,) = [Requirement(r) for r in pyproject()["project"]["dependencies"] if r.startswith("ray")]
    assert ray.specifier.contains(args["RAY_VERSION"]), f"{args['RAY_VERSION']} is outside the pin {ray}"
    for arg, package in (("TORCH_VERSION", "torch"), ("TORCHVISION_VERSION", "torchvision"),
                         ("DEEPSPEED_VERSION", "deepspeed"), ("GRPCIO_TOOLS_VERSION", "grpcio-tools"),
                         ("MLFLOW_VERSION", "mlflow")):
        assert args[arg] == version(package).split("+")[0], f"{arg} differs from the tested {package}"
    bases = [a.split()[0] for op, a in instructions() if op == "FROM"]
    assert bases and all(b == "rayproject/ray:${RAY_VERSION}-py311-${VARIANT}" for b in bases), bases


def test_multi_stage_non_root_and_no_compilers_in_the_final_stage():
    *build, final = stages()
    assert build, "a build stage keeps build tools and wheels out of the final image"
    ops = [op for op, _ in final]
    assert "USER" in ops and final[[op for op, _ in final].index("USER")][1].split(":")[0] not in ("0", "root")
    assert [a for op, a in final if op == "USER"][-1].split(":")[0] == "1000"
    text = " ".join(a for _, a in final)
    for word in ("apt-get", "gcc", "g++", "build-essential", "nvcc", "cuda-toolkit"):
        assert word not in text, f"the final stage installs {word}"
    assert not [a for op, a in final if op == "COPY"], "the final stage takes wheels via a bind mount, not a layer"


def test_image_sets_the_serve_environment_of_the_app():
    from clipstream.services.app import SERVE_ENV

    *_, final = stages()
    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(a for op, a in final if op == "ENV")))
    assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV


@pytest.mark.parametrize("path,expected", [("clipstream/cli/entry.py", False), ("tests/conftest.py", True),
                                           ("training/__pycache__/job.cpython-311.pyc", True)])
def test_dockerignore_reader(path, expected):
    assert dockerignored(path) is expected


PUSH = REPO / "k8s/images/push.sh"


def push(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PUSH), *args], capture_output=True, text=True, cwd=REPO, timeout=30)


def test_push_builds_with_buildx_pushes_and_records_the_digest(tmp_path):
    """`--dry-run` prints what push.sh runs (no docker here): buildx builds the Dockerfile for the variant, tags it
    VERSION-VARIANT, pushes it and writes the metadata (whose containerimage.digest it records); nothing is
    written."""
    out = push("--repository", "registry.example.com:5000/ml/clipstream", "--variant", "cpu", "--out",
               str(tmp_path / "images"), "--dry-run")
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[0].split()
    assert command[:3] == ["docker", "buildx", "build"] and "--push" in command
    value = {flag: command[i + 1] for i, flag in enumerate(command) if flag.startswith("--") and flag != "--push"}
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert value["--tag"] == f"registry.example.com:5000/ml/clipstream:{version}-cpu"
    assert command[command.index("-f") + 1] == str(DOCKERFILE)
    assert [a for i, a in enumerate(command) if command[i - 1] == "--build-arg"] == [f"VERSION={version}",
                                                                                     "VARIANT=cpu"]
    assert value["--metadata-file"] == str(tmp_path / "images/cpu.metadata.json") and command[-1] == str(REPO)
    assert "cpu.digest" in out.stdout and "cpu.values.yaml" in out.stdout and not (tmp_path / "images").exists()
    # (run under `make test-all`, a make of its own would print "Entering directory" lines)
    make = subprocess.run(["make", "-n", "--no-print-directory", "push-images"], capture_output=True, text=True,
                          cwd=REPO, check=True).stdout
    assert [line.split()[-1] for line in make.splitlines()] == ["gpu", "cpu"]


@pytest.mark.parametrize("args, message", [
    (["--variant", "tpu"], "--variant 'tpu': gpu or cpu"),
    (["--repository", "GHCR.io/Org/x"], "--repository 'GHCR.io/Org/x': not an image repository"),
    (["--version", "1.0/../x"], "--version '1.0/../x': not usable in an image tag"),
    (["--out"], "--out needs a value"),
    (["--push-it"], "unknown argument '--push-it'"),
])
def test_push_refuses_bad_arguments_in_one_line(args, message):
    out = push(*args, "--dry-run")
    assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1 and not out.stdout
