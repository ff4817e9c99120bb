"""Version 0 of a stream: an existing CLIP (an open_clip pretrained tag, a checkpoint file, an hf-hub model or an
exported folder) registered as the stream's start, with no training.

    load      → the model (`models.from_source`) and the tasks to evaluate, checked; nothing is written yet, so a
                bad source or task leaves nothing behind (no run, no version)
    evaluate  → row 0 of the R matrix (`evaluate.BASELINE`, "before any training") on the given tasks, task-known
                and task-unknown, and the held-out zero-shot tasks: the baseline later versions' retention and
                zero-shot drop are measured from
    register  → the export + manifest as the next version of the stream (`job.publish`, as a trained version),
                in its own MLflow run; alias `candidate`

It has an empty lineage (stream position 0: the next `clipstream train --parent` of it trains task index 0) and
serves, before any training, the galleries of the tasks it was evaluated on (`indexing`)."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from clipstream import models
from clipstream.registry import DEFAULT_LANGUAGE, Registry
from clipstream.settings import Settings
from clipstream.training import evaluate
from clipstream.training.data.task import Task
from clipstream.training.job import MODES, check_aliases, evaluate_zero_shot, log_evaluation, publish, zero_shot_entries

METHOD = "pretrained"  # the `method` tag of a version 0
BATCH_SIZE = 256  # the evaluation's batch (the presets' eval.batch_size)


@dataclass
class Registered:
    version: str
    run_id: str
    source: str
    known: evaluate.ResultMatrix  # row 0 alone
    unknown: evaluate.ResultMatrix
    heatmap: Optional[Path]
    seconds: float
    zero_shot: list[float] = field(default_factory=list)


def register_version0(source: str, evaluate_dirs: Iterable[str | Path] = (), zero_shot: Iterable[str | Path] = (),
                      aliases: Iterable[str] = (), settings: Optional[Settings] = None) -> Registered:
    """Register the model `source` names (`models.from_source`) as the stream's next version, untrained: lineage
    empty, tags `method=pretrained`, `source`, `parent_version` and `task` empty; evaluated on the test splits of
    `evaluate_dirs` (row 0 of its matrices) and of the held-out `zero_shot` tasks (the first entry of the zero-shot
    history). A bad source or task raises before anything is written (ValueError, DataError, FileNotFoundError; a
    download that failed: models.ModelUnavailable)."""
    tic = time.perf_counter()
    aliases = tuple(aliases)
    check_aliases(aliases)
    tasks = [Task.load(d) for d in evaluate_dirs]
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"--evaluate names a task twice: {names}")
    entries = [{"task": t.name, "path": str(t.root), "data_sha": t.data_sha(),
                **({"lang": str(t.meta["lang"])} if t.meta.get("lang") else {})} for t in tasks]
    for task in tasks:
        task.check("test")
    held_out = zero_shot_entries(zero_shot, None, entries)  # (refuses a task that is also evaluated as a stream task)
    bundle, source = models.from_source(source)
    settings = (settings or Settings()).ensure_dirs()
    registry = Registry(settings)
    tags = {"task": "", "task_index": "0", "method": METHOD, "parent_version": "", "source": source}
    run_name = f"00-{METHOD}"
    workdir = Path(tempfile.mkdtemp(prefix="clipstream-version0-"))
    try:
        folder = models.export(bundle, workdir / "checkpoint")
        with registry.run(run_name, tags) as run_id:
            run = registry.log(run_id)
            run.log_params({"source": source, "arch": bundle.arch, "evaluate": ",".join(names),
                            "zero_shot": ",".join(e["task"] for e in held_out)})
            scores = evaluate.evaluate_seen(evaluate.embed_tasks(bundle, tasks, batch_size=BATCH_SIZE)) if tasks \
                else {mode: {} for mode in MODES}
            matrices = {mode: evaluate.ResultMatrix(baseline={n: m["Rm"] for n, m in scores[mode].items()})
                        for mode in MODES}
            plots = settings.home / "plots" / run_id
            log_evaluation(run, scores, matrices, plots, run_name, "before any training")
            history, _, accuracy = evaluate_zero_shot(held_out, {}, bundle, BATCH_SIZE, run)
            run.log_artifacts(plots, "plots")
            version = publish(registry, folder, {
                "lineage": [], "source": source, "parent_version": "",
                # the tasks of row 0: what this version serves before any training (indexing)
                "evaluated": entries,
                # open_clip's pretrained CLIPs learnt English captions; a trained version knows its lineage's languages
                "languages": [DEFAULT_LANGUAGE],
                "matrix": {mode: matrices[mode].to_dict() for mode in MODES},
                "config": {"model": {"arch": bundle.arch, "pretrained": source}, "eval": {"batch_size": BATCH_SIZE}},
                "zero_shot": {"tasks": held_out, "Rm": history, "accuracy": accuracy} if held_out else None,
                "unchanged_towers": [], "image_tower": None}, tags, aliases, run_id)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return Registered(version, run_id, source, matrices["known"], matrices["unknown"],
                      plots / f"{run_name}-known.png" if tasks else None, time.perf_counter() - tic, history)
