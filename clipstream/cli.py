"""The `clipstream` command: synthesise data, train task after task, evaluate, list versions, demo."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from clipstream import console
from clipstream.settings import Settings


def _synth(args) -> None:
    from clipstream.training.data.synth import held_out_task, synthesize, synthesize_languages

    sizes = {k: v for k, v in {"train_pairs": args.train_pairs, "test_per_task": args.test_per_task}.items()
             if v is not None}  # unset: the default of the kind of stream
    if args.languages is not None:
        dirs = synthesize_languages(args.out, args.languages, seed=args.seed, image_size=args.image_size, **sizes)
    else:
        dirs = synthesize(args.out, tasks=args.tasks, seed=args.seed, image_size=args.image_size,
                          digits=not args.no_digits, held_out=not args.no_held_out, **sizes)
    for folder in dirs:
        print(folder)
    zero_shot = held_out_task(args.out)
    if zero_shot:  # not a stream task: on stderr, so stdout stays the list of tasks to train
        print(f"held-out zero-shot task (no version trains on it): {zero_shot}", file=console.err())


def _check(args) -> None:
    from clipstream.training.data.task import Task

    task = Task.load(args.task)
    for split in task.splits:
        check = task.check(split, args.on_bad_image)
        print(f"{task.name} {split}: {len(check.rows)} rows ok, {len(check.skipped)} skipped")
        for line in check.skipped:
            print(f"  skipped {line}")


def _train(args) -> None:
    from clipstream.training.job import run_task

    result = run_task(args.task, args.method, args.parent, args.workers, args.set, Settings(),
                      gpus_per_worker=args.gpus_per_worker, aliases=args.alias, wait_parent_s=args.wait_parent,
                      zero_shot=args.zero_shot, retrain=args.retrain)
    _print_result(result)


def _task_line(result, i: int, tasks: int, parent) -> str:
    """One line per trained task: what it made, how long it took, where the stream stands."""
    known = result.known
    return (f"task {i + 1}/{tasks} {result.task:<22} version {result.version} (parent {parent or 'none'}) "
            f"{result.seconds:4.0f} s   task-known AA {known.average_accuracy():5.1f}  forgetting "
            f"{known.mean_forgetting():4.1f}  BWT {known.bwt():+5.1f}")


def _print_result(result) -> None:
    print(f"\nregistered version {result.version} (alias candidate) for task {result.task} "
          f"[{result.seconds:.0f} s, {result.skipped} rows skipped]")
    print("\ntask-known Rm, R[i][j] = after task i, on task j:\n" + result.known.format_table())
    print("\ntask-unknown Rm:\n" + result.unknown.format_table())
    if result.zero_shot:
        print(f"\nzero-shot (held-out tasks, never trained on) Rm: {result.zero_shot[-1]:.2f}, "
              f"drop since the first version evaluated on them: {result.zero_shot[0] - result.zero_shot[-1]:+.2f}")
    print(f"\nheatmap: {result.heatmap}")


def _eval(args) -> None:
    from clipstream import models
    from clipstream.registry import CANDIDATE, Registry
    from clipstream.training import evaluate
    from clipstream.training.data.task import Task

    settings = Settings()
    version = Registry(settings).resolve(args.version or CANDIDATE)
    bundle = models.load_exported(version.folder)
    tasks = [Task.load(p) for p in args.task] or [Task.load(e["path"]) for e in version.lineage]
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
    print(f"version {version.version} ({version.tags.get('method')}, after task {version.tags.get('task')}), {source}")
    print(evaluate.format_scores(scores))


def _index(args) -> None:
    from clipstream.indexing import index_task

    state = index_task(Settings(), args.version, args.task, args.policy, args.split)
    print(f"index {state['name']!r} generation {state['generation']} (dim {state['dim']}):")
    for name, entry in state["tasks"].items():
        print(f"  {name:<24} version {entry['model_version']:>4}  {entry['counts']['image']} images, "
              f"{entry['counts']['text']} texts")


def _export(args) -> None:
    from clipstream.registry import Registry
    from clipstream.training.methods.state import STATE_FILE

    version, out = Registry(Settings()).export(args.version, Path(args.out), leave_out=(STATE_FILE,))
    print(f"version {version.version} ({version.tags.get('task', '?')}, {version.tags.get('method', '?')}) -> {out}\n"
          f"load it with stock open_clip:\n"
          f"  import open_clip\n"
          f"  model, _, preprocess = open_clip.create_model_and_transforms(\"local-dir:{out}\")\n"
          f"  tokenizer = open_clip.get_tokenizer(\"local-dir:{out}\")")


def _ui(args) -> None:
    """`mlflow ui` on the settings' store, on loopback, until Ctrl-C (or the process is told to stop)."""
    import signal
    import subprocess

    from clipstream.local_cluster import free_port, http_get, tool

    settings = Settings()
    uri = settings.mlflow_tracking_uri
    if uri.startswith(("http://", "https://")):
        print(f"MLflow UI: {uri} (the tracking server of these settings serves it)")
        return
    port = args.port or free_port()
    command = [tool("mlflow"), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)  # (its output: the log)
    url = f"http://127.0.0.1:{port}"

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        deadline = time.monotonic() + args.timeout
        while http_get(f"{url}/health") is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`mlflow ui` did not come up on {url} ("
                                   f"{'exited ' + str(server.returncode) if server.poll() is not None else 'timed out'}"
                                   f"; its output is in {console.log_path() or 'the terminal'})")
            time.sleep(0.5)
        print(f"MLflow UI: {url} (experiment {settings.stream!r}: a run per task with its R-matrix heatmap, recall "
              f"curve and loss curves under Artifacts > plots; registered model {settings.stream!r}). Ctrl-C stops it.",
              flush=True)
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)  # its group: the server and the workers it started
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def _compact(args) -> None:
    from clipstream.index import open_index

    with open_index(Settings()) as index:
        index.progress = True
        before = index.segments()
        state = index.compact()
        after = index.segments()
    print(f"index {state['name']!r} generation {state['generation']}: {len(state['tasks'])} tasks in "
          f"{after} segment{'s' * (after != 1)} per modality (was {before})")


