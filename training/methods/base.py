"""The interface every continual-learning method implements (hooks into one task's train loop), the
stack that composes methods (`ctp_er` = CTP's losses on batches that mix in ER's replay), and the
pieces several methods share: the features of one forward pass and the frozen previous model."""

from __future__ import annotations

import contextlib
import math
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.profiler import record_function


@dataclass
class Features:
    """One forward pass on a local batch: L2-normalised features, the pre-normalisation ones (MAS, LwF)
    and exp(logit_scale)."""

    image: torch.Tensor
    text: torch.Tensor
    image_raw: torch.Tensor
    text_raw: torch.Tensor
    logit_scale: torch.Tensor


def forward_features(model: torch.nn.Module, image: torch.Tensor, text: torch.Tensor) -> Features:
    """open_clip's forward without its built-in normalisation, so the raw features stay visible; features in fp32
    whatever the model's dtype (the losses, queues and importances are fp32).

    It runs as one call of the model itself (its `forward` swapped for the towers' for the duration), because ZeRO-3
    gathers a module's parameters in hooks around its calls: the CLIP's own positional embedding, text projection
    and logit scale are read outside any submodule, so only a call of the model gathers them, for the forward and,
    through the tensors of the tuple it returns, again for the backward. Under ZeRO 0-2 it is the same maths."""
    with towers(model):
        image_raw, text_raw, scale = model(image.to(next(model.parameters()).dtype), text)
    image_raw, text_raw = image_raw.float(), text_raw.float()
    return Features(F.normalize(image_raw, dim=-1), F.normalize(text_raw, dim=-1), image_raw, text_raw, scale.float())


@contextlib.contextmanager
def towers(model: torch.nn.Module):
    """`model`'s forward swapped for the towers' for the duration: (raw image features, raw text features,
    exp(logit_scale))."""
    model.forward = types.MethodType(_towers, model)
    try:
        yield model
    finally:
        del model.forward


def _towers(model: torch.nn.Module, image: torch.Tensor, text: torch.Tensor) -> tuple:
    # exp(logit_scale) kept in [1, 100] (open_clip: ln s in [0, ln 100]) here rather than by clamping the
    # parameter after each step as open_clip does: under ZeRO 1-3 the fp32 master copy would undo that
    return model.encode_image(image), model.encode_text(text), model.logit_scale.exp().clamp(1, 100)


@contextlib.contextmanager
def gathered(params, write: bool = False):
    """`params` whole for the duration where ZeRO-3 partitions them (a collective: every rank enters), as they are
    otherwise. `write`: what rank 0 leaves in them is partitioned back to every rank."""
    params = list(params)
    if not any(hasattr(p, "ds_id") for p in params):  # nothing partitioned, nothing to gather
        yield params
        return
    # imported here: DeepSpeed logs its accelerator choice on import, which would reach every command that only
    # reads presets (the CLI's parser, `--help`)
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if write else None):
        yield params


@dataclass
class TaskContext:
    """What a hook may look at: the live model (unwrapped), the frozen model of the previous task
    (`teacher`, None on the first task), where it runs, and the task being trained."""

    model: torch.nn.Module
    task_index: int
    rank: int
    world_size: int
    device: torch.device
    teacher: Optional[torch.nn.Module] = None
    current: dict = field(default_factory=dict)
    step: int = 0
    lr: float = 0.0  # the scheduler's learning rate at this step
    _teacher_cache: tuple = (None, None)

    def teacher_features(self, batch: dict) -> Features:
        """The teacher's features of this step's batch, computed once however many methods ask."""
        if self._teacher_cache[0] is not batch:
            with torch.no_grad(), record_function("teacher forward"):
                self._teacher_cache = (batch, forward_features(self.teacher, batch["image"], batch["text"]))
        return self._teacher_cache[1]


