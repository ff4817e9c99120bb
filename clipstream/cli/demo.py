"""`clipstream demo`: a short stream of real emoji (Twemoji captioned by their CLDR labels and tags, German then
English: clipstream.training.data.emoji DEMO_STREAM), or with --world synthetic, or when the npm registry cannot be
reached, a synthesised one, trained task by task, then indexed, promoted, served and searched (or, with --cluster, the
synthetic one on a local two-node Ray cluster: clipstream.local_cluster)."""

from __future__ import annotations

import time
from pathlib import Path

from clipstream import console
from clipstream.cli.render import format_hits, print_promotion, print_result, task_line
from clipstream.settings import Settings

# The emoji world's training (before the user's --set): from random weights, 24 epochs of ~250 pairs a task teach the
# searched emoji their names; experience replay of every German pair while English is learnt keeps the German (with
# none, or 30% of them, "roter Apfel" fell out of its top 5 in some runs: README, What the demo prints)
EMOJI_METHOD, EMOJI_SET = "er", ["train.epochs=24", "train.lr=2e-3"]
EMOJI_ER_SET = ["method.er.buffer_fraction=1.0", "method.er.buffer_pairs=null"]  # (with --method er, the default)
IMAGE_SIZE = 32  # the default model's input (clipstream-vit-tiny)
# every image of the demo once, added through AddItems: what the searches look through; one per version, so that a
# demo run again in the same home has its images embedded by its own version (a catalogue keeps the version that
# embedded it first)
CATALOGUE = "demo-emoji-v{version}"
SYNTHETIC_TASKS = 3
FALLBACK = "the demo synthesises its world instead"  # ends the one line said when the npm registry cannot be reached