def _bench(args) -> None:
    """Hand the rest of the command line to the benchmark's own script (`benchmarks/MODULE.py`)."""
    import importlib

    from clipstream.benchmarks import BENCHMARKS

    module = importlib.import_module(f"clipstream.benchmarks.{BENCHMARKS[args.benchmark]}")
    module.main(args.options, prog=f"clipstream bench {args.benchmark}")


def _serve(args) -> None:
    from clipstream.services import app, binding
    from clipstream.services.health import SERVICES
    from clipstream.training.job import init_ray

    settings = Settings(**({"serve_replicas": args.replicas} if args.replicas else {}))
    binding.check(settings)  # before Ray starts: a refusal costs nothing
    app.serving_environment()
    init_ray(settings)
    app.start(settings)
    if not args.no_follow:  # a production alias moved in MLflow gets its gallery, then serving switches
        import threading

        from clipstream.promotion import follow_forever

        threading.Thread(target=follow_forever, args=(settings,), daemon=True, name="follow-production").start()
    where = binding.address(settings.grpc_host, settings.grpc_port)
    print(f"serving {', '.join(SERVICES)} on {where} ({'TLS' if settings.tls else 'plaintext'}; reflection and "
          f"grpc.health.v1 on{'; API key required' if settings.secret('api_key') else ''}); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _client(args):
    from clipstream.services.client import Client

    settings = Settings()
    args.address = args.address or f"127.0.0.1:{settings.grpc_port}"  # what the command's output names
    return Client(args.address, api_key=settings.secret("api_key"), tls=args.tls or settings.tls,
                  ca_file=settings.tls_ca_file or settings.tls_cert_file)


def _status(args) -> None:
    with _client(args) as client:
        status, versions = client.status(), client.versions()
    print(f"stream {status['stream']}: production v{status['production_version'] or '-'}, queries encoded by "
          f"v{status['query_version'] or '-'}, index generation {status['index_generation']}, "
          f"loaded {', '.join('v' + v for v in status['loaded_versions']) or 'none'}")
    print(format_table([("task", "#", "vectors from", "images", "texts", "indexed at")] + [
        (t["task"], str(t["task_index"]), "v" + t["model_version"], str(t["images"]), str(t["texts"]), t["indexed_at"])
        for t in status["tasks"]]))
    print(format_table([("version", "task", "method", "parent", "aliases", "loaded", "created")] + [
        ("v" + v["version"], v["task"], v["method"], v["parent_version"], ",".join(v["aliases"]),
         "yes" if v["loaded"] else "", v["created_at"]) for v in versions]))
    print("consistent" if status["consistent"] else "NOT consistent:\n  " + "\n  ".join(status["problems"]))


def _health(args) -> int:
    """A probe for people and for `helm test`: one line, exit 0 only when the service answers SERVING."""
    with _client(args) as client:
        status = client.health(args.service)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


def _k8s(args) -> None:
    """Print RayJob manifests; the preset and overrides are resolved first, so a typo fails here, not in the cluster."""
    from clipstream import k8s
    from clipstream.training.methods.config import resolve

    resolve(args.method, args.set)
    release = k8s.Release(args.release, args.namespace, args.image or k8s.default_image(args.variant))
    resources = k8s.Resources(args.workers, args.gpus_per_worker, args.worker_cpus, args.worker_memory)
    if args.k8s_command == "job":
        manifests = [k8s.job(args.task, args.method, release, resources, parent=args.parent, overrides=args.set,
                             name=args.name, zero_shot=args.zero_shot)]
    else:
        manifests = k8s.stream(args.tasks, args.method, release, resources, parent=args.parent, overrides=args.set,
                               name=args.name or time.strftime("s%Y%m%d-%H%M%S"), wait_parent_s=args.wait_parent,
                               zero_shot=args.zero_shot)
    print(k8s.dump(manifests), end="")


def _encode(args) -> None:
    with _client(args) as client:
        vectors, version = (client.encode_image(args.image, model_version=args.model_version) if args.image
                            else client.encode_text(args.text, model_version=args.model_version, language=args.language))
    for item, vector in zip(args.image or args.text, vectors):
        print(f"{str(item)[:40]:<40} " + " ".join(f"{v:+.3f}" for v in vector[:8]) + " ...")
    print(f"{len(vectors)} vectors of dimension {vectors.shape[1]} from model version {version}")


def _search(args) -> None:
    with _client(args) as client:
        hits = client.search(text=args.query if not args.image else None, image=args.image, task=args.task or "",
                             k=args.k, model_version=args.model_version, language=args.language)
    print(format_hits(hits, args.query if not args.image else args.image, args.task))


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell (the last one left ragged); the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows)


