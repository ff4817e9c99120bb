"""One typed place for every URI, path and port clipstream uses.

Values come, highest priority first, from: keyword arguments, `CLIPSTREAM_*` environment variables,
a YAML file (`CLIPSTREAM_CONFIG` or `./clipstream.yaml`), then the embedded defaults under
`./.clipstream/` (SQLite MLflow, Qdrant Edge, local Ray).
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

# how promotion puts a version's gallery in place (clipstream.index implements them): defined here, where a setting
# names one, so that reading settings does not import the vector index
Policy = Literal["no-reindex", "reindex"]
NO_REINDEX: Policy = "no-reindex"
REINDEX: Policy = "reindex"
POLICIES: tuple[Policy, ...] = (NO_REINDEX, REINDEX)
Precision = Literal["auto", "fp32", "bf16", "fp16"]  # (clipstream.models.placement reads it)
# Settings.serve_app: a Ray Serve application name that is also a route prefix as it stands (/NAME), and a safe part
# of the names Serve gives its actors (SERVE_REPLICA::APP#DEPLOYMENT#ID)
APP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")


# What MLflow reads from the environment, set by `configure_process`
MLFLOW_ENV = {
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # one bar per tiny file is noise
    # a server that does not answer is reported in seconds, not after MLflow's 7 retries (minutes)
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}


def configure_process() -> None:
    """The process's MLflow set-up (MLFLOW_ENV; values already set win), done once by each entry point: the CLI's
    `main`, a Serve replica, a benchmark run as a script. Nothing else in clipstream changes the process: a
    `Registry` reaches MLflow through its own client, so a library user's MLflow state is theirs. Before Ray starts,
    so that the workers of a local Ray inherit it."""
    for key, value in MLFLOW_ENV.items():
        os.environ.setdefault(key, value)


def _config_file() -> Optional[Path]:
    path = os.environ.get("CLIPSTREAM_CONFIG")
    if path:
        if not Path(path).is_file():
            raise FileNotFoundError(f"CLIPSTREAM_CONFIG={path}: no such file")
        return Path(path)
    default = Path("clipstream.yaml")
    return default if default.is_file() else None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CLIPSTREAM_", extra="forbid", hide_input_in_errors=True)  # (keys)

    home: Path = Field(Path(".clipstream"), description="root of every embedded default")
    data_dir: Optional[Path] = Field(None, description="task data and synthetic benchmarks; default HOME/data")
    mlflow_tracking_uri: Optional[str] = Field(None, description="default sqlite:///HOME/mlflow.db")
    mlflow_artifact_root: Optional[str] = Field(None, description="default HOME/mlartifacts")
    stream: str = Field("clipstream", description="MLflow experiment and registered-model name")
    qdrant_path: Optional[Path] = Field(None, description="embedded Qdrant Edge directory; default HOME/qdrant")
    qdrant_url: Optional[str] = Field(None, description="Qdrant server URL (or local:PATH for qdrant-client's local mode); when set, used instead of the embedded engine")
    qdrant_api_key: Optional[SecretStr] = Field(None, description="the Qdrant server's API key (prefer qdrant_api_key_file)")
    qdrant_api_key_file: Optional[Path] = Field(None, description="a file holding the Qdrant API key (a mounted Secret)")
    ray_address: Optional[str] = Field(None, description="None starts a local Ray; 'auto' or ray://host:port joins a cluster")
    grpc_port: int = Field(9000, ge=1, le=65535)
    server: Optional[str] = Field(None, description="the server clients and the CLI's service commands call: "
                                  "grpc://HOST:PORT, grpcs://HOST:PORT (TLS) or HOST:PORT; default 127.0.0.1 and "
                                  "grpc_port")
    grpc_host: str = Field("127.0.0.1", description="the interface `clipstream serve` listens on: loopback by default; "
                           "0.0.0.0 or :: for all, which needs an API key (or grpc_allow_unauthenticated)")
    grpc_allow_unauthenticated: bool = Field(False, description="listen on a non-loopback grpc_host without an API key "
                                             "(only on a network where every client is trusted)")
    tls_cert_file: Optional[Path] = Field(None, description="PEM certificate chain: with tls_key_file, the gRPC port "
                                          "speaks TLS only")
    tls_key_file: Optional[Path] = Field(None, description="PEM private key of tls_cert_file")
    tls_ca_file: Optional[Path] = Field(None, description="client side (--tls): PEM roots that signed the server's "
                                        "certificate (default: the system's)")
    runs_dir: Optional[str] = Field(None, description="Ray Train storage (checkpoints, the inputs a job shares with "
                                    "its workers): a folder every node mounts, or a URI Ray Train's pyarrow opens "
                                    "(s3://bucket/runs, gs://, file://); default HOME/runs")
    image_roots: list[str] = Field(default_factory=list, description="folders and URI prefixes (s3://bucket/imgs) "
                                   "outside a task that its rows may name images in by absolute path or URI: none by "
                                   "default (a task's paths stay inside it); a JSON list in CLIPSTREAM_IMAGE_ROOTS")
    npm_registry: str = Field("https://registry.npmjs.org", description="the npm registry `clipstream data fetch` "
                              "downloads the open image sets from (a mirror where the public one cannot be reached)")
    presets: Optional[Path] = Field(None, description="a YAML file of your own method presets, added to the "
                                    "shipped ones (same format; inherit_from may name shipped presets)")
    promote_max_forgetting: float = Field(25.0, description="a candidate's task-known mean forgetting (R points) may not exceed this")
    promote_max_aa_drop: float = Field(0.0, description="a candidate's task-known AA may be at most this far below production's")
    index_policy: Policy = Field(NO_REINDEX, description="how promotion puts the gallery in place")
    index_ray_min_rows: int = Field(1024, ge=0, description="a gallery with fewer pairs is embedded in the indexing "
                                    "process, not as a Ray Data job (whose start-up costs more than embedding it)")
    index_gpus: float = Field(0, ge=0, description="GPUs each embedding actor of the indexing job asks Ray for (0: "
                              "CPU tasks); with GPUs, one actor per index_gpus of the cluster's GPUs, its model on the GPU")
    embed_precision: Precision = Field("auto", description="the dtype a model embeds in when serving, indexing and "
                                       "evaluating: auto is bf16 on a GPU that has it (else fp16) and fp32 on the CPU; "
                                       "vectors are unit float32 either way")
    index_fields: dict[str, Literal["keyword", "integer", "float"]] = Field(
        default_factory=dict, description="the fields catalogue items (AddItems) may carry in their metadata, each "
        "with a payload index, and the ones searches may filter on: name -> keyword, integer or float; a JSON "
        "object in CLIPSTREAM_INDEX_FIELDS, e.g. {\"brand\": \"keyword\", \"price\": \"float\"}")
    catalogue_dir: Optional[str] = Field(None, description="where catalogues keep the items users add (AddItems), "
                                         "which a reindex embeds again: a folder, or an object-store URI "
                                         "(s3://bucket/catalogues) every pod that serves or promotes reaches; default "
                                         "HOME/catalogues")
    index_compact_segments: int = Field(4, ge=0, description="when no-reindex appends leave more segments per "
                                        "modality than this, the indexing job merges them into one (a task-unknown "
                                        "search reads each: `clipstream compact`); 0: never")
    serve_app: str = Field("clipstream", description="the Ray Serve application `clipstream serve` deploys, "
                           "and the one clients name (gRPC metadata `application`) when several share the proxy; "
                           "its route prefix is /NAME")
    serve_replicas: int = Field(1, ge=1, description="Encoder replicas")
    serve_encoder_cpus: float = Field(0.5, ge=0, description="CPUs each Encoder replica reserves (0 shares the cores)")
    serve_encoder_gpus: float = Field(0, ge=0, description="GPUs each Encoder replica asks Ray for (0: the CPU); a "
                                      "replica given one loads its models onto it (the Search deployment holds none)")
    serve_search_cpus: float = Field(0.25, ge=0, description="CPUs the Search deployment reserves")
    serve_batch_size: int = Field(32, ge=1, description="most requests one @serve.batch call gathers")
    serve_model_cache: int = Field(3, ge=1, description="model versions each Encoder replica keeps loaded")
    serve_max_items: int = Field(256, ge=1, description="texts or images in one request")
    serve_max_text_chars: int = Field(2000, ge=1)
    serve_max_image_bytes: int = Field(8 * 1024 * 1024, ge=1)
    api_key: Optional[SecretStr] = Field(None, description="when set, every clipstream RPC must carry metadata "
                                         "x-api-key (health and reflection stay open for probes); prefer api_key_file")
    api_key_file: Optional[Path] = Field(None, description="a file holding the API key (a mounted Kubernetes Secret): "
                                         "unlike a variable it is not inherited by every child process")
    _secrets: dict = PrivateAttr(default_factory=dict)  # key name -> value read from its file

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = [init_settings, env_settings]
        path = _config_file()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)

    @field_validator("runs_dir", "catalogue_dir", mode="before")
    @classmethod
    def _path_or_uri(cls, value):
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("npm_registry")
    @classmethod
    def _registry_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r}: give the registry's http:// or https:// URL, e.g. https://registry.npmjs.org")
        return value.rstrip("/")

    @field_validator("serve_app")
    @classmethod
    def _app_name(cls, value: str) -> str:
        if not APP_NAME.fullmatch(value):
            raise ValueError(f"{value!r}: name the application with letters, digits, '-' and '_' (up to 63, starting "
                             "with a letter or digit); it is also its route prefix, /NAME")
        return value

    @model_validator(mode="after")
    def _resolve_defaults(self) -> "Settings":
        home = self.home.absolute()
        self.home = home
        self.data_dir = (self.data_dir or home / "data").absolute()
        self.qdrant_path = (self.qdrant_path or home / "qdrant").absolute()
        # a URI stays as written (Path() would make s3://b/runs the local folder s3:/b/runs)
        runs = self.runs_dir or str(home / "runs")
        self.runs_dir = runs if is_uri(runs) else str(Path(runs).absolute())
        catalogues = self.catalogue_dir or str(home / "catalogues")
        self.catalogue_dir = catalogues if is_uri(catalogues) else str(Path(catalogues).absolute())
        if self.mlflow_tracking_uri is None:
            self.mlflow_tracking_uri = f"sqlite:///{home / 'mlflow.db'}"
        if self.mlflow_artifact_root is None:
            self.mlflow_artifact_root = str(home / "mlartifacts")
        for name in ("api_key", "qdrant_api_key"):
            self._secrets[name] = _read_secret(name, getattr(self, name), getattr(self, f"{name}_file"))
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both for TLS, or neither")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name}={path}: no such file")
        return self

    def secret(self, name: str) -> Optional[str]:
        """The value of `api_key` or `qdrant_api_key`, from the setting or its `_file`; never in a repr or a log."""
        return self._secrets.get(name)

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def embedded_registry(self) -> bool:
        return self.mlflow_tracking_uri.startswith("sqlite:")

    @property
    def runs_path(self):
        """runs_dir as a path: a `Path`, or for a URI a `UPath` (fsspec) with the same operations."""
        if is_uri(self.runs_dir):
            from upath import UPath

            return UPath(self.runs_dir)
        return Path(self.runs_dir)

    def existing_store(self) -> "Settings":
        """These settings, for a command that reads what earlier commands stored (versions, runs, promotions): an
        embedded store that does not exist is an error naming where it was looked for, not a new empty one made in
        passing (each directory has its own ./.clipstream unless CLIPSTREAM_HOME or a clipstream.yaml says)."""
        registry = Path(self.mlflow_tracking_uri.removeprefix("sqlite:///"))
        if self.embedded_registry and not registry.parent.exists():
            raise ValueError(f"no clipstream store at {registry.parent}: run the command where you trained, or name "
                             "the store with CLIPSTREAM_HOME or in a clipstream.yaml (`clipstream config` shows each "
                             "setting and where it came from)")
        return self

    def ensure_dirs(self) -> "Settings":
        for path in (self.home, self.data_dir, *([] if is_uri(self.runs_dir) else [Path(self.runs_dir)])):
            path.mkdir(parents=True, exist_ok=True)  # (an object store has no folders to make)
        return self

    def env(self) -> dict[str, str]:
        """The environment that makes a child process (a Ray worker, a job) see these same settings."""
        out = {}
        for name, value in self.model_dump().items():
            if value is not None:
                out[f"CLIPSTREAM_{name.upper()}"] = (value.get_secret_value() if isinstance(value, SecretStr) else
                                                     json.dumps(value) if isinstance(value, list) else str(value))
        return out


# The distribution that installs the package (pyproject.toml; the client alone is "clipstream-client")
DISTRIBUTION = "clipstream-continual"

# CLIPSTREAM_* variables that are not settings: the settings file, and the fault-injection hook the tests use
OTHER_VARIABLES = ("CLIPSTREAM_CONFIG", "CLIPSTREAM_FAIL_ONCE")


def unknown_variables(environ: Optional[dict] = None) -> list[tuple[str, Optional[str]]]:
    """(variable, the closest setting's variable or None) for each CLIPSTREAM_* variable no setting reads: a typo
    there is otherwise silently ignored."""
    environ = os.environ if environ is None else environ
    known = {f"CLIPSTREAM_{name.upper()}" for name in Settings.model_fields} | set(OTHER_VARIABLES)

    def closest(var: str) -> Optional[str]:  # on the part after the prefix, which every candidate shares
        names = {v.removeprefix("CLIPSTREAM_"): v for v in known}
        found = difflib.get_close_matches(var.removeprefix("CLIPSTREAM_"), sorted(names), n=1, cutoff=0.6)
        return names[found[0]] if found else None
    return [(var, closest(var)) for var in sorted(environ) if var.startswith("CLIPSTREAM_") and var not in known]


def effective(settings: Settings) -> list[dict]:
    """Every setting's value (secrets masked) and where it came from: `CLIPSTREAM_X`, the settings file, or the
    default (some derived from `home`)."""
    path = _config_file()
    in_file = (yaml.safe_load(path.read_text()) or {}) if path else {}
    rows = []
    for name in Settings.model_fields:
        var = f"CLIPSTREAM_{name.upper()}"
        source = var if var in os.environ else f"{path}" if name in in_file else "default"
        value = getattr(settings, name)
        shown = ("(set)" if value is not None else None) if isinstance(value, SecretStr) else \
            str(value) if isinstance(value, Path) else value
        rows.append({"setting": name, "value": shown, "source": source})
    return rows


def is_uri(text: str) -> bool:
    """`scheme://...` (s3://, gs://, file://), as opposed to a local path."""
    return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(text)))


def _read_secret(name: str, value: Optional[SecretStr], file: Optional[Path]) -> Optional[str]:
    if value is not None and file is not None:
        raise ValueError(f"both {name} and {name}_file are set: keep one")
    if file is None:
        return value.get_secret_value() if value is not None else None
    if not file.is_file():
        raise ValueError(f"{name}_file={file}: no such file")
    secret = file.read_text(encoding="utf-8").strip()  # (a Secret written with `echo` ends in a newline)
    if not secret:
        raise ValueError(f"{name}_file={file} is empty")
    return secret