class Method:
    """Sequential fine-tuning is the base behaviour; a method overrides only the hooks it needs.

    Lifecycle per task job: `load_state_dict` (state saved with the parent version; on the driver too)
    → `extra_tasks` and `prepare_version` (driver) → `prepare_model` (before the engine is built) → `before_task`
    → for each step:
    `loss_terms` → `after_step` → `after_task` (with the task's last `task_end_batches` batches; then `task_metrics`
    logged) → `state_dict` (saved with the version); `export_model` gives the plain open_clip model each export holds.
    """

    name = "finetune"
    needs_teacher = False  # the engine then builds ctx.teacher: the parent version, frozen
    task_end_batches = 0   # how many of the last epoch's batches `after_task` receives
    trains_towers = ("image", "text")  # a tower left out is recorded unchanged, so indexing can reuse its vectors
    clip_weight = 1.0      # the engine's CLIP loss is scaled by it
    needs_trained_start = False  # True: refuses to start from random weights (teaches a trained CLIP something new)
    teacher_text = False   # batches then carry `text_en`: the English caption (else the caption) in the teacher's tokens
    starts_from_stream_start = False  # True: every job trains from the stream's start model, not the parent's weights

    def __init__(self, params: dict):
        self.params = params

    def extra_tasks(self, current: dict, history: list[dict], workdir: str) -> list[dict]:
        """Training data besides the current task's: lineage-style entries `{task, path, ...}`."""
        return []

    def prepare_version(self, source: Optional[str], parent: Optional[str], config: dict, current: dict,
                        history: list[dict], workdir: Path) -> Optional[Path]:
        """A model folder to train instead of `source` (the parent's folder or the preset's model; `parent` its
        version), written under `workdir` (CLL-CLIP: vocabulary and table grown); None trains `source` as is.
        Runs on the driver before the job; the state it leaves is what the workers load."""
        return None

    def teacher(self) -> Optional[dict]:
        """The teacher pinned for the whole stream, `{"version": V}` or `{"source": pretrained}`; None: the parent."""
        return None

    def lr_scale(self, name: str) -> float:
        """The multiple of the preset's learning rate that parameter `name` trains at."""
        return 1.0

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model the engine trains (adapters added, parameters frozen); also on a resumed worker, whose
        checkpoint then fills what this added."""
        return model

    def export_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain open_clip model that a checkpoint's export (and so the version) holds; must not change `model`."""
        return model

    def before_task(self, ctx: TaskContext) -> None:
        pass

    def loss_terms(self, ctx: TaskContext, batch: dict[str, torch.Tensor], feats: Features) -> dict[str, torch.Tensor]:
        """Extra weighted terms added to the CLIP loss; names are logged as `loss/<name>`."""
        return {}

    def after_step(self, ctx: TaskContext) -> None:
        pass

    def after_task(self, ctx: TaskContext, batches: list[dict]) -> None:
        pass

    def task_metrics(self) -> dict[str, float]:
        """What `after_task` measured about itself, logged as `method/<name>` (EWC's importance seconds)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Distillation(Method):
    """A method whose one term, `distill`, compares the live features with the frozen previous model's on
    the same batch; nothing to distil from on the first task."""

    needs_teacher = True

    def loss_terms(self, ctx, batch, feats):
        if ctx.teacher is None:
            return {}
        return {"distill": self.distill(feats, ctx.teacher_features(batch))}

    def distill(self, feats: Features, teacher: Features) -> torch.Tensor:
        raise NotImplementedError


class Stack(Method):
    """Methods applied together, each with its own parameters and state; an empty stack is fine-tuning."""

    def __init__(self, name: str, components: list[Method]):
        super().__init__({c.name: c.params for c in components})
        self.name, self.components = name, components
        self.needs_teacher = any(c.needs_teacher for c in components)
        self.teacher_text = any(c.teacher_text for c in components)
        self.needs_trained_start = any(c.needs_trained_start for c in components)
        self.starts_from_stream_start = any(c.starts_from_stream_start for c in components)
        self.task_end_batches = max([c.task_end_batches for c in components], default=0)
        self.clip_weight = float(math.prod(c.clip_weight for c in components))
        if components:  # an empty stack is fine-tuning: both towers
            self.trains_towers = tuple(t for t in ("image", "text") if any(t in c.trains_towers for c in components))

    def extra_tasks(self, current, history, workdir):
        entries = {}
        for c in self.components:
            entries.update({e["task"]: e for e in c.extra_tasks(current, history, workdir)})
        return list(entries.values())

    def prepare_version(self, source, parent, config, current, history, workdir):
        grown = None
        for c in self.components:
            grown = c.prepare_version(str(grown) if grown else source, parent, config, current, history, workdir) or grown
        return grown

    def teacher(self):
        return next((t for t in (c.teacher() for c in self.components) if t), None)

    def lr_scale(self, name):
        return float(math.prod(c.lr_scale(name) for c in self.components))

    def prepare_model(self, model):
        for c in self.components:
            model = c.prepare_model(model)
        return model

    def export_model(self, model):
        for c in reversed(self.components):
            model = c.export_model(model)
        return model

    def before_task(self, ctx):
        for c in self.components:
            c.before_task(ctx)

    def loss_terms(self, ctx, batch, feats):
        terms = {}
        for c in self.components:
            terms.update({(k if k not in terms else f"{c.name}_{k}"): v for k, v in c.loss_terms(ctx, batch, feats).items()})
        return terms

    def after_step(self, ctx):
        for c in self.components:
            c.after_step(ctx)

    def after_task(self, ctx, batches):
        for c in self.components:
            c.after_task(ctx, batches[-c.task_end_batches:] if c.task_end_batches else [])

    def task_metrics(self):
        metrics = {}
        for c in self.components:
            metrics.update({(k if k not in metrics else f"{c.name}_{k}"): v for k, v in c.task_metrics().items()})
        return metrics

    def state_dict(self):
        return {c.name: c.state_dict() for c in self.components}

    def load_state_dict(self, state):
        for c in self.components:  # a parent trained with another method has no state for this one
            if c.name in state:
                c.load_state_dict(state[c.name])


def frozen(module: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients: a teacher or momentum copy that an optimizer must never touch."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
