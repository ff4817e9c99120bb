"""The DeepSpeed JSON config built from a preset, and open_clip's weight-decay split."""

import pytest

from clipstream import models
from clipstream.training.engine import (
    check_precision,
    deepspeed_config,
    param_groups,
    prepare_for_deepspeed,
    warmup_steps,
)
from clipstream.training.methods import resolve


def test_deepspeed_config_follows_the_preset():
    train = resolve("finetune", ["train.micro_batch=8", "train.grad_accum=3", "train.zero_stage=2",
                                 "train.precision=bf16", "train.lr=2e-4", "train.warmup_steps=5"])["train"]
    cfg = deepspeed_config(train, world_size=2, total_steps=100)
    assert cfg["train_batch_size"] == 8 * 3 * 2
    assert cfg["train_micro_batch_size_per_gpu"] == 8 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["optimizer"]["params"]["lr"] == 2e-4
    sched = cfg["scheduler"]
    assert sched["type"] == "WarmupCosineLR"
    assert sched["params"]["total_num_steps"] == 100 and sched["params"]["warmup_num_steps"] == 5
    assert sched["params"]["cos_min_ratio"] == train["min_lr_ratio"]


def test_warmup_never_exceeds_the_task_and_bad_precision_is_refused():
    train = resolve("finetune", ["train.warmup_steps=50"])["train"]
    assert deepspeed_config(train, 1, total_steps=10)["scheduler"]["params"]["warmup_num_steps"] == 9
    no_warmup = {**train, "warmup_steps": 0}  # DeepSpeed refuses 0 warmup steps; one step is the least it takes
    assert deepspeed_config(no_warmup, 1, total_steps=1)["scheduler"]["params"]["warmup_num_steps"] == 1
    with pytest.raises(ValueError, match="precision must be"):
        deepspeed_config({**train, "precision": "fp8"}, 1, 10)


def test_warmup_is_the_larger_of_its_steps_and_its_fraction_of_the_task():
    train = resolve("finetune", ["train.warmup_steps=10", "train.warmup_ratio=0.2"])["train"]
    assert warmup_steps(train, 1000) == 200  # the fraction, where it is more
    assert warmup_steps(train, 20) == 10  # the steps, where they are more
    assert deepspeed_config(train, 1, total_steps=1000)["scheduler"]["params"]["warmup_num_steps"] == 200
    assert warmup_steps({**train, "warmup_steps": 0, "warmup_ratio": 0.0}, 50) == 1  # DeepSpeed's least
    with pytest.raises(ValueError, match="warmup_ratio"):
        resolve("finetune", ["train.warmup_ratio=1.0"])


def test_param_groups_exclude_gains_biases_embeddings_and_logit_scale_from_decay():
    model = prepare_for_deepspeed(models.create("clipstream-vit-tiny").model)
    no_decay, decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "logit_scale" in {names[id(p)] for p in no_decay["params"]}
    assert "token_embedding.weight" in {names[id(p)] for p in no_decay["params"]}
    assert all(p.ndim >= 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_prepare_for_deepspeed_reshapes_logit_scale_and_keeps_training_maths():
    bundle = models.create("clipstream-vit-tiny")
    before = float(bundle.model.logit_scale.exp())
    model = prepare_for_deepspeed(bundle.model)
    assert model.logit_scale.shape == (1,) and model.logit_scale.requires_grad
    assert float(model.logit_scale.exp()) == pytest.approx(before)
    assert "logit_scale" in dict(model.named_parameters())  # still trained


def test_a_precision_the_workers_device_cannot_train_in_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^train.precision=fp16: DeepSpeed cannot train in it on CPU workers"):
        check_precision("fp16", 0)
    check_precision("bf16", 0)  # DeepSpeed's CPU accelerator has bf16 (test_zero trains in it)
    check_precision("fp32", 0)


def test_param_groups_keep_every_tensor_aligned_in_deepspeeds_flat_buffers():
    """DeepSpeed lays each group out back to back in one flat buffer: with the odd-sized ones (the logit scale) last,
    every other tensor starts 128-byte aligned, which cuBLAS's fast GEMM kernels need of a Linear's weight and bias."""
    model = prepare_for_deepspeed(models.create("ViT-B-32").model)
    for group in param_groups(model, 0.1):
        offsets, offset = [], 0
        for p in group["params"]:
            offsets.append((offset, p.numel()))
            offset += p.numel()
        odd = [i for i, (_, n) in enumerate(offsets) if n % 64]
        assert odd == list(range(len(offsets) - len(odd), len(offsets)))  # the odd sizes, if any, at the end
        assert all(start % 64 == 0 for start, n in offsets if n % 64 == 0)
    no_decay = param_groups(model, 0.1)[0]["params"]
    assert no_decay[-1] is model.logit_scale  # (it came first among the no-decay tensors before)


def test_bf16_below_zero_2_takes_deepspeeds_bf16_optimizer_with_fp32_gradient_accumulation():
    for stage, expected in ((0, 1), (1, 1), (2, 2), (3, 3)):
        train = resolve("finetune", ["train.precision=bf16", f"train.zero_stage={stage}"])["train"]
        cfg = deepspeed_config(train, 1, 10)
        assert cfg["zero_optimization"]["stage"] == expected
        assert cfg.get("data_types") == ({"grad_accum_dtype": "fp32"} if stage <= 1 else None)
    fp32 = resolve("finetune", ["train.zero_stage=0"])["train"]
    assert deepspeed_config(fp32, 1, 10)["zero_optimization"] == {"stage": 0} and "data_types" not in deepspeed_config(fp32, 1, 10)
