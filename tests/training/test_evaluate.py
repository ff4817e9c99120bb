import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipstream.training.evaluate import (
    BASELINE,
    KS,
    TEMPLATES,
    Embedded,
    GalleryCache,
    ResultMatrix,
    UnionPositives,
    class_vectors,
    classification_accuracy,
    embed_task,
    embed_tasks,
    evaluate_seen,
    flat_ranks,
    metrics_from_ranks,
    nested_ranks,
    positives,
    recall_at_k,
    retrieval_metrics,
)


def unit_rows(n, d, seed):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ---------------------------------------------------------------- positives / recall_at_k


def test_positives_diagonal_same_image_and_identical_caption():
    p = positives(["a.jpg", "b.jpg", "a.jpg", "c.jpg"], ["a dog", "a cat", "a puppy", "a cat"])
    expected = np.eye(4, dtype=bool)
    expected[0, 2] = expected[2, 0] = True  # same image file a.jpg
    expected[1, 3] = expected[3, 1] = True  # identical caption "a cat"
    assert p.dtype == bool
    np.testing.assert_array_equal(p, expected)
    with pytest.raises(ValueError):
        positives(["a", "b"], ["x"])


def test_recall_at_k_hand_computed_ranks():
    # 4 queries over a 12-item gallery; the single positive sits at 0-based rank 0, 3, 7, 11.
    # R@1 = 1/4 (rank 0), R@5 = 2/4 (ranks 0, 3), R@10 = 3/4 (ranks 0, 3, 7).
    base = np.linspace(1.0, 0.0, 12)  # strictly decreasing: column c has rank c
    scores = np.tile(base, (4, 1))
    positive = np.zeros((4, 12), dtype=bool)
    for q, rank in enumerate([0, 3, 7, 11]):
        positive[q, rank] = True
    assert recall_at_k(scores, positive) == {1: 0.25, 5: 0.5, 10: 0.75}
    assert recall_at_k(scores, positive, ks=(4, 12)) == {4: 0.5, 12: 1.0}


def test_recall_at_k_ties_are_pessimistic_and_order_independent():
    # The positive (0.5) ties a negative (0.5): it is ranked below it -> rank 1, so R@1 = 0, R@5 = 1,
    # whichever column comes first.
    for scores, positive in [
        ([[0.5, 0.5, 0.1]], [[True, False, False]]),
        ([[0.5, 0.5, 0.1]], [[False, True, False]]),
    ]:
        assert recall_at_k(np.array(scores), np.array(positive), ks=(1, 2)) == {1: 0.0, 2: 1.0}
    # All items tie: the positive is behind the other 4 -> rank 4: miss at 4, hit at 5.
    assert recall_at_k(np.zeros((1, 5)), np.eye(1, 5, dtype=bool), ks=(4, 5)) == {4: 0.0, 5: 1.0}


def test_recall_at_k_ties_between_positives_still_hit():
    # Two identical captions (both positives) score the same, above every negative: one of them is
    # first whatever the tie-break, so R@1 = 1. A negative tying them pushes the best positive to rank 1.
    positive = np.array([[True, True, False]])
    assert recall_at_k(np.array([[0.7, 0.7, 0.1]]), positive, ks=(1,)) == {1: 1.0}
    assert recall_at_k(np.array([[0.7, 0.7, 0.7]]), positive, ks=(1, 2)) == {1: 0.0, 2: 1.0}


def test_identical_caption_counts_as_hit():
    # Images 0 and 2 have captions "a dog" (identical text); image 0's embedding is closest to caption 2.
    p = positives(["x.jpg", "y.jpg", "z.jpg"], ["a dog", "a cat", "a dog"])
    scores = np.array([[0.8, 0.1, 0.9], [0.0, 1.0, 0.2], [0.3, 0.1, 0.9]])
    assert recall_at_k(scores, p, ks=(1,)) == {1: 1.0}
    assert recall_at_k(scores, np.eye(3, dtype=bool), ks=(1,)) == {1: 2 / 3}  # pair-only rule misses it


def test_recall_at_k_rejects_queries_without_positive_and_bad_input():
    with pytest.raises(ValueError, match="no positive"):
        recall_at_k(np.ones((2, 3)), np.array([[True, False, False], [False, False, False]]))
    with pytest.raises(ValueError):
        recall_at_k(np.ones((2, 3)), np.ones((2, 4), dtype=bool))
    with pytest.raises(ValueError, match="non-finite"):  # NaN must never rank as a hit
        recall_at_k(np.array([[np.nan, 0.0]]), np.array([[True, False]]))


def test_recall_non_decreasing_in_k():
    scores = np.random.default_rng(0).standard_normal((50, 40))
    positive = np.random.default_rng(1).random((50, 40)) < 0.05
    positive[np.arange(50), np.arange(50) % 40] = True  # every query has at least one positive
    r = recall_at_k(scores, positive, ks=range(1, 41))
    assert all(r[k] <= r[k + 1] for k in range(1, 40))
    assert r[40] == 1.0


# ---------------------------------------------------------------- retrieval_metrics


