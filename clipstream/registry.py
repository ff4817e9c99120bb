"""The registry: one MLflow experiment and one registered model per stream, read and written by both
sides (training registers versions; serving resolves and loads them; promotion moves aliases).

Each task job is one run (params, live loss curves, evaluation, matrix row, heatmap) that registers
one model version. The version's artifact is the open_clip export plus what the next task needs
(method state, lineage of tasks seen, the R matrix so far), so a job on a fresh machine continues the
stream from `models:/STREAM@ALIAS` or a version number alone. MLflow keeps no alias history, so every
promotion is also a run, in the experiment `STREAM-promotions`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import mlflow
import mlflow.pyfunc
import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from clipstream import models
from clipstream.settings import Settings

logger = logging.getLogger(__name__)
PRODUCTION = "production"  # the alias serving follows
NOT_FOUND = ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST")  # MLflow's answers for a missing alias, number
MAX_RECHECK_S = 60.0  # the longest wait between alias checks while the registry does not answer
CHECKSUMS = "artifact_sha256"  # version tag: {file: sha256} of the checkpoint folder, taken at registration
CANDIDATE = "candidate"  # the alias every newly registered version gets
MANIFEST = "clipstream.json"  # lineage, matrix and config inside each version's checkpoint folder
ARTIFACT = "checkpoint"  # the pyfunc artifact that holds the open_clip folder
MODEL = "model"  # the run's artifact folder that holds the pyfunc model
PROMOTION_TAGS = ("from_version", "to_version", "reason", "user", "time", "forced", "gates", "state")
PENDING, DONE, ABORTED = "pending", "done", "aborted"  # a promotion record's state (see Registry.record_promotion)


DEFAULT_LANGUAGE = "en"  # of a task whose task.yaml names no `lang` (the synthetic domains, most caption sets)


def _languages(lineage: list[dict]) -> list[str]:
    return list(dict.fromkeys(e.get("lang") or DEFAULT_LANGUAGE for e in lineage))


class RegistryError(LookupError):
    """A model reference that does not resolve, with the reason."""


class NoSuchVersion(RegistryError):
    """The reference is well formed but names no version (yet: `resolve(wait_s=...)` waits for it)."""


class RegistryUnavailable(RegistryError):
    """The registry did not answer (MLflow down or unreachable, its database locked)."""


class LockHeld(RuntimeError):
    """Another process holds the registry lock; the message names who, since when, and how to clear a stale one."""


@dataclass
class Version:
    """A registered model version; `folder` and `manifest` once its checkpoint folder is downloaded."""

    version: str
    tags: dict[str, str]
    run_id: str
    aliases: list[str]
    created_ms: int = 0
    folder: Optional[Path] = None
    manifest: dict = field(default_factory=dict)

    @property
    def lineage(self) -> list[dict]:
        return self.manifest.get("lineage", [])

    @property
    def gallery(self) -> list[dict]:
        """The tasks whose galleries this version serves (lineage-style entries, in order): its lineage; a version 0
        (`clipstream register --from`), trained on none, serves the tasks it was evaluated on (`--evaluate`)."""
        return self.lineage or self.manifest.get("evaluated", [])

    @property
    def image_tower(self) -> str:
        """The version whose image tower this one has unchanged (itself unless a method froze that tower):
        image vectors made by any version with the same `image_tower` are this version's too."""
        return self.tags.get("image_tower") or self.version

    @property
    def languages(self) -> list[str]:
        """The caption languages this version was trained on (a task's `lang`; English where a task names none),
        from the tag: no download needed."""
        names = self.tags.get("languages")
        if names is None:  # (registered before the tag existed)
            return _languages(self.lineage)
        return names.split(",") if names else []

    @property
    def tasks(self) -> list[str]:
        """The tasks this version was trained through, in order (from the tag: no download needed)."""
        names = self.tags.get("lineage_tasks")
        return names.split(",") if names else [e["task"] for e in self.lineage]