def format_hits(hits: list[dict], query, task) -> str:
    scope = f"task-known ({task})" if task else "task-unknown (all tasks)"
    version = hits[0]["query_model_version"] if hits else "-"
    lines = [f"query {str(query)!r}, {scope}, encoded by version {version}",
             f"{'#':>2} {'score':>6}  {'task':<20} {'item':<28} {'ver':>3} {'gen':>3}  caption"]
    for i, h in enumerate(hits, 1):
        lines.append(f"{i:>2} {h['score']:6.3f}  {h['task']:<20} {h['item_id']:<28} {h['model_version']:>3} "
                     f"{h['index_generation']:>3}  {h['caption'] or ''}")
    return "\n".join(lines)


def _runs(args) -> None:
    from clipstream.registry import Registry

    registry = Registry(Settings())
    versions = registry.versions()
    if not versions:
        print(f"no registered versions in stream {registry.name!r} yet (train one with `clipstream train`)")
        return
    header = (f"{'version':>7}  {'aliases':<20} {'task':<22} {'method':<10} {'parent':>6}  {'AA':>6} {'forget':>6} "
              f"{'BWT':>6} {'ZS':>6} {'ZSdrop':>6}")
    print(header + "\n" + "-" * len(header))
    for v in versions:
        m = registry.run_metrics(v.run_id)
        print(f"{v.version:>7}  {','.join(v.aliases):<20} {v.tags.get('task', ''):<22} {v.tags.get('method', ''):<10} "
              f"{v.tags.get('parent_version') or '-':>6}  {m.get('known/AA', float('nan')):6.1f} "
              f"{m.get('known/forgetting', float('nan')):6.1f} {m.get('known/BWT', float('nan')):6.1f} "
              f"{m.get('zero_shot/Rm', float('nan')):6.1f} {m.get('zero_shot/drop', float('nan')):6.1f}")


def _promote(args) -> None:
    from clipstream.promotion import PromotionError, gate_rows, promote

    try:
        result = promote(Settings(), args.version, force=args.force, index=not args.no_index)
    except PromotionError as exc:
        if exc.gates:
            print(format_table(gate_rows(exc.gates)))
        raise
    _print_promotion(result)


def _rollback(args) -> None:
    from clipstream.promotion import rollback

    _print_promotion(rollback(Settings(), index=not args.no_index))


