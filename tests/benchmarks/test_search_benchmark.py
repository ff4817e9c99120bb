"""`clipstream bench search`: its galleries, a tiny measurement against exact search, and the report."""

import json

import numpy as np
import pytest

from clipstream.benchmarks import search as bench


def test_galleries_are_unit_vectors_spread_over_the_tasks():
    gallery = bench.synthetic_gallery(1003, 4, 16, seed=3)
    assert [len(tv.item_ids) for tv in gallery] == [251, 251, 251, 250]
    assert len({i for tv in gallery for i in tv.item_ids}) == 1003
    for tv in gallery:
        for x in (tv.image, tv.text):
            assert x.dtype == np.float32 and x.shape == (len(tv.item_ids), 16)
            np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    # clustered (in the model's 128 dimensions): a caption is nearest its own image; tasks lie apart
    gallery = bench.synthetic_gallery(1003, 4, 128, seed=3)
    t, means = gallery[0], [tv.image.mean(0) for tv in gallery]
    assert np.mean(np.argmax(t.text @ t.image.T, axis=1) == np.arange(len(t.item_ids))) > 0.9
    assert means[0] @ means[0] > 0.2 and abs(means[0] @ means[1]) < 0.05
    uniform = bench.synthetic_gallery(100, 2, 16, kind="uniform")
    assert abs(float(np.mean(uniform[0].image @ uniform[1].image.T))) < 0.05
    with pytest.raises(ValueError, match="kind"):
        bench.synthetic_gallery(10, 1, 4, kind="gaussian")


@pytest.mark.parametrize("layout", ["reindex", "append", "policy"])
def test_a_tiny_run_matches_exact_search(tmp_path, layout):
    results = bench.run_size(1200, 3, 32, 15, "clustered", tmp_path / "idx", layout=layout, compact_segments=1)
    # an appended index is measured as appended, then once more after `compact` merged its segments
    assert [r["layout"] for r in results] == ([layout, "compacted"] if layout == "append" else [layout])
    # per modality: one for every task; each task its own; the policy's first 2 tasks merged + the last one
    assert [r["segments"] for r in results] == {"reindex": [1], "append": [3, 1], "policy": [2]}[layout]
    for result in results:
        assert result["n"] == 1200 and result["tasks"] == 3 and result["build_s"] > 0
        assert len(result["appends_s"]) == (0 if result["layout"] in ("reindex", "compacted") else 3)
        for mode in bench.MODES:
            cell = result[mode]
            assert cell["recall"] == cell["min_recall"] == 1.0  # a small index scans every segment: exact
            assert 0 < cell["index_50"] <= cell["index_99"] and 0 < cell["exact_50"] <= cell["exact_99"]


def test_the_policy_layout_is_the_most_segments_the_default_serves(tmp_path):
    """The indexing job merges an append that leaves more than index_compact_segments: the policy layout stops
    right after such an append (one merged segment + compact_segments appended), and with too few tasks to merge
    it is every task appended."""
    from clipstream.settings import Settings

    assert bench.default_compact_segments() == Settings().index_compact_segments
    gallery = bench.synthetic_gallery(600, 6, 16)
    index, _, appends = bench.build(tmp_path / "a", gallery, layout="policy", compact_segments=4)
    assert index.segments() == 5 and len(appends) == 6 and sorted(index.state()["tasks"]) == [tv.task for tv in gallery]
    index, _, _ = bench.build(tmp_path / "b", gallery[:4], layout="policy", compact_segments=4)
    assert index.segments() == 4


def fake(n, recall=1.0, p99=1.0, kind="clustered", dim=128):
    cell = {"recall": recall, "min_recall": recall, "index_50": p99 / 2, "index_99": p99, "exact_50": 2.0, "exact_99": 3.0}
    return {"n": n, "dim": dim, "kind": kind, "tasks": 10, "segments": 1, "build_s": 12.0, "appends_s": [1.2] * 10, "known": dict(cell),
            "unknown": dict(cell)}