def test_retrieval_metrics_hand_computed():
    img = np.array([[1, 0], [0, 1], [-1, 0]], dtype=np.float32)
    txt = np.array([[0.6, 0.8], [-0.6, 0.8], [0, -1]], dtype=np.float32)
    # S = img @ txt.T:
    #   img0: [ 0.6, -0.6,  0 ] -> txt0 first: hit@1
    #   img1: [ 0.8,  0.8, -1 ] -> txt1 ties negative txt0 -> rank 1: miss@1
    #   img2: [-0.6,  0.6,  0 ] -> txt2 (0) behind txt1 (0.6) -> rank 1: miss@1
    # i2t R@1 = 1/3; a 3-item gallery puts every rank < 5, so R@5 = R@10 = 100.
    # Columns (t2i):
    #   txt0: [0.6, 0.8, -0.6] -> img0 behind img1: miss@1
    #   txt1: [-0.6, 0.8, 0.6] -> img1 first: hit@1
    #   txt2: [0, -1, 0]       -> img2 ties negative img0 -> rank 1: miss@1
    # t2i R@1 = 1/3.  Rm = (2 * 100/3 + 4 * 100) / 6 = 77.78
    m = retrieval_metrics(img, txt, np.eye(3, dtype=bool))
    assert list(m) == ["i2t_R@1", "i2t_R@5", "i2t_R@10", "t2i_R@1", "t2i_R@5", "t2i_R@10", "Rm"]
    assert m["i2t_R@1"] == pytest.approx(100 / 3)
    assert m["t2i_R@1"] == pytest.approx(100 / 3)
    for d in ("i2t", "t2i"):
        assert m[f"{d}_R@5"] == m[f"{d}_R@10"] == 100.0
    assert m["Rm"] == pytest.approx((2 * 100 / 3 + 400) / 6)


def test_retrieval_metrics_non_square_gallery():
    # 2 images, 3 captions (image 0 has captions 0 and 1). Image 1 is nearest caption 1 (of image 0):
    # i2t: img0 -> [0.9, 0.8, 0.0] hit; img1 -> [0.0, 0.6, 0.5] best positive txt2 (0.5) behind txt1: miss.
    # t2i: txt0 -> [0.9, 0.0] hit; txt1 -> [0.8, 0.6] hit; txt2 -> [0.0, 0.5] hit.
    img = np.array([[1.0, 0.0], [0.0, 1.0]])
    txt = np.array([[0.9, 0.0], [0.8, 0.6], [0.0, 0.5]])
    positive = np.array([[True, True, False], [False, False, True]])
    m = retrieval_metrics(img, txt, positive)
    assert m["i2t_R@1"] == 50.0 and m["i2t_R@5"] == 100.0
    assert m["t2i_R@1"] == 100.0


def test_perfect_embeddings_score_100():
    e = unit_rows(300, 64, seed=0)
    m = retrieval_metrics(e, e.copy(), np.eye(300, dtype=bool))
    assert all(v == 100.0 for v in m.values()), m


def test_perfect_embeddings_with_duplicate_captions_score_100():
    # Rows 0 and 1 are two images with the identical caption: their text embeddings are identical,
    # so image 0 ties caption 0 and caption 1, both positives -> still a hit.
    keys, caps = ["a", "b", "c", "d"], ["red dress", "red dress", "blue car", "cat"]
    img = unit_rows(4, 16, seed=3)
    txt = img.copy()
    txt[1] = txt[0]
    m = retrieval_metrics(img, txt, positives(keys, caps))
    assert m["i2t_R@1"] == 100.0 and m["t2i_R@1"] == 100.0


def test_random_embeddings_near_chance():
    # 500 queries, one positive each among 500: chance R@K = K / 500 (0.2 %, 1 %, 2 %).
    n = 500
    m = retrieval_metrics(unit_rows(n, 32, seed=1), unit_rows(n, 32, seed=2), np.eye(n, dtype=bool))
    for d in ("i2t", "t2i"):
        for k in KS:
            assert abs(m[f"{d}_R@{k}"] - 100 * k / n) < 2.0, m
    assert m["Rm"] < 5.0


# ---------------------------------------------------------------- evaluate_seen


