"""TLS and the API key as `clipstream serve` sets them up, in a process of its own: its own local Ray, its proxy
TLS-only with a self-signed certificate, the key read from a file. A proxy's TLS is fixed when Serve starts, and the
session's shared proxy listens in plaintext: this one is a server of its own, started as a user or a pod starts it.
"""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from clipstream.promotion import promote
from clipstream.runtime import free_port
from clipstream.services.client import Client
from clipstream.settings import Settings
from tests.conftest import register_version
from tests.services.conftest import self_signed

pytestmark = pytest.mark.slow  # a second Ray and Serve start-up (~1 min): `make test-all`

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def tls_server(stream, tmp_path_factory):
    """`clipstream serve --no-follow` on a promoted version (health SERVING), stopped by SIGTERM as a pod is."""
    root = tmp_path_factory.mktemp("tls")
    cert, key = self_signed(root / "tls")
    (root / "api-key").write_text(KEY + "\n")  # as a mounted Secret holds it
    settings = Settings(home=root / "home", grpc_port=free_port(), api_key_file=root / "api-key", tls_cert_file=cert,
                        tls_key_file=key, serve_encoder_cpus=0, serve_search_cpus=0).ensure_dirs()
    promote(settings, register_version(settings, seed=21, task_dirs=stream[:1]))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("CLIPSTREAM_", "RAY_"))}, **settings.env()}
    log = root / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "clipstream.cli", "-v", "serve", "--no-follow"], cwd=root,
                                  env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not serving(settings):
            assert server.poll() is None, f"clipstream serve exited {server.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"clipstream serve did not come up: {log.read_text()[-3000:]}"
            time.sleep(2)
        yield settings
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # (its own session: the command, and the Ray it started)
        assert server.wait(timeout=120) == 0, log.read_text()[-3000:]


def serving(settings) -> bool:
    try:
        with client(settings, retries=0, timeout_s=5) as secure:
            return secure.health() == "SERVING"
    except grpc.RpcError:
        return False


def client(settings, **kwargs) -> Client:
    return Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, tls=True, ca_file=settings.tls_cert_file,
                  application=settings.serve_app, **kwargs)


def test_tls_only_with_the_right_certificate(tls_server, tmp_path):
    settings = tls_server
    with client(settings) as secure:
        assert secure.health() == "SERVING" and secure.encode_text(["a cup"])[0].shape[0] == 1
    with Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, retries=0, timeout_s=5) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # a plaintext client gets no answer
    other, _ = self_signed(tmp_path / "other")
    with Client(f"127.0.0.1:{settings.grpc_port}", api_key=KEY, retries=0, timeout_s=5, tls=True,
                ca_file=other) as fooled:
        with pytest.raises(grpc.RpcError) as err:
            fooled.health()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # nor one that trusts another certificate
    with Client(f"127.0.0.1:{settings.grpc_port}", tls=True, ca_file=settings.tls_cert_file) as anonymous:
        with pytest.raises(grpc.RpcError) as err:
            anonymous.encode_text(["a cup"])
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # and the key is still wanted


def test_the_cli_speaks_tls(tls_server, capsys, monkeypatch):
    from clipstream.cli import main

    settings = tls_server
    monkeypatch.setenv("CLIPSTREAM_API_KEY_FILE", str(settings.api_key_file))
    monkeypatch.setenv("CLIPSTREAM_TLS_CA_FILE", str(settings.tls_cert_file))
    address = f"127.0.0.1:{settings.grpc_port}"
    assert main(["health", "--address", address, "--tls"]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert main(["encode", "a red cup", "--address", address, "--tls"]) == 0
    assert "1 vectors" in capsys.readouterr().out
