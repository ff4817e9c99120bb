"""Each method's training step against finetune's, timed side by side in one process on the same batches.

    clipstream bench method-step [--methods finetune,ewc,...] [--steps 10] [--rounds 5] [--batch 32]

The methods table (`clipstream bench methods`) times the step inside task jobs, where two workers share
two cores with Ray Data's tasks, and a method's step varies by ±15% from task to task. Here every
method runs the engine's own step (`clipstream.training.engine.train_step`) on its own DeepSpeed engine with one
thread, as one of the job's workers does, in the state of a second task: its first task's state
(importances, replay buffer, queues) in place and θ(t−1) as the teacher. The methods take turns for
`--rounds` rounds; each method's median over rounds of its mean step is compared with finetune's.
(Replay and joint add rows, not step work: their step is finetune's.) Writes
benchmarks/results/method-step.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import deepspeed
import torch

from clipstream import models
from clipstream.benchmarks import report
from clipstream.training import methods
from clipstream.training.data.synth import synthesize
from clipstream.training.data.task import Task
from clipstream.training.engine import (
    deepspeed_config,
    param_groups,
    prepare_for_deepspeed,
    train_step,
)
from clipstream.training.methods.base import TaskContext, frozen
from clipstream.training.methods.config import method_presets, resolve


def batches(task: Task, bundle, size: int, count: int) -> list[dict]:
    """`count` batches of the task's first rows, preprocessed as the evaluation does (no random crop)."""
    rows = task.check("train").rows[: size * count]
    images = [bundle.preprocess_val(models.load_image(task.image(row))) for row in rows]
    texts = bundle.tokenizer([row["caption"] for row in rows])
    return [{"image": torch.stack(images[i:i + size]), "text": texts[i:i + size]} for i in range(0, len(rows), size)]


def second_task(name: str, task: Task, data: list[dict], batch: int):
    """An engine, the method and its context as a task job has them on its second task."""
    config = resolve(name, [f"train.micro_batch={batch}"])
    train = config["train"]
    torch.manual_seed(0)
    model = prepare_for_deepspeed(models.create(config["model"]["arch"]).model)
    method = methods.build(config)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, train["weight_decay"], train["lr"], method.lr_scale),
                                      config=deepspeed_config(train, 1, 10**6))
    current = {"task": task.name, "path": str(task.root)}
    first = TaskContext(model=engine.module, task_index=0, rank=0, world_size=1, device=engine.device, current=current)
    method.before_task(first)
    for b in data:
        train_step(engine, method, first, b)
    method.after_task(first, data[-method.task_end_batches:] if method.task_end_batches else [])
    teacher = frozen(copy.deepcopy(engine.module)) if method.needs_teacher else None
    ctx = TaskContext(model=engine.module, task_index=1, rank=0, world_size=1, device=engine.device,
                      teacher=teacher, current={**current, "task": "next"})
    method.before_task(ctx)
    return engine, method, ctx


def timed(engine, method, ctx, data: list[dict], steps: int) -> float:
    """Mean ms of `steps` steps, cycling over the batches."""
    tic = time.perf_counter()
    for i in range(steps):
        train_step(engine, method, ctx, data[i % len(data)])
    return 1000 * (time.perf_counter() - tic) / steps


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default=",".join(method_presets()), help="comma-separated presets (default: all)")
    parser.add_argument("--steps", type=int, default=10, help="steps per method per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a job's CPU worker has 1 of 2 cores)")
    parser.add_argument("--out", default=str(report.RESULTS / "method-step.md"))
    args = parser.parse_args(argv)
    names = args.methods.split(",")
    if "finetune" not in names:
        parser.error("--methods must include finetune, the baseline")
    torch.set_num_threads(args.threads)
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")})
    deepspeed.init_distributed(dist_backend="gloo")

    with tempfile.TemporaryDirectory() as tmp:
        task = Task.load(synthesize(Path(tmp) / "data", tasks=1, digits=False, train_pairs=400, progress=False)[0])
        arch = resolve("finetune")["model"]["arch"]
        data = batches(task, models.create(arch), args.batch, 4)
        setups = {}
        for name in names:
            print(f"[setup] {name}: a first task, then the second task's state", flush=True)
            setups[name] = second_task(name, task, data, args.batch)
            timed(*setups[name], data, 2)  # warm-up
        per_round = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names:
                per_round[name].append(timed(*setups[name], data, args.steps))
            print(f"[round {r + 1}/{args.rounds}] " + " ".join(f"{n}={per_round[n][-1]:.0f}ms" for n in names), flush=True)

    median = {name: statistics.median(v) for name, v in per_round.items()}
    base = median["finetune"]
    text = report.write(args.out, [
        "# Training step per method, side by side",
        "",
        f"Reproduce: `clipstream bench method-step --methods {args.methods} --steps {args.steps} "
        f"--rounds {args.rounds} --batch {args.batch} --threads {args.threads}`",
        "",
        f"Device: {report.device(f'{args.threads} torch thread(s)')}. Model `{arch}`, micro batch {args.batch}, one "
        "DeepSpeed engine per method, each in the state of its second task; the median over rounds of each method's "
        "mean step.",
        "",
        *report.table(["method", "step ms", "×finetune", "rounds (ms)"],
                      [[name, median[name], f"{median[name] / base:.2f}", ", ".join(f"{v:.0f}" for v in per_round[name])]
                       for name in names])])
    print(text)
    return text


if __name__ == "__main__":
    main()