def test_evaluate_seen_unknown_gallery_distracts():
    # Task A: images e0, e1; texts t0 = (.6,0,.8,0), t1 = (0,.6,0,.8).  Task-known: every query's own
    # positive scores 0.6 against 0 for the other item -> 100 everywhere. Task B: one pair
    # b0 = e3, u0 = (.8,0,0,.6); known is trivially 100 (gallery of one).
    # Task-unknown (union galleries):
    #   i2t A: a0 -> [t0 .6, t1 0, u0 .8] miss@1; a1 -> [0, .6, 0] hit       -> R@1 50
    #   t2i A: t0 -> [a0 .6, a1 0, b0 0] hit;      t1 -> [0, .6, b0 .8] miss -> R@1 50
    #   i2t B: b0 -> [t0 0, t1 .8, u0 .6] miss;  t2i B: u0 -> [a0 .8, a1 0, b0 .6] miss -> R@1 0
    # Galleries have 3 items, so R@5 = R@10 = 100. Rm A = (50+50+400)/6, Rm B = 400/6.
    f = np.float32
    a = Embedded(
        "A",
        np.array([[1, 0, 0, 0], [0, 1, 0, 0]], f),
        np.array([[0.6, 0, 0.8, 0], [0, 0.6, 0, 0.8]], f),
        np.eye(2, dtype=bool),
    )
    b = Embedded("B", np.array([[0, 0, 0, 1]], f), np.array([[0.8, 0, 0, 0.6]], f), np.eye(1, dtype=bool))
    out = evaluate_seen([a, b])
    assert set(out) == {"known", "unknown"}
    for task in ("A", "B"):
        assert all(v == 100.0 for v in out["known"][task].values())
    ua, ub = out["unknown"]["A"], out["unknown"]["B"]
    assert (ua["i2t_R@1"], ua["t2i_R@1"], ua["i2t_R@5"], ua["t2i_R@10"]) == (50.0, 50.0, 100.0, 100.0)
    assert ua["Rm"] == pytest.approx(500 / 6)
    assert (ub["i2t_R@1"], ub["t2i_R@1"]) == (0.0, 0.0)
    assert ub["Rm"] == pytest.approx(400 / 6)


def test_evaluate_seen_single_task_unknown_equals_known():
    e = unit_rows(20, 8, seed=4)
    txt = unit_rows(20, 8, seed=5) * 0.3 + e
    txt /= np.linalg.norm(txt, axis=1, keepdims=True)
    out = evaluate_seen([Embedded("only", e, txt, np.eye(20, dtype=bool))])
    assert out["known"]["only"] == out["unknown"]["only"]


def test_evaluate_seen_rejects_duplicates_and_bad_shapes():
    e = Embedded("A", np.eye(2, dtype=np.float32), np.eye(2, dtype=np.float32), np.eye(2, dtype=bool))
    with pytest.raises(ValueError, match="duplicate"):
        evaluate_seen([e, e])
    with pytest.raises(ValueError):
        Embedded("B", np.eye(2), np.eye(3), np.eye(2, dtype=bool))


def languages(n_tasks=3, n=30, d=16, seed=0):
    """A language stream as evaluate_seen sees it: every task shows the same n images (one copy of the files each,
    so the same content keys and, under one model, the same image vectors) with captions of its own language."""
    # (values on a grid of 1/16: every dot product is exact in float32 whatever order a BLAS sums it in, so the
    # copies of an image tie exactly with it, as one model's vectors of the same file do)
    grid = lambda x: (np.round(x * 16) / 16).astype(np.float32)  # noqa: E731
    img = grid(unit_rows(n, d, seed))
    keys = [f"sha-{i}" for i in range(n)]
    out = []
    for t in range(n_tasks):
        txt = img + 0.9 * unit_rows(n, d, seed + 1 + t)  # each language's captions near their image, noisily
        txt = grid(txt / np.linalg.norm(txt, axis=1, keepdims=True))
        captions = [f"lang{t} caption {i}" for i in range(n)]
        out.append(Embedded(f"lang-{t}", img.copy(), txt, positives(keys, captions), keys, captions))
    return out


def test_a_language_streams_text_to_image_hits_the_same_image_in_any_language():
    tasks = languages()
    fixed = evaluate_seen(tasks)["unknown"]
    # before: the other languages' copies of the positive image tie with it as negatives: R@1 is 0 for every query
    before = evaluate_seen([Embedded(e.task, e.img, e.txt, e.positive) for e in tasks])["unknown"]
    assert all(before[e.task]["t2i_R@1"] == 0.0 for e in tasks)
    for e in tasks:
        assert fixed[e.task]["t2i_R@1"] > 0
        # the deduplicated union gallery (one copy of each image: the task's own) gives the same R@1
        assert fixed[e.task]["t2i_R@1"] == pytest.approx(100 * recall_at_k(e.txt @ e.img.T, e.positive.T, (1,))[1])
        # image->text: a caption of the same image in any language is a hit (the union gallery, positives by key)
        union_txt = np.concatenate([x.txt for x in tasks])
        same_image = np.tile(np.eye(len(e.img), dtype=bool), len(tasks))
        assert fixed[e.task]["i2t_R@1"] == pytest.approx(100 * recall_at_k(e.img @ union_txt.T, same_image, (1,))[1])


def test_tasks_sharing_no_content_score_as_before_the_fix():
    tasks = []
    for t in range(3):
        img = unit_rows(25, 16, 10 + t)
        txt = img + unit_rows(25, 16, 20 + t)
        txt /= np.linalg.norm(txt, axis=1, keepdims=True)
        keys, captions = [f"t{t}-{i}" for i in range(25)], [f"task {t} caption {i % 20}" for i in range(25)]
        tasks.append(Embedded(f"t{t}", img, txt, positives(keys, captions), keys, captions))
    old_rule = [Embedded(e.task, e.img, e.txt, e.positive) for e in tasks]  # positives inside the task only
    assert evaluate_seen(tasks) == evaluate_seen(old_rule)


