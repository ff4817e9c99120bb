"""`clipstream bench languages`: the report from hand-made cells, and the checks before anything trains."""

import numpy as np
import pytest

from clipstream.benchmarks import cells, stats
from clipstream.benchmarks import languages as bench

TASKS = ["task-00-lang-en", "task-01-lang-xa", "task-02-lang-xb"]


def _cell(seed, hits, n=200):
    rng = np.random.default_rng(seed)
    rows = []
    for i, row in enumerate(hits):
        known = {TASKS[j]: tuple(np.where(rng.random(n) < h, 0, 30) for _ in range(2)) for j, h in enumerate(row)}
        rows.append({"known": known, "unknown": known})
    return {"tasks": TASKS, "rows": rows, "step_ms": [1.0] * 3, "seconds": [1.0] * 3, "sd": [{}] * 3}


def test_the_report_has_english_forgetting_intervals_differences_and_the_mean_matrices(tmp_path):
    seeds = (0, 1, 2)  # the paired differences' t intervals need the seeds' spread: 2 degrees of freedom
    results = {"embeddings": {s: _cell(s, [[0.8], [0.5, 0.6], [0.4, 0.3, 0.7]]) for s in seeds},
               "teir": {s: _cell(5 + s, [[0.8], [0.78, 0.5], [0.79, 0.48, 0.6]]) for s in seeds}}
    tables = bench.statistics(3, TASKS[0])
    summary = stats.bootstrap(cells.streams(results), [st for t in tables.values() for st in t], "embeddings",
                              resamples=100)
    out = tmp_path / "languages.md"
    text = bench.languages_report(summary, results, tables, 3, 200, ["train.epochs=2"], [], 2, out)
    assert ("`clipstream bench languages --languages 3 --seeds 0,1,2 --test-per-task 200 --streams embeddings,teir "
            f"--workers 2 --set train.epochs=2 --resamples 100 --out {out}`") in text
    assert ("| stream | preset | AA | forgetting (lower is better) | forgetting on task-00-lang-en (lower is better) "
            "| task-00-lang-en Rm at the end | final Rm (task-unknown AA) |") in text
    emb, teir = summary.estimates["embeddings"], summary.estimates["teir"]
    assert 30 < emb["forgetting on task-00-lang-en"].point < 50 and teir["forgetting on task-00-lang-en"].point < 5
    assert f"| teir | teir | {teir['AA'].format()} |" in text
    diff = next(line for line in text.splitlines() if line.startswith("| teir | +"))
    assert "forgetting on task-00-lang-en" in diff.split(" | ")[-2]  # teir beats embeddings on English forgetting
    assert "Holm-adjusted over this table's 6 comparisons (streams × statistics)" in text  # 1 stream × 6
    assert "## teir (task-known R, mean over seeds)" in text and "task-02-lang-xb" in text
    for png in ("languages.png", "languages-forest.png"):
        assert (tmp_path / png).stat().st_size > 1000 and png in text


def test_unknown_streams_and_a_stream_without_a_second_language_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown stream"):
        bench.main(["--streams", "teir,nope"])
    with pytest.raises(ValueError, match="at least one more language"):
        bench.languages(None, 1, ["teir"])
    with pytest.raises(ValueError, match="seed.s. 2 given more than once"):
        bench.languages(None, 3, ["teir"], seeds=[2, 2])
    with pytest.raises(ValueError, match="--vary nope: none of teir"):
        bench.languages(None, 3, ["embeddings", "teir"], vary=[("nope", ["1"])])