@dataclass(frozen=True)
class RunLog:
    """Logging into one MLflow run, by its id through an explicit client (never MLflow's global active run)."""

    client: MlflowClient
    run_id: str

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_params(self, params: dict[str, object]) -> None:
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log_dict(self, value: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, value, artifact_file)

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(folder), artifact_path)

    def set_tag(self, key: str, value: object) -> None:
        self.client.set_tag(self.run_id, key, str(value))

    def metric_history(self, key: str) -> list:
        return self.client.get_metric_history(self.run_id, key)

    def metrics(self) -> dict[str, float]:
        return dict(self.client.get_run(self.run_id).data.metrics)


@dataclass
class _Alias:
    """What an alias named when last checked, when to check it again, and whether a check is under way."""

    version: str
    due: float
    checking: bool = False


class Registry:
    """Versions, aliases, tags, lineage and promotion history of the stream `settings.stream`.

    `alias_ttl_s` > 0 caches alias lookups in `number()` (serving asks on every request): an alias seen once is
    answered from the cache while a background thread checks it again every `alias_ttl_s` (an alias move is seen
    within about that time). While the registry does not answer, the cache keeps answering with the version last
    seen (stale, `stale_since` says since when), a warning is logged once per outage and the checks back off up
    to MAX_RECHECK_S. Version numbers never change meaning, so a number found once is never asked again."""

    def __init__(self, settings: Settings, alias_ttl_s: float = 0.0):
        # (no process-global MLflow state is set here: everything goes through `self.client`; the process's own
        # MLflow set-up is `configure_process`, called by the entry points)
        self.settings = settings
        self.name = settings.stream
        self.tracking_uri = settings.mlflow_tracking_uri
        if settings.embedded_registry:
            Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.tracking_uri, registry_uri=self.tracking_uri)
        self.alias_ttl_s = alias_ttl_s
        self._aliases: dict[str, _Alias] = {}
        self._numbers: set[str] = set()
        self._checker: Optional[ThreadPoolExecutor] = None  # made on the first check: one at a time, off the caller
        self.stale_since: Optional[float] = None  # (time.time()) when the registry stopped answering; None: it answers
        self._failed_checks = 0

    # ---- runs --------------------------------------------------------------------------------------------
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
        """A new run in the stream's experiment, open while the block runs; yields its id (log into it through
        `log(run_id)`). It ends FINISHED, or FAILED when the block raises. MLflow's global active run is not used:
        a process's own MLflow runs are left alone."""
        from mlflow.tracking.context import registry as context

        run_id = self.client.create_run(self.experiment_id(), run_name=run_name,
                                        tags=context.resolve_tags(tags)).info.run_id  # (+ source, user: as start_run)
        status = "FAILED"
        try:
            yield run_id
            status = "FINISHED"
        finally:
            self.client.set_terminated(run_id, status)

    def log(self, run_id: str) -> RunLog:
        """What a job logs into its run `run_id`, through this registry's client."""
        return RunLog(self.client, run_id)

    def run_metrics(self, run_id: str) -> dict[str, float]:
        return dict(self.client.get_run(run_id).data.metrics)

    # ---- versions ----------------------------------------------------------------------------------------
    def register(self, checkpoint: Path, tags: dict[str, str], alias: str = CANDIDATE, *, run_id: str) -> str:
        """Log `checkpoint` as the model of run `run_id`, register it as the next version, tag it, alias it.
        The lineage's task names also go in a tag, so serving can check its gallery without a download.

        Client calls only: the pyfunc is saved to a local folder (`mlflow.pyfunc.save_model` touches no tracking
        state), logged as the run's artifact `model`, and registered from there. (`mlflow.pyfunc.log_model` and
        `mlflow.register_model` would need the global tracking URI and active run.)"""
        manifest = json.loads((Path(checkpoint) / MANIFEST).read_text())
        lineage = manifest.get("lineage", [])
        tags = {**tags, CHECKSUMS: json.dumps(checksums(Path(checkpoint)), separators=(",", ":")),
                "lineage_tasks": ",".join(e["task"] for e in lineage),
                # (a version 0 trained on no task names the languages of the model it was made from)
                "languages": ",".join(_languages(lineage) if lineage else manifest.get("languages", [])),
                "tokenizer": (manifest.get("tokenizer") or {}).get("sha", ""),
                "image_tower": manifest.get("image_tower") or ""}
        with tempfile.TemporaryDirectory() as staging:
            model = Path(staging) / MODEL
            config = json.loads((Path(checkpoint) / models.CONFIG_FILE).read_text())
            mlflow.pyfunc.save_model(str(model), python_model=str(Path(__file__).with_name("mlflow_model.py")),
                                     artifacts={ARTIFACT: str(checkpoint)},
                                     code_paths=[_own_code(Path(staging) / "code")],
                                     pip_requirements=pyfunc_requirements(),
                                     signature=pyfunc_signature(int(config["model_cfg"]["embed_dim"])),
                                     input_example=pyfunc_input_example())
            self.client.log_artifacts(run_id, str(model), MODEL)
        try:
            self.client.create_registered_model(self.name)
        except MlflowException as exc:
            if exc.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
        source = f"{self.client.get_run(run_id).info.artifact_uri.rstrip('/')}/{MODEL}"
        version = self.client.create_model_version(self.name, source, run_id,
                                                   tags={k: str(v) for k, v in tags.items()}).version
        self.set_alias(alias, str(version))
        return str(version)

    def resolve(self, ref: str | int, download: bool = True, wait_s: float = 0.0, poll_s: float = 5.0) -> Version:
        """`models:/NAME@ALIAS`, `models:/NAME/3`, `@alias`, `3` or `alias` → the version, downloaded.
        With `wait_s`, a reference that does not exist yet is polled for that long (a stream's RayJobs are
        applied at once; each waits for the alias its parent's job sets) before the error is raised."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._resolve(ref, download)
            except (NoSuchVersion, RegistryUnavailable) as exc:
                if time.monotonic() + poll_s > deadline:
                    if wait_s:
                        raise RegistryError(f"{exc} after waiting {wait_s:.0f} s: did the job that registers it "
                                            "fail? (kubectl get rayjobs)") from exc
                    raise
            time.sleep(poll_s)

    def _resolve(self, ref: str | int, download: bool) -> Version:
        text = str(ref).strip()
        match = re.fullmatch(r"models:/([^/@]+)(?:@(.+)|/(\d+))", text)
        name, alias, number = (match.groups() if match else (self.name, None, None))
        if not match:
            if text.isdigit():
                number = str(int(text))
            else:
                alias = text.removeprefix("@")
        if name != self.name:
            raise RegistryError(f"{text}: this stream's registered model is {self.name!r}, not {name!r}")
        if not (alias or number):
            raise RegistryError("empty model reference: give a version number or an alias such as 'production'")
        try:
            mv = self.client.get_model_version_by_alias(name, alias) if alias else self.client.get_model_version(name, number)
        except MlflowException as exc:
            if exc.error_code in NOT_FOUND:
                raise NoSuchVersion(f"{text}: no such model version in {name!r} ({exc.error_code})") from exc
            raise RegistryUnavailable(f"the model registry at {self.tracking_uri} did not answer for {text}: "
                                      f"{str(exc)[:300]}") from exc
        version = Version(str(mv.version), dict(mv.tags), mv.run_id, list(mv.aliases), int(mv.creation_timestamp or 0))
        if download:
            version.folder = self.download(version)
            version.manifest = json.loads((version.folder / MANIFEST).read_text())
        return version

    def number(self, ref: str = PRODUCTION) -> str:
        """The version number `ref` (a number, or an alias; '' = production) names now, cheaply: this is
        serving's per-request lookup (see `alias_ttl_s`)."""
        ref = (ref or PRODUCTION).strip()
        if ref.isdigit():
            ref = str(int(ref))
            if ref not in self._numbers:
                self.resolve(ref, download=False)
                self._numbers.add(ref)
            return ref
        seen = self._aliases.get(ref)
        if seen is None or self.alias_ttl_s <= 0:  # nothing to answer with yet: the caller waits (and sees errors)
            version = self.resolve(ref, download=False).version
            if self.alias_ttl_s > 0:
                self._aliases[ref] = _Alias(version, time.monotonic() + self.alias_ttl_s)
            return version
        if time.monotonic() >= seen.due and not seen.checking:
            seen.checking = True
            if self._checker is None:
                self._checker = ThreadPoolExecutor(1, thread_name_prefix="alias-check")
            self._checker.submit(self._check, ref, seen)
        return seen.version

    def _check(self, ref: str, seen: "_Alias") -> None:
        """Look alias `ref` up again (the background check of `number`)."""
        try:
            version = self.resolve(ref, download=False).version
        except NoSuchVersion:  # the alias was removed: the next lookup asks again and answers why
            self._aliases.pop(ref, None)
        except Exception as exc:  # noqa: BLE001  (whatever the client raises, the version last seen is served)
            self._failed_checks += 1
            if self.stale_since is None:
                self.stale_since = time.time()
                logger.warning("the model registry does not answer (%s): serving version %s as %r, last seen; checking "
                               "again with back-off", str(exc)[:300], seen.version, ref)
            seen.due = time.monotonic() + min(self.alias_ttl_s * 2 ** self._failed_checks, MAX_RECHECK_S)
        else:
            if self.stale_since is not None:
                logger.warning("the model registry answers again after %.0f s: %r is version %s",
                               time.time() - self.stale_since, ref, version)
                self.stale_since, self._failed_checks = None, 0
            seen.version, seen.due = version, time.monotonic() + self.alias_ttl_s
        finally:
            seen.checking = False

    def staleness_s(self) -> float:
        """Seconds since the registry last answered an alias check (0 while it answers)."""
        return 0.0 if self.stale_since is None else time.time() - self.stale_since

    def versions(self) -> list[Version]:
        """Every registered version, oldest first, with its aliases."""
        try:  # search results leave `aliases` empty: the registered model holds them
            aliases = self.client.get_registered_model(self.name).aliases  # {alias: version}
            found = self.client.search_model_versions(f"name = '{self.name}'")
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # nothing registered yet (a server that is down is not that)
                return []
            raise
        return sorted((Version(str(v.version), dict(v.tags), v.run_id,
                               sorted(a for a, n in aliases.items() if str(n) == str(v.version)),
                               int(v.creation_timestamp or 0)) for v in found),
                      key=lambda v: int(v.version))

    def download(self, version: Version) -> Path:
        """The checkpoint folder of `version`, downloaded once into HOME/cache (versions are immutable; the run id
        keys the cache so a recreated registry never reads stale files) and checked against the checksums taken
        at registration: a missing, truncated or altered file is an error, and nothing is cached."""
        folder = self.settings.home / "cache" / self.name / f"v{version.version}-{version.run_id}"
        if not (folder / models.CONFIG_FILE).is_file():
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix="download-", dir=folder.parent))
            try:
                source = self.client.get_model_version_download_uri(self.name, version.version)
                local = Path(mlflow.artifacts.download_artifacts(f"{source.rstrip('/')}/artifacts/{ARTIFACT}",
                                                                 dst_path=str(staging), tracking_uri=self.tracking_uri))
                expected = json.loads(version.tags.get(CHECKSUMS) or "null")
                if expected is not None:  # (versions registered before checksums existed have none)
                    found = checksums(local)
                    bad = sorted(f for f in expected.keys() | found.keys() if expected.get(f) != found.get(f))
                    if bad:
                        raise RegistryError(f"model version {version.version}: its artifacts are incomplete or altered "
                                            f"({', '.join(f'{f} {_state(f, found, expected)}' for f in bad[:5])}): "
                                            "it cannot be loaded or promoted; register it again from its run")
                shutil.rmtree(folder, ignore_errors=True)
                local.rename(folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return folder

    def load(self, ref: str | int) -> models.ClipBundle:
        """The version's model bundle, in eval mode."""
        bundle = models.load_exported(self.resolve(ref).folder)
        bundle.model.eval()
        return bundle

    def export(self, ref: str | int, out: Path, leave_out: tuple[str, ...] = ()) -> tuple[Version, Path]:
        """The version's open_clip folder copied to `out` (a new or empty folder), without the files named in
        `leave_out` (what only the next task's job reads, such as the method state): stock open_clip loads it with
        `create_model_and_transforms("local-dir:OUT")`, which is checked before `out` is written. The version's
        manifest (lineage, R matrix) goes along as provenance."""
        out = Path(out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out} exists and is not an empty folder: choose a new one (nothing was written)")
        version = self.resolve(ref)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            for path in version.folder.iterdir():
                if path.name not in leave_out:
                    (shutil.copytree if path.is_dir() else shutil.copy2)(path, staging / path.name)
            models.load_exported(staging)  # what a user will call; an error here leaves `out` untouched
            if out.exists():
                out.rmdir()  # (empty, checked above)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return version, out

    def set_alias(self, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))
        self._aliases.pop(alias, None)

    def set_tags(self, version: str, tags: dict[str, object]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, str(version), key, str(value))

    # ---- the promotion lock -------------------------------------------------------------------------------
    @contextmanager
    def lock(self, purpose: str, stale_s: float = 3600.0) -> Iterator[None]:
        """Hold the stream's lock for `purpose` (promotions serialise on it). The lock is a registered model named
        STREAM-lock: MLflow creates a name once (a unique key in its database, SQLite or a server's), so two
        processes cannot both create it, and it shows in the MLflow UI while held. A holder that died (its pid gone
        on this host) or held it past `stale_s` is taken over."""
        name = f"{self.name}-lock"
        me = {"purpose": purpose, "host": socket.gethostname(), "pid": str(os.getpid()), "since": str(time.time())}
        for _ in range(2):
            try:
                self.client.create_registered_model(name, tags=me, description=f"held by a clipstream {purpose}")
                break
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                held = self._holder(name)
                if held is not None and not _stale(held, stale_s):
                    raise LockHeld(f"another {held.get('purpose', 'promotion')} holds the stream's lock (pid "
                                   f"{held.get('pid')} on {held.get('host')}, for {time.time() - float(held.get('since', 0)):.0f} s): "
                                   f"wait for it; if it died on another machine, delete registered model {name!r} in MLflow") from None
                self._delete_model(name)  # a dead holder's: take it over (once)
        else:
            raise LockHeld(f"could not take the stream's lock {name!r}: another process keeps taking it")
        try:
            yield
        finally:
            self._delete_model(name)

    def lock_holder(self) -> Optional[dict]:
        """Who holds the stream's lock (purpose, host, pid, since), None when nobody does."""
        return self._holder(f"{self.name}-lock")

    def _holder(self, name: str) -> Optional[dict]:
        try:
            return dict(self.client.get_registered_model(name).tags)
        except MlflowException:
            return None  # released meanwhile

    def _delete_model(self, name: str) -> None:
        try:
            self.client.delete_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise

    # ---- promotion history -------------------------------------------------------------------------------
    @property
    def promotions_experiment(self) -> str:
        return f"{self.name}-promotions"

    def record_promotion(self, record: dict) -> str:
        """One run per promotion, its fields (PROMOTION_TAGS) as tags; `gates` a JSON-ready list. Written before the
        alias moves, in state `pending`, and marked `done` after (`finish_promotion`): a promotion killed in between
        leaves a pending record that the next one settles from where the alias points (`settle_promotions`)."""
        tags = {k: json.dumps(v) if k == "gates" else str(v) for k, v in {**record, "state": PENDING}.items()
                if k in PROMOTION_TAGS}
        before = f"v{record['from_version']}" if record["from_version"] else "none"
        name = f"{record['reason']} {before} -> v{record['to_version']}"
        return self.client.create_run(self.experiment_id(self.promotions_experiment), tags=tags, run_name=name).info.run_id

    def finish_promotion(self, run_id: str, state: str = DONE) -> None:
        self.client.set_tag(run_id, "state", state)
        self.client.set_terminated(run_id, "FINISHED" if state == DONE else "KILLED")

    def settle_promotions(self) -> None:
        """Mark every pending record done if the alias reached its version, else aborted (call under the lock)."""
        pending = [r for r in self.promotions(settled=False) if r["state"] == PENDING]
        if not pending:
            return
        try:
            current = self.number(PRODUCTION)
        except RegistryError:
            current = ""
        for record in pending:
            last = record is pending[-1]
            self.finish_promotion(record["run_id"], DONE if last and record["to_version"] == current else ABORTED)

    def promotions(self, settled: bool = True) -> list[dict]:
        """Every recorded promotion that took effect, oldest first: PROMOTION_TAGS (`forced` a bool, `gates` a list)
        + run_id. An unsettled last record (its promotion killed or still running) counts when the alias reached
        its version; `settled=False` returns every record as stored."""
        found = self.client.get_experiment_by_name(self.promotions_experiment)
        if not found:
            return []
        runs, token = [], None
        while True:
            page = self.client.search_runs([found.experiment_id], max_results=1000, page_token=token)
            runs += page
            token = page.token
            if not token:
                break
        records = [{**{k: r.data.tags.get(k, "") for k in PROMOTION_TAGS}, "forced": r.data.tags.get("forced") == "True",
                    "gates": json.loads(r.data.tags.get("gates", "[]")), "run_id": r.info.run_id} for r in runs]
        records = sorted(records, key=lambda r: r["time"])
        for r in records:
            r["state"] = r["state"] or DONE  # (recorded before records had states: after the alias moved)
        if not settled:
            return records
        if records and records[-1]["state"] == PENDING:
            try:
                reached = self.number(PRODUCTION) == records[-1]["to_version"]
            except RegistryError:
                reached = False
            records[-1]["state"] = DONE if reached else ABORTED
        return [r for r in records if r["state"] == DONE]