def _demo(args) -> None:
    settings = Settings()
    if args.cluster:  # everything runs in the cluster's processes: this one imports no training stack
        from clipstream import local_cluster

        out = Path(args.out or settings.data_dir / f"cluster-demo-{time.strftime('%Y%m%d-%H%M%S')}")
        return local_cluster.demo(out, args.method or "finetune", args.tasks or SYNTHETIC_TASKS, args.seed, args.set,
                                  args.zero_shot)
    if args.world == "emoji" and args.tasks is not None:
        raise ValueError("--tasks sets the synthetic world's domain tasks (--world synthetic); the emoji world is its "
                         "own two tasks")
    roots = emoji_roots(settings) if args.world == "emoji" else None
    from clipstream.training.job import run_task

    if not args.no_serve:  # the Ray the training jobs then use, started as serving needs it (services/app.py)
        from clipstream.services.app import ray_for_serving

        ray_for_serving(settings)
    out = Path(args.out or settings.data_dir / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if roots is None:
        from clipstream.training.data.synth import held_out_task, synthesize

        tasks = args.tasks or SYNTHETIC_TASKS
        print(f"== synthesising {tasks} domain tasks + the digits task under {out}")
        dirs, overrides = synthesize(out, tasks=tasks, seed=args.seed), args.set
        method, zero_shot = args.method or "finetune", [*args.zero_shot, held_out_task(out)]
    else:
        from clipstream.training.data.emoji import DEMO_STREAM, write_stream

        written = write_stream(DEMO_STREAM, out, roots, seed=args.seed, image_size=IMAGE_SIZE, progress=False)
        c = written[0].counts
        print(f"== the emoji world under {out}: {c['images']} Twemoji, {len(written)} tasks captioned in "
              f"{', then '.join(w.task.meta['lang'] for w in written)} (CLDR labels and tags)\n   trained on "
              f"{c['train_concepts']} of them, the searched ones among them; tested on the {c['test_concepts']} others")
        method = args.method or EMOJI_METHOD
        overrides = [*EMOJI_SET, *(EMOJI_ER_SET if method == "er" else []), *args.set]
        dirs, zero_shot = [w.task.root for w in written], args.zero_shot
    parent, result = None, None
    print(f"== training them one after another: {method}, {args.workers} Ray Train workers with DeepSpeed")
    for i, folder in enumerate(dirs):
        result = run_task(folder, method, parent, args.workers, overrides, settings,  # (later tasks inherit it)
                          zero_shot=zero_shot if i == 0 else (),
                          retrain=True)  # a demo run again in the same home trains again
        print(task_line(result, i, len(dirs), parent))
        parent = result.version
    print_result(result)
    if roots is not None:
        print(f"(Rm: the mean of R@1/5/10 both ways, %, on the {c['test_concepts']} test emoji, which no task trains on)")
    print(f"every run with its R matrix, recall and loss curves: clipstream ui (MLflow, {settings.mlflow_tracking_uri})")
    if not args.no_serve:
        _demo_serve(settings, result.version, dirs, emoji=roots is not None)


def emoji_roots(settings: Settings) -> dict[str, Path] | None:
    """The emoji demo's package roots, fetched into the home's cache the first time; None, said in one line on stderr,
    when the npm registry cannot be reached: the demo then synthesises its world."""
    from clipstream.training.data.emoji import DEMO_STREAM, packages
    from clipstream.training.data.sources import RegistryError, fetch

    try:
        fetched = fetch(settings, list(dict.fromkeys(source for source, _ in packages(DEMO_STREAM))))
    except RegistryError as exc:
        print(f"clipstream demo: {' '.join(str(exc).split())}; {FALLBACK}", file=console.err())
        return None
    return {p.name: d for f in fetched for p, d in zip(f.source.packages, f.dirs)}


def _demo_serve(settings: Settings, version: str, dirs: list[Path], emoji: bool) -> None:
    """Index, promote and serve the final version, then ask it a few questions over gRPC."""
    from ray import serve

    from clipstream.promotion import promote
    from clipstream.services import app

    print(f"\n== promote v{version}: index its gallery ({settings.index_policy}), then move alias production "
          "(--force for the demo: a gate that fails is shown, not enforced)")
    print_promotion(promote(settings, version, force=True))
    print(f"\n== serve gRPC Encoder + Search on port {settings.grpc_port}")
    target = app.serve(settings)
    try:
        if emoji:
            _emoji_searches(target, dirs, CATALOGUE.format(version=version))
        else:
            _synthetic_searches(target, dirs)
    finally:
        serve.shutdown()


def _synthetic_searches(target: str, dirs: list[Path]) -> None:
    from clipstream.services.client import Client
    from clipstream.training.data.task import Task

    first, last = (Task.load(d).check("test").rows[0] for d in (dirs[0], dirs[-1]))
    with Client(target) as client:
        for query, task in ((first["caption"], dirs[0].name), (first["caption"], None), (last["caption"], None)):
            print()
            print(format_hits(client.search(text=query, task=task or "", k=3), query, task))
        image = Task.load(dirs[-1]).root / last["image"]
        print()
        print(format_hits(client.search(image=image, task=dirs[-1].name, k=3), f"image {last['image']}", dirs[-1].name))


def gallery(task_dir: Path) -> list[dict]:
    """The demo's catalogue items: each image of the emoji task once (its train and test concepts), with the English
    CLDR label its hits are shown by."""
    from clipstream.training.data.task import Task

    task, found = Task.load(task_dir), {}
    for split in ("train", "test"):
        for row in task.check(split).rows:
            found.setdefault(row["image"], {"item_id": Path(row["image"]).stem, "image": task.root / row["image"],
                                            "label": row["label"]})
    return list(found.values())


def _emoji_searches(target: str, dirs: list[Path], catalogue: str) -> None:
    """The queries of DEMO_SEARCHES, each through the catalogue of every image the demo has, its hits named."""
    from clipstream.services.client import Client
    from clipstream.training.data.emoji import DEMO_SEARCHES

    items = gallery(dirs[-1])
    names = {item["item_id"]: item["label"] for item in items}
    with Client(target) as client:
        added = client.add_items(catalogue, [{"item_id": i["item_id"], "image": i["image"]} for i in items])
        print(f"catalogue {catalogue}: the demo's {added['added'] + added['replaced']} emoji images added through "
              f"AddItems, embedded by version {added['model_version']}")
        for query in DEMO_SEARCHES:
            print()
            print(format_hits(client.search(text=query, task=catalogue, k=5), query, catalogue, names=names))