def _print_promotion(result: dict) -> None:
    from clipstream.promotion import gate_rows

    print(format_table(gate_rows(result["gates"])))
    before = f"v{result['from_version']}" if result["from_version"] else "none"
    forced = " (forced past failed gates)" if result["forced"] else ""
    print(f"production: {before} -> v{result['to_version']} [{result['reason']}]{forced}")


def _follow(args) -> None:
    from clipstream.promotion import follow, follow_forever

    settings = Settings()
    if not args.once:
        print(f"following alias production of stream {settings.stream!r} every {args.interval:g} s; Ctrl-C stops",
              flush=True)
        try:
            return follow_forever(settings, args.interval)
        except KeyboardInterrupt:
            return None
    result = follow(settings)
    if result is None:
        print("production is where the last promotion put it: nothing to do")
    else:
        _print_promotion(result)


def _history(args) -> None:
    from clipstream.promotion import history

    records = history(Settings())
    if not records:
        print("no promotions yet (promote a version with `clipstream promote VERSION`)")
        return
    header = f"{'time (UTC)':<19}  {'from':>5} {'to':>5}  {'reason':<9} {'user':<16} forced"
    print(header + "\n" + "-" * len(header))
    for r in records:
        print(f"{r['time'][:19].replace('T', ' '):<19}  {r['from_version'] or '-':>5} {r['to_version']:>5}  "
              f"{r['reason']:<9} {r['user']:<16} {'yes' if r['forced'] else 'no'}")


def _demo(args) -> None:
    settings = Settings()
    if args.cluster:  # everything runs in the cluster's processes: this one imports no training stack
        from clipstream import local_cluster

        out = Path(args.out or settings.data_dir / f"cluster-demo-{time.strftime('%Y%m%d-%H%M%S')}")
        return local_cluster.demo(out, args.method, args.tasks, args.seed, args.set, args.zero_shot)
    from clipstream.training.data.synth import held_out_task, synthesize
    from clipstream.training.job import run_task

    if not args.no_serve:
        from clipstream.services.app import serving_environment

        serving_environment()  # before the training jobs start Ray: Serve reads it when its processes start
    out = Path(args.out or settings.data_dir / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"== synthesising {args.tasks} domain tasks + the digits task under {out}")
    dirs = synthesize(out, tasks=args.tasks, seed=args.seed)
    parent, result = None, None
    print(f"== training them one after another: {args.method}, {args.workers} Ray Train workers with DeepSpeed")
    for i, folder in enumerate(dirs):
        result = run_task(folder, args.method, parent, args.workers, args.set, settings,  # (later tasks inherit it)
                          zero_shot=[*args.zero_shot, held_out_task(out)] if i == 0 else (),
                          retrain=True)  # a demo run again in the same home trains again
        print(_task_line(result, i, len(dirs), parent))
        parent = result.version
    _print_result(result)
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
    _print_promotion(promote(settings, version, force=True))
    print(f"\n== serve gRPC Encoder + Search on port {settings.grpc_port}")
    app.start(settings)
    first, last = (Task.load(d).check("test").rows[0] for d in (dirs[0], dirs[-1]))
    try:
        with Client(f"127.0.0.1:{settings.grpc_port}") as client:
            for query, task in ((first["caption"], dirs[0].name), (first["caption"], None), (last["caption"], None)):
                print()
                print(format_hits(client.search(text=query, task=task or "", k=3), query, task))
            image = Task.load(dirs[-1]).root / last["image"]
            print()
            print(format_hits(client.search(image=image, task=dirs[-1].name, k=3), f"image {last['image']}", dirs[-1].name))
    finally:
        serve.shutdown()


