"""The `clipstream` command line: the argparse parser (it only parses; each command's handler does the work)."""

from __future__ import annotations

import argparse

from clipstream.cli import config, controller, data, demo, manifests, serving, training, ui, versions

DESCRIPTION = "The `clipstream` command: synthesise data, train task after task, evaluate, list versions, demo."
EXIT_STATUS = """exit status:
  0  done
  1  a failure not caused by the input: a training job, MLflow or the vector store (one line on stderr)
  2  bad input: an option, a file, a version or a task the command cannot use (one line on stderr)
  3  the server did not answer (gRPC UNAVAILABLE or DEADLINE_EXCEEDED): not started, or the wrong address"""


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

    from clipstream.settings import DISTRIBUTION

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{name} {of(dist)}" for name, dist in (("torch", "torch"), ("open_clip", "open_clip_torch"),
                     ("ray", "ray"), ("deepspeed", "deepspeed"), ("mlflow", "mlflow"), ("qdrant-edge", "qdrant-edge-py")))
    return f"clipstream {of(DISTRIBUTION)} ({deps})"


# `clipstream COMMAND --help` ends with these
EXAMPLES = {
    "train": """examples:
  clipstream data synth --out data/stream
  clipstream train --task data/stream/task-00-household --method ewc
  clipstream train --task data/stream/task-01-furnishing --method ewc --parent candidate --set train.epochs=2""",
    "register": """examples:
  clipstream register --from ViT-B-32:laion2b_s34b_b79k --evaluate data/stream/task-00-household --zero-shot data/stream/zero-shot-toys
  clipstream register --from ViT-B-32:/data/ckpt.pt --alias start
  clipstream register --from hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K
  clipstream train --task data/stream/task-00-household --parent start""",
    "index": """examples:
  clipstream index --version candidate --task data/stream/task-00-household
  clipstream index --version 3 --task data/stream/task-01-furnishing --policy reindex""",
    "search": """examples (with `clipstream serve` running):
  clipstream search "a photo of a cup"
  clipstream search "a wooden chair" --task task-01-furnishing -k 10
  clipstream search --image photo.png --model-version 2
  clipstream search "a red mug" --task mugs --filter brand=acme,zed --filter 'price<=30' --score-threshold 0.2""",
    "items": """examples (with `clipstream serve` running; fields declared in CLIPSTREAM_INDEX_FIELDS):
  clipstream items add mugs mugs.jsonl      # lines like {"item_id": "m-1", "image": "img/m-1.png", "text": "a red mug",
                                            #             "metadata": {"brand": "acme", "price": 12.5}}
  clipstream items delete mugs m-1 m-2""",
    "export": """examples:
  clipstream export --version production --out my-model
  python -c 'import open_clip; open_clip.create_model_and_transforms("local-dir:my-model")'""",
    "promote": """examples:
  clipstream runs
  clipstream promote 3
  clipstream rollback""",
    "controller": """examples:
  clipstream controller --source s3://bucket/tasks --name news --promote auto          # in the cluster (the chart)
  clipstream controller --source data/stream --name s --jobs-api http://127.0.0.1:8265 --once
  clipstream k8s stream --tasks s3://b/t0 s3://b/t1 --name s | kubectl apply -f -   # resumed by the controller""",
    "demo": """examples:
  clipstream demo                     # real emoji, German then English captions, er, then indexing and searches
  clipstream demo --method ewc --no-serve
  clipstream demo --world synthetic --tasks 2 --set train.epochs=1""",
}