def test_an_identical_caption_in_another_task_is_a_positive():
    # task A's image a0 is nearest B's caption "a red cup" (B's image of it is another picture): with captions known
    # that is a hit, as `positives` counts identical captions inside one task; without, a negative ranked first.
    f = np.float32
    a = Embedded("A", np.array([[1, 0, 0], [0, 1, 0]], f), np.array([[0.8, 0.6, 0], [0, 1, 0]], f), np.eye(2, dtype=bool),
                 ["ka0", "ka1"], ["a red cup", "a blue hat"])
    b = Embedded("B", np.array([[0, 0, 1]], f), np.array([[1, 0, 0]], f), np.eye(1, dtype=bool),
                 ["kb0"], ["a red cup"])
    assert evaluate_seen([a, b])["unknown"]["A"]["i2t_R@1"] == 100.0
    assert evaluate_seen([replace(a, keys=None, captions=None), b])["unknown"]["A"]["i2t_R@1"] == 50.0
    with pytest.raises(ValueError, match="both keys and captions"):
        replace(a, captions=None)
    with pytest.raises(ValueError, match="one of each per row"):
        replace(a, keys=["ka0"])


def test_union_positives_are_built_per_chunk_of_queries(monkeypatch):
    import clipstream.training.evaluate as ev

    tasks = languages(n=30)
    whole = evaluate_seen(tasks)
    monkeypatch.setattr(ev, "_QUERY_CHUNK", 7)  # chunks that straddle nothing special: same numbers
    assert evaluate_seen(tasks) == whole
    union = UnionPositives(tasks)
    rows = union.rows(1, "t2i", 3, 10)
    assert rows.shape == (7, 90) and rows.sum() == 7 * 3  # each caption: its image in each of the 3 tasks
    with pytest.raises(ValueError, match="direction"):
        union.rows(0, "x", 0, 1)


def test_no_reindex_ranks_todays_queries_against_the_galleries_each_version_made():
    # Two tasks of two pairs. Today's model embeds both alike (perfect pairs: reindex scores 100 everywhere). Task A's
    # gallery as its own (older) version made it has the two captions swapped: today's image a0 is nearest the
    # vector stored for caption 1, so under no-reindex A's image->text R@1 is 0 (and text->image, against A's old
    # image vectors, likewise). Task B's gallery is today's (it is the current task): its known row is reindex's.
    f = np.float32
    e = np.eye(4, dtype=f)
    today = [Embedded("A", e[:2], e[:2].copy(), np.eye(2, dtype=bool), ["a0", "a1"], ["ca0", "ca1"]),
             Embedded("B", e[2:], e[2:].copy(), np.eye(2, dtype=bool), ["b0", "b1"], ["cb0", "cb1"])]
    stored = [replace(today[0], img=e[:2][::-1].copy(), txt=e[:2][::-1].copy()), today[1]]
    reindex, noreindex = evaluate_seen(today), evaluate_seen(today, stored)
    assert all(m["Rm"] == 100.0 for mode in reindex.values() for m in mode.values())
    assert noreindex["known"]["A"]["i2t_R@1"] == noreindex["known"]["A"]["t2i_R@1"] == 0.0
    assert noreindex["known"]["B"] == reindex["known"]["B"]  # the diagonal: the current task's own gallery
    assert noreindex["unknown"]["A"]["i2t_R@1"] == 0.0 and noreindex["unknown"]["B"]["i2t_R@1"] == 100.0
    with pytest.raises(ValueError, match="same rows"):
        evaluate_seen(today, stored[:1])
    with pytest.raises(ValueError, match="same rows"):
        evaluate_seen(today, [stored[0], replace(today[1], img=e[2:3], txt=e[2:3], positive=np.eye(1, dtype=bool),
                                                 keys=None, captions=None)])


def test_every_query_keeps_its_rank_and_the_metrics_are_its_recall():
    # the example of test_evaluate_seen_unknown_gallery_distracts: in the union gallery a0, t1, b0 and u0 have one
    # negative above their positive
    f = np.float32
    a = Embedded("A", np.array([[1, 0, 0, 0], [0, 1, 0, 0]], f), np.array([[0.6, 0, 0.8, 0], [0, 0.6, 0, 0.8]], f),
                 np.eye(2, dtype=bool))
    b = Embedded("B", np.array([[0, 0, 0, 1]], f), np.array([[0.8, 0, 0, 0.6]], f), np.eye(1, dtype=bool))
    out = evaluate_seen([a, b])
    ranks = {mode: {t: tuple(r.tolist() for r in m.ranks) for t, m in per_task.items()}
             for mode, per_task in out.items()}
    assert ranks == {"known": {"A": ([0, 0], [0, 0]), "B": ([0], [0])},
                     "unknown": {"A": ([1, 0], [0, 1]), "B": ([1], [1])}}
    rng = np.random.default_rng(0)
    i2t, t2i = rng.integers(0, 30, 50), rng.integers(0, 30, 50)
    m = metrics_from_ranks(i2t, t2i)
    assert m["i2t_R@5"] == 100 * np.mean(i2t < 5) and m["t2i_R@10"] == 100 * np.mean(t2i < 10)
    assert m.ranks[0] is i2t and m.ranks[1] is t2i
    back = nested_ranks(flat_ranks({"known": {"A": m.ranks}, "zero_shot": {"Z": (i2t[:3], t2i[:3])}}))
    assert back["known"]["A"][1].tolist() == t2i.tolist() and back["zero_shot"]["Z"][0].tolist() == i2t[:3].tolist()


