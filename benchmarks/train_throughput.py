"""Training throughput: clipstream's task job (Ray Data → Ray Train → DeepSpeed) vs a plain PyTorch
open_clip loop on the same data, model, batch size and optimizer, measured side by side in one run.

    clipstream bench train-throughput [--pairs 2000] [--epochs 3] [--batch 32] [--rounds 2]

Each side reports steady-state samples/s of its last epoch (the first epochs carry start-up: Ray
Data planning, DeepSpeed op builds, DataLoader worker spawn); the two alternate for `--rounds` rounds
and the medians are compared, since a 2-core machine drifts by ±10% between runs.
Writes benchmarks/results/train-throughput.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch
from open_clip.loss import ClipLoss
from torch.utils.data import DataLoader, Dataset

from clipstream import models
from clipstream.benchmarks import report
from clipstream.registry import Registry
from clipstream.settings import Settings
from clipstream.training.data.synth import synthesize
from clipstream.training.data.task import Task
from clipstream.training.job import run_task


class Pairs(Dataset):
    def __init__(self, task: Task, preprocess, tokenizer):
        self.task, self.rows, self.preprocess, self.tokenizer = task, task.check("train").rows, preprocess, tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return self.preprocess(models.load_image(self.task.image(row))), self.tokenizer([row["caption"]])[0]


def plain_pytorch(task: Task, arch: str, batch: int, epochs: int, lr: float) -> tuple[float, float]:
    """The loop an open_clip user would write: DataLoader, AdamW, ClipLoss. Returns the last epoch's
    samples/s and its mean step time in ms (batch in hand to optimizer step done), as the engine reports."""
    torch.manual_seed(0)
    bundle = models.create(arch)
    model = bundle.model.train()
    loader = DataLoader(Pairs(task, bundle.preprocess_train, bundle.tokenizer), batch_size=batch, shuffle=True,
                        drop_last=True, num_workers=1, persistent_workers=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    loss_fn = ClipLoss()
    rate, busy, steps = 0.0, 0.0, 0
    for _ in range(epochs):
        tic, seen, steps, busy = time.perf_counter(), 0, 0, 0.0
        for images, texts in loader:
            start = time.perf_counter()
            img, txt, scale = model(images, texts)[:3]
            loss = loss_fn(img, txt, scale)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            busy += time.perf_counter() - start
            seen, steps = seen + images.shape[0], steps + 1
        rate = seen / (time.perf_counter() - tic)
        print(f"[plain] epoch samples/s {rate:.1f}", flush=True)
    return rate, 1000 * busy / max(steps, 1)


def clipstream_job(task_dir: Path, arch: str, batch: int, epochs: int, lr: float, home: Path) -> tuple[float, float]:
    settings = Settings(home=home)
    result = run_task(task_dir, "finetune", None, workers=1, settings=settings,
                      overrides=[f"model.arch={arch}", f"train.micro_batch={batch}", f"train.epochs={epochs}",
                                 f"train.lr={lr}", "train.log_every=1000000"])
    registry = Registry(settings)
    metrics = registry.run_metrics(result.run_id)
    return metrics["train/samples_per_s"], metrics["train/step_ms"]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--arch", default="clipstream-vit-tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(report.RESULTS / "train-throughput.md"))
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        task_dir = synthesize(Path(tmp) / "data", tasks=1, seed=0, train_pairs=args.pairs, test_per_task=32, digits=False)[0]
        task = Task.load(task_dir)
        plain_runs, our_runs = [], []
        for r in range(args.rounds):
            plain_runs.append(plain_pytorch(task, args.arch, args.batch, args.epochs, 1e-3))
            our_runs.append(clipstream_job(task_dir, args.arch, args.batch, args.epochs, 1e-3, Path(tmp) / f"home{r}"))
        plains, oursl = [r for r, _ in plain_runs], [r for r, _ in our_runs]
        plain, ours = statistics.median(plains), statistics.median(oursl)
        plain_step, our_step = statistics.median(s for _, s in plain_runs), statistics.median(s for _, s in our_runs)

    text = report.write(args.out, [
        f"# Training throughput, {args.arch}, batch {args.batch}, {args.pairs} pairs, last of {args.epochs} epochs", "",
        f"Device: {report.device(f'{torch.get_num_threads()} torch threads')}. Command: `clipstream bench "
        f"train-throughput --pairs {args.pairs} --epochs {args.epochs} --batch {args.batch} --arch {args.arch} "
        f"--rounds {args.rounds}`", "",
        "Step = batch in hand to optimizer step done; the rest of each step's share of the epoch is waiting for input.",
        "",
        *report.table(["loop", "samples/s (median)", "rounds", "ratio", "step ms (median)", "waiting for input"], [
            ["plain PyTorch (DataLoader + AdamW + ClipLoss, 1 process)", plain, ", ".join(f"{v:.0f}" for v in plains),
             "1.00", plain_step, _waiting(plain, plain_step, args.batch)],
            ["clipstream (Ray Data → Ray Train, 1 DeepSpeed worker)", ours, ", ".join(f"{v:.0f}" for v in oursl),
             f"{ours / plain:.2f}", our_step, _waiting(ours, our_step, args.batch)]])])
    print(text)
    print(json.dumps({"plain": plain, "clipstream": ours, "ratio": ours / plain, "plain_step_ms": plain_step,
                      "clipstream_step_ms": our_step}))
    return text


def _waiting(rate: float, step_ms: float, batch: int) -> str:
    """The share of the epoch's time per step not spent in the step itself."""
    per_step_ms = 1000 * batch / rate
    return f"{max(0.0, 1 - step_ms / per_step_ms):.0%}"


if __name__ == "__main__":
    main()
