"""`clipstream bench grpc-encode`: the report, verdict and plot from hand-made numbers, and the measuring helpers."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from clipstream.benchmarks import grpc_encode as bench


def cell(rates, latencies, batch=None, cpu_ms=None):
    return {"rates": rates, "latencies": latencies, "batch": batch or [], "cpu_ms": cpu_ms or []}


def results(grpc_16=900.0, grpc_64=950.0):
    lat = [10.0] * 98 + [50.0, 90.0]  # p50 10, p99 ~50
    return {"image": {
        "in-process": {1: cell([400.0, 410.0, 420.0], lat, cpu_ms=[4.0]), 16: cell([1000.0], lat, cpu_ms=[4.5]),
                       64: cell([1000.0], lat, cpu_ms=[5.0])},
        "grpc": {1: cell([300.0, 310.0, 320.0], lat, [1.0], [6.0]), 16: cell([grpc_16], lat, [12.0], [4.4]),
                 64: cell([grpc_64], lat, [31.5], [4.2])},
        "grpc-b1": {1: cell([290.0], lat, [1.0], [6.1]), 16: cell([300.0], lat, [1.0], [9.0]),
                    64: cell([380.0], lat, [1.0], [9.5])}}}


def test_the_report_compares_every_side_at_every_concurrency(tmp_path):
    out = tmp_path / "ge.md"
    text = bench.encode_report(results(), out, "clipstream bench grpc-encode --out x", "CPU (x86_64, 2 cores)",
                               "clipstream-vit-small", 8, 32, seconds=150.0)
    assert text == out.read_text() and (tmp_path / "ge.png").stat().st_size > 1000
    assert "Reproduce: `clipstream bench grpc-encode --out x`" in text and "Wall time 2.5 min." in text
    assert "![items/s and p99 latency against concurrent clients](ge.png)" in text
    # medians over rounds; gRPC ÷ in-process; gRPC ÷ max_batch_size=1; batch sizes; CPU per item of each side
    assert "| 1 | 410.0 | 310.0 | 0.76 | 290.0 | 1.07 | 1.0 | 1.0 | 4.0 / 6.0 / 6.1 | 300, 310, 320 |" in text
    assert "| 64 | 1000.0 | 950.0 | 0.95 | 380.0 | 2.50 | 31.5 | 1.0 | 5.0 / 4.2 / 9.5 | 950 |" in text
    assert "| 16 | 10 / 50 | 10 / 50 | 10 / 50 |" in text  # p50 / p99 per side
    assert "| image: gRPC ÷ in-process items/s, 16 clients | 0.90 | ≥ 0.90 | met |" in text
    assert text.rstrip().endswith("| image: gRPC ÷ in-process items/s, 64 clients | 0.95 | ≥ 0.90 | met |")
    checks = json.loads((tmp_path / "ge.json").read_text())["checks"]
    assert [c["ok"] for c in checks] == [True, True] and checks[0]["target"] == "≥ 0.90"


def test_a_miss_says_whether_grpc_cost_more_cpu_or_got_less_of_the_cores():
    data = results(grpc_16=500.0, grpc_64=500.0)
    data["image"]["grpc"][64]["cpu_ms"] = [6.0]  # 1.2× in-process's 5.0
    sixteen, sixty_four = bench.checks(data)
    assert not sixteen["ok"] and sixteen["why"] == "same CPU per item (4.4 vs 4.5 ms): the gRPC side got less of the cores"
    assert not sixty_four["ok"] and sixty_four["why"] == "gRPC spent 1.20× the in-process CPU per item"


def test_the_verdict_fails_when_one_target_concurrency_is_short():
    verdict = bench.verdict(results(grpc_16=899.0))
    assert not verdict["pass"] and verdict["ratios"]["image"][16]["grpc_vs_in_process"] == pytest.approx(0.899)
    assert verdict["ratios"]["image"][64]["batching_gain"] == pytest.approx(2.5)
    assert bench.verdict(results())["pass"]


def test_a_run_without_the_max_batch_size_1_side_still_reports(tmp_path):
    data = results()
    data["image"]["grpc-b1"] = {c: cell([], []) for c in (1, 16, 64)}
    text = bench.encode_report(data, tmp_path / "ge.md", "c", "d", "a", 8, 32)
    assert "| 16 | 1000.0 | 900.0 | 0.90 | - | - | 12.0 | - | 4.5 / 4.4 / - | 900 |" in text


def test_batches_are_counted_back_from_the_newest_until_they_hold_the_requests():
    assert bench.batches_for([1, 1, 32, 32, 20, 12], 64) == 3  # 12 + 20 + 32
    assert bench.batches_for([5, 1, 1, 1], 3) == 3
    assert bench.batches_for([], 10) == 1


def test_run_concurrently_times_every_request_and_counts_cpu():
    calls, clock = [], iter(range(100))
    rate, latencies, cpu = bench.run_concurrently(lambda items: calls.append(len(items)), [[1, 2]] * 10, 4,
                                                  cpu=lambda: float(next(clock)))
    assert len(calls) == 14 and len(latencies) == 10 and rate > 0 and cpu == 1.0  # 4 warm-up calls, then 10 timed
    assert bench.tree_cpu() > 0


def test_workloads_are_the_same_inputs_for_every_side():
    texts, images = bench.workload("text", 3, 2), bench.workload("image", 2, 2)
    assert texts == bench.workload("text", 3, 2) and len(texts) == 3 and all(len(r) == 2 for r in texts)
    assert images[0][0][:4] == b"\x89PNG" and images == bench.workload("image", 2, 2)


def test_the_served_model_is_registered_in_a_run_of_its_own_as_the_production_version(settings):
    """`register` (bench grpc-encode's, and bench search's for its RPC): a real export of the named architecture in
    MLflow, production alias on it."""
    from clipstream.registry import Registry

    version = bench.register(settings, "clipstream-vit-tiny")
    registry = Registry(settings)
    assert registry.number() == version
    found = registry.resolve(version)
    assert "production" in found.aliases and found.tags["method"] == "none" and found.run_id
    assert json.loads((found.folder / "open_clip_config.json").read_text())["model_cfg"]["embed_dim"] == 64


def test_one_async_client_is_compared_with_one_in_process_caller(tmp_path):
    single = {"captions": 10000, "batch": 64, "in_flight": 8,
              "rates": {"in-process": [1000.0, 1100.0, 900.0], "async client": [850.0, 700.0, 880.0]}}
    text = bench.encode_report(results(), tmp_path / "ge.md", "c", "d", "a", 8, 32, single=single)
    assert "## One client, 10000 captions" in text and "| async client | 850.0 | 850, 700, 880 |" in text
    assert "| AsyncClient ÷ in-process | 0.85 | 0.85, 0.64, 0.98 |" in text
    assert "AsyncClient ÷ in-process: 0.85× (median of the rounds' ratios, 0.64-0.98)." in text
    checks = {c["check"]: c for c in json.loads((tmp_path / "ge.json").read_text())["checks"]}
    assert checks["text: one AsyncClient ÷ one in-process caller items/s, 10000 captions"]["ok"]
    single["rates"]["async client"] = [700.0] * 3
    assert not bench.checks(results(), single)[0]["ok"]


def test_the_one_client_ratio_is_taken_round_by_round():
    # the machine slowed down in round 2: both sides of that round alike. The ratio of the medians (700 ÷ 800 =
    # 0.875) would credit the client with the in-process side's slow round; round by round it is 0.83
    single = {"rates": {"in-process": [1000.0, 600.0, 800.0], "async client": [700.0, 500.0, 780.0]}}
    assert bench.round_ratios(single) == pytest.approx([0.7, 5 / 6, 0.975])
    assert bench.one_client_ratio(single) == pytest.approx(5 / 6)


@pytest.mark.component
def test_one_client_runs_both_sides_against_the_served_app(served):
    from clipstream.registry import Registry

    settings, _, _, (v1, _) = served
    # on a thread of its own: asyncio.run leaves its thread with no event loop set, which later tests that build a
    # gRPC aio server on the main thread (tests/services/test_app.py) would inherit
    with ThreadPoolExecutor(1) as pool:
        single = pool.submit(bench.one_client, Registry(settings).load(v1), f"127.0.0.1:{settings.grpc_port}",
                             40, 8, 2, 3).result()
    assert single["captions"] == 40 and single["batch"] == 8 and single["in_flight"] == 2
    assert all(len(r) == 3 and min(r) > 0 for r in single["rates"].values())