# ---------------------------------------------------------------- ResultMatrix

# R = [[80], [85, 70], [50, 75, 90]] over tasks a, b, c:
#   AA_0 = 80, AA_1 = (85 + 70) / 2 = 77.5, AA_2 = (50 + 75 + 90) / 3 = 71.667
#   forgetting a = max(R[0][a] 80, R[1][a] 85) - R[2][a] 50 = 35
#   forgetting b = R[1][b] 70 - R[2][b] 75 = -5 (the last row is not part of the max: improving is
#   negative forgetting)
#   mean forgetting = 15;  BWT = ((50 - 80) + (75 - 70)) / 2 = -12.5
def matrix():
    m = ResultMatrix()
    m.add_row("a", {"a": 80.0})
    m.add_row("b", {"a": 85.0, "b": 70.0})
    m.add_row("c", {"c": 90.0, "a": 50.0, "b": 75.0})  # key order does not matter; stream order does
    return m


def test_result_matrix_metrics_hand_computed():
    m = matrix()
    assert m.tasks == ["a", "b", "c"]
    v = m.values
    assert v.shape == (3, 3)
    np.testing.assert_array_equal(np.isnan(v), np.triu(np.ones((3, 3), dtype=bool), k=1))
    np.testing.assert_array_equal(v[np.tril_indices(3)], [80, 85, 70, 50, 75, 90])
    assert [m.average_accuracy(t) for t in range(3)] == pytest.approx([80, 77.5, 215 / 3])
    assert m.average_accuracy() == pytest.approx(215 / 3)
    assert m.forgetting() == {"a": 35.0, "b": -5.0}
    assert m.mean_forgetting() == 15.0
    assert m.bwt() == -12.5


def test_result_matrix_single_task_and_empty():
    m = ResultMatrix()
    assert m.forgetting() == {} and m.mean_forgetting() == 0.0 and m.bwt() == 0.0
    with pytest.raises(ValueError):
        m.average_accuracy()
    m.add_row("a", {"a": 42.0})
    assert m.average_accuracy() == 42.0
    assert m.forgetting() == {} and m.mean_forgetting() == 0.0 and m.bwt() == 0.0
    with pytest.raises(IndexError):
        m.average_accuracy(1)


def test_result_matrix_add_row_validation():
    m = ResultMatrix()
    m.add_row("a", {"a": 1.0})
    with pytest.raises(ValueError, match="missing"):
        m.add_row("b", {"b": 1.0})  # seen task a missing
    with pytest.raises(ValueError, match="unknown"):
        m.add_row("b", {"a": 1.0, "b": 1.0, "zzz": 1.0})
    with pytest.raises(ValueError, match="missing"):
        m.add_row("b", {"a": 1.0})  # the new task's own score missing
    with pytest.raises(ValueError, match="already"):
        m.add_row("a", {"a": 1.0})
    with pytest.raises(ValueError, match="finite"):
        m.add_row("b", {"a": float("nan"), "b": 1.0})
    assert m.tasks == ["a"] and m.values.shape == (1, 1)  # failed adds change nothing
    with pytest.raises(ValueError):
        ResultMatrix(["a", "b"], [[1.0], [1.0]])  # row 1 needs 2 scores
    with pytest.raises(ValueError):
        ResultMatrix(["a"], [])


def test_result_matrix_dict_round_trip():
    m = matrix()
    d = json.loads(json.dumps(m.to_dict(), allow_nan=False))  # strict JSON: NaN must be None
    assert d["values"][0] == [80.0, None, None]
    assert d["forgetting"] == {"a": 35.0, "b": -5.0} and d["bwt"] == -12.5
    r = ResultMatrix.from_dict(d)
    assert r.tasks == m.tasks
    np.testing.assert_array_equal(r.values, m.values)  # NaN positions equal too
    assert ResultMatrix.from_dict(ResultMatrix().to_dict()).tasks == []


