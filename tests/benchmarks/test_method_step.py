"""`clipstream bench method-step`: every method's step on its own engine in its second task's state, the
targets it is held to, and the profile of where a step's time goes."""

import json

import pytest

from clipstream.benchmarks import method_step as bench


@pytest.mark.slow  # a real run of the benchmark (every method's step, a profile): the full tier
def test_a_small_run_times_each_method_profiles_it_and_checks_the_targets(tmp_path):
    out = tmp_path / "method-step.md"
    # (--extra-arch: a second model measured after the first in the same run, as its own section)
    text = bench.main(["--methods", "finetune,ewc,teir", "--profile", "ewc", "--steps", "1", "--rounds", "1",
                       "--batch", "8", "--extra-arch", "clipstream-vit-small", "--extra-methods", "finetune,lwf",
                       "--extra-batch", "4", "--extra-steps", "2", "--out", str(out)])
    assert text == out.read_text()
    first, extra = text.split("## clipstream-vit-small, micro batch 4, 2 cycles")
    for name in ("plain PyTorch", "finetune", "ewc", "teir"):  # teir: CLL-CLIP's grown vocabulary and pinned teacher
        assert f"\n| {name} | " in first
    assert "`clipstream-vit-small` (" in extra and "| lwf | " in extra and "| ewc | " not in extra.split("## Targets")[0]
    assert "clipstream's finetune step (DeepSpeed engine, method lifecycle, the profiler's phase marks) is " in text
    checks = {c["check"]: c for c in json.loads(out.with_suffix(".json").read_text())["checks"]}
    assert set(checks) == {"ewc step ×finetune", "teir step ×finetune"}
    assert checks["ewc step ×finetune"]["target"] == "≤ 1.10" and checks["teir step ×finetune"]["target"] == "≤ 1.05"
    profile = text.split("## Where a step's time goes")[1].split("## Targets")[0]
    assert "| phase | finetune | ewc |" in profile and "| step: backward |" in profile
    # finetune adds no terms (only the profiler's own mark, ~0.1 ms on a busy machine); EWC its closed-form pull
    terms = next(line for line in profile.splitlines() if line.startswith("| step: method terms |"))
    assert float(terms.split("|")[2]) < 1.0


def test_the_profile_table_puts_phases_in_step_order_and_marks_what_a_method_does_not_run():
    lines = bench.phases({"finetune": {"step: forward": 10.0, "step: backward": 20.0},
                          "ctp": {"step: forward": 10.0, "momentum forward": 9.5, "step: backward": 21.0}}, 5)
    assert lines[2:7] == ["| phase | finetune | ctp |", "|---|---|---|", "| step: forward | 10.0 | 10.0 |",
                          "|   momentum forward | – | 9.5 |", "| step: backward | 20.0 | 21.0 |"]


def test_methods_take_turns_each_cycle_starting_one_later_and_ratios_pair_steps_of_one_cycle(monkeypatch):
    order = []  # (cycle, method) as `timed` is asked for one step of it
    monkeypatch.setattr(bench, "timed", lambda name, *rest, first=0: order.append((first, name)) or 1.0)
    times = bench.interleaved({n: (n,) for n in ("a", "b", "c")}, 4)
    assert order == [(c, n) for c, names in enumerate(["abc", "bca", "cab", "abc"]) for n in names]
    assert times == {n: [1.0] * 4 for n in "abc"}
    # the machine slows down 2x halfway through: each cycle's pair still says 1.1x
    assert bench.paired_ratio([110, 110, 220, 220], [100, 100, 200, 200]) == 1.1


def test_the_plain_step_trains_the_model_with_open_clips_loss_and_adamw():
    import torch

    from clipstream import models

    torch.manual_seed(1)
    bundle = models.create("clipstream-vit-tiny")
    batch = {"image": torch.randn(4, 3, 32, 32), "text": bundle.tokenizer(["a red cup", "a blue car", "a dog", "a tree"])}
    before = [p.detach().clone() for p in bundle.model.parameters()]
    assert bench.timed(bench.plain_step(bundle.model), [batch], 2) > 0
    assert bundle.model.training
    assert all(not torch.equal(a, p) for a, p in zip(before, bundle.model.parameters()))  # every parameter trained
