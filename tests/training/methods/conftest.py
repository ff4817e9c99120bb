"""Fixtures the method tests share."""

import pytest
import torch


@pytest.fixture(scope="module")
def pair():
    """Two different real tiny CLIPs (student, teacher) and a batch of 6 pairs for them."""
    from clipstream import models
    from clipstream.training.engine import prepare_for_deepspeed
    from clipstream.training.methods.base import frozen

    torch.manual_seed(0)
    student = prepare_for_deepspeed(models.create("clipstream-vit-tiny").model)
    torch.manual_seed(1)
    teacher = frozen(prepare_for_deepspeed(models.create("clipstream-vit-tiny").model))
    bundle = models.create("clipstream-vit-tiny")
    batch = {"image": torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
             "text": bundle.tokenizer([f"a {c} square on a plain background" for c in
                                       ("red", "blue", "green", "white", "black", "pink")])}
    return student, teacher, batch
