"""ER's buffer (training/methods/er.py): as a fraction of the pairs seen, every pair kept with that probability and
the buffer's size after n pairs; the `er` preset's fixed size, CTP's scaled to the tasks here; the schema's one-size
rule. (The fixed-size reservoir: test_methods.py.)"""

import math

import numpy as np
import pytest
import torch

from clipstream.training.data.task import Task
from clipstream.training.methods import resolve
from clipstream.training.methods.base import TaskContext
from clipstream.training.methods.er import ER, fraction_sample


def test_a_fraction_buffer_keeps_every_pair_seen_with_that_probability_and_its_share_of_them():
    fraction, sizes, runs = 0.05, (37, 120, 53), 4000  # tasks whose share is no whole number of pairs
    n = sum(sizes)
    counts, lengths = np.zeros(n), np.zeros((runs, len(sizes)))
    for seed in range(runs):
        kept, offset = [], 0
        for t, m in enumerate(sizes):
            chosen = fraction_sample(m, fraction, np.random.default_rng([seed, t]))
            assert len(set(chosen)) == len(chosen) and all(0 <= c < m for c in chosen)
            kept += [offset + int(c) for c in chosen]
            offset += m
            lengths[seed, t] = len(kept)
        counts[kept] += 1
    # each pair, of any task, kept in runs · f of the runs: a chi-square over the pairs within 5 sd of its mean
    expected = runs * fraction
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < (n - 1) + 5 * math.sqrt(2 * (n - 1)), chi2
    for task in np.split(counts, np.cumsum(sizes)[:-1]):  # no task favoured
        assert abs(task.mean() / runs - fraction) < 0.1 * fraction
    # after each task: the share f·n of the pairs seen so far, within one pair per task (the rounding), f·n on average
    seen = np.cumsum(sizes)
    floor = np.cumsum([math.floor(fraction * m) for m in sizes])
    assert (lengths >= floor).all() and (lengths <= floor + np.arange(1, len(sizes) + 1)).all()
    assert lengths.mean(0) == pytest.approx(fraction * seen, rel=0.02)
    assert len(fraction_sample(40, 0.25, np.random.default_rng(0))) == 10
    assert fraction_sample(3, 1.0, np.random.default_rng(0)).tolist() == [0, 1, 2]


def test_er_with_a_fraction_grows_its_buffer_with_the_stream_and_keeps_what_it_kept(stream):
    er = ER({"buffer_fraction": 0.1, "buffer_pairs": None, "seed": 0})
    rows, before = 0, []
    for i, folder in enumerate(stream):
        er.after_task(TaskContext(model=None, task_index=i, rank=0, world_size=1, device=torch.device("cpu"),
                                  current={"task": folder.name, "path": str(folder)}), [])
        m = len(Task.load(folder).check("train").rows)
        rows += m
        assert er.seen == rows and er.pairs[:len(before)] == before  # nothing kept is dropped
        assert len(er.pairs) - len(before) in (math.floor(0.1 * m), math.ceil(0.1 * m))
        assert {p["task"] for p in er.pairs[len(before):]} == {folder.name}
        before = list(er.pairs)


def test_the_er_preset_is_ctps_buffer_scaled_to_these_tasks_and_exactly_one_size_is_given():
    # CTP: 10,000 pairs (§5) against P9D's 1,014,599 pairs in 9 tasks; here the bench stream's 4 tasks
    ctp_share = 10_000 / (1_014_599 / 9)
    assert resolve("er")["method"]["er"] == {"buffer_pairs": round(ctp_share * (886 + 951 + 163 + 151) / 4),
                                             "buffer_fraction": None, "seed": 0}
    assert resolve("er")["method"]["er"]["buffer_pairs"] > 5 * 0.01 * 951  # not the ~9 pairs a task of 1% of them
    assert resolve("er-vit-b-16")["method"]["er"] == {"buffer_fraction": None, "buffer_pairs": 10000, "seed": 0}
    assert resolve("er", ["method.er.buffer_fraction=0.01", "method.er.buffer_pairs=null"])["method"]["er"][
        "buffer_fraction"] == 0.01
    for sets in (["method.er.buffer_fraction=0.01"], ["method.er.buffer_pairs=null"]):
        with pytest.raises(ValueError, match="give exactly one of buffer_pairs and buffer_fraction, the other null "
                           r"\(e.g. --set method.er.buffer_pairs=null with") as err:
            resolve("er", sets)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"buffer_fraction=1.5: expected a number in \(0, 1\] or null"):
        resolve("er", ["method.er.buffer_fraction=1.5", "method.er.buffer_pairs=null"])


def test_the_er_preset_holds_its_pairs_from_the_first_task_on_as_ctps_buffer_does(stream):
    er = ER(resolve("er")["method"]["er"])
    size = er.params["buffer_pairs"]
    for i, folder in enumerate(stream):
        er.after_task(TaskContext(model=None, task_index=i, rank=0, world_size=1, device=torch.device("cpu"),
                                  current={"task": folder.name, "path": str(folder)}), [])
        assert len(er.pairs) == min(size, er.seen) == size  # full after the first task (256 pairs here)
    assert {p["task"] for p in er.pairs} == {folder.name for folder in stream}