def parser() -> argparse.ArgumentParser:
    from clipstream.index import NO_REINDEX, POLICIES
    from clipstream.training.methods.config import PRESETS, SCALES, load_presets, method_presets

    shipped = [n for n in method_presets(load_presets(PRESETS)) if not n.endswith(tuple(f"-{s}" for s in SCALES))]  # not the user's file: a bad one is an error of `main`, not of --help
    p = _Parser(prog="clipstream", description=DESCRIPTION, epilog=EXIT_STATUS)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)

    ds = sub.add_parser("data", help="task data").add_subparsers(dest="data_command", required=True)
    synth = ds.add_parser("synth", help="write the synthetic benchmark")
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
    synth.set_defaults(func=data._synth)
    im = ds.add_parser("import", help="write a task directory from CSV/TSV (open_clip's), JSONL, parquet, COCO "
                       "captions or Karpathy splits")
    im.add_argument("format", choices=("csv", "tsv", "jsonl", "parquet", "coco", "karpathy"),
                    help="the source's format: csv, tsv, jsonl, parquet, coco (captions JSON) or karpathy (splits JSON)")
    im.add_argument("source", help="the file: a CSV/TSV/JSONL/parquet table, a COCO captions or Karpathy JSON")
    im.add_argument("--out", required=True, metavar="DIR", help="the new task directory (new or empty)")
    im.add_argument("--name", help="the task's name (default: the folder's name)")
    im.add_argument("--image-root", metavar="DIR",
                    help="where relative image paths start (default: the source's folder)")
    im.add_argument("--img-key", help="the image column (open_clip's --csv-img-key; default filepath for CSV/TSV, "
                    "image otherwise)")
    im.add_argument("--caption-key", help="the caption column (open_clip's --csv-caption-key; default title for "
                    "CSV/TSV, caption otherwise)")
    im.add_argument("--separator", help="CSV/TSV separator (default: tab for tsv; for csv the header's own)")
    im.add_argument("--split", help="put every pair in this split (default: the source's splits, else a seeded "
                    "--test-fraction of the images to test)")
    im.add_argument("--test-fraction", type=float, default=0.1, help="share of the images held out as test")
    im.add_argument("--seed", type=int, default=0, help="the random split's seed")
    im.add_argument("--lang", help="the captions' language (a language task)")
    im.set_defaults(func=data._import)

    check = ds.add_parser("check", help="validate a task directory")
    check.add_argument("--task", required=True, metavar="DIR", help="a task folder (task.yaml, splits, images)")
    check.add_argument("--on-bad-image", choices=("fail", "skip"), default="fail",
                       help="fail: exit 2 at the first bad row; skip: list the bad rows and go on")
    check.set_defaults(func=data._check)

    from clipstream.training.data.sources import SOURCES

    fetch = ds.add_parser("fetch", help="download openly licensed image sets (emoji, icons) from the npm registry, "
                          "checked against their pinned integrity, into HOME/sources")
    fetch.add_argument("sources", nargs="+", choices=list(SOURCES), metavar="SOURCE",
                       help=f"one or more of {', '.join(SOURCES)}")
    fetch.add_argument("--refetch", action="store_true", help="download again and replace the cached copy (one "
                       "reported damaged: without this, a damaged copy is an error and left as it is)")
    fetch.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")
    fetch.set_defaults(func=data._fetch)

    # (the names of clipstream.training.data.emoji.STREAMS, not imported: every command builds this parser)
    emoji = ds.add_parser("stream", help="write a stream of tasks from fetched emoji and icon sets (`data fetch`): "
                          "real pictures, CLDR captions in 28 locales, one concept split shared by every stream")
    emoji.add_argument("name", choices=("emoji-styles", "emoji-groups", "emoji-languages", "pretrain"),
                       help="emoji-styles: Twemoji, Noto, OpenMoji (a new look per task); emoji-groups: one task per "
                            "CLDR group or pair of groups (new concepts); emoji-languages: the same images captioned in a new language "
                            "per task; pretrain: one task for version 0 (Tabler icons, OpenMoji line art of train "
                            "concepts)")
    emoji.add_argument("--out", required=True, metavar="DIR", help="where the task folders go (new or empty)")
    emoji.add_argument("--seed", type=int, default=0, help="the seed of the concept split and of caption sampling")
    emoji.add_argument("--image-size", type=int, default=64, help="image side in pixels (the model preset's input)")
    emoji.add_argument("--langs", nargs="+", metavar="LOCALE", help="emoji-languages: the captions' locales in stream "
                       "order (default en de ja hi ru zh; any of emojibase's 28, e.g. fr ko pt zh-hant)")
    emoji.add_argument("--test-fraction", type=float, default=0.27, help="share of each CLDR group's concepts held out "
                       "as test concepts, for every stream and the pretraining corpus alike")
    emoji.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")
    emoji.set_defaults(func=data._stream)

    def training_args(q, method: bool = True):
        if method:
            q.add_argument("--method", default="finetune", help=f"a method preset: {', '.join(shipped)}; each also "
                           f"as METHOD-{' / METHOD-'.join(SCALES)}: a pretrained CLIP on GPUs at its paper's settings "
                           "(or one of CLIPSTREAM_PRESETS)")
        q.add_argument("--workers", type=int, default=2, help="Ray Train workers")
        q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a preset value, e.g. train.epochs=2")
        q.add_argument("--zero-shot", action="append", default=[], metavar="TASK",
                       help="a held-out task no version trains on, evaluated with every version of the stream for "
                            "zero-shot retention (repeatable; default: the parent's)")

    def json_arg(q):
        q.add_argument("--json", action="store_true", help="print one JSON document on stdout instead of text")

    def client_args(q):
        q.add_argument("--address", help="the server: HOST:PORT, grpc://HOST:PORT or grpcs://HOST:PORT (TLS) "
                       "(default: Settings server, else 127.0.0.1 and the Settings port)")
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
    train.set_defaults(func=training._train)

    rg = sub.add_parser("register", help="register an existing CLIP (pretrained tag, checkpoint, hf-hub model, exported "
                        "folder) as the stream's version 0, with no training")
    rg.add_argument("--from", dest="source", required=True, metavar="SOURCE",
                    help="ARCH:PRETRAINED (an open_clip pretrained tag or a checkpoint file, e.g. ViT-B-32:laion2b_s34b_b79k "
                         "or ViT-B-32:/data/ckpt.pt), hf-hub:ORG/NAME, or an exported clipstream/open_clip folder")
    rg.add_argument("--evaluate", nargs="+", default=[], metavar="TASK",
                    help="task folders whose test splits make row 0 of the R matrix ('pretrained', before any training); "
                         "the version serves their galleries")
    rg.add_argument("--zero-shot", nargs="+", default=[], metavar="TASK",
                    help="held-out tasks no version trains on: the zero-shot baseline later versions' drop is measured from")
    rg.add_argument("--alias", action="append", default=[], help="also set this alias on the new version (repeatable)")
    rg.set_defaults(func=training._register)

    ev = sub.add_parser("eval", help="evaluate a registered version on its tasks (or the given ones)")
    ev.add_argument("--version", help="a version number or alias (default: the newest candidate)")
    ev.add_argument("--task", action="append", default=[], metavar="DIR",
                    help="a task folder to evaluate on (repeatable; default: every task the version was trained on)")
    ev.add_argument("--through-index", action="store_true",
                    help="rank the stored vectors (queries encoded by this version) instead of re-embedding galleries")
    json_arg(ev)
    ev.set_defaults(func=training._eval)

    ix = sub.add_parser("index", help="embed a task's gallery with a version and store it in the vector index")
    ix.add_argument("--version", required=True, help="models:/STREAM@ALIAS, an alias or a version number")
    ix.add_argument("--task", required=True, metavar="DIR", help="the task folder whose gallery is embedded")
    ix.add_argument("--policy", choices=POLICIES, default=NO_REINDEX, help=f"default {NO_REINDEX}")
    ix.add_argument("--split", default="test", help="the task's split that is the gallery")
    ix.set_defaults(func=versions._index)

    xp = sub.add_parser("export", help="write a version as an open_clip folder that stock open_clip loads "
                        "(`local-dir:DIR`)")
    xp.add_argument("--version", required=True, help="models:/STREAM@ALIAS, an alias or a version number")
    xp.add_argument("--out", required=True, metavar="DIR", help="a new (or empty) folder")
    xp.set_defaults(func=versions._export)

    mu = sub.add_parser("ui", help="start the MLflow UI on the settings' tracking store (loopback) and print its URL")
    mu.add_argument("--port", type=int, default=0, help="the port (0: a free one)")
    mu.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the UI to answer")
    mu.set_defaults(func=ui._ui)

    sub.add_parser("compact", help="merge the vector index's per-task segments into one per modality (no-reindex "
                   "appends write one each; the indexing job merges them past Settings index_compact_segments)"
                   ).set_defaults(func=versions._compact)

    json_arg(runs := sub.add_parser("runs", help="registered versions with their key metrics"))
    runs.set_defaults(func=versions._runs)

    pr = sub.add_parser("promote", help="check a version's gates, index its gallery, move alias production to it")
    pr.add_argument("version", help="models:/STREAM@ALIAS, an alias or a version number")
    pr.add_argument("--force", action="store_true", help="promote even when gates fail (recorded as forced)")
    pr.add_argument("--no-index", action="store_true", help="move the alias without putting the gallery in place")
    pr.set_defaults(func=versions._promote)
    json_arg(hist := sub.add_parser("history", help="every promotion and rollback, oldest first"))
    hist.set_defaults(func=versions._history)
    fo = sub.add_parser("follow", help="honour a production alias moved in MLflow: index its gallery (serving "
                        "switches then) and record it in the history (`serve` does this unless --no-follow)")
    fo.add_argument("--once", action="store_true", help="check once and exit (default: every --interval seconds)")
    fo.add_argument("--interval", type=float, default=5.0, help="seconds between checks (default 5)")
    fo.set_defaults(func=versions._follow)
    rb = sub.add_parser("rollback", help="return production to the version before the last promotion")
    rb.add_argument("--no-index", action="store_true", help="move the alias without putting the gallery in place")
    rb.set_defaults(func=versions._rollback)

    sv = sub.add_parser("serve", help="serve gRPC Encoder and Search on Ray Serve (port from Settings)")
    sv.add_argument("--replicas", type=int, help="Encoder replicas (default: Settings serve_replicas)")
    sv.add_argument("--no-follow", action="store_true", help="do not follow a production alias moved in MLflow (by "
                    "default the server indexes that version's gallery, then switches, and records it; see `follow`)")
    sv.set_defaults(func=serving._serve)
    en = sub.add_parser("encode", help="embed texts or images through the running service")
    en.add_argument("text", nargs="*", help="texts to embed")
    en.add_argument("--image", action="append", default=[], help="an image file (repeatable)")
    en.add_argument("--model-version", default="", help="a version number or alias (default: production)")
    en.add_argument("--language", default="", help="the text's language (a task's lang): refused by a version not trained on it")
    client_args(en)
    json_arg(en)
    en.set_defaults(func=serving._encode)
    se = sub.add_parser("search", help="search the index through the running service")
    se.add_argument("query", nargs="?", help="a text query (or use --image)")
    se.add_argument("--image", help="an image file as the query")
    se.add_argument("--task", help="task-known search in this task; omit for task-unknown")
    se.add_argument("-k", type=int, default=5, help="hits to return")
    se.add_argument("--model-version", default="", help="a version number or alias whose vectors are searched (default: production)")
    se.add_argument("--language", default="", help="the text's language (a task's lang): refused by a version not trained on it")
    se.add_argument("--filter", action="append", default=[], metavar="FIELD=V1,V2|FIELD>=X|FIELD<=X",
                    help="only items whose declared field is any of the values, or within the bound (repeatable: all "
                         "must hold; a value is read as JSON, so quote a number to make it a string: brand='\"42\"')")
    se.add_argument("--score-threshold", type=float, metavar="COSINE", help="only hits scoring at least this")
    client_args(se)
    json_arg(se)
    se.set_defaults(func=serving._search)
    items = sub.add_parser("items", help="add or delete the items of a catalogue (your own gallery) through the "
                           "running service")
    items_sub = items.add_subparsers(dest="items_command", required=True)
    add = items_sub.add_parser("add", help="add items, or replace those with the same item_id")
    add.add_argument("catalogue", help="the catalogue's name (made by its first item): a-z 0-9 . _ -")
    add.add_argument("file", help="JSON lines, one item each: item_id, and image (a path, relative to the file), "
                     "image_uri (where hits say the image is), text, metadata (declared fields) as it has them")
    add.add_argument("--batch-size", type=int, default=64, help="items per request")
    delete = items_sub.add_parser("delete", help="delete items by id (ids the catalogue lacks are reported)")
    delete.add_argument("catalogue", help="the catalogue's name")
    delete.add_argument("item_ids", nargs="+", metavar="ITEM_ID", help="the items to delete")
    for q, func in ((add, serving._items_add), (delete, serving._items_delete)):
        client_args(q)
        json_arg(q)
        q.set_defaults(func=func)
    kube = sub.add_parser("k8s", help="print RayJob manifests for `kubectl apply -f -` (see k8s/README.md)")
    kube_sub = kube.add_subparsers(dest="k8s_command", required=True)
    kjob = kube_sub.add_parser("job", help="one training task as a RayJob")
    kjob.add_argument("--task", required=True, help="the task's URI as the pods see it: s3://, gs:// or a mounted path")
    kjob.add_argument("--parent", help="models:/STREAM@ALIAS, an alias or a version number")
    kstream = kube_sub.add_parser("stream", help="one RayJob per task; jobs 2..n suspended until `clipstream controller` "
                                  "resumes each once its parent's version is registered")
    kstream.add_argument("--tasks", nargs="+", required=True, metavar="URI", help="the tasks in stream order, as the "
                         "pods see them")
    kstream.add_argument("--parent", help="the first task's parent (default: the preset's model)")
    kstream.add_argument("--wait-parent", type=float, default=0, metavar="SECONDS",
                         help="how long a job started before its parent's version exists waits for it (default 0: "
                              "the controller resumes a job only once its parent is registered)")
    for q in (kjob, kstream):
        q.add_argument("--name", help="job name suffix (job) or the stream's alias prefix (stream; default sDATE-TIME)")
        q.add_argument("--release", default="clipstream", help="the Helm release whose image, ConfigMap and Secrets "
                       "the job uses (default clipstream)")
        q.add_argument("--namespace", help="the release's namespace (default: kubectl's current one)")
        q.add_argument("--release-values", action="append", default=[], metavar="FILE",
                       help="the values files the release was installed with (repeatable, in `helm -f` order): the "
                       "jobs run the image the release runs (image.repository, image.tag, image.variant)")
        q.add_argument("--image", help="REPOSITORY:TAG or REPOSITORY@sha256:DIGEST (k8s/images/push.sh prints it; "
                       "default: the release's, from --release-values, else the chart's default for this clipstream "
                       "version and --variant)")
        q.add_argument("--variant", choices=("gpu", "cpu"), help="image variant where the values set none "
                       "(default gpu)")
        q.add_argument("--gpus-per-worker", type=float, default=1, help="default 1 (0 for CPU-only workers)")
        q.add_argument("--worker-cpus", type=int, default=8, help="CPUs per worker pod (default 8)")
        q.add_argument("--worker-memory", default="32Gi", help="memory per worker pod (default 32Gi)")
        q.add_argument("--runs-dir", default="/mnt/clipstream/runs", metavar="PATH|URI",
                       help="Ray Train storage: a path on the release's runs volume (mounted there), or an s3:// or "
                       "gs:// URI every pod reaches (no volume then)")
        q.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE",
                       help="a node label the worker pods require (repeatable)")
        q.add_argument("--toleration", action="append", default=[], metavar="KEY[=VALUE][:EFFECT]",
                       help="a taint the worker pods tolerate (repeatable; workers with GPUs always tolerate "
                       "nvidia.com/gpu:NoSchedule, as GPU operators taint GPU nodes)")
        q.add_argument("--affinity", metavar="YAML", help="the worker pods' spec.affinity, as YAML or JSON")
        q.add_argument("--priority-class", metavar="NAME", help="the PriorityClass of every pod of the job")
        q.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                       help="an environment variable of the Ray pods (repeatable)")
        q.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                       help="a label of the RayJob and its pods, e.g. kueue.x-k8s.io/queue-name=gpu (repeatable)")
        q.add_argument("--annotation", action="append", default=[], metavar="KEY=VALUE",
                       help="an annotation of the RayJob and its pods (repeatable)")
        q.add_argument("--no-ray-auth", dest="ray_auth", action="store_false",
                       help="start the job's Ray cluster without token authentication (default: KubeRay's "
                       "authOptions mode token, as the release's RayService)")
        training_args(q)
        q.set_defaults(func=manifests._k8s)

    co = sub.add_parser("controller", help="train each new task of a task source as it appears, one job at a time, "
                        "and resume the suspended jobs of `k8s stream` (see k8s/README.md)")
    co.add_argument("--source", required=True, metavar="URI", help="a folder or prefix (s3://, gs://) whose sub-folders "
                    "with a task.yaml are the tasks, in name order; or a file listing task URIs, one a line")
    co.add_argument("--name", required=True, help="the stream's name: its jobs' names and its versions' aliases "
                    "(NAME-TASKKEY) start with it")
    co.add_argument("--parent", help="the first task's parent (default: the preset's model)")
    co.add_argument("--promote", choices=("candidate", "auto"), default="candidate",
                    help="auto: promote each new version whose gates pass; candidate: leave it candidate")
    co.add_argument("--on-failure", choices=("skip", "stop"), default="skip",
                    help="a task whose job failed or whose task.yaml is bad: report it and go on (skip), or report it "
                         "and train nothing after it until it is fixed (stop)")
    co.add_argument("--jobs-api", metavar="URL", help="submit through this Ray Jobs API (a Ray dashboard; its token "
                    "from RAY_AUTH_TOKEN) instead of creating RayJobs through the Kubernetes API")
    co.add_argument("--interval", type=float, default=30.0, help="seconds between passes")
    co.add_argument("--once", action="store_true", help="one pass, then exit")
    co.add_argument("--release", default="clipstream", help="the Helm release whose image, ConfigMap and Secrets the "
                    "jobs use")
    co.add_argument("--namespace", help="the release's namespace (default: the pod's, or kubectl's current one)")
    co.add_argument("--image", help="default: the chart's image for this clipstream version and --variant")
    co.add_argument("--variant", choices=("gpu", "cpu"), default="gpu", help="image variant")
    co.add_argument("--gpus-per-worker", type=float, default=1, help="0 for CPU-only workers")
    co.add_argument("--worker-cpus", type=int, default=8, help="CPUs per worker pod")
    co.add_argument("--worker-memory", default="32Gi", help="memory per worker pod")
    training_args(co)
    co.set_defaults(func=controller._controller)

    cf = sub.add_parser("config", help="the effective settings and where each came from (CLIPSTREAM_* variables, "
                        "the settings file, defaults)")
    json_arg(cf)
    cf.set_defaults(func=config._config)

    hc = sub.add_parser("health", help="check the running service with grpc.health.v1 (exit 0 when SERVING)")
    hc.add_argument("--service", default="", help="a service name such as clipstream.v1.SearchService (default: the server)")
    hc.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS",
                    help="how long to wait for an answer; a server that is down fails at once, exit 3 (no retries)")
    client_args(hc)
    json_arg(hc)
    hc.set_defaults(func=serving._health)

    st = sub.add_parser("status", help="what the running service holds (Admin.GetStatus and ListVersions)")
    client_args(st)
    json_arg(st)
    st.set_defaults(func=serving._status)

    from clipstream.benchmarks import BENCHMARKS

    bench = sub.add_parser("bench", help="reproducible benchmarks (scripts under benchmarks/; results in benchmarks/results/)",
                           description="Run a benchmark; `clipstream bench NAME --help` lists its options.")
    bench.add_argument("benchmark", choices=list(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(func=training._bench)

    dm = sub.add_parser("demo", help="train a short stream task by task, show the R matrix, serve and search it")
    dm.add_argument("--world", choices=("emoji", "synthetic"), default="emoji",
                    help="emoji: Twemoji captioned by their CLDR labels and tags, in German then in English (fetched "
                         "from the npm registry into HOME/sources the first time, ~65 MB), trained with er (experience "
                         "replay) unless --method, then searched for named emoji; synthetic: synthesised domain tasks + "
                         "handwritten digits, trained with finetune unless --method, also what the demo falls back to "
                         "when the registry cannot be reached")
    dm.add_argument("--out", metavar="DIR", help="where the demo's tasks go (default: a new demo-DATE-TIME folder in "
                    "Settings data_dir)")
    dm.add_argument("--tasks", type=int, help="the synthetic world's domain tasks (default 3; the digits task is added "
                    "last)")
    dm.add_argument("--seed", type=int, default=0, help="the random seed of the data and of training")
    dm.add_argument("--no-serve", action="store_true", help="stop after training (no indexing, promotion or serving)")
    dm.add_argument("--cluster", action="store_true",
                    help="the cluster path on this machine instead: 2 `ray start` nodes, `mlflow server`, the RayJobs "
                         "of `clipstream k8s stream` through the Jobs API, the chart's RayService config `serve deploy`ed "
                         "(needs helm: `make cluster-demo`; --tasks domain tasks, no digits task)")
    training_args(dm)
    dm.set_defaults(func=demo._demo, method=None)  # (the world's: see --world)
    for name, text in EXAMPLES.items():
        sub.choices[name].epilog = text
    return p
