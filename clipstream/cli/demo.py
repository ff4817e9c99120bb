"""`clipstream demo`: a stream synthesised, trained task by task, then indexed, promoted, served and searched
(or, with --cluster, the same on a local two-node Ray cluster: clipstream.local_cluster)."""

from __future__ import annotations

import time
from pathlib import Path

from clipstream.cli.render import format_hits, print_promotion, print_result, task_line
from clipstream.settings import Settings


def _demo(args) -> None:
    settings = Settings()
    if args.cluster:  # everything runs in the cluster's processes: this one imports no training stack
        from clipstream import local_cluster

        out = Path(args.out or settings.data_dir / f"cluster-demo-{time.strftime('%Y%m%d-%H%M%S')}")
        return local_cluster.demo(out, args.method, args.tasks, args.seed, args.set, args.zero_shot)
    from clipstream.training.data.synth import held_out_task, synthesize
    from clipstream.training.job import run_task

    if not args.no_serve:  # the Ray the training jobs then use, started as serving needs it (services/app.py)
        from clipstream.services.app import ray_for_serving

        ray_for_serving(settings)
    out = Path(args.out or settings.data_dir / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"== synthesising {args.tasks} domain tasks + the digits task under {out}")
    dirs = synthesize(out, tasks=args.tasks, seed=args.seed)
    parent, result = None, None
    print(f"== training them one after another: {args.method}, {args.workers} Ray Train workers with DeepSpeed")
    for i, folder in enumerate(dirs):
        result = run_task(folder, args.method, parent, args.workers, args.set, settings,  # (later tasks inherit it)
                          zero_shot=[*args.zero_shot, held_out_task(out)] if i == 0 else (),
                          retrain=True)  # a demo run again in the same home trains again
        print(task_line(result, i, len(dirs), parent))
        parent = result.version
    print_result(result)
    print(f"every run with its R matrix, recall and loss curves: clipstream ui (MLflow, {settings.mlflow_tracking_uri})")
    if not args.no_serve:
        _demo_serve(settings, result.version, dirs)


def _demo_serve(settings: Settings, version: str, dirs: list[Path]) -> None:
    """Index, promote and serve the final version, then ask it a few questions over gRPC."""
    from ray import serve

    from clipstream.promotion import promote
    from clipstream.services import app
    from clipstream.services.client import Client
    from clipstream.training.data.task import Task

    print(f"\n== promote v{version}: index its gallery ({settings.index_policy}), then move alias production "
          "(--force for the demo: a gate that fails is shown, not enforced)")
    print_promotion(promote(settings, version, force=True))
    print(f"\n== serve gRPC Encoder + Search on port {settings.grpc_port}")
    target = app.serve(settings)
    first, last = (Task.load(d).check("test").rows[0] for d in (dirs[0], dirs[-1]))
    try:
        with Client(target) as client:
            for query, task in ((first["caption"], dirs[0].name), (first["caption"], None), (last["caption"], None)):
                print()
                print(format_hits(client.search(text=query, task=task or "", k=3), query, task))
            image = Task.load(dirs[-1]).root / last["image"]
            print()
            print(format_hits(client.search(image=image, task=dirs[-1].name, k=3), f"image {last['image']}", dirs[-1].name))
    finally:
        serve.shutdown()
