"""open_clip models by name: built-in or our small JSON architectures, pretrained tags, local checkpoints.

Architectures are data (`model_configs/*.json`, registered with open_clip at import). A model version
is exported in open_clip's own folder layout (`open_clip_config.json` + `open_clip_model.safetensors`),
so stock open_clip loads it with `create_model_and_transforms("local-dir:DIR")`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import open_clip
import torch
from open_clip.push_to_hf_hub import save_config_for_hf
from safetensors.torch import save_file

CONFIG_DIR = Path(__file__).parent / "model_configs"
open_clip.add_model_config(CONFIG_DIR)

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class ClipBundle:
    """A model with everything needed to feed it: the two transforms and the tokenizer."""

    model: torch.nn.Module
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable
    arch: str
    model_cfg: dict[str, Any]

    @property
    def image_size(self) -> int:
        size = self.model.visual.image_size
        return size[0] if isinstance(size, (tuple, list)) else int(size)

    @property
    def embed_dim(self) -> int:
        return int(self.model_cfg["embed_dim"])


def list_architectures() -> list[str]:
    return open_clip.list_models()


def create(arch: str, pretrained: Optional[str] = None) -> ClipBundle:
    """`arch` is an open_clip architecture name; `pretrained` a pretrained tag, a checkpoint file, or
    an exported model folder (then `arch` may be None-like and the folder's own config wins)."""
    if pretrained and Path(pretrained).is_dir():
        return load_exported(pretrained)
    if arch not in open_clip.list_models():
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(open_clip.list_models())}")
    if pretrained and not Path(pretrained).is_file() and pretrained not in open_clip.list_pretrained_tags_by_model(arch):
        raise ValueError(f"{pretrained!r} is neither a checkpoint file nor a pretrained tag of {arch}")
    model, pre_train, pre_val = open_clip.create_model_and_transforms(arch, pretrained=pretrained)
    return ClipBundle(model, pre_train, pre_val, open_clip.get_tokenizer(arch), arch, open_clip.get_model_config(arch))


def load_exported(folder: str | Path) -> ClipBundle:
    folder = Path(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not an exported model: {CONFIG_FILE} missing")
    meta = json.loads(config_path.read_text())
    model, pre_train, pre_val = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    return ClipBundle(model, pre_train, pre_val, tokenizer, meta.get("arch", folder.name), meta["model_cfg"])


def export(bundle: ClipBundle, folder: str | Path) -> Path:
    """Write an open_clip-loadable folder: weights, architecture config (+ preprocessing), tokenizer description."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in bundle.model.state_dict().items()}
    state["logit_scale"] = state["logit_scale"].reshape(())  # stock open_clip keeps a 0-dim scalar
    save_file(state, folder / WEIGHTS_FILE)
    save_config_for_hf(bundle.model, folder / CONFIG_FILE, model_config=bundle.model_cfg)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    meta["arch"] = bundle.arch
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    tok = bundle.tokenizer
    description = {"class": type(tok).__name__, "context_length": getattr(tok, "context_length", None)}
    if hasattr(tok, "save_pretrained"):  # HF tokenizers carry their own files
        tok.save_pretrained(folder)
    (folder / TOKENIZER_FILE).write_text(json.dumps(description, indent=2))
    return folder


def download_registered(name: str, version: str, run_id: str, cache: Path, tracking_uri: Optional[str] = None) -> Path:
    """The checkpoint folder of MLflow model version `models:/NAME/VERSION`, downloaded once into `cache`
    (versions are immutable; the run id keys the cache so a recreated registry never reads stale files)."""
    import shutil
    import tempfile

    import mlflow
    from mlflow import MlflowClient

    folder = Path(cache) / name / f"v{version}-{run_id}"
    if not (folder / CONFIG_FILE).is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="download-", dir=folder.parent))
        source = MlflowClient(tracking_uri, registry_uri=tracking_uri).get_model_version_download_uri(name, version)
        local = mlflow.artifacts.download_artifacts(f"{source.rstrip('/')}/artifacts/checkpoint", dst_path=str(staging),
                                                    tracking_uri=tracking_uri)
        shutil.rmtree(folder, ignore_errors=True)
        Path(local).rename(folder)
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def prepare_for_deepspeed(model: torch.nn.Module) -> torch.nn.Module:
    """DeepSpeed broadcasts parameters as bytes and cannot view a 0-dim tensor that way, so the
    0-dim `logit_scale` becomes shape [1] while training (open_clip's maths broadcasts either way)."""
    for name in ("logit_scale", "logit_bias"):
        param = getattr(model, name, None)
        if isinstance(param, torch.nn.Parameter) and param.dim() == 0:
            setattr(model, name, torch.nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))
    return model
