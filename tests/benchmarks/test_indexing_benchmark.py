"""`clipstream bench indexing`: the report from hand-made timings, and the clock that splits them."""

import json

from clipstream.benchmarks import indexing as bench


def _run(total: float, embed: float, store: float) -> dict:
    return {"total": total, "embed": embed, "store": store, "other": total - embed - store}


def results(**changes) -> dict:
    out = {
        "pairs": 1000, "task_pairs": 100, "rounds": 3,
        "local": {2: [10.0, 12.0, 11.0], 1: [8.0, 9.0, 30.0]},  # one thread is the faster: median 9 s
        "served": [_run(10.0, 8.0, 1.5), _run(11.0, 9.0, 1.5), _run(12.0, 10.0, 1.5)],
        "cold": _run(30.0, 28.0, 1.5),
        "appends": [_run(2.0, 1.5, 0.4), _run(2.0, 1.5, 0.5), _run(2.0, 1.4, 0.5), _run(2.2, 1.5, 0.6)],
        "reindexes": [{"tasks": 1, **_run(2.0, 1.5, 0.4)}, {"tasks": 2, **_run(4.0, 3.0, 0.8)},
                      {"tasks": 4, **_run(8.0, 6.0, 1.6)}],
        "text_only": {"reused": [_run(4.0, 2.0, 1.6), _run(5.0, 3.0, 1.6)],
                      "re-embedded": [_run(8.0, 6.0, 1.6), _run(10.0, 8.0, 1.6)]},
        "setup": {"data and versions": 20.0, "Ray start-up": 6.0, "whole run": 150.0},
        "loads": [1.0, 1.5, 2.0, 2.0], "ray_min_rows": 1024, "block_rows": 256}
    out.update(changes)
    return out


def test_the_report_compares_the_indexing_job_with_the_faster_in_process_loop(tmp_path):
    out = tmp_path / "indexing.md"
    text = bench.indexing_report(results(), out, "clipstream bench indexing --pairs 1000", "CPU (test)")
    assert text == out.read_text() and (tmp_path / "indexing.png").stat().st_size > 0
    assert "Device: CPU (test). Reproduce: `clipstream bench indexing --pairs 1000`." in text
    # 2000 vectors; in-process medians 11 s (2 threads) and 9 s (1 thread): the baseline is 9 s
    assert "| in-process encode loop, 2 torch threads | 182 | 11.0 |  |  |  | 10.0, 12.0, 11.0 | 0.82 |" in text
    assert "| in-process encode loop, 1 torch thread | 222 | 9.0 |  |  |  | 8.0, 9.0, 30.0 | 1.00 |" in text
    assert "| clipstream index (Ray Data + upserts) | 182 | 11.0 | 9.0 | 1.5 | 0.5 | 10.0, 11.0, 12.0 | 0.82 |" in text
    assert "| its first job (Ray workers import torch, open_clip) | 67 | 30.0 | 28.0 | 1.5 | 0.5 |  | 0.30 |" in text
    checks = json.loads((tmp_path / "indexing.json").read_text())["checks"]
    assert checks[0] == {"check": "clipstream index vectors/s ÷ in-process encode loop", "value": "0.82",
                         "target": "≥ 0.80", "ok": True, "why": ""}


def test_the_size_tables_split_each_append_and_reindex_and_the_targets_follow_them(tmp_path):
    text = bench.indexing_report(results(), tmp_path / "indexing.md", "cmd", "CPU")
    assert "| 4 | 400 | 8.0 | 6.0 | 1.6 | 0.4 | 20.0 |" in text  # 4 tasks of 100 pairs: 20 ms per pair
    assert "| 3 | 2.2 | 1.5 | 0.6 | 0.1 |" in text  # the append with 3 tasks already indexed
    assert "| re-embedded | 9.0 | 7.0 | 1.6 | 0.4 | 8.0, 10.0 |" in text
    assert "| reused | 4.5 | 2.5 | 1.6 | 0.4 | 4.0, 5.0 |" in text
    assert "Reusing them saves 4.5 s (50%) of the reindex." in text
    checks = {c["check"]: c for c in json.loads((tmp_path / "indexing.json").read_text())["checks"]}
    growth = checks["append store s (median), 2-3 tasks indexed ÷ 1"]
    assert growth["value"] == "1.10" and growth["ok"]  # median(0.5, 0.6) / 0.5: the first append creates the index
    reuse = checks["text-only reindex s, image vectors reused ÷ re-embedded"]
    assert reuse["value"] == "0.50" and reuse["ok"]

    slow = results(served=[_run(20.0, 18.0, 1.5)], appends=[_run(2.0, 1.5, 0.4), _run(2.0, 1.5, 0.5),
                                                              _run(3.0, 1.5, 1.5)])
    checks = json.loads((bench.indexing_report(slow, tmp_path / "slow.md", "cmd", "CPU") and
                         (tmp_path / "slow.json")).read_text())["checks"]
    assert [c["ok"] for c in checks] == [False, False, True]  # 9/20 = 0.45; 1.5/0.5 = 3.0


def test_store_growth_compares_medians_so_one_slow_append_does_not_decide_it():
    # a run whose last append was slow: the end points alone give 0.7 / 0.4 = 1.75
    assert round(bench.store_growth([0.4, 0.4, 0.4, 0.5, 0.4, 0.5, 0.5, 0.7]), 2) == 1.25
    assert round(bench.store_growth([0.4, 0.4, 0.4, 0.4, 0.8, 0.8, 0.9]), 2) == 2.0  # a real trend still shows
    assert bench.store_growth([0.4, 0.5]) == 1.0  # one append after the first: nothing to compare


def test_the_clock_splits_index_task_into_embed_and_store_and_puts_everything_back():
    from clipstream import indexing
    from clipstream.index import VectorIndex

    before = (indexing.embed_gallery, indexing._regallery, VectorIndex.append, VectorIndex.reindex)
    clock = bench.Clock()
    with clock.installed():
        assert indexing.embed_gallery is not before[0] and VectorIndex.append is not before[2]
    assert (indexing.embed_gallery, indexing._regallery, VectorIndex.append, VectorIndex.reindex) == before

    calls = []
    nested = clock._wrap("embed", lambda: calls.append(1))
    outer = clock._wrap("embed", lambda: (nested(), nested()))
    outer()
    assert calls == [1, 1] and clock.seconds["embed"] > 0 and clock.seconds["store"] == 0
    assert set(clock.reset()) == {"embed", "store"} and clock.seconds == {"embed": 0.0, "store": 0.0}


def test_fewest_train_pairs_is_what_synthesize_accepts():
    from clipstream.training.data.synth import MIN_TASK_PAIRS, P9D_SHARES, _allocate

    for tasks in (1, 2, 3, 8, 9):
        n = bench.fewest_train_pairs(tasks)
        assert _allocate(n, [P9D_SHARES[i % len(P9D_SHARES)] for i in range(tasks)]).min() >= MIN_TASK_PAIRS