def _stale(holder: dict, stale_s: float) -> bool:
    """A lock holder that is gone: a pid no longer alive on this host, or older than `stale_s`."""
    if time.time() - float(holder.get("since") or 0) > stale_s:
        return True
    if holder.get("host") != socket.gethostname():
        return False
    try:
        pid = int(holder.get("pid") or 0)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return False


# What loading the pyfunc imports (clipstream/mlflow_model.py: MLflow, the model and its tokenizer), pinned to
# the versions that made the model. clipstream itself travels as code (`code_paths`), never as a requirement:
# "clipstream" on the public index is someone else's package.
PYFUNC_DISTRIBUTIONS = ("mlflow", "torch", "torchvision", "open_clip_torch", "transformers", "safetensors", "pillow",
                        "numpy")


def pyfunc_requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name).split('+')[0]}" for name in PYFUNC_DISTRIBUTIONS]


def pyfunc_signature(embed_dim: int):
    """Optional `text` (string) and `image` (binary) columns in; a float32 vector of `embed_dim` per row out."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema, TensorSpec

    return ModelSignature(inputs=Schema([ColSpec("string", "text", required=False),
                                         ColSpec("binary", "image", required=False)]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, embed_dim))]))


def pyfunc_input_example():
    """One caption and one small PNG, the two kinds of row."""
    import io

    import pandas as pd
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(png, format="PNG")
    return pd.DataFrame({"text": ["a photo of a red cup", None], "image": [None, png.getvalue()]})


def _own_code(staging: Path) -> str:
    """This installed clipstream package as one folder (the repository maps training/ and services/ into it),
    without benchmarks or caches: what a registered model's pyfunc imports."""
    from importlib.util import find_spec  # where the packages are, without importing the layers above this one

    target = staging / "clipstream"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "benchmarks")
    shutil.copytree(Path(models.__file__).parent, target, ignore=ignore)
    for package in ("training", "services"):
        if not (target / package).exists():  # (a source checkout: the folder lives beside clipstream/, not in it)
            shutil.copytree(find_spec(f"clipstream.{package}").submodule_search_locations[0], target / package,
                            ignore=ignore)
    return str(target)


def checksums(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`."""
    import hashlib

    out = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        out[path.relative_to(folder).as_posix()] = digest.hexdigest()
    return out


def _state(name: str, found: dict, expected: dict) -> str:
    return "missing" if name not in found else "unexpected" if name not in expected else "differs"