class _Help(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one and does not name it already; descriptions and
    examples keep their lines."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or action.default in ([], "")):
            return text
        return f"{text} (default: {str(action.default).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """(subcommands are made of the parser's own class: every one gets the formatter)"""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)
        # before or after the command (`clipstream -v train ...`, `clipstream train -v ...`); SUPPRESS: a command's
        # parser leaves the value the top one set
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="show Ray's, Ray Data's, DeepSpeed's and MLflow's logs here (default: into a log file "
                               "under HOME/logs, whose path is printed)")


def _version() -> str:
    """clipstream's version and its main dependencies' (from their installed metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{name} {of(dist)}" for name, dist in (("torch", "torch"), ("open_clip", "open_clip_torch"),
                     ("ray", "ray"), ("deepspeed", "deepspeed"), ("mlflow", "mlflow"), ("qdrant-edge", "qdrant-edge-py")))
    return f"clipstream {of('clipstream')} ({deps})"


# `clipstream COMMAND --help` ends with these
EXAMPLES = {
    "train": """examples:
  clipstream data synth --out data/stream
  clipstream train --task data/stream/task-00-household --method ewc
  clipstream train --task data/stream/task-01-furnishing --method ewc --parent candidate --set train.epochs=2""",
    "index": """examples:
  clipstream index --version candidate --task data/stream/task-00-household
  clipstream index --version 3 --task data/stream/task-01-furnishing --policy reindex""",
    "search": """examples (with `clipstream serve` running):
  clipstream search "a photo of a cup"
  clipstream search "a wooden chair" --task task-01-furnishing -k 10
  clipstream search --image photo.png --model-version 2""",
    "export": """examples:
  clipstream export --version production --out my-model
  python -c 'import open_clip; open_clip.create_model_and_transforms("local-dir:my-model")'""",
    "promote": """examples:
  clipstream runs
  clipstream promote 3
  clipstream rollback""",
    "demo": """examples:
  clipstream demo                     # 3 domain tasks + digits, finetune, then indexing and searches
  clipstream demo --method ewc --no-serve
  clipstream demo --tasks 2 --set train.epochs=1""",
}


def parser() -> argparse.ArgumentParser:
    from clipstream.index import NO_REINDEX, POLICIES
    from clipstream.training.methods.config import PRESETS, load_presets, method_presets

    shipped = method_presets(load_presets(PRESETS))  # not the user's file: a bad one is an error of `main`, not of --help
    p = _Parser(prog="clipstream", description=__doc__)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="task data").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write the synthetic benchmark")
    synth.add_argument("--out", required=True, metavar="DIR", help="where the task folders go")
    stream = synth.add_mutually_exclusive_group()
    stream.add_argument("--tasks", type=int, default=4, help="domain tasks (default 4)")
    stream.add_argument("--languages", type=int, metavar="K",
                        help="instead of domain tasks, K language tasks: the same images captioned in English and "
                             "K-1 synthetic languages")
    synth.add_argument("--seed", type=int, default=0, help="the random seed of images and captions")
    synth.add_argument("--image-size", type=int, default=32, help="image side in pixels")
    synth.add_argument("--train-pairs", type=int, help="domain tasks: in all (default 2000); languages: per language "
                                                       "(default 600)")
    synth.add_argument("--test-per-task", type=int, help="default 64 per domain task, 48 per language")
    synth.add_argument("--no-digits", action="store_true", help="leave out the handwritten-digits task")
    synth.add_argument("--no-held-out", action="store_true", help="leave out the held-out zero-shot task")
    synth.set_defaults(func=_synth)
    check = data.add_parser("check", help="validate a task directory")
    check.add_argument("--task", required=True, metavar="DIR", help="a task folder (task.yaml, splits, images)")
    check.add_argument("--on-bad-image", choices=("fail", "skip"), default="fail",
                       help="fail: exit 2 at the first bad row; skip: list the bad rows and go on")
    check.set_defaults(func=_check)

    def training_args(q, method: bool = True):
        if method:
            q.add_argument("--method", default="finetune", help=f"a method preset: {', '.join(shipped)} "
                           "(or one of CLIPSTREAM_PRESETS)")
        q.add_argument("--workers", type=int, default=2, help="Ray Train workers")
        q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset value, e.g. train.epochs=2")
        q.add_argument("--zero-shot", action="append", default=[], metavar="TASK",
                       help="a held-out task no version trains on, evaluated with every version of the stream for "
                            "zero-shot retention (repeatable; default: the parent's)")

    def client_args(q):
        q.add_argument("--address", help="HOST:PORT of the server (default 127.0.0.1 and the Settings port)")
        q.add_argument("--tls", action="store_true", help="speak TLS, verifying the server against CLIPSTREAM_TLS_CA_FILE "
                       "(default: the system's roots; on when this machine's settings configure a certificate)")

    train = sub.add_parser("train", help="train one task as a Ray Train job and register a version")
    train.add_argument("--task", required=True, metavar="DIR", help="the task folder to train on")
    train.add_argument("--parent", help="models:/STREAM@ALIAS, an alias or a version number")
    train.add_argument("--wait-parent", type=float, default=0.0, metavar="SECONDS",
                       help="wait this long for --parent to be registered (default 0: it must exist)")
    train.add_argument("--alias", action="append", default=[], help="also set this alias on the new version (repeatable)")
    train.add_argument("--gpus-per-worker", type=float, help="GPUs per Ray Train worker (default: 1 if the driver "
                       "sees CUDA, else 0)")
    train.add_argument("--retrain", action="store_true", help="train the task again although it already registered a "
                       "version from the same parent, method and data (a new version; without it such a rerun is "
                       "refused, and an interrupted one resumes from its last epoch checkpoint)")
    training_args(train)
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="evaluate a registered version on its tasks (or the given ones)")
    ev.add_argument("--version", help="a version number or alias (default: the newest candidate)")
    ev.add_argument("--task", action="append", default=[], metavar="DIR",
                    help="a task folder to evaluate on (repeatable; default: every task the version was trained on)")
    ev.add_argument("--through-index", action="store_true",
                    help="rank the stored vectors (queries encoded by this version) instead of re-embedding galleries")
    ev.set_defaults(func=_eval)

    ix = sub.add_parser("index", help="embed a task's gallery with a version and store it in the vector index")
    ix.add_argument("--version", required=True, help="models:/STREAM@ALIAS, an alias or a version number")
    ix.add_argument("--task", required=True, metavar="DIR", help="the task folder whose gallery is embedded")
    ix.add_argument("--policy", choices=POLICIES, default=NO_REINDEX, help=f"default {NO_REINDEX}")
    ix.add_argument("--split", default="test", help="the task's split that is the gallery")
    ix.set_defaults(func=_index)

    xp = sub.add_parser("export", help="write a version as an open_clip folder that stock open_clip loads "
                        "(`local-dir:DIR`)")
    xp.add_argument("--version", required=True, help="models:/STREAM@ALIAS, an alias or a version number")
    xp.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder")
    xp.set_defaults(func=_export)

    ui = sub.add_parser("ui", help="start the MLflow UI on the settings' tracking store (loopback) and print its URL")
    ui.add_argument("--port", type=int, default=0, help="the port (0: a free one)")
    ui.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the UI to answer")
    ui.set_defaults(func=_ui)

    sub.add_parser("compact", help="merge the vector index's per-task segments into one per modality (no-reindex "
                   "appends write one each; the indexing job merges them past Settings index_compact_segments)"
                   ).set_defaults(func=_compact)

    sub.add_parser("runs", help="registered versions with their key metrics").set_defaults(func=_runs)

    pr = sub.add_parser("promote", help="check a version's gates, index its gallery, move alias production to it")
    pr.add_argument("version", help="models:/STREAM@ALIAS, an alias or a version number")
    pr.add_argument("--force", action="store_true", help="promote even when gates fail (recorded as forced)")
    pr.add_argument("--no-index", action="store_true", help="move the alias without putting the gallery in place")
    pr.set_defaults(func=_promote)
    sub.add_parser("history", help="every promotion and rollback, oldest first").set_defaults(func=_history)
    fo = sub.add_parser("follow", help="honour a production alias moved in MLflow: index its gallery (serving "
                        "switches then) and record it in the history (`serve` does this unless --no-follow)")
    fo.add_argument("--once", action="store_true", help="check once and exit (default: every --interval seconds)")
    fo.add_argument("--interval", type=float, default=5.0, help="seconds between checks (default 5)")
    fo.set_defaults(func=_follow)
    rb = sub.add_parser("rollback", help="return production to the version before the last promotion")
    rb.add_argument("--no-index", action="store_true", help="move the alias without putting the gallery in place")
    rb.set_defaults(func=_rollback)

    sv = sub.add_parser("serve", help="serve gRPC Encoder and Search on Ray Serve (port from Settings)")
    sv.add_argument("--replicas", type=int, help="Encoder replicas (default: Settings serve_replicas)")
    sv.add_argument("--no-follow", action="store_true", help="do not follow a production alias moved in MLflow (by "
                    "default the server indexes that version's gallery, then switches, and records it; see `follow`)")
    sv.set_defaults(func=_serve)
    en = sub.add_parser("encode", help="embed texts or images through the running service")
    en.add_argument("text", nargs="*", help="texts to embed")
    en.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    en.add_argument("--model-version", default="", help="a version number or alias (default: production)")
    en.add_argument("--language", default="", help="the text's language (a task's lang): refused by a version not trained on it")
    client_args(en)
    en.set_defaults(func=_encode)
    se = sub.add_parser("search", help="search the index through the running service")
    se.add_argument("query", nargs="?", help="a text query (or use --image)")
    se.add_argument("--image", help="an image file as the query")
    se.add_argument("--task", help="task-known search in this task; omit for task-unknown")
    se.add_argument("-k", type=int, default=5, help="hits to return")
    se.add_argument("--model-version", default="", help="a version number or alias whose vectors are searched (default: production)")
    se.add_argument("--language", default="", help="the text's language (a task's lang): refused by a version not trained on it")
    client_args(se)
    se.set_defaults(func=_search)
    kube = sub.add_parser("k8s", help="print RayJob manifests for `kubectl apply -f -` (see k8s/README.md)")
    kube_sub = kube.add_subparsers(dest="k8s_command", required=True)
    kjob = kube_sub.add_parser("job", help="one training task as a RayJob")
    kjob.add_argument("--task", required=True, help="the task's URI as the pods see it: s3://, gs:// or a mounted path")
    kjob.add_argument("--parent", help="models:/STREAM@ALIAS, an alias or a version number")
    kstream = kube_sub.add_parser("stream", help="one RayJob per task, each waiting for its parent's version")
    kstream.add_argument("--tasks", nargs="+", required=True, metavar="URI", help="the tasks in stream order, as the "
                         "pods see them")
    kstream.add_argument("--parent", help="the first task's parent (default: the preset's model)")
    kstream.add_argument("--wait-parent", type=float, default=24 * 3600, metavar="SECONDS",
                         help="how long each job waits for its parent's version (default 86400)")
    for q in (kjob, kstream):
        q.add_argument("--name", help="job name suffix (job) or the stream's alias prefix (stream; default sDATE-TIME)")
        q.add_argument("--release", default="clipstream", help="the Helm release whose image, ConfigMap and Secrets "
                       "the job uses (default clipstream)")
        q.add_argument("--namespace", help="the release's namespace (default: kubectl's current one)")
        q.add_argument("--image", help="default: the chart's image for this clipstream version and --variant")
        q.add_argument("--variant", choices=("gpu", "cpu"), default="gpu", help="image variant (default gpu)")
        q.add_argument("--gpus-per-worker", type=float, default=1, help="default 1 (0 for CPU-only workers)")
        q.add_argument("--worker-cpus", type=int, default=8, help="CPUs per worker pod (default 8)")
        q.add_argument("--worker-memory", default="32Gi", help="memory per worker pod (default 32Gi)")
        training_args(q)
        q.set_defaults(func=_k8s)

    hc = sub.add_parser("health", help="check the running service with grpc.health.v1 (exit 0 when SERVING)")
    hc.add_argument("--service", default="", help="a service name such as clipstream.v1.Search (default: the server)")
    client_args(hc)
    hc.set_defaults(func=_health)

    st = sub.add_parser("status", help="what the running service holds (Admin.GetStatus and ListVersions)")
    client_args(st)
    st.set_defaults(func=_status)

    from clipstream.benchmarks import BENCHMARKS

    bench = sub.add_parser("bench", help="reproducible benchmarks (scripts under benchmarks/; results in benchmarks/results/)",
                           description="Run a benchmark; `clipstream bench NAME --help` lists its options.")
    bench.add_argument("benchmark", choices=list(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=_bench)

    demo = sub.add_parser("demo", help="synthesise a stream, train it task by task, show the R matrix")
    demo.add_argument("--out", metavar="DIR", help="where the demo's synthetic tasks go (default: a new "
                      "demo-DATE-TIME folder in Settings data_dir)")
    demo.add_argument("--tasks", type=int, default=3, help="domain tasks (the digits task is added last)")
    demo.add_argument("--seed", type=int, default=0, help="the random seed of the data and of training")
    demo.add_argument("--no-serve", action="store_true", help="stop after training (no indexing, promotion or serving)")
    demo.add_argument("--cluster", action="store_true",
                      help="the cluster path on this machine instead: 2 `ray start` nodes, `mlflow server`, the RayJobs "
                           "of `clipstream k8s stream` through the Jobs API, the chart's RayService config `serve deploy`ed "
                           "(needs helm: `make cluster-demo`; --tasks domain tasks, no digits task)")
    training_args(demo)
    demo.set_defaults(func=_demo)
    for name, text in EXAMPLES.items():
        sub.choices[name].epilog = text
    return p


# the commands that start Ray, DeepSpeed or Ray Serve: quiet unless -v (see clipstream.console)
QUIET = ("train", "eval", "index", "compact", "promote", "rollback", "follow", "serve", "demo", "bench", "ui")


def _quiet(command: str) -> None:
    import tempfile

    try:
        settings = Settings()
        if settings.ray_address:  # the driver of a job on a cluster (a RayJob): its output is the job's log
            return
        folder = settings.home / "logs"
    except Exception:  # (bad settings are reported by the command itself, in one line)
        folder = Path(tempfile.gettempdir())
    path = console.quiet(folder, command)
    if path:
        print(f"clipstream: Ray, DeepSpeed and MLflow log to {path} (-v shows them here)", file=console.err())


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from clipstream.settings import configure_process  # (the process's MLflow set-up, once per process)

    configure_process()
    if args.command in QUIET and not getattr(args, "verbose", False):
        _quiet(args.command)
    # MLflow's SQL store logs a database error with its traceback before raising it; the error is ours to
    # report, in one line (below)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    try:
        code = args.func(args)
    except Exception as exc:
        job = _loaded("clipstream.training.job")
        if job and isinstance(exc, (job.TrainingFailed, job.RayStartError)) or isinstance(exc, _dependency_errors()):
            # not the input's fault (a job that failed, MLflow or the vector store down): exit 1, one line
            print(f"clipstream: error: {_one_line(exc)}", file=console.err())
            return 1
        if not isinstance(exc, _user_errors()):  # a bug: one line here, the traceback in a file
            print(f"clipstream: internal error: {type(exc).__name__}: {_one_line(exc)} (traceback in {_crash_log(exc)}; "
                  "please report it)", file=console.err())
            return 1
        rpc = _loaded("grpc")
        detail = f"{exc.code().name}: {exc.details()}" if rpc and isinstance(exc, rpc.RpcError) else _one_line(exc)
        print(f"clipstream: error: {detail}", file=console.err())  # a gRPC error: the service's own status and message
        return 2
    return code or 0


def _one_line(exc: Exception) -> str:
    """The message on one line; a settings error (pydantic) as `field: reason` pairs."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg'].removeprefix('Value error, ')}"
                         for e in errors())
    return " ".join(str(exc).split())


