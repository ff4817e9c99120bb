"""Mod-X "spatial disorder" (SD) diagnostics between two model versions on a fixed probe set, as defined
in "Continual Vision-Language Representation Learning with Off-Diagonal Information" (Ni et al., ICML 2023,
arXiv:2305.07437), §3.

Why: Mod-X found that continual CLIP training rotates the embedding spaces from
phase to phase: most samples move > 30 deg (large rotation angle, RAM) while pairwise angles inside a
modality barely change (small self-angle change, theta_SAM). A rotation shared by both modalities keeps
every cross-modal cosine, so retrieval survives it; what breaks retrieval is *relative* rotation of the
two modalities (inter-modal deviation) or non-rigid change, which the inter-modal angle variation (ImAV)
of correctly retrieved samples measures most directly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

RAM_EDGES = (0, 15, 20, 25, 30, 180)  # bins [0,15], (15,20], ..., (30,180] in degrees
SAM_EDGES = (0, 5, 10, 15, 20, 180)
_CHUNK = 8192  # pairs / query rows handled at once, so no [pairs, D] or [N, N] array is ever built


def angles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise angle in degrees between a[i] and b[i]: arccos(clamp(<a_i, b_i>, -1, 1)) for unit rows.
    Computed as 2 * atan2(|a - b|, |a + b|) in float64, which is the same angle but exact near 0 and
    180 deg, where arccos loses half the digits (identical rows give exactly 0, not ~0.03 deg)."""
    a, b = (np.asarray(x, dtype=np.float64) for x in (a, b))
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return np.degrees(2 * np.arctan2(np.linalg.norm(a - b, axis=-1), np.linalg.norm(a + b, axis=-1)))


