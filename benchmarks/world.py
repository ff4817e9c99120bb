"""`clipstream bench world`: version 0 of the emoji world, pretrained on this machine and registered, scored on each
stream's first task beside its floors.

    clipstream bench world [--work DIR] [--workers 1] [--set train.epochs=N ...] [--out benchmarks/results/world.md]
    clipstream bench world --candidates MINUTES [--out benchmarks/results/world-model.md]

1. data: the sources fetched (`clipstream data fetch`, cached under Settings home), the pretraining corpus and the
   three streams written (`clipstream data stream`) under WORK/data at the preset's image size (kept between runs);
2. pretraining: `clipstream train --task WORK/data/pretrain/emoji-pretrain --method pretrain-emoji` from random
   weights, as a Ray Train job in a home of its own (WORK/pretrain-home: its runs are not the stream's versions);
3. version 0: that version exported (`clipstream export`) and registered into the settings' registry with
   `clipstream register --from WORK/version0 --evaluate FIRST-TASKS --alias start`: row 0 of every stream trained
   on top of it (`clipstream train --parent start`);
4. scores: version 0's task-known R@1/5/10, both directions, on each stream's first task's test gallery (concepts
   that no version trained on), beside chance (k/N) and a floor that learns nothing: words and pixels (a query's
   score for a gallery image sums, over the corpus's training pairs, the Jaccard overlap of the query's words with
   the pair's caption times the raw-pixel cosine of the pair's image with the gallery image; image queries the
   same matrix transposed; ties broken at random) -- what shared words alone carry across to unseen concepts.

Writes benchmarks/results/world.md and world.png (version 0's top 5 for a few of the styles task's queries).

--candidates: how the preset's model was sized. The preset's model and variants of it (a larger input, wider
towers, deeper towers) each trained for the same wall-clock minutes on the corpus written at its input size, in one
process with the plain open_clip loop (AdamW, ClipLoss, the preset's batch, learning rate and weight decay, the rate
on a cosine over the minutes, not the steps: a slower model gets fewer steps, as it would in the hour), then scored
as version 0 is on emoji-styles' first task. Writes benchmarks/results/world-model.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from clipstream.benchmarks import report
from clipstream.settings import Settings

PRESET = "pretrain-emoji"
STREAMS = ("emoji-styles", "emoji-groups", "emoji-languages")
FLOOR_PIXELS = 16  # the words-and-pixels floor compares images at 16x16: a thumbnail's colours and layout
SHOWN = 6  # queries in world.png
# --candidates: the preset's model, then each change alone (each costs ~2x its CPU per pair: 2.25x the image tokens,
# or the towers' width x1.5, or their depth x2)
CANDIDATES = {"preset": {}, "48 px": {"vision_cfg": {"image_size": 48}},
              "width 192": {"embed_dim": 192, "vision_cfg": {"width": 192}, "text_cfg": {"width": 192, "heads": 6}},
              "8+8 layers": {"vision_cfg": {"layers": 8}, "text_cfg": {"layers": 8}}}
STREAM_SETTINGS = ("train.epochs=2",)  # the streams' jobs: a few thousand pairs a task, twice


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="", help="where the data, the pretraining home and version 0's export go "
                                              "(default: Settings data_dir/world)")
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers of the pretraining job (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override the {PRESET} preset (e.g. train.epochs=2 for a short run)")
    p.add_argument("--seed", type=int, default=0, help="the streams' concept split and captions (default 0)")
    p.add_argument("--streams", nargs="?", const=",".join(STREAMS), default="", metavar="NAME,...",
                   help="then train these streams (default: all three) on top of version 0 with finetune and report "
                        "their R matrices")
    p.add_argument("--stream-set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override finetune for the streams' jobs (default: {' '.join(STREAM_SETTINGS)})")
    p.add_argument("--fresh", action="store_true", help="pretrain again even if WORK holds a version 0 already")
    p.add_argument("--candidates", type=float, default=0, metavar="MINUTES",
                   help=f"instead: train each candidate model ({', '.join(CANDIDATES)}) for MINUTES and score it on "
                        "emoji-styles' first task (how the preset's model was sized)")
    p.add_argument("--out", default="", help="default: benchmarks/results/world.md (world-model.md with --candidates)")
    return p


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    args = report.parse(parser(prog), argv)
    settings = Settings()
    work = Path(args.work) if args.work else settings.data_dir / "world"
    trained = [n for n in args.streams.split(",") if n]
    unknown = sorted(set(trained) - set(STREAMS))
    if unknown:
        raise ValueError(f"--streams: unknown {', '.join(unknown)}; choose from {', '.join(STREAMS)}")
    if args.candidates < 0:
        raise ValueError(f"--candidates {args.candidates:g}: give the minutes each candidate trains (> 0)")
    if args.candidates:
        return candidates(settings, work, args.candidates, args.set, args.seed,
                          Path(args.out or report.RESULTS / "world-model.md"))
    return world(settings, work, args.workers, args.set, args.seed, Path(args.out or report.RESULTS / "world.md"),
                 args.stream_set or list(STREAM_SETTINGS), args.fresh, trained)


def world(settings: Settings, work: Path, workers: int = 1, overrides: Sequence[str] = (), seed: int = 0,
          out: Path = report.RESULTS / "world.md", stream_overrides: Sequence[str] = STREAM_SETTINGS,
          fresh: bool = False, trained_streams: Sequence[str] = ()) -> str:
    from clipstream.registry import Registry
    from clipstream.training import methods
    from clipstream.training.job import run_task
    from clipstream.training.version0 import register_version0

    arch = methods.resolve(PRESET, overrides)["model"]["arch"]
    size = _image_size(arch)
    corpus, streams = data(settings, work / "data", size, seed)
    firsts = [tasks[0] for tasks in streams.values()]
    # the pretraining's registry and runs in a home of their own (given as None, a path Settings derives from home)
    home = Settings(home=work / "pretrain-home", **dict.fromkeys(("data_dir", "qdrant_path", "runs_dir", "catalogue_dir",
                                                                  "mlflow_tracking_uri", "mlflow_artifact_root")))
    export, done = work / "version0", work / "version0.json"
    if fresh or not done.exists():  # (the pretraining is the hour of this benchmark: done once per WORK)
        done.unlink(missing_ok=True)
        tic = time.perf_counter()
        trained = run_task(corpus, PRESET, None, workers, overrides, home, retrain=True)
        if export.exists():
            shutil.rmtree(export)
        Registry(home).export(trained.version, export)
        done.write_text(json.dumps({"seconds": time.perf_counter() - tic, "overrides": list(overrides)}))
    pretrain_s = json.loads(done.read_text())["seconds"]
    # row 0 on every task of every stream: each one's plasticity is measured from version 0's score on it
    registered = register_version0(str(export), [t for tasks in streams.values() for t in tasks], aliases=["start"],
                                   settings=settings)
    scores = version0_scores(export, firsts)
    floors = floor_scores(corpus, [_load(t) for t in firsts], seed)
    figure = out.with_suffix(".png")
    show_top5(export, firsts[0], figure)
    sets = "".join(f" --set {o}" for o in overrides)
    trained = (f" --streams {','.join(trained_streams)}" + "".join(f" --stream-set {o}" for o in stream_overrides)
               if trained_streams else "")
    lines = [
        "# The emoji world: version 0, pretrained here, on each stream's first task",
        "",
        f"Reproduce: `clipstream bench world --workers {workers}{sets} --seed {seed} --out {out}{trained}`",
        "",
        f"Device: {report.device(f'{workers} Ray Train worker(s)')}. Version 0: preset `{PRESET}` "
        f"({arch}, {size} px) trained from random weights on the pretraining "
        f"corpus ({_pairs(corpus, 'train')} pairs: Tabler icons and the streams' train concepts in styles no stream "
        f"shows; see its task.yaml) in **{pretrain_s / 60:.1f} min** (the Ray Train job, start-up and its evaluation "
        f"included), then registered as version {registered.version} "
        "(alias `start`). Each first task's test gallery holds concepts no version trained on (the shared concept "
        f"split, seed {seed}); task-known R@K in percent, image→text / text→image.",
        "",
        *report.table(["task", "test pairs", "scorer", "R@1 i2t/t2i", "R@5 i2t/t2i", "R@10 i2t/t2i", "R@10 mean"],
                      [row for task in map(_load, firsts) for row in _rows(task, scores[task.name],
                                                                             floors[task.name])]),
        "",
        "Floors: chance is k/N; words and pixels learns nothing (see benchmarks/world.py): what the corpus's captions "
        "that share a query's words, and their images' raw pixels, say about an unseen concept. Target (issue 47): "
        "version 0's R@10 ≥ 30 % on the emoji-styles first task.",
        "",
        f"![version 0's top 5 for the first queries of {_load(firsts[0]).name}]({figure.name})",
    ]
    if trained_streams:
        command = f"--streams {','.join(trained_streams)}" + "".join(f" --stream-set {o}" for o in stream_overrides)
        lines += ["", f"## finetune on each stream from version 0 (`{command}`)", "",
                  "R[i][j]: Rm (mean of R@1/5/10, both directions, task-known) on task j's test gallery after "
                  "training task i; row 0 is version 0. Plasticity: R[j][j] minus version 0's score on j; forgetting: "
                  "the best earlier score on j minus the last.", ""]
        for name in trained_streams:
            report.write(out, lines)  # (what is done so far: a stream is tens of minutes of jobs)
            lines += stream_section(settings, name, streams[name], workers, stream_overrides, out, work)
    return report.shown(out, lines)


def stream_section(settings: Settings, name: str, tasks: list[Path], workers: int, overrides: Sequence[str],
                   out: Path, work: Path) -> list[str]:
    """The stream `name` trained on top of version 0 with finetune, task after task; after each task the version is
    scored on every task of the stream (the whole R matrix, the upper triangle too), row 0 being version 0."""
    from clipstream.registry import Registry
    from clipstream.training.evaluate import ResultMatrix
    from clipstream.training.job import run_task

    lines = []
    registry = Registry(settings)
    rows, parent = [], "start"
    for task in [*[None], *tasks]:
        if task is not None:
            parent = run_task(task, "finetune", parent, workers, overrides, settings, retrain=True).version
        folder = work / "versions" / f"{name}-{len(rows)}"
        if folder.exists():
            shutil.rmtree(folder)
        registry.export(parent, folder)
        scores = version0_scores(folder, tasks)
        rows.append([scores[_load(t).name]["Rm"] for t in tasks])
    names = [_load(t).name for t in tasks]
    matrix = ResultMatrix(names, [r[:i + 1] for i, r in enumerate(rows[1:])], baseline=dict(zip(names, rows[0])))
    picture = matrix.heatmap(out.with_name(f"world-{name}.png"), f"{name}: finetune from version 0, Rm")
    plastic = [rows[j + 1][j] - rows[0][j] for j in range(len(names))]
    lines += [f"### {name}", "", *report.table(["after \\ on", *names],
                                              [["version 0", *rows[0]], *([n, *r] for n, r in zip(names, rows[1:]))]),
              "", f"Plasticity per task: {', '.join(f'{p:+.1f}' for p in plastic)}; forgetting: mean "
                  f"{matrix.mean_forgetting():.1f} ({', '.join(f'{t} {f:.1f}' for t, f in matrix.forgetting().items())})"
                  f"; BWT {matrix.bwt():.1f}.", "", f"![{name}]({picture.name})", ""]
    return lines


def data(settings: Settings, root: Path, size: int, seed: int,
         streams: Sequence[str] = STREAMS) -> tuple[Path, dict[str, list[Path]]]:
    """The pretraining corpus and each of `streams`' tasks at `size` px, written once under `root`."""
    from clipstream.training.data import emoji, sources

    names = sorted({source for stream in (*streams, "pretrain") for source, _ in emoji.packages(stream)})
    sources.fetch(settings, names)
    tasks = {}
    for stream in ("pretrain", *streams):
        folder = root / f"{stream}-{size}px-seed{seed}"
        if not (folder / ".complete").exists():
            if folder.exists():
                shutil.rmtree(folder)  # an interrupted write
            roots = {package: sources.package_dir(settings, source, package)
                     for source, package in emoji.packages(stream)}
            emoji.write_stream(stream, folder, roots, seed=seed, image_size=size)
            (folder / ".complete").touch()
        tasks[stream] = sorted(p for p in folder.iterdir() if (p / "task.yaml").exists())
    return tasks["pretrain"][0], {s: tasks[s] for s in streams}