def _crash_log(exc: Exception) -> Path:
    """The traceback written under HOME/logs (the temp dir when the settings themselves cannot be read)."""
    import tempfile
    import traceback

    try:
        folder = Settings().home / "logs"
        folder.mkdir(parents=True, exist_ok=True)
    except Exception:
        folder = Path(tempfile.gettempdir())
    path = folder / f"clipstream-crash-{time.strftime('%Y%m%d-%H%M%S')}.log"
    path.write_text(f"clipstream {' '.join(sys.argv[1:])}\n" + "".join(traceback.format_exception(exc)))
    return path


def _user_errors() -> tuple[type[Exception], ...]:
    """What a user's input can cause: bad data, a reference the registry does not know, a bad value, a missing
    file, a status from the service. Read from the modules a command loaded (a module that was never imported
    raised nothing), so that `data synth` does not pay for importing MLflow and gRPC."""
    errors: list[type[Exception]] = [ValueError, FileNotFoundError, FileExistsError]
    for module, name in (("clipstream.training.data.task", "DataError"), ("clipstream.registry", "RegistryError"),
                         ("grpc", "RpcError"), ("clipstream.services.binding", "BindingError")):
        if _loaded(module):
            errors.append(getattr(_loaded(module), name))
    return tuple(errors)


def _dependency_errors() -> tuple[type[Exception], ...]:
    """What a dependency that is down raises: MLflow (a server that does not answer, a locked database), the
    vector store (a Qdrant server that does not answer), the network."""
    errors: list[type[Exception]] = [ConnectionError, TimeoutError]
    for module, name in (("mlflow.exceptions", "MlflowException"),
                         ("qdrant_client.http.exceptions", "ResponseHandlingException")):
        if _loaded(module):
            errors.append(getattr(_loaded(module), name))
    return tuple(errors)


def _loaded(module: str):
    return sys.modules.get(module)


if __name__ == "__main__":
    sys.exit(main())
