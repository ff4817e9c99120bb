"""The interface every continual-learning method implements: hooks into one task's train loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TaskContext:
    """What a hook may look at: the live model (unwrapped), where it runs, and the stream so far."""

    model: torch.nn.Module
    task_index: int
    rank: int
    world_size: int
    device: torch.device
    params: dict = field(default_factory=dict)
    step: int = 0


@dataclass
class Features:
    """One forward pass of the live model on a local batch (L2-normalised features)."""

    image: torch.Tensor
    text: torch.Tensor
    logit_scale: torch.Tensor


class Method:
    """Sequential fine-tuning is the base behaviour; a method overrides only the hooks it needs.

    Lifecycle per task job: `load_state_dict` (state saved with the parent version) → `training_tasks`
    (on the driver) → `before_task` → for each step: `loss_terms` → `after_step` → `after_task` →
    `state_dict` (persisted with the new version)."""

    name = "finetune"
    trains_towers = ("image", "text")  # a tower left out is recorded unchanged, so indexing can reuse its vectors

    def __init__(self, params: dict):
        self.params = params

    def training_tasks(self, current: dict, history: list[dict]) -> list[dict]:
        """Which tasks' training data this job reads: lineage entries `{task, path, ...}`."""
        return [current]

    def before_task(self, ctx: TaskContext) -> None:
        pass

    def loss_terms(self, ctx: TaskContext, batch: dict[str, torch.Tensor], feats: Features) -> dict[str, torch.Tensor]:
        """Extra weighted terms added to the CLIP loss; names are logged as `loss/<name>`."""
        return {}

    def after_step(self, ctx: TaskContext) -> None:
        pass

    def after_task(self, ctx: TaskContext) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
