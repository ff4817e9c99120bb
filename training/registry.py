"""MLflow tracking and model registry: one experiment and one registered model per stream.

Each task job is one run (params, live loss curves, evaluation, matrix row, heatmap) that registers
one model version. The version's artifact is the open_clip export plus what the next task needs
(method state, lineage of tasks seen, the R matrix so far), so a job on a fresh machine continues the
stream from `models:/STREAM@ALIAS` or a version number alone.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import mlflow
import mlflow.pyfunc
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from clipstream.settings import Settings
from training import models

CANDIDATE = "candidate"
MANIFEST = "clipstream.json"  # lineage, matrix and config inside each version's checkpoint folder
VERSION_TAGS = ("task", "task_index", "method", "parent_version", "data_sha")


class RegistryError(LookupError):
    """A model reference that does not resolve, with the reason."""


class ClipEmbedder(mlflow.pyfunc.PythonModel):
    """The registered artifact as an MLflow pyfunc: captions in, L2-normalised text embeddings out."""

    def load_context(self, context):
        from training import models

        self.bundle = models.load_exported(context.artifacts["checkpoint"])
        self.bundle.model.eval()

    def predict(self, context, model_input: list[str], params=None) -> list[list[float]]:
        import torch

        with torch.no_grad():
            return self.bundle.model.encode_text(self.bundle.tokenizer(list(model_input)), normalize=True).tolist()


@dataclass
class Version:
    """A registered model version, with its checkpoint folder downloaded locally."""

    version: str
    tags: dict[str, str]
    run_id: str
    aliases: list[str]
    folder: Optional[Path] = None
    manifest: dict = field(default_factory=dict)

    @property
    def lineage(self) -> list[dict]:
        return self.manifest.get("lineage", [])


class Registry:
    def __init__(self, settings: Settings):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per tiny file is noise
        self.settings = settings
        self.name = settings.stream
        if settings.embedded_registry:
            Path(settings.mlflow_tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        mlflow.set_tracking_uri(settings.mlflow_tracking_uri)
        self.client = MlflowClient(settings.mlflow_tracking_uri)

    def experiment_id(self, name: Optional[str] = None) -> str:
        """The experiment `name` (default: the stream's), created on first use with artifacts beside the others."""
        name = name or self.name
        found = self.client.get_experiment_by_name(name)
        if found:
            return found.experiment_id
        location = Path(self.settings.mlflow_artifact_root) / name if self.settings.embedded_registry else None
        return self.client.create_experiment(name, artifact_location=location.absolute().as_uri() if location else None)

    @contextmanager
    def run(self, run_name: str, tags: dict[str, str]) -> Iterator[str]:
        with mlflow.start_run(experiment_id=self.experiment_id(), run_name=run_name, tags=tags) as active:
            yield active.info.run_id

    def register(self, checkpoint: Path, tags: dict[str, str], alias: str = CANDIDATE) -> str:
        """Log `checkpoint` as the active run's model, register it as the next version, tag it, alias it.
        The lineage's task names also go in a tag, so serving can check its gallery without a download."""
        lineage = json.loads((Path(checkpoint) / MANIFEST).read_text()).get("lineage", [])
        tags = {**tags, "lineage_tasks": ",".join(e["task"] for e in lineage)}
        info = mlflow.pyfunc.log_model(name="model", python_model=str(Path(__file__).with_name("mlflow_model.py")),
                                       artifacts={"checkpoint": str(checkpoint)}, pip_requirements=["clipstream"])
        version = mlflow.register_model(info.model_uri, self.name, tags={k: str(v) for k, v in tags.items()}).version
        self.client.set_registered_model_alias(self.name, alias, version)
        return str(version)

    def resolve(self, ref: str | int, download: bool = True) -> Version:
        """`models:/NAME@ALIAS`, `models:/NAME/3`, `@alias`, `3` or `alias` → the version, downloaded."""
        text = str(ref).strip()
        match = re.fullmatch(r"models:/([^/@]+)(?:@(.+)|/(\d+))", text)
        name, alias, number = (match.groups() if match else (self.name, None, None))
        if not match:
            if text.isdigit():
                number = text
            else:
                alias = text.removeprefix("@")
        if name != self.name:
            raise RegistryError(f"{text}: this stream's registered model is {self.name!r}, not {name!r}")
        try:
            mv = self.client.get_model_version_by_alias(name, alias) if alias else self.client.get_model_version(name, number)
        except MlflowException as exc:
            raise RegistryError(f"{text}: no such model version in {name!r} ({exc.error_code})") from exc
        version = Version(str(mv.version), dict(mv.tags), mv.run_id, list(mv.aliases))
        if download:
            version.folder = models.download_registered(name, str(mv.version), mv.run_id, self.settings.home / "cache",
                                                        self.settings.mlflow_tracking_uri)
            version.manifest = json.loads((version.folder / MANIFEST).read_text())
        return version

    def versions(self) -> list[Version]:
        try:
            aliases = self.client.get_registered_model(self.name).aliases  # {alias: version}
            found = self.client.search_model_versions(f"name = '{self.name}'")
        except MlflowException:
            return []
        return sorted((Version(str(v.version), dict(v.tags), v.run_id,
                               [a for a, n in aliases.items() if str(n) == str(v.version)]) for v in found),
                      key=lambda v: int(v.version))

    def run_metrics(self, run_id: str) -> dict[str, float]:
        return dict(self.client.get_run(run_id).data.metrics)
