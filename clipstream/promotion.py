"""Promotion: move alias `production` to a version once its gates pass and its gallery is in place.

The gallery is indexed before the alias moves, so the serving stack never sees a production version
whose tasks are missing from the index. MLflow keeps no alias history, so every promotion is also
recorded in the registry (`Registry.record_promotion`); rollback replays that history to find the
version to restore.
"""

from __future__ import annotations

import getpass
import math
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from clipstream.indexing import put_lineage
from clipstream.registry import PRODUCTION, LockHeld, Registry, RegistryError, Version
from clipstream.settings import Settings

SPLIT = "test"  # the gallery split the serving index holds


class PromotionError(ValueError):
    """A promotion refused (failed gates, nothing to roll back to); nothing has changed."""

    def __init__(self, message: str, gates: list[Gate] = ()):
        super().__init__(message)
        self.gates = list(gates)


@dataclass
class Gate:
    name: str
    passed: bool
    value: Any
    threshold: Any
    detail: str = ""


def check_gates(registry: Registry, candidate: Version, production: Version | None, settings: Settings) -> list[Gate]:
    """Every gate, passed or not, so a refusal can name them all at once."""
    metrics = registry.run_metrics(candidate.run_id)
    forgetting = metrics.get("known/forgetting", math.nan)
    aa = metrics.get("known/AA", math.nan)
    if candidate.tasks:
        gates = [Gate("forgetting", forgetting <= settings.promote_max_forgetting, forgetting,
                      settings.promote_max_forgetting, "task-known mean forgetting must be <= threshold")]
    else:  # a version 0 (`clipstream register --from`): its model learnt no task of the stream
        gates = [Gate("forgetting", True, None, settings.promote_max_forgetting,
                      f"version {candidate.version} was trained on no task: nothing to forget")]
    if production is None:
        return gates + [Gate("aa", True, aa, None, "no production version to compare with"),
                        Gate("not-production", True, candidate.version, None, "no production version"),
                        Gate("lineage", True, candidate.tasks, None, "no production version")]
    floor = registry.run_metrics(production.run_id).get("known/AA", math.nan) - settings.promote_max_aa_drop
    key = lambda v: [(e["task"], e.get("data_sha")) for e in v.lineage]
    extends = key(candidate)[:len(production.lineage)] == key(production)
    if not production.tasks:  # production is a version 0: no trained row, no AA to compare with
        aa_gate = Gate("aa", True, aa, None, f"production v{production.version} was trained on no task: no AA to compare")
    elif not candidate.tasks:
        aa_gate = Gate("aa", False, aa, floor, f"version {candidate.version} was trained on no task: it has no task-known "
                                               f"AA to compare with production v{production.version}'s")
    else:
        aa_gate = Gate("aa", aa >= floor, aa, floor, f"task-known AA must be >= production v{production.version}'s "
                                                     f"minus {settings.promote_max_aa_drop}")
    return gates + [
        aa_gate,
        Gate("not-production", candidate.version != production.version, candidate.version, f"!= {production.version}",
             "the candidate must not already be production"),
        Gate("lineage", extends, candidate.tasks, production.tasks,
             f"the candidate's tasks (and data) must extend production v{production.version}'s"),
    ]


def promote(settings: Settings, ref: str, *, force: bool = False, reason: str = "promote", index: bool = True) -> dict:
    """Under the stream's lock: gates (against the version last put in place), then the gallery
    (settings.index_policy), then the history record (pending), the alias, and the record marked done.

    A failed gate refuses unless `force`; a failed indexing leaves the alias where it was. A promotion killed at
    any step converges when run again: the gallery step is idempotent, and a record left pending counts exactly
    when the alias reached its version (Registry.settle_promotions). A second promotion while one runs is refused."""
    registry = Registry(settings)
    try:
        with registry.lock(f"{reason} to {ref}"):
            registry.settle_promotions()
            return _promote(settings, registry, ref, force, reason, index)
    except LockHeld as exc:
        raise PromotionError(f"not promoted: {exc}") from exc


