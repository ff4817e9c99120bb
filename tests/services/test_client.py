"""The Python client against the real served app: batching, numpy outputs, search dicts, retries."""

import socket
import time

import grpc
import numpy as np
import pytest

from clipstream.services.client import Client


def test_client_batches_and_returns_numpy(served):
    settings, _, _, (v1, _) = served
    texts = [f"a red cup number {i}" for i in range(20)]  # the server's limit is 8 per request
    with Client(f"127.0.0.1:{settings.grpc_port}") as client:
        vectors, version = client.encode_text(texts, batch_size=8)
        single, _ = client.encode_text(texts[:1])
    assert version == v1 and vectors.shape == (20, 64) and vectors.dtype == np.float32
    assert np.allclose(vectors[0], single[0], atol=1e-6)


def test_client_refuses_ambiguous_queries_and_empty_input(served):
    settings = served[0]
    with Client(f"127.0.0.1:{settings.grpc_port}") as client:
        with pytest.raises(ValueError, match="exactly one of"):
            client.search(text="a", vector=[1.0])
        with pytest.raises(ValueError, match="nothing to encode"):
            client.encode_text([])


def test_client_retries_unavailable_then_gives_up():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    client = Client(f"127.0.0.1:{port}", retries=2, timeout_s=2)
    tic = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.encode_text(["a cup"])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - tic >= 0.2 + 0.4  # it backed off twice before giving up


def test_cli_search_and_encode_print_tables_and_statuses(served, indexed, capsys, monkeypatch):
    from clipstream.cli import main

    settings = served[0]
    address = f"127.0.0.1:{settings.grpc_port}"
    assert main(["search", "a red square", "--task", "squares", "-k", "3", "--address", address]) == 0
    out = capsys.readouterr().out
    assert "task-known (squares)" in out and out.count("squares-") == 3
    assert main(["encode", "a red cup", "a blue lamp", "--address", address]) == 0
    assert "2 vectors of dimension 64 from model version 1" in capsys.readouterr().out
    assert main(["search", "a cup", "--task", "nope", "--address", address]) == 2
    assert "NOT_FOUND: unknown task 'nope'" in capsys.readouterr().err


def test_cli_health_is_a_probe(served, capsys):
    """`clipstream health` (the Helm chart's test pod runs it): exit 0 and SERVING for the server and each
    service; an unknown service is the server's NOT_FOUND, exit 2."""
    from clipstream.cli import main

    address = f"127.0.0.1:{served[0].grpc_port}"
    assert main(["health", "--address", address]) == 0
    assert main(["health", "--address", address, "--service", "clipstream.v1.Search"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{address} (server): SERVING",
                                                    f"{address} clipstream.v1.Search: SERVING"]
    assert main(["health", "--address", address, "--service", "clipstream.v1.Nope"]) == 2
    assert "NOT_FOUND" in capsys.readouterr().err