def candidates(settings: Settings, work: Path, minutes: float, overrides: Sequence[str] = (), seed: int = 0,
               out: Path = report.RESULTS / "world-model.md") -> str:
    """Each of CANDIDATES trained for `minutes` and scored on emoji-styles' first task (the module's docstring)."""
    import tempfile

    import open_clip

    from clipstream.training import methods

    preset = methods.resolve(PRESET, overrides)
    rows, written = [], {}
    with tempfile.TemporaryDirectory() as configs:
        for name, config in candidate_configs(preset["model"]["arch"]).items():
            arch = f"clipstream-probe-{len(rows)}"
            (Path(configs) / f"{arch}.json").write_text(json.dumps(config))
            open_clip.add_model_config(Path(configs) / f"{arch}.json")
            size = int(config["vision_cfg"]["image_size"])
            if size not in written:  # (each size's data once: `data` checks every source's cache too)
                written[size] = data(settings, work / "data", size, seed, ["emoji-styles"])
            corpus, streams = written[size]
            trained = probe(arch, _load(corpus), preset["train"], minutes * 60)
            [scores] = evaluate_bundle(trained.pop("bundle"), [streams["emoji-styles"][0]]).values()
            v, t = config["vision_cfg"], config["text_cfg"]
            rows.append([name, f"{size} px / {v['patch_size']}", f"{v['width']} / {t['width']}",
                         f"{v['layers']} + {t['layers']}", f"{trained['params'] / 1e6:.2f}", f"{trained['rate']:.0f}",
                         f"{trained['epochs']:.1f}", f"{scores['Rm']:.1f}",
                         f"{(scores['i2t_R@10'] + scores['t2i_R@10']) / 2:.1f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    sets = "".join(f" --set {o}" for o in overrides)
    lines = ["# The emoji world: how version 0's model was sized", "",
             f"Reproduce: `clipstream bench world --candidates {minutes:g}{sets} --seed {seed} --out {out}`", "",
             f"Device: {report.device('one process, plain open_clip loop')}. Each candidate trained for {minutes:g} "
             f"min of wall clock on the pretraining corpus at its input size (batch {preset['train']['micro_batch']}, "
             f"AdamW lr {preset['train']['lr']:g} on a cosine over the minutes, weight decay "
             f"{preset['train']['weight_decay']:g}), then scored on emoji-styles' first task's test gallery as "
             "version 0 is (task-known; R@10 mean of both directions). One seed: a difference of a point or two is "
             "within a rerun's spread.", "",
             *report.table(["model", "input / patch", "width vision / text", "layers", "M params", "pairs/s",
                            "epochs in the time", "Rm", "R@10"], rows), ""]
    return report.shown(out, lines)


def candidate_configs(arch: str) -> dict[str, dict]:
    """Each of CANDIDATES as an open_clip model config: `arch`'s with the candidate's changes."""
    from clipstream import models

    base = models.architecture(arch)
    return {name: {**base, **{k: {**base.get(k, {}), **v} if isinstance(v, dict) else v for k, v in change.items()}}
            for name, change in CANDIDATES.items()}


def probe(arch: str, corpus, train: dict, seconds: float) -> dict:
    """`arch` from random weights trained on `corpus` for `seconds` by the loop an open_clip user writes, the
    learning rate on a cosine over the seconds; its bundle, parameters, pairs/s and epochs of the corpus seen."""
    import math

    import torch
    from open_clip.loss import ClipLoss
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    from clipstream import models
    from clipstream.benchmarks.train_throughput import Pairs

    torch.manual_seed(0)
    bundle = models.create(arch)
    model = bundle.model.train()
    pairs = Pairs(corpus, bundle.preprocess_train, bundle.tokenizer)
    loader = DataLoader(pairs, batch_size=train["micro_batch"], shuffle=True, drop_last=True, num_workers=1,
                        persistent_workers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=train["lr"], weight_decay=train["weight_decay"],
                            betas=tuple(train["betas"]), eps=train["eps"])
    loss_fn, seen, tic = ClipLoss(), 0, time.perf_counter()
    with tqdm(total=round(seconds), desc=f"probe {arch}", unit="s") as bar:
        while time.perf_counter() - tic < seconds:
            for images, texts in loader:
                elapsed = time.perf_counter() - tic
                if elapsed >= seconds:
                    break
                for group in opt.param_groups:
                    group["lr"] = train["lr"] * (train["min_lr_ratio"] + (1 - train["min_lr_ratio"]) * 0.5
                                                 * (1 + math.cos(math.pi * elapsed / seconds)))
                loss = loss_fn(*model(images, texts)[:3])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen += images.shape[0]
                bar.update(round(time.perf_counter() - tic) - bar.n)
    del loader
    model.eval()
    return {"bundle": bundle, "params": sum(p.numel() for p in model.parameters()),
            "rate": seen / (time.perf_counter() - tic), "epochs": seen / len(pairs)}


def version0_scores(export: Path, tasks: Sequence[Path]) -> dict[str, dict[str, float]]:
    """Task-known metrics of the exported model on each task's test split, as training's evaluation computes them."""
    from clipstream import models

    return evaluate_bundle(models.load_exported(export), tasks)


def evaluate_bundle(bundle, tasks: Sequence[Path]) -> dict[str, dict[str, float]]:
    from clipstream.training import evaluate

    return evaluate.evaluate_seen(evaluate.embed_tasks(bundle, [_load(t) for t in tasks]))["known"]


def floor_scores(corpus: Path, tasks: Sequence, seed: int) -> dict[str, dict[str, float]]:
    """The words-and-pixels floor's metrics on each task's test gallery (see the module's docstring), by task name;
    the corpus's rows and pixels read once for all of them."""
    corpus = _load(corpus)
    train = corpus.check("train").rows
    seen = _pixels([corpus.image(r) for r in train])
    return {task.name: _floor(train, seen, task, seed) for task in tasks}


def _floor(train: list[dict], seen: np.ndarray, task, seed: int) -> dict[str, float]:
    from sklearn.feature_extraction.text import CountVectorizer

    from clipstream.training import evaluate

    test = task.check("test").rows
    words = CountVectorizer(binary=True, token_pattern=r"(?u)\b\w+\b").fit([r["caption"] for r in train + test])
    q, c = words.transform([r["caption"] for r in test]), words.transform([r["caption"] for r in train])
    shared = (q @ c.T).toarray()
    jaccard = shared / (np.asarray(q.sum(1)) + np.asarray(c.sum(1)).T - shared).clip(min=1)
    looks = np.maximum(_pixels([task.image(r) for r in test]) @ seen.T, 0)  # gallery x corpus
    scores = jaccard @ looks.T  # query text x gallery image
    scores = scores + 1e-9 * np.random.default_rng(seed).random(scores.shape) * max(1.0, float(np.abs(scores).max()))
    keys = [evaluate.content_key(task.image(r)) for r in test]
    positive = evaluate.positives(keys, [r["caption"] for r in test])
    t2i = evaluate.recall_at_k(scores, positive.T)
    i2t = evaluate.recall_at_k(scores.T, positive)
    return {**{f"i2t_R@{k}": 100 * v for k, v in i2t.items()}, **{f"t2i_R@{k}": 100 * v for k, v in t2i.items()}}


def show_top5(export: Path, task_dir: Path, figure: Path) -> Path:
    """version 0's five best images for SHOWN test captions spread over the task, in one figure."""
    import matplotlib.pyplot as plt
    from PIL import Image

    from clipstream import models

    task = _load(task_dir)
    rows = task.check("test").rows
    bundle = models.load_exported(export)
    images = [task.image(r) for r in rows]
    img = bundle.embed_images(images, 256)
    shown = list(range(0, len(rows), max(1, len(rows) // SHOWN)))[:SHOWN]  # spread over the gallery's groups
    txt = bundle.embed_texts([rows[q]["caption"] for q in shown], 256)
    fig, axes = plt.subplots(SHOWN, 6, figsize=(7, 1.3 * SHOWN))
    for i, q in enumerate(shown):
        best = np.argsort(-(txt[i] @ img.T))[:5]
        axes[i, 0].text(0, 0.5, rows[q]["caption"], fontsize=8, va="center", wrap=True)
        for j, g in enumerate(best, 1):
            axes[i, j].imshow(Image.open(images[g]))
            axes[i, j].set_title("✓" if g == q else "", fontsize=8, color="green")
        for ax in axes[i]:
            ax.axis("off")
    fig.suptitle(f"version 0, {task.name}: a caption's five nearest test images (✓: its own)", fontsize=9)
    return report.save_figure(fig, figure)


def _pixels(images) -> np.ndarray:
    from PIL import Image

    rows = []
    for image in images:
        with Image.open(image) as opened:
            a = np.asarray(opened.convert("RGB").resize((FLOOR_PIXELS, FLOOR_PIXELS), Image.BILINEAR), np.float32)
        a = a.ravel() - a.mean()
        rows.append(a / max(float(np.linalg.norm(a)), 1e-6))
    return np.stack(rows)


def _rows(task, model: dict, floor: dict) -> list[list]:
    n = len(task.check("test").rows)
    chance = {k: 100 * min(k, n) / n for k in (1, 5, 10)}
    both = lambda m, k: f"{m[f'i2t_R@{k}']:.1f} / {m[f't2i_R@{k}']:.1f}"  # noqa: E731
    mean = lambda m: f"{(m['i2t_R@10'] + m['t2i_R@10']) / 2:.1f}"  # noqa: E731
    return [[task.name, n, "version 0", *(both(model, k) for k in (1, 5, 10)), f"**{mean(model)}**"],
            ["", "", "words and pixels (floor)", *(both(floor, k) for k in (1, 5, 10)), mean(floor)],
            ["", "", "chance", *(f"{chance[k]:.1f}" for k in (1, 5, 10)), f"{chance[10]:.1f}"]]


def _load(folder: Path):
    from clipstream.training.data.task import Task

    return Task.load(folder)


def _pairs(folder: Path, split: str) -> int:
    return len(_load(folder).check(split).rows)


def _image_size(arch: str) -> int:
    import open_clip

    from clipstream import models  # noqa: F401  (registers clipstream's model configs with open_clip)

    return int(open_clip.get_model_config(arch)["vision_cfg"]["image_size"])


if __name__ == "__main__":
    main()
