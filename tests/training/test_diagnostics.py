"""Mod-X spatial-disorder diagnostics (the properties of Ni et al., arXiv:2305.07437, §3) and the loss plot."""

import math

import numpy as np
import pytest

from clipstream.training.diagnostics import (
    RAM_EDGES,
    SAM_EDGES,
    _percent,
    angles,
    plot_losses,
    plot_spatial_disorder,
    sample_pairs,
    spatial_disorder,
)


def unit_rows(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def probe(n=60, d=16, seed=0):
    """Paired embeddings where each text is a noisy copy of its image, so the model retrieves them."""
    rng = np.random.default_rng(seed)
    img = unit_rows(rng.standard_normal((n, d)))
    txt = unit_rows(img + 0.3 * rng.standard_normal((n, d)) / math.sqrt(d))
    return img.astype(np.float32), txt.astype(np.float32)


def orthogonal(d, seed):
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def on_circle(deg):
    rad = np.radians(np.asarray(deg, dtype=np.float64))
    return np.stack([np.cos(rad), np.sin(rad)], axis=1)


def bins(metrics, prefix, edges):
    return [metrics[f"sd/{prefix}_bin_{lo}_{hi}"] for lo, hi in zip(edges[:-1], edges[1:])]


GROUPS = [("image_rotation", RAM_EDGES), ("text_rotation", RAM_EDGES),
          ("image_topology_change", SAM_EDGES), ("text_topology_change", SAM_EDGES)]


def test_angles_known_values_and_agree_with_arccos():
    a = on_circle([0, 0, 0, 0, 30])
    b = on_circle([10, 40, 90, 180, 30])
    np.testing.assert_allclose(angles(a, b), [10, 40, 90, 180, 0], atol=1e-9)
    rng = np.random.default_rng(1)
    x, y = unit_rows(rng.standard_normal((50, 8))), unit_rows(rng.standard_normal((50, 8)))
    ref = np.degrees(np.arccos(np.clip((x * y).sum(1), -1, 1)))
    np.testing.assert_allclose(angles(x, y), ref, atol=1e-6)


def test_same_model_has_no_disorder():
    img, txt = probe()
    m = spatial_disorder(img, txt, img, txt)
    for key in ("image_rotation_mean", "text_rotation_mean", "image_topology_change_mean",
                "text_topology_change_mean", "intermodal_deviation_mean", "intermodal_deviation_tv", "imav_mean"):
        assert m[f"sd/{key}"] == pytest.approx(0, abs=1e-9), key
    assert m["sd/image_rotation_bin_0_15"] == 100 and m["sd/text_topology_change_bin_0_5"] == 100
    assert m["sd/imav_le5_pct"] == 100 and m["sd/imav_samples"] == 60


def test_shared_rotation_keeps_topology_and_cross_modal_angles():
    img, txt = probe()
    q = orthogonal(16, seed=3)
    m = spatial_disorder(img, txt, img @ q, txt @ q)
    assert m["sd/image_rotation_mean"] > 30 and m["sd/text_rotation_mean"] > 30  # the space moved ...
    assert m["sd/image_topology_change_mean"] < 1e-4 and m["sd/text_topology_change_mean"] < 1e-4  # rigidly
    assert m["sd/image_topology_change_bin_0_5"] == 100
    assert m["sd/imav_samples"] == 60 and m["sd/imav_mean"] < 1e-4 and m["sd/imav_le5_pct"] == 100


def test_rotating_only_images_is_inter_modal_deviation():
    img, txt = probe()
    m = spatial_disorder(img, txt, img @ orthogonal(16, seed=4), txt)
    assert m["sd/text_rotation_mean"] == pytest.approx(0, abs=1e-9)
    assert m["sd/image_topology_change_mean"] < 1e-4  # still rigid within the image space
    assert m["sd/intermodal_deviation_mean"] > 30
    assert m["sd/intermodal_deviation_tv"] > 0.5
    assert m["sd/imav_mean"] > 10 and m["sd/imav_le5_pct"] < 50


def test_bins_sum_to_100_under_non_rigid_change():
    img, txt = probe(n=80)
    rng = np.random.default_rng(5)
    step = rng.uniform(0, 1.2, (80, 1)) / 4  # per-sample noise size, so angles spread over the bins
    new_img = unit_rows(img + step * rng.standard_normal(img.shape))
    new_txt = unit_rows(txt + step * rng.standard_normal(txt.shape))
    m = spatial_disorder(img, txt, new_img, new_txt)
    for prefix, edges in GROUPS:
        b = bins(m, prefix, edges)
        assert sum(b) == pytest.approx(100) and all(0 <= v <= 100 for v in b), prefix
        assert max(b) < 100, prefix  # the change really spreads over several bins
    assert all(isinstance(v, float) and "@" not in k and k.startswith("sd/") for k, v in m.items())


def test_hand_computed_2d_example():
    # images at 0/90/200 deg move by 10/40/22 deg (non-rigid); texts start on the images, all turn by 10 deg
    old_img, new_img = on_circle([0, 90, 200]), on_circle([10, 130, 222])
    old_txt, new_txt = on_circle([0, 90, 200]), on_circle([10, 100, 210])
    m = spatial_disorder(old_img, old_txt, new_img, new_txt)
    third = 100 / 3
    np.testing.assert_allclose(bins(m, "image_rotation", RAM_EDGES), [third, 0, third, 0, third])
    assert bins(m, "text_rotation", RAM_EDGES) == [100, 0, 0, 0, 0]
    assert m["sd/image_rotation_mean"] == pytest.approx(24) and m["sd/text_rotation_mean"] == pytest.approx(10)
    # pair angles 90/160/110 become 120/148/92: changes 30, 12, 18
    np.testing.assert_allclose(bins(m, "image_topology_change", SAM_EDGES), [0, 0, third, third, third])
    assert m["sd/image_topology_change_mean"] == pytest.approx(20)
    assert m["sd/text_topology_change_mean"] == pytest.approx(0, abs=1e-9)
    assert m["sd/intermodal_deviation_mean"] == pytest.approx(14)  # |10-10|, |40-10|, |22-10|
    assert m["sd/intermodal_deviation_tv"] == pytest.approx(2 / 3)
    # image-text angles go 0 -> 0, 0 -> 30, 0 -> 12
    assert m["sd/imav_samples"] == 3 and m["sd/imav_mean"] == pytest.approx(14)
    assert m["sd/imav_le5_pct"] == pytest.approx(third)


def test_bins_are_right_closed_except_the_first():
    x = np.array([0, 15, 15.001, 20, 25, 30, 30.001, 180])
    np.testing.assert_allclose(_percent(x, RAM_EDGES), np.array([2, 2, 1, 1, 2]) * 100 / 8)


def test_deviation_is_per_sample_while_tv_compares_histograms():
    # image and text swap their rotations (10/40 vs 40/10): same histograms, yet every sample deviates by 30
    old = on_circle([0, 90])
    m = spatial_disorder(old, old, on_circle([10, 130]), on_circle([40, 100]))
    assert m["sd/intermodal_deviation_mean"] == pytest.approx(30)
    assert m["sd/intermodal_deviation_tv"] == pytest.approx(0, abs=1e-12)
    assert m["sd/imav_mean"] == pytest.approx(30) and m["sd/imav_le5_pct"] == 0


def test_imav_only_counts_samples_the_old_model_retrieves():
    old_img = on_circle([0, 90, 180])
    old_txt = on_circle([0, 260, 180])  # image 1's own text points away: the old model misses it
    new_img, new_txt = on_circle([0, 90, 180]), on_circle([20, 90, 180])  # sample 0 opens 20 deg, 1 closes
    m = spatial_disorder(old_img, old_txt, new_img, new_txt)
    assert m["sd/imav_samples"] == 2
    assert m["sd/imav_mean"] == pytest.approx(10) and m["sd/imav_le5_pct"] == pytest.approx(50)


def test_no_correct_retrieval_gives_nan_imav():
    old_img, old_txt = on_circle([0, 180]), on_circle([180, 0])
    m = spatial_disorder(old_img, old_txt, old_img, old_txt)
    assert m["sd/imav_samples"] == 0 and math.isnan(m["sd/imav_mean"]) and math.isnan(m["sd/imav_le5_pct"])


def test_pair_subsampling_is_deterministic_capped_and_valid():
    n = 40
    total = n * (n - 1) // 2
    all_i, all_j = sample_pairs(n, max_pairs=total)
    assert len(all_i) == total and np.all(all_i < all_j)
    i, j = sample_pairs(n, max_pairs=total - 1, seed=7)  # subsampled path, nearly every pair
    pairs = set(zip(i.tolist(), j.tolist()))
    assert len(i) == len(pairs) == total - 1 and pairs < set(zip(all_i.tolist(), all_j.tolist()))
    a, b = sample_pairs(n, 100, seed=1), sample_pairs(n, 100, seed=1)
    assert len(a[0]) == 100 and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(sample_pairs(n, 100, seed=2)[0], a[0])


def test_spatial_disorder_uses_the_pair_cap_and_seed():
    img, txt = probe(n=50)
    rng = np.random.default_rng(6)
    new_img = unit_rows(img + 0.4 * rng.standard_normal(img.shape))
    m1 = spatial_disorder(img, txt, new_img, txt, max_pairs=7, seed=3)
    assert m1 == spatial_disorder(img, txt, new_img, txt, max_pairs=7, seed=3)
    counts = np.array(bins(m1, "image_topology_change", SAM_EDGES)) * 7 / 100  # whole pairs out of 7
    np.testing.assert_allclose(counts, np.round(counts), atol=1e-9)
    full = spatial_disorder(img, txt, new_img, txt)
    assert m1["sd/image_topology_change_mean"] != full["sd/image_topology_change_mean"]
    assert m1["sd/image_rotation_mean"] == full["sd/image_rotation_mean"]  # per-sample metrics not subsampled


def test_shape_mismatch_is_refused():
    img, txt = probe(n=10)
    with pytest.raises(ValueError, match="one shape"):
        spatial_disorder(img, txt, img[:5], txt)


def test_plot_writes_a_png(tmp_path):
    img, txt = probe()
    out = plot_spatial_disorder(img, txt, img @ orthogonal(16, 8), txt, tmp_path / "sub" / "sd.png", title="0->1")
    assert out == tmp_path / "sub" / "sd.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_loss_plot_of_a_run_with_no_losses_is_written_without_a_warning(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found" would fail here
        empty = plot_losses({"loss": []}, tmp_path / "empty.png")
    full = plot_losses({"loss": [(1, 2.0), (2, 1.5)], "ewc": [(1, 0.1), (2, 0.2)]}, tmp_path / "full.png")
    assert empty.read_bytes()[:8] == full.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