def test_row_0_is_kept_and_shown_but_the_papers_metrics_stay_over_the_trained_rows(tmp_path):
    """A stream started from a version 0: its pretrained scores (on a, b and d, a task not reached yet) are row 0
    ("pretrained"); AA, forgetting and BWT are those of the same trained rows without it, though a's pretrained
    score (95) is above every trained one: forgetting counts from the best score after a task was learnt."""
    with pytest.raises(ValueError, match="finite"):
        ResultMatrix(baseline={"a": float("nan")})
    m = ResultMatrix(baseline={"a": 95.0, "b": 20.0, "d": 10.0})
    assert m.tasks == [] and m.columns == ["a", "b", "d"]
    assert "forgetting" not in m.format_table() and "pretrained" in m.format_table()
    for task, scores in (("a", {"a": 80.0}), ("b", {"a": 85.0, "b": 70.0}), ("c", {"c": 90.0, "a": 50.0, "b": 75.0})):
        m.add_row(task, scores)
        m = ResultMatrix.from_dict(json.loads(json.dumps(m.to_dict(), allow_nan=False)))  # as each version stores it
    trained = matrix()
    assert m.tasks == trained.tasks and np.array_equal(m.values, trained.values, equal_nan=True)
    assert (m.average_accuracy(), m.forgetting(), m.bwt()) == (trained.average_accuracy(), trained.forgetting(), trained.bwt())
    assert m.to_dict()["baseline"] == {"label": BASELINE, "scores": {"a": 95.0, "b": 20.0, "d": 10.0}}
    assert "baseline" not in trained.to_dict()

    labels, shown = m.shown()
    assert labels == [BASELINE, "a", "b", "c"] and m.columns == ["a", "b", "c", "d"]
    np.testing.assert_array_equal(shown[0], [95.0, 20.0, np.nan, 10.0])
    np.testing.assert_array_equal(shown[1:, :3], trained.values)
    assert np.isnan(shown[1:, 3]).all()
    table = m.format_table().splitlines()
    assert table[1].split() == [BASELINE, "95.00", "20.00", "10.00"] and table[2].split()[0] == "a"
    for draw in (m.heatmap, m.curves):
        with Image.open(draw(tmp_path / f"{draw.__name__}.png")) as im:
            assert im.size[0] > 200
    with Image.open(ResultMatrix(baseline={"a": 1.0}).heatmap(tmp_path / "row0.png")) as im:  # row 0 alone
        assert im.size[1] > 100


