"""The bootstrap of `benchmarks/stats.py` on synthetic ranks (numpy only): its point estimates are the R matrix's,
identical methods differ by exactly 0, a clearly better one is told apart with the right sign, and the interval
covers a known binomial rate about 95% of the time."""

import numpy as np
import pytest

from clipstream.benchmarks import stats
from clipstream.benchmarks.stats import Statistic, Stream
from clipstream.training.evaluate import ResultMatrix, metrics_from_ranks

TASKS = ["t0", "t1", "t2"]
AA = Statistic("AA", lambda v: stats.average_accuracy(v.rm("known")))
FORGETTING = Statistic("forgetting", lambda v: stats.forgetting(v.rm("known")), lower_is_better=True)
BWT = Statistic("BWT", lambda v: stats.bwt(v.rm("known")))
ZERO_SHOT_DROP = Statistic("zero-shot drop", lambda v: v.zero_shot()[:, 0] - v.zero_shot()[:, -1], lower_is_better=True)


def ranks(rng, n, hit):
    """n queries' (i2t, t2i) ranks: each a hit at rank 0 with probability `hit`, else far down (rank 50)."""
    return tuple(np.where(rng.random(n) < hit, 0, 50) for _ in range(2))


def stream(seed, hits, n=200, zero_shot=()):
    """A 3-task stream whose R[i][j] hit rate is hits[i][j] (row i: after task i), queries drawn with `seed`."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, row in enumerate(hits):
        known = {TASKS[j]: ranks(rng, n, h) for j, h in enumerate(row)}
        rows.append({"known": known, "unknown": known,
                     **({"zero_shot": {"held": ranks(rng, n, zero_shot[i])}} if zero_shot else {})})
    return Stream(TASKS[: len(hits)], rows)


FORGETS = [[0.8], [0.4, 0.8], [0.2, 0.3, 0.8]]
KEEPS = [[0.8], [0.75, 0.8], [0.7, 0.75, 0.8]]


def test_point_estimates_are_the_r_matrix_of_the_logged_metrics():
    s = stream(0, FORGETS, zero_shot=[0.6, 0.5, 0.4])
    matrix = ResultMatrix()
    for i, row in enumerate(s.rows):
        matrix.add_row(TASKS[i], {t: metrics_from_ranks(*r)["Rm"] for t, r in row["known"].items()})
    np.testing.assert_allclose(stats.point_matrix(s, "known"), matrix.values, rtol=1e-5)
    summary = stats.bootstrap({"ft": {0: s}}, [AA, FORGETTING, BWT, ZERO_SHOT_DROP], resamples=50)
    est = summary.estimates["ft"]
    assert est["AA"].point == pytest.approx(matrix.average_accuracy(), rel=1e-5)
    assert est["forgetting"].point == pytest.approx(matrix.mean_forgetting(), rel=1e-5)
    assert est["BWT"].point == pytest.approx(matrix.bwt(), rel=1e-5)
    zs = [metrics_from_ranks(*row["zero_shot"]["held"])["Rm"] for row in s.rows]
    assert est["zero-shot drop"].point == pytest.approx(zs[0] - zs[-1], rel=1e-5)
    assert est["AA"].lo < est["AA"].point < est["AA"].hi and summary.differences == {}


def test_a_method_identical_to_the_baseline_differs_by_exactly_zero():
    cells = {"finetune": {0: stream(0, FORGETS), 1: stream(1, FORGETS)},
             "same": {0: stream(0, FORGETS), 1: stream(1, FORGETS)}}
    summary = stats.bootstrap(cells, [AA, FORGETTING], baseline="finetune", resamples=200)
    for name in ("AA", "forgetting"):
        d = summary.differences["same"][name]
        assert d.point == d.lo == d.hi == 0 and not d.excludes_zero
        assert summary.estimates["same"][name] == summary.estimates["finetune"][name]
    assert summary.beats("same", ["AA", "forgetting"]) == ([], [])
    assert "finetune" not in summary.differences


def test_a_method_that_forgets_less_beats_the_baseline_with_the_right_signs():
    cells = {"finetune": {s: stream(s, FORGETS) for s in (0, 1, 2)},
             "keeps": {s: stream(10 + s, KEEPS) for s in (0, 1, 2)}}
    summary = stats.bootstrap(cells, [AA, FORGETTING, BWT], baseline="finetune", resamples=300)
    diff, est = summary.differences["keeps"], summary.estimates
    # forgetting is lower for "keeps": its difference is finetune − keeps, > 0 = better
    assert est["keeps"]["forgetting"].point < est["finetune"]["forgetting"].point
    assert diff["forgetting"].point == pytest.approx(est["finetune"]["forgetting"].point
                                                     - est["keeps"]["forgetting"].point)
    for name in ("AA", "forgetting", "BWT"):
        assert diff[name].lo > 0 and diff[name].excludes_zero, (name, diff[name])
    assert summary.beats("keeps", ["AA", "forgetting", "BWT"]) == (["AA", "forgetting", "BWT"], [])
    table = "\n".join(stats.difference_table(summary, [AA, FORGETTING]))
    assert "Δ forgetting (finetune − method: > 0 = lower)" in table and "Δ AA (method − finetune)" in table
    assert "| AA, forgetting | - |" in table


def test_the_same_rng_seed_gives_the_same_intervals():
    cells = {"a": {0: stream(0, KEEPS), 1: stream(1, FORGETS)}}
    one = stats.bootstrap(cells, [AA], resamples=100, rng_seed=7)
    assert one.estimates == stats.bootstrap(cells, [AA], resamples=100, rng_seed=7).estimates
    assert one.estimates != stats.bootstrap(cells, [AA], resamples=100, rng_seed=8).estimates
    # the seeds' spread widens the interval beyond one seed's query noise
    assert one.estimates["a"]["AA"].hi - one.estimates["a"]["AA"].lo > 10


def test_the_interval_covers_a_known_binomial_rate_about_95_percent_of_the_time():
    p, n, trials, covered = 0.3, 200, 120, 0
    for trial in range(trials):
        s = stream(100 + trial, [[p]], n=n)
        est = stats.bootstrap({"x": {0: s}}, [AA], resamples=400, rng_seed=trial).estimates["x"]["AA"]
        covered += est.lo <= 100 * p <= est.hi
    assert 0.88 <= covered / trials <= 0.99, covered


def test_counts_resample_with_replacement():
    c = stats.counts(np.random.default_rng(0), 500, 40)
    assert c.shape == (500, 40) and (c.sum(axis=1) == 40).all()
    assert abs(c.mean() - 1) < 1e-6 and c.max() > 1  # repeats, and each query drawn once on average


def test_bad_inputs_are_one_clear_error():
    a = stream(0, KEEPS)
    with pytest.raises(ValueError, match="every row needs the same seeds"):
        stats.bootstrap({"a": {0: a}, "b": {1: a}}, [AA], resamples=20)
    with pytest.raises(ValueError, match="baseline 'finetune' is not among"):
        stats.bootstrap({"a": {0: a}}, [AA], baseline="finetune", resamples=20)
    with pytest.raises(ValueError, match="resamples must be >= 10"):
        stats.bootstrap({"a": {0: a}}, [AA], resamples=5)
    with pytest.raises(ValueError, match="'b', seed 0: other test sets than 'a'"):
        stats.bootstrap({"a": {0: a}, "b": {0: stream(0, KEEPS, n=100)}}, [AA], resamples=20)
    odd = Stream(["t0"], [{"known": {"t0": (np.zeros(4, int), np.zeros(3, int))}}])
    with pytest.raises(ValueError, match="4 image and 3 text queries"):
        stats.bootstrap({"a": {0: odd}}, [AA], resamples=20)


def test_the_plots_show_bands_and_the_forest(tmp_path):
    cells = {"finetune": {s: stream(s, FORGETS) for s in (0, 1)}, "keeps": {s: stream(s, KEEPS) for s in (0, 1)}}
    curve = [Statistic(f"AA after {t}", lambda v, t=t: stats.average_accuracy(v.rm("known"), t)) for t in range(3)]
    summary = stats.bootstrap(cells, [AA, FORGETTING, *curve], baseline="finetune", resamples=50)
    for png in (stats.plot_curves(summary, [c.name for c in curve], TASKS, tmp_path / "aa.png", "AA", "AA"),
                stats.plot_forest(summary, [AA, FORGETTING], tmp_path / "forest.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