def _promote(settings: Settings, registry: Registry, ref: str, force: bool, reason: str, index: bool) -> dict:
    candidate = registry.resolve(ref)
    production = _in_place(registry)
    gates = check_gates(registry, candidate, production, settings)
    failed = [g for g in gates if not g.passed]
    if failed and not force:
        raise PromotionError(f"version {candidate.version} not promoted: " + "; ".join(
            f"{g.name} {_fmt(g.value)} vs threshold {_fmt(g.threshold)} ({g.detail})" for g in failed)
            + " (use --force to promote anyway)", gates)
    forced = bool(failed) and reason != "rollback"  # a rollback bypasses gates by design: not "forced"
    state = put_lineage(settings, candidate, SPLIT) if index else None
    record = {"from_version": production.version if production else "", "to_version": candidate.version,
              "reason": "force" if forced and reason == "promote" else reason, "user": getpass.getuser(),
              "time": datetime.now(timezone.utc).isoformat(timespec="microseconds"), "forced": forced}
    record["run_id"] = registry.record_promotion({**record, "gates": [asdict(g) for g in gates]})
    registry.set_alias(PRODUCTION, candidate.version)
    registry.finish_promotion(record["run_id"])
    return {**record, "gates": gates, "index": state}


def follow(settings: Settings) -> dict | None:
    """Honour a production alias moved outside `clipstream promote` (MLflow's client or UI): put that version's
    gallery in place and record the promotion (reason `mlflow`; `forced` when its gates fail: the move is the
    registry user's decision, recorded, not undone). Serving switches its query encoder only then (Search
    follows the gallery's pin, not the alias). None when the alias is where the last promotion put it."""
    registry = Registry(settings)
    production = _production(registry, download=False)
    records = registry.promotions()
    in_place = records[-1]["to_version"] if records else None
    if production is None or production.version == in_place:
        return None
    result = promote(settings, production.version, force=True, reason="mlflow")
    return result


def follow_forever(settings: Settings, interval_s: float = 5.0, stop=None) -> None:
    """`follow` every `interval_s` until `stop` (a threading.Event) is set; a failure is reported and retried."""
    import logging
    import threading

    stop = stop or threading.Event()
    while not stop.wait(interval_s):
        try:
            result = follow(settings)
            if result:
                logging.getLogger(__name__).warning("production moved outside clipstream to v%s: gallery in place, "
                                                    "recorded", result["to_version"])
        except Exception as exc:  # the data gone, the registry down, another promotion running: try again later
            logging.getLogger(__name__).warning("could not follow production: %s", exc)


def history(settings: Settings) -> list[dict]:
    """Every recorded promotion, oldest first."""
    return [{**r, "gates": [Gate(**g) for g in r["gates"]]} for r in Registry(settings).promotions()]


def rollback(settings: Settings, *, index: bool = True) -> dict:
    """Restore the production version before the current one; rollbacks undo promotions like a stack,
    so rolling back twice goes two promotions back rather than toggling."""
    stack: list[str] = []
    for record in history(settings):
        if record["reason"] == "rollback" and stack:
            stack.pop()
        if not stack or stack[-1] != record["to_version"]:
            stack.append(record["to_version"])
    if len(stack) < 2:
        raise PromotionError("nothing to roll back to: the promotion history holds no earlier production version"
                             + (f" than v{stack[-1]}" if stack else " (nothing was promoted yet)"))
    current = _production(Registry(settings), download=False)
    if current is None or current.version != stack[-1]:
        raise PromotionError(f"production is {_v(current)} but the promotion history ends at v{stack[-1]}: the alias "
                             f"was moved outside `clipstream promote`; promote the version you want explicitly")
    return promote(settings, stack[-2], force=True, reason="rollback", index=index)


def gate_rows(gates: list[Gate]) -> list[tuple[str, ...]]:
    return [("gate", "value", "threshold", "result", "detail")] + [
        (g.name, _fmt(g.value), _fmt(g.threshold), "PASS" if g.passed else "FAIL", g.detail) for g in gates]


def _in_place(registry: Registry) -> Version | None:
    """What a promotion is gated against: the version the last recorded promotion put in place (gates checked,
    gallery indexed), or the alias's when none was recorded. They differ when the alias was moved outside
    `clipstream promote` (MLflow's client or UI, bypassing both): promoting the alias's version then
    completes that move instead of being refused as "already production"."""
    records = registry.promotions()
    return registry.resolve(records[-1]["to_version"]) if records else _production(registry)


def _production(registry: Registry, download: bool = True) -> Version | None:
    try:
        return registry.resolve(PRODUCTION, download=download)
    except RegistryError:
        return None


def _v(version) -> str:
    number = version.version if isinstance(version, Version) else version
    return f"v{number}" if number else "none"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, list):
        return ",".join(value)
    return "-" if value is None else str(value)