def test_heatmap_writes_png(tmp_path):
    path = matrix().heatmap(tmp_path / "plots" / "r.png", title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000
    with Image.open(path) as im:
        assert im.size[0] > 200 and im.size[1] > 200


def test_format_table_contains_numbers():
    text = matrix().format_table()
    cells = ["80.00", "85.00", "70.00", "50.00", "75.00", "90.00"]
    for s in cells + ["77.50", "71.67", "35.00", "-5.00", "15.00", "-12.50"]:  # AA, forgetting, BWT
        assert s in text, s
    lines = text.splitlines()
    assert len({len(line) for line in lines[:4]}) == 1  # header + 3 rows are fixed-width
    assert "BWT" in text and "forgetting" in text


# ---------------------------------------------------------------- embedding a stream's galleries


class _CountingBundle:
    """A stand-in model: each image or caption's vector is a function of it alone; counts the model calls."""

    def __init__(self):
        self.calls = {"image": [], "text": []}

    def embed_images(self, images, batch_size):
        return self._embed("image", [str(x) for x in images], batch_size)

    def embed_texts(self, texts, batch_size):
        return self._embed("text", list(texts), batch_size)

    def _embed(self, tower, items, batch_size):
        out = []
        for s in range(0, len(items), batch_size):
            chunk = items[s : s + batch_size]
            self.calls[tower].append(len(chunk))
            out += [unit_rows(1, 8, seed=sum(map(ord, x)))[0] for x in chunk]
        return np.array(out, np.float32).reshape(-1, 8)


def test_embed_tasks_embeds_every_row_once_in_shared_batches_as_embed_task_would(stream):
    from clipstream.training.data.task import Task

    tasks = [Task.load(p) for p in stream]
    sizes = [len(t.check("test").rows) for t in tasks]  # 24 + 24
    bundle = _CountingBundle()
    together = embed_tasks(bundle, tasks, batch_size=20)
    # 48 rows in batches of 20 across the task boundary: 3 calls per tower, each row once
    assert bundle.calls == {"image": [20, 20, 8], "text": [20, 20, 8]}
    alone = [embed_task(_CountingBundle(), t, batch_size=20) for t in tasks]  # 24 = 20 + 4 each: 4 calls per tower
    assert [e.task for e in together] == [t.name for t in tasks] and [len(e.img) for e in together] == sizes
    for a, b in zip(together, alone):
        np.testing.assert_array_equal(a.img, b.img)
        np.testing.assert_array_equal(a.txt, b.txt)
        np.testing.assert_array_equal(a.positive, b.positive)
    assert embed_tasks(bundle, [], batch_size=20) == []


def test_embed_tasks_gives_a_real_model_the_vectors_embed_task_does(stream):
    import torch

    from clipstream import models
    from clipstream.training.data.task import Task

    torch.manual_seed(0)
    bundle = models.create("clipstream-vit-tiny")
    tasks = [Task.load(p) for p in stream]
    together = embed_tasks(bundle, tasks, batch_size=7)  # batches that straddle the two tasks
    for a, t in zip(together, tasks):
        b = embed_task(bundle, t)
        np.testing.assert_allclose(a.img, b.img, atol=1e-6)
        np.testing.assert_allclose(a.txt, b.txt, atol=1e-6)
        assert retrieval_metrics(a.img, a.txt, a.positive) == retrieval_metrics(b.img, b.txt, b.positive)


def test_a_real_language_streams_copies_of_an_image_share_its_content_key(tmp_path):
    """Three language tasks of the synthesiser (each with its own copy of the image files) through a real model:
    the rows of an image share one key across the tasks, and text->image task-unknown R@1 is what the task's own
    gallery (the deduplicated union: one copy of each image) gives, no longer 0."""
    import torch

    from clipstream import models
    from clipstream.training.data.synth import synthesize_languages
    from clipstream.training.data.task import Task

    dirs = synthesize_languages(tmp_path / "langs", 3, seed=0, train_pairs=40, test_per_task=16, progress=False)
    torch.manual_seed(0)
    embedded = embed_tasks(models.create("clipstream-vit-tiny"), [Task.load(d) for d in dirs])
    assert embedded[0].keys == embedded[1].keys == embedded[2].keys and len(set(embedded[0].keys)) == 16
    assert embedded[0].captions != embedded[1].captions
    scores = evaluate_seen(embedded)
    for e in embedded:
        dedup = 100 * recall_at_k(e.txt @ e.img.T, e.positive.T, (1,))[1]
        assert scores["unknown"][e.task]["t2i_R@1"] == pytest.approx(dedup) and dedup > 0


def test_gallery_cache_holds_the_last_versions_vectors_by_run_and_task_entry():
    entries = [{"task": "a", "path": "/d/a", "data_sha": "1"}, {"task": "b", "path": "/d/b", "data_sha": "2"}]
    embedded = [Embedded(e["task"], unit_rows(3, 4, i), unit_rows(3, 4, i + 9), np.eye(3, dtype=bool))
                for i, e in enumerate(entries)]
    cache = GalleryCache(keep=1)
    cache.put("run-1", entries, embedded, 256)
    got = cache.get("run-1", entries[:1], 256)
    assert len(got) == 1 and got[0][0] is embedded[0].img and got[0][1] is embedded[0].txt
    assert cache.get("run-1", [{**entries[0], "data_sha": "changed"}], 256) is None  # other data: not these vectors
    assert cache.get("run-1", entries, 64) is None  # other batches
    assert cache.get("run-2", entries, 256) is None
    cache.put("run-2", entries[1:], embedded[1:], 256)  # keep=1: run-1's are dropped
    assert cache.get("run-1", entries[:1], 256) is None and cache.get("run-2", entries[1:], 256) is not None
    assert cache.get("run-2", entries, 256) is None  # not all held
    with pytest.raises(ValueError):
        cache.put("run-3", entries, embedded[:1], 256)
    with pytest.raises(ValueError):
        GalleryCache(keep=0)


def test_each_version_embeds_each_gallery_once_and_the_next_job_reuses_its_parents(settings, stream, tmp_path,
                                                                                  monkeypatch):
    """Two jobs' evaluations in one process: the second embeds the two seen galleries with its own model and takes
    its parent's vectors of the first task from the parent's evaluation instead of embedding them again; the
    spatial disorder it logs is the one a fresh embedding by the parent gives. Its no-reindex row ranks its queries
    against those vectors of the parent's, which another process reads from the parent's run."""
    import tempfile

    import torch

    from clipstream import models
    from clipstream.registry import Registry
    from clipstream.training import diagnostics, evaluate
    from clipstream.training.data.task import Task
    from clipstream.training.engine import METHOD_STATE_FILE
    from clipstream.training.job import evaluate_version, prepare, register
    from clipstream.training.methods.state import save_state

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the jobs' scratch dirs
    embedded = []  # (which model, images embedded) per call
    original = models.ClipBundle.embed_images

    def counting(self, images, batch_size=256):
        images = list(images)
        embedded.append((id(self.model), len(images)))
        return original(self, images, batch_size)

    monkeypatch.setattr(models.ClipBundle, "embed_images", counting)
    registry = Registry(settings)
    versions, runs = [], []
    for seed, task_dir in enumerate(stream):
        plan = prepare(registry, task_dir, "finetune", versions[-1] if versions else None, workers=1,
                       overrides=["train.micro_batch=8"])
        with registry.run(plan.run_name, plan.tags) as run_id:
            torch.manual_seed(seed)
            trained = plan.workdir / "checkpoint"
            models.export(models.create(plan.config["model"]["arch"]), trained)
            save_state(plan.method.state_dict(), trained / METHOD_STATE_FILE)
            embedded.clear()
            result = evaluate_version(registry, plan, trained, settings.home / "plots" / run_id, registry.log(run_id))
            versions.append(register(registry, plan, trained, result, run_id))
            runs.append(run_id)
        gallery = sum(len(Task.load(p).check("test").rows) for p in stream[: seed + 1])
        # one model, one pass over the seen tasks' test images: nothing embedded twice, the parent embeds nothing
        assert len({model for model, _ in embedded}) == 1 and sum(n for _, n in embedded) == gallery
        metrics = registry.run_metrics(run_id)
        assert metrics["eval/gallery_pairs"] == metrics["eval/embedded_pairs"] == gallery
        assert metrics["eval/seconds"] > 0
    # the reused vectors are the parent's own: the spatial disorder is the one a fresh embedding gives
    parent, child = (models.load_exported(registry.resolve(v).folder) for v in versions)
    old, new = (embed_task(b, Task.load(stream[0])) for b in (parent, child))
    expected = diagnostics.spatial_disorder(old.img, old.txt, new.img, new.txt)
    logged = registry.run_metrics(runs[1])
    assert {k: logged[k] for k in expected} == pytest.approx(expected, abs=1e-6, nan_ok=True)

    # no-reindex: version 2's queries against task 0's gallery as version 1 embedded it (its own task's vectors,
    # logged with its run), and task 1's as version 2 does; the task-known diagonal is reindex's
    new1 = embed_task(child, Task.load(stream[1]))
    expected = evaluate_seen([new, new1], [old, new1])
    matrices = {name: ResultMatrix.from_dict(m) for name, m in registry.resolve(versions[1]).manifest["matrix"].items()}
    assert set(matrices) == {"known", "unknown", "noreindex_known", "noreindex_unknown"}
    for mode in ("known", "unknown"):
        assert matrices[f"noreindex_{mode}"].values[1].tolist() == pytest.approx(
            [expected[mode][t.name]["Rm"] for t in map(Task.load, stream)], abs=1e-6)
        assert matrices[f"noreindex_{mode}"].values[0, 0] == matrices[mode].values[0, 0]  # row 1: the same gallery
    assert np.diag(matrices["noreindex_known"].values).tolist() == np.diag(matrices["known"].values).tolist()
    assert logged["noreindex_known/AA"] == pytest.approx(matrices["noreindex_known"].average_accuracy())
    assert {"matrix_noreindex_unknown.json", "gallery_vectors.npz"} <= {
        a.path for a in registry.client.list_artifacts(runs[1])}

    # another process's job (nothing cached) reads version 1's vectors from its run; without them (a version
    # registered before they were kept) version 1's model embeds them again
    from urllib.parse import urlparse

    from clipstream.training import job

    monkeypatch.setattr(evaluate, "GALLERIES", evaluate.GalleryCache())
    galleries, again = job.noreindex_galleries(registry, plan, [new, new1], 256, models.placement())
    assert again == 0 and [g.task for g in galleries] == [new.task, new1.task] and galleries[1] is new1
    np.testing.assert_allclose(galleries[0].img, old.img, atol=1e-6)
    (Path(urlparse(registry.client.get_run(runs[0]).info.artifact_uri).path) / job.GALLERY_VECTORS).unlink()
    galleries, again = job.noreindex_galleries(registry, plan, [new, new1], 256, models.placement())
    assert again == len(old.txt)
    np.testing.assert_allclose(galleries[0].txt, old.txt, atol=1e-6)


def test_curves_draw_each_tasks_rm_from_the_task_that_brought_it(tmp_path):
    path = matrix().curves(tmp_path / "plots" / "recall.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


# ---------------------------------------------------------------- zero-shot classification


def test_classification_accuracy_hand_computed_top1_top5_and_pessimistic_ties():
    classes = np.eye(7, dtype=np.float32)  # 7 classes: top-5 is reported too
    img = np.zeros((4, 7), np.float32)
    img[0, [2, 4]] = [1.0, 0.5]  # class 2 first, 4 second
    img[1, [2, 4]] = [1.0, 0.5]
    img[2] = np.array([7, 6, 5, 4, 3, 2, 1], np.float32)  # class 6 is last of seven
    img[3, [1, 3]] = [0.8, 0.8]  # a tie between its class and another
    acc = classification_accuracy(img, classes, [2, 4, 6, 3])
    # image 0 right; image 1's class second (top-5 hit); image 2's seventh (a miss); image 3's tie counts against it
    assert acc == {"top1": 25.0, "top5": 75.0}
    assert classification_accuracy(img[:, :5], classes[:5, :5], [2, 4, 4, 3]) == {"top1": 25.0}  # 5 classes: no top-5
    assert classification_accuracy(img, classes, [2, 2, 0, 1]) == {"top1": 75.0, "top5": 100.0}  # (3: the tie)
    for labels in ([2, 4, 6], [2, 4, 6, 7], [2, 4, 6, -1]):
        with pytest.raises(ValueError):
            classification_accuracy(img, classes, labels)


def test_class_vectors_average_each_class_prompts_and_renormalise():
    import torch

    from clipstream import models

    torch.manual_seed(0)
    bundle = models.create("clipstream-vit-tiny")
    classes, templates = ["kite", "drum", "robot"], ["a photo of a {}.", "a {} on a table"]
    vectors = class_vectors(bundle, classes, templates, batch_size=4)  # batches across the classes' prompts
    assert vectors.shape == (3, bundle.embed_texts(["x"]).shape[1])
    for row, name in zip(vectors, classes):  # class-major: row c is c's prompts, and no other class's
        mean = bundle.embed_texts([t.replace("{}", name) for t in templates]).mean(axis=0)
        np.testing.assert_allclose(row, mean / np.linalg.norm(mean), atol=1e-5)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert len(TEMPLATES) > 1 and all(t.count("{}") == 1 for t in TEMPLATES)
    with pytest.raises(ValueError):
        class_vectors(bundle, [], templates)
