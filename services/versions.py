"""Registered model versions as the serving side sees them: an alias or number resolved in MLflow,
the version's open_clip folder downloaded once and loaded with `training.models` (the one door into training)."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from training import models

PRODUCTION = "production"


class UnknownVersion(LookupError):
    """A version number or alias that the registry does not know."""


class VersionStore:
    """Resolves references to version numbers (aliases re-read at most every `ttl_s`, so an alias move
    is seen within that time) and loads versions into memory."""

    def __init__(self, tracking_uri: str, name: str, cache_dir: str | Path, ttl_s: float = 2.0):
        self.client, self.name = MlflowClient(tracking_uri), name
        self.tracking_uri, self.cache_dir, self.ttl_s = tracking_uri, Path(cache_dir), ttl_s
        self._aliases: dict[str, tuple[float, str]] = {}
        self._numbers: set[str] = set()  # versions seen to exist: a number never changes meaning, so ask once

    def resolve(self, ref: str = "") -> str:
        """'' = production; digits = that version (checked); anything else = an alias."""
        ref = (ref or PRODUCTION).strip()
        try:
            if ref.isdigit():
                ref = str(int(ref))
                if ref not in self._numbers:
                    self._numbers.add(str(self.client.get_model_version(self.name, ref).version))
                return ref
            seen = self._aliases.get(ref)
            if seen and time.monotonic() - seen[0] < self.ttl_s:
                return seen[1]
            version = str(self.client.get_model_version_by_alias(self.name, ref).version)
        except MlflowException as exc:
            raise UnknownVersion(f"model version {ref!r} not found in registered model {self.name!r}") from exc
        self._aliases[ref] = (time.monotonic(), version)
        return version

    def versions(self) -> list[tuple[object, list[str]]]:
        """Every registered version, newest first: (MLflow ModelVersion, its aliases)."""
        try:  # search results leave `aliases` empty: the registered model holds them
            aliases = self.client.get_registered_model(self.name).aliases
        except MlflowException:
            return []
        found = self.client.search_model_versions(f"name = '{self.name}'")
        return [(mv, sorted(a for a, n in aliases.items() if str(n) == str(mv.version)))
                for mv in sorted(found, key=lambda mv: int(mv.version), reverse=True)]

    def load(self, version: str) -> models.ClipBundle:
        mv = self.client.get_model_version(self.name, version)
        bundle = models.load_exported(models.download_registered(self.name, version, mv.run_id, self.cache_dir,
                                                                 self.tracking_uri))
        bundle.model.eval()
        return bundle
