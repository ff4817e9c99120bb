"""protos/: the gRPC contracts pass buf's standard lint rules (protos/buf.yaml) with no exception, as the linter from
the npm registry that `make setup` installs (@bufbuild/buf) reports them."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUF = ROOT / ".venv" / "buf" / "node_modules" / ".bin" / "buf"


def buf(*args: str) -> subprocess.CompletedProcess:
    assert BUF.exists(), f"{BUF} is missing: run `make setup`"
    return subprocess.run([str(BUF), *args], cwd=ROOT / "protos", capture_output=True, text=True, timeout=120)


@pytest.mark.component
def test_buf_lint_finds_nothing():
    done = buf("lint")
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@pytest.mark.component
def test_the_linter_is_the_one_that_refuses_what_the_rules_forbid(tmp_path):
    """A service without the Service suffix and a response shared by two RPCs: what the contracts were before."""
    (tmp_path / "buf.yaml").write_text((ROOT / "protos" / "buf.yaml").read_text())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "v1").mkdir()
    (tmp_path / "old" / "v1" / "encoder.proto").write_text(
        'syntax = "proto3";\npackage old.v1;\nservice Encoder {\n  rpc EncodeText(EncodeTextRequest) returns (Out);\n'
        '  rpc EncodeImage(EncodeImageRequest) returns (Out);\n}\nmessage EncodeTextRequest {}\n'
        'message EncodeImageRequest {}\nmessage Out {}\n')
    done = subprocess.run([str(BUF), "lint"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert 'Service name "Encoder" should be suffixed with "Service"' in done.stdout
    assert '"old.v1.Out" is used as the request or response type for multiple RPCs' in done.stdout


@pytest.mark.component
def test_the_contracts_build():
    done = buf("build")
    assert done.returncode == 0, done.stderr