def test_the_report_checks_recall_everywhere_and_p99_at_100k_and_1m(tmp_path):
    results = [fake(10_000, p99=50.0), fake(100_000, p99=4.0), fake(1_000_000, recall=0.985, p99=25.0),
               fake(100_000, recall=0.5, kind="uniform")]
    results[1]["unknown"]["index_99"] = 6.0
    results.append({**fake(100_000, p99=9.0), "layout": "append", "segments": 10})
    results.append({**fake(100_000, p99=3.0), "layout": "compacted", "segments": 1})
    results.append({**fake(100_000, p99=5.5), "layout": "policy", "segments": 5})
    results.append(fake(100_000, p99=4.5, dim=512))  # a real CLIP's vectors beside the small model's (--extra-arch)
    out = tmp_path / "search.md"
    text = bench.search_report(results, {"n": 100_000, "known": {"p50": 7.0, "p99": 9.0},
                                         "unknown": {"p50": 8.0, "p99": 11.0}}, out, "clipstream bench search", "CPU",
                               seconds=300.0, compact_segments=4)
    assert "Reproduce: `clipstream bench search`" in text and "Wall time 5.0 min" in text and "in d dimensions" in text and "k = 10," in text
    assert "| 1M | 128 | clustered | reindex | 10 | 1 | unknown | 0.9850 |" in text
    assert "| 100k | 128 | uniform | reindex | 10 | 1 | known | 0.5000 |" in text
    assert "| 100k | 128 | clustered | append | 10 | 10 | known |" in text
    assert "| 100k | 128 | clustered | compacted | 10 | 1 | unknown |" in text
    assert "| 100k | 128 | clustered | policy | 10 | 5 | known |" in text
    assert "| 100k | 512 | clustered | reindex | 10 | 1 | known | 1.0000 |" in text
    assert "## Search RPC at 100k" in text and "| unknown | 8.0 | 11.0 |" in text
    assert out.with_suffix(".png").exists() and "![p50 and p99 search latency" in text
    checks = {c["check"]: c for c in json.loads(out.with_suffix(".json").read_text())["checks"]}
    # recall at 3 sizes × 2 modes, p99 at 2 sizes × 2 modes, recall again for the appended 100k (its p99 has no target:
    # compaction off), both for it compacted and for the policy's layout; uniform: reported only; 512-d 100k: both
    assert len(checks) == 24
    assert "vector search p99 ms at 100k (128-d), task-known, appended, compaction off" not in checks
    assert checks["recall@10 at 100k (128-d), task-known, appended, compaction off"]["ok"]
    assert checks["vector search p99 ms at 100k (128-d), task-unknown, appended then compacted"]["ok"]
    assert not checks["vector search p99 ms at 100k (128-d), task-unknown, appended under the default policy (5 segments)"]["ok"]
    assert not checks["vector search p99 ms at 100k (128-d), task-unknown"]["ok"]
    assert checks["vector search p99 ms at 100k (128-d), task-known"]["ok"]
    assert checks["vector search p99 ms at 100k (512-d), task-unknown"]["ok"] and checks["recall@10 at 100k (512-d), task-known"]["ok"]
    assert not checks["recall@10 at 1M (128-d), task-known"]["ok"]
    assert checks["recall@10 at 10k (128-d), task-known"]["target"] == "≥ 0.9900"
    assert "vector search p99 ms at 10k (128-d), task-known" not in checks  # no latency target at 10k
    assert "| vector search p99 ms at 1M (128-d), task-known | 25.00 | ≤ 20.00 | **not met** |" in text


def test_hnsw_ef_fixes_every_segments_candidate_list_and_0_keeps_the_rule(tmp_path):
    """`--hnsw-ef N` (a recall/latency sweep) searches segments of any size with N, below the rule's base too."""
    from clipstream import index as module

    gallery = bench.synthetic_gallery(600, 2, 16)
    index, _, _ = bench.build(tmp_path / "fixed", gallery, hnsw_ef=40)
    assert index._open(index._read()["segments"]["t00"]["image"])[1] == 40
    index, _, _ = bench.build(tmp_path / "rule", gallery)
    assert index._open(index._read()["segments"]["t00"]["image"])[1] == module.HNSW_EF


@pytest.mark.parametrize("argv, message", [(["--compact-segments", "0"], "--compact-segments: at least 1"),
                                           (["--hnsw-ef", "-1"], "--hnsw-ef: a candidate list length")])
def test_bad_options_exit_2_before_anything_is_built(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