def sample_pairs(n: int, max_pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j), i < j: all n(n-1)/2 of them, or max_pairs distinct ones drawn with `seed`."""
    total = n * (n - 1) // 2
    if total <= max_pairs:
        return np.triu_indices(n, 1)
    flat = np.sort(np.random.default_rng(seed).choice(total, size=max_pairs, replace=False))
    starts = np.concatenate([[0], np.cumsum(np.arange(n - 1, 0, -1))])  # flat index of (i, i+1)
    i = np.searchsorted(starts, flat, side="right") - 1
    return i, flat - starts[i] + i + 1


def _pair_angles(x: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    return np.concatenate([np.empty(0)] + [angles(x[i[s:s + _CHUNK]], x[j[s:s + _CHUNK]])
                                           for s in range(0, len(i), _CHUNK)])


def _raw(old_img, old_txt, new_img, new_txt, max_pairs: int, seed: int) -> dict[str, np.ndarray]:
    """Per-sample / per-pair angle arrays behind every metric and plot."""
    shapes = {np.shape(x) for x in (old_img, old_txt, new_img, new_txt)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"need four [N, D] arrays of one shape, got {sorted(shapes)}")
    n = len(old_img)
    i, j = sample_pairs(n, max_pairs, seed)
    raw = {"image_rotation": angles(old_img, new_img), "text_rotation": angles(old_txt, new_txt)}
    for mod, old, new in (("image", old_img, new_img), ("text", old_txt, new_txt)):
        raw[f"{mod}_topology_change"] = np.abs(_pair_angles(old, i, j) - _pair_angles(new, i, j))
    top1 = np.concatenate([np.empty(0, dtype=int)] + [np.argmax(old_img[s:s + _CHUNK] @ old_txt.T, axis=1)
                                                      for s in range(0, n, _CHUNK)])
    correct = top1 == np.arange(n)  # old model retrieves sample a's text for image a (I2T top-1)
    raw["imav"] = np.abs(angles(new_img, new_txt) - angles(old_img, old_txt))[correct]
    return raw


def _percent(x: np.ndarray, edges: tuple[int, ...]) -> np.ndarray:
    """% of x per bin; first bin closed [lo, hi], the others (lo, hi]."""
    idx = np.searchsorted(edges[1:-1], x, side="left")
    return 100.0 * np.bincount(idx, minlength=len(edges) - 1) / max(len(x), 1)


def spatial_disorder(old_img: np.ndarray, old_txt: np.ndarray, new_img: np.ndarray, new_txt: np.ndarray,
                     max_pairs: int = 200_000, seed: int = 0) -> dict[str, float]:
    """Flat `sd/...` metrics (MLflow-safe keys) from the old to the new model's probe embeddings [N, D].
    ImAV metrics are NaN when the old model retrieves no probe sample correctly."""
    raw = _raw(old_img, old_txt, new_img, new_txt, max_pairs, seed)
    out: dict[str, float] = {}
    for kind, edges in (("rotation", RAM_EDGES), ("topology_change", SAM_EDGES)):
        for mod in ("image", "text"):
            x = raw[f"{mod}_{kind}"]
            out[f"sd/{mod}_{kind}_mean"] = float(x.mean())
            for lo, hi, pct in zip(edges[:-1], edges[1:], _percent(x, edges)):
                out[f"sd/{mod}_{kind}_bin_{lo}_{hi}"] = float(pct)
    ram_v, ram_l = raw["image_rotation"], raw["text_rotation"]
    out["sd/intermodal_deviation_mean"] = float(np.abs(ram_v - ram_l).mean())
    tv = 0.5 * np.abs(_percent(ram_v, RAM_EDGES) - _percent(ram_l, RAM_EDGES)).sum() / 100.0
    out["sd/intermodal_deviation_tv"] = float(tv)
    imav = raw["imav"]
    out["sd/imav_mean"] = float(imav.mean()) if imav.size else float("nan")
    out["sd/imav_le5_pct"] = float(100.0 * (imav <= 5).mean()) if imav.size else float("nan")
    out["sd/imav_samples"] = float(imav.size)
    return out


def plot_spatial_disorder(old_img: np.ndarray, old_txt: np.ndarray, new_img: np.ndarray, new_txt: np.ndarray,
                          path: str | Path, title: str = "", max_pairs: int = 200_000, seed: int = 0) -> Path:
    """PNG with the binned RAM and theta_SAM histograms, image vs text (the paper's SD figures).
    Uses a bare Figure (Agg canvas) so no pyplot/global backend state is touched."""
    raw = _raw(old_img, old_txt, new_img, new_txt, max_pairs, seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(11, 4), layout="constrained")
    panels = (("rotation", RAM_EDGES, "rotation angle RAM (deg)"),
              ("topology_change", SAM_EDGES, "self-angle change theta_SAM (deg)"))
    for ax, (kind, edges, xlabel) in zip(fig.subplots(1, 2), panels):
        pos = np.arange(len(edges) - 1)
        for k, mod in enumerate(("image", "text")):
            x = raw[f"{mod}_{kind}"]
            ax.bar(pos + (k - 0.5) * 0.4, _percent(x, edges), width=0.4, label=f"{mod} (mean {x.mean():.1f})")
        ax.set_xticks(pos, [f"{'[' if b == 0 else '('}{lo},{hi}]" for b, (lo, hi) in enumerate(zip(edges, edges[1:]))])
        ax.set(xlabel=xlabel, ylabel="% of samples" if kind == "rotation" else "% of pairs", ylim=(0, 100))
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_losses(histories: dict[str, list[tuple[int, float]]], path: str | Path, title: str = "") -> Path:
    """PNG of training loss curves: {name: [(step, value), ...]}, the total loss on top, the method's terms under it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    for name, points in sorted(histories.items(), key=lambda kv: (kv[0] != "loss", kv[0])):
        if points:
            steps, values = zip(*sorted(points))
            ax.plot(steps, values, lw=2 if name == "loss" else 1, label=name)
    ax.set(xlabel="step", ylabel="loss", title=title)
    if ax.lines:  # (a run that logged no loss yet: an empty plot, no legend to warn about)
        ax.legend(fontsize=8)
    fig.savefig(path, format="png", dpi=100)
    return path
