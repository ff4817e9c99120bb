"""`clipstream train`, `register`, `eval` and `bench`: jobs that make and measure versions."""

from __future__ import annotations

from clipstream.cli.render import print_json, print_registered, print_result
from clipstream.settings import Settings


def _train(args) -> None:
    from clipstream.training.job import run_task

    result = run_task(args.task, args.method, args.parent, args.workers, args.set, Settings(),
                      gpus_per_worker=args.gpus_per_worker, aliases=args.alias, wait_parent_s=args.wait_parent,
                      zero_shot=args.zero_shot, retrain=args.retrain)
    print_result(result)


def _register(args) -> None:
    from clipstream.training.version0 import register_version0

    print_registered(register_version0(args.source, args.evaluate, args.zero_shot, args.alias, Settings()))


def _eval(args) -> None:
    from clipstream import models
    from clipstream.registry import CANDIDATE, Registry
    from clipstream.training import evaluate
    from clipstream.training.data.task import Task

    settings = Settings()
    version = Registry(settings).resolve(args.version or CANDIDATE)
    bundle = models.load_exported(version.folder).to(*models.placement(settings.embed_precision))
    tasks = [Task.load(p) for p in args.task] or [Task.load(e["path"]) for e in version.gallery]
    if not tasks:
        raise ValueError(f"version {version.version} was trained and evaluated on no task: name tasks with --task")
    if args.through_index:
        from clipstream.index import open_index
        from clipstream.indexing import evaluate_through_index

        with open_index(settings) as index:
            indexed = set(index.state()["tasks"])
            missing = [t.name for t in tasks if t.name not in indexed]
            if missing:
                raise ValueError(f"tasks {missing} are not indexed; run `clipstream index` for them first")
            scores = evaluate_through_index(index, bundle, tasks)
    else:
        scores = evaluate.evaluate_seen([evaluate.embed_task(bundle, t) for t in tasks])
    source = "through the index" if args.through_index else "in memory"
    if args.json:
        return print_json({"version": version.version, "method": version.tags.get("method"),
                           "trained_on": version.tags.get("task"), "source": source, "scores": scores})
    after = f"after task {version.tags['task']}" if version.tags.get("task") else "before any training"
    print(f"version {version.version} ({version.tags.get('method')}, {after}), {source}")
    print(evaluate.format_scores(scores))


def _bench(args) -> None:
    """Hand the rest of the command line to the benchmark's own script (`benchmarks/MODULE.py`)."""
    import importlib

    from clipstream.benchmarks import BENCHMARKS

    module = importlib.import_module(f"clipstream.benchmarks.{BENCHMARKS[args.benchmark]}")
    module.main(args.options, prog=f"clipstream bench {args.benchmark}")
