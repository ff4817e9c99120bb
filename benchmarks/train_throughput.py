"""Training throughput: clipstream's task job (Ray Data → Ray Train → DeepSpeed) vs a plain PyTorch
open_clip loop on the same data, model, batch size and optimizer; and the job on 2 workers with ZeRO
stage 0 vs 2 (samples/s and each worker's peak memory). Measured side by side in one run.

    clipstream bench train-throughput [--pairs 2000] [--epochs 3] [--batch 32] [--rounds 2]
                                      [--zero-stages 0,2] [--zero-workers 2] [--zero-rounds 1] [--arch ARCH]
                                      [--extra-arch ViT-B-32 --extra-pairs 48 --extra-batch 8 --extra-epochs 2]

Each side reports steady-state samples/s of its last epoch (the first epochs carry start-up: Ray
Data planning, DeepSpeed op builds, DataLoader worker spawn); the sides alternate for `--rounds` rounds
and the medians are compared, since a 2-core machine drifts by ±10% between runs (the ZeRO jobs, which
cost a minute each, run in the first `--zero-rounds` rounds). A worker's peak
memory is the peak resident set (VmHWM) of its Ray Train worker process, sampled from outside the job
every 0.2 s; next to it, ZeRO's own count of the model states a worker holds (fp32 params, grads and
AdamW's two moments: 16 bytes per parameter at stage 0; 4 + 16/N at stage 2 on N workers).
Ray starts its workers 15 nice levels below the driver, where the plain loop runs; here they run at the
driver's priority (RAY_worker_niceness=0), so that on a busy machine both sides compete on equal terms.
`--arch` is any open_clip architecture by name. In the same run, `--extra-arch` (a real CLIP such as ViT-B-32) is
measured after it, one round of both sides on `--extra-pairs` pairs at `--extra-batch`, as its own section (its ratio
as measured: the target is set for the small model). Target: the job ≥ 0.95× the plain loop at 1 worker. Writes benchmarks/results/train-throughput.md and
train-throughput.json (the check).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

from clipstream.benchmarks import report
from clipstream.benchmarks.processes import JobCost

TARGET = 0.95  # the job on 1 worker ÷ the plain loop
MIB = 1 << 20
WORKER_NICENESS = "RAY_worker_niceness"  # Ray starts its workers this much nicer than the raylet (default 15)


class Pairs:
    """The task's training pairs as a map-style dataset: (preprocessed image, tokens)."""

    def __init__(self, task, preprocess, tokenizer):
        self.task, self.rows, self.preprocess, self.tokenizer = task, task.check("train").rows, preprocess, tokenizer

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        from clipstream import models

        row = self.rows[i]
        return self.preprocess(models.load_image(self.task.image(row))), self.tokenizer([row["caption"]])[0]


def plain_pytorch(task, arch: str, batch: int, epochs: int, lr: float) -> dict:
    """The loop an open_clip user would write: DataLoader, AdamW, ClipLoss. Returns the last epoch's
    samples/s ("rate") and its mean step time in ms (batch in hand to optimizer step done), as the engine
    reports, the loop's wall seconds, model creation included, and the CPU seconds of its process and of its
    DataLoader worker ("cpu_by")."""
    import torch
    from open_clip.loss import ClipLoss
    from torch.utils.data import DataLoader

    from clipstream import models

    wall, own, children = time.perf_counter(), _cpu_s(resource.RUSAGE_SELF), _cpu_s(resource.RUSAGE_CHILDREN)
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
    del loader  # its worker exits and is waited for: its CPU time joins RUSAGE_CHILDREN
    return {"rate": rate, "step_ms": 1000 * busy / max(steps, 1), "seconds": time.perf_counter() - wall,
            "cpu_by": {"the loop's process": _cpu_s(resource.RUSAGE_SELF) - own,
                       "DataLoader worker": _cpu_s(resource.RUSAGE_CHILDREN) - children}}


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def clipstream_job(task_dir: Path, arch: str, batch: int, epochs: int, lr: float, home: Path, workers: int = 1,
                   extra: Sequence[str] = ()) -> dict:
    """The task job (`clipstream train`'s), its last epoch's samples/s (all workers) and step ms from the run's
    metrics, each worker's peak memory in MiB, the job's wall seconds (Ray start-up, data, training,
    evaluation, registration) and its CPU seconds by kind of process ("cpu_by")."""
    from clipstream.registry import Registry
    from clipstream.settings import Settings
    from clipstream.training.job import run_task

    settings = Settings(home=home)
    with JobCost() as cost:
        result = run_task(task_dir, "finetune", None, workers=workers, settings=settings,
                          overrides=[f"model.arch={arch}", f"train.micro_batch={batch}", f"train.epochs={epochs}",
                                     f"train.lr={lr}", "train.log_every=1000000", *extra])
    metrics = Registry(settings).run_metrics(result.run_id)
    return {"rate": metrics["train/samples_per_s"], "step_ms": metrics["train/step_ms"], "peak_mib": cost.worker_peaks_mib,
            "seconds": result.seconds, "cpu_by": cost.cpu_by_process}


def model_state_mib(params: int, stage: int, workers: int) -> float:
    """ZeRO's count of one worker's fp32 model states with AdamW: params, grads and two moments (16 B/param) at
    stage 0; at stage 2 the module's params stay whole (4 B) and the master copy, grads and moments are split."""
    per_param = 16.0 if stage == 0 else 4.0 + 16.0 / workers if stage in (1, 2) else 16.0 / workers
    return params * per_param / MIB


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> str:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="micro batch per worker")
    p.add_argument("--arch", default="clipstream-vit-tiny", help="any open_clip architecture by name")
    p.add_argument("--extra-arch", default="", metavar="ARCH",
                   help="also measure this model (e.g. ViT-B-32) after --arch's, in the same run, as its own section")
    p.add_argument("--extra-pairs", type=int, default=48, help="--extra-arch's training pairs")
    p.add_argument("--extra-batch", type=int, default=8, help="--extra-arch's micro batch")
    p.add_argument("--extra-epochs", type=int, default=2, help="--extra-arch's epochs (the last one is measured)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--zero-stages", default="0,2", help="ZeRO stages compared on --zero-workers workers (none: skip)")
    p.add_argument("--zero-workers", type=int, default=2)
    p.add_argument("--zero-rounds", type=int, default=1, help="rounds that also run the ZeRO jobs (the first ones)")
    p.add_argument("--out", default=str(report.RESULTS / "train-throughput.md"))
    args = report.parse(p, argv)
    stages = [] if args.zero_stages.strip().lower() in ("", "none") else [int(s) for s in args.zero_stages.split(",")]

    import torch

    from clipstream import models
    from clipstream.training.data.synth import synthesize
    from clipstream.training.data.task import Task

    for name in filter(None, [args.arch, args.extra_arch]):
        models.architecture(name)  # an unknown name: one line, before anything runs
    os.environ.setdefault(WORKER_NICENESS, "0")  # (read when this process starts Ray, in the first job)
    wall, load = time.perf_counter(), os.getloadavg()[0]
    runs: dict = {"plain": [], "clipstream": [], "zero": {s: [] for s in stages}}
    extra = None
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = synthesize(Path(tmp) / "data", tasks=1, seed=0, train_pairs=args.pairs, test_per_task=32, digits=False)[0]
        task = Task.load(task_dir)
        for r in range(args.rounds):
            runs["plain"].append(plain_pytorch(task, args.arch, args.batch, args.epochs, 1e-3))
            runs["clipstream"].append(clipstream_job(task_dir, args.arch, args.batch, args.epochs, 1e-3,
                                                     Path(tmp) / f"home{r}"))
            for s in stages if r < args.zero_rounds else ():
                runs["zero"][s].append(clipstream_job(task_dir, args.arch, args.batch, args.epochs, 1e-3,
                                                      Path(tmp) / f"home{r}-zero{s}", args.zero_workers,
                                                      [f"train.zero_stage={s}"]))
            print(f"[round {r + 1}/{args.rounds}] plain {runs['plain'][-1]['rate']:.0f}, clipstream "
                  f"{runs['clipstream'][-1]['rate']:.0f}" + "".join(
                      f", ZeRO {s} x{args.zero_workers} {runs['zero'][s][-1]['rate']:.0f} samples/s "
                      f"(peak {', '.join(f'{m:.0f}' for m in runs['zero'][s][-1]['peak_mib'])} MiB)"
                      for s in stages if r < args.zero_rounds),
                  flush=True)
        if args.extra_arch:
            extra_dir = synthesize(Path(tmp) / "extra", tasks=1, seed=0, train_pairs=args.extra_pairs, test_per_task=32,
                                   digits=False)[0]
            plain = plain_pytorch(Task.load(extra_dir), args.extra_arch, args.extra_batch, args.extra_epochs, 1e-3)
            ours = clipstream_job(extra_dir, args.extra_arch, args.extra_batch, args.extra_epochs, 1e-3,
                                  Path(tmp) / "home-extra")
            extra = {"arch": args.extra_arch, "batch": args.extra_batch, "pairs": args.extra_pairs,
                     "epochs": args.extra_epochs, "params": count_params(args.extra_arch),
                     "runs": {"plain": [plain], "clipstream": [ours]}}
            print(f"[{args.extra_arch}] plain {plain['rate']:.1f}, clipstream {ours['rate']:.1f} samples/s", flush=True)
    params = count_params(args.arch)
    command = (f"clipstream bench train-throughput --pairs {args.pairs} --epochs {args.epochs} --batch {args.batch} "
               f"--arch {args.arch} --rounds {args.rounds} --zero-stages {','.join(map(str, stages)) or 'none'}"
               + (f" --zero-workers {args.zero_workers} --zero-rounds {args.zero_rounds}" if stages else "")
               + (f" --extra-arch {args.extra_arch} --extra-pairs {args.extra_pairs} --extra-batch {args.extra_batch} "
                  f"--extra-epochs {args.extra_epochs}" if args.extra_arch else "")
               + f" --out {args.out}")
    device = report.device(f"{torch.get_num_threads()} torch threads",
                           f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    text = throughput_report(runs, Path(args.out), command, device, args.arch, args.batch, args.pairs, args.epochs,
                             args.zero_workers, params, time.perf_counter() - wall, extra)
    print(text)
    print(json.dumps(verdict(runs)))
    return text


def count_params(arch: str) -> int:
    from clipstream import models

    return sum(t.numel() for t in models.create(arch).model.parameters())


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _wall(runs: list[dict]) -> str:
    seconds = [r["seconds"] for r in runs if "seconds" in r]
    return f"{statistics.median(seconds):.0f}" if seconds else "-"


def _peaks(runs: list[dict]) -> list[float]:
    """Each worker's peak over rounds (workers ranked by their peak within a round)."""
    width = max((len(r["peak_mib"]) for r in runs), default=0)
    return [statistics.median(r["peak_mib"][i] for r in runs if len(r["peak_mib"]) > i) for i in range(width)]


def verdict(runs: dict) -> dict:
    plain, ours = _median(runs["plain"], "rate"), _median(runs["clipstream"], "rate")
    out = {"plain": plain, "clipstream": ours, "ratio": ours / plain, "target": TARGET, "pass": ours / plain >= TARGET,
           "plain_step_ms": _median(runs["plain"], "step_ms"), "clipstream_step_ms": _median(runs["clipstream"], "step_ms")}
    zero = {s: {"samples_per_s": _median(r, "rate"), "peak_mib": _peaks(r)} for s, r in runs.get("zero", {}).items() if r}
    if zero:
        out["zero"] = zero
        if 0 in zero:
            for s in zero:
                zero[s]["vs_zero0"] = zero[s]["samples_per_s"] / zero[0]["samples_per_s"]
    return out


def throughput_report(runs: dict, out: Path, command: str, device: str, arch: str, batch: int, pairs: int, epochs: int,
                      zero_workers: int, params: int, seconds: float | None = None, extra: dict | None = None) -> str:
    """Write the tables to `out` and return the markdown. `runs`: "plain" and "clipstream" -> per round {"rate":
    samples/s, "step_ms"}; "zero" -> stage -> per round {"rate", "step_ms", "peak_mib": per worker}. `extra`: the
    --extra-arch section, {"arch", "batch", "pairs", "epochs", "params", "runs": "plain" and "clipstream" as above}."""
    v = verdict(runs)
    plain, ours = v["plain"], v["clipstream"]
    rounds = lambda rs: ", ".join(f"{r['rate']:.0f}" for r in rs)  # noqa: E731
    lines = [f"# Training throughput, {arch}, batch {batch}, {pairs} pairs, last of {epochs} epochs", "",
             f"Reproduce: `{command}`", "",
             f"Device: {device}." + (f" Wall time {seconds / 60:.1f} min." if seconds else ""), "",
             "Step = batch in hand to optimizer step done; the rest of each step's share of the epoch is waiting for input. "
             "Wall = the whole loop or task job (for the job: Ray start-up, data, training, evaluation, registration).",
             "", *sides(runs, batch)]
    if extra:
        lines += ["", f"## {extra['arch']}, batch {extra['batch']}, {extra['pairs']} pairs, last of {extra['epochs']} "
                      "epochs", "",
                  f"The same two sides in the same run on `{extra['arch']}` ({extra['params'] / 1e6:.0f} M parameters), "
                  "one round each. The ratio is as measured; the target below is set for the small model.", "",
                  *sides(extra["runs"], extra["batch"])]
    if v.get("zero"):
        lines += ["", f"## ZeRO stages on {zero_workers} workers", "",
                  f"The same job on {zero_workers} Ray Train workers (micro batch {batch} each), `--set "
                  "train.zero_stage=S`. samples/s = all workers' samples in the last epoch ÷ its time. Peak memory = "
                  "the peak resident set (VmHWM) of each worker's process, median over rounds (it includes the "
                  f"~hundreds of MiB of torch and Ray every process maps); model states = ZeRO's count for "
                  f"{params / 1e6:.2f} M parameters (fp32 params, grads, AdamW moments).", ""]
        rows = []
        for s, z in v["zero"].items():
            rows.append([s, z["samples_per_s"], rounds(runs["zero"][s]), f"{z['vs_zero0']:.2f}" if "vs_zero0" in z else "-",
                         _median(runs["zero"][s], "step_ms"), " / ".join(f"{m:.0f}" for m in z["peak_mib"]) or "-",
                         f"{max(z['peak_mib']) - max(v['zero'][0]['peak_mib']):+.0f}" if 0 in v["zero"] and z["peak_mib"]
                         and v["zero"][0]["peak_mib"] else "-",
                         model_state_mib(params, s, zero_workers), _wall(runs["zero"][s])])
        lines += report.table(["ZeRO stage", "samples/s (median)", "rounds", "×ZeRO 0", "step ms (median)",
                               "peak memory per worker (MiB)", "max peak vs ZeRO 0 (MiB)", "model states per worker (MiB)",
                               "wall s (median)"], rows)
    cpu = cpu_per_pair(runs, pairs * epochs)
    lines += cpu_lines(cpu, pairs, epochs)
    why = "" if v["pass"] or not cpu else (
        f"the job's step {v['clipstream_step_ms']:.0f} ms, the loop's {v['plain_step_ms']:.0f} ms; waiting for input "
        f"{_waiting(ours, v['clipstream_step_ms'], batch)} of the job's epoch, {_waiting(plain, v['plain_step_ms'], batch)}"
        " of the loop's: Ray Data starts each epoch's pipeline afresh and yields the worker's first batch once its "
        "local shuffle buffer holds half of train.shuffle_buffer rows. On 2 cores the wait and the step trade off "
        "(while the worker waits, Ray Data's tasks have the cores), so samples/s follows the CPU per pair trained: the "
        f"job {cpu['clipstream']['all']:.1f} ms, the loop {cpu['plain']['all']:.1f} ms (the table above)")
    lines += ["", *report.targets(out, [report.check("clipstream ÷ plain PyTorch samples/s, 1 worker", ours / plain,
                                                     at_least=TARGET, why=why)])]
    lines += ["", f"Verdict: clipstream at 1 worker is {ours / plain:.2f}× the plain loop (target ≥ {TARGET:.2f}: "
              + ("met" if v["pass"] else "NOT met") + ")." + "".join(
                  f" ZeRO {s} on {zero_workers} workers: {z['vs_zero0']:.2f}× ZeRO 0's samples/s" +
                  (f", peak {max(z['peak_mib']):.0f} MiB vs {max(v['zero'][0]['peak_mib']):.0f} MiB."
                   if z["peak_mib"] and v["zero"][0]["peak_mib"] else ".")
                  for s, z in v.get("zero", {}).items() if s != 0 and "vs_zero0" in z)]
    return report.write(out, lines)


def sides(runs: dict, batch: int) -> list[str]:
    """The plain loop and the job side by side: samples/s, their ratio, step ms, the wait for input, wall s."""
    v = verdict({"plain": runs["plain"], "clipstream": runs["clipstream"]})
    plain, ours = v["plain"], v["clipstream"]
    # (a decimal below 10 samples/s: a real CLIP on a CPU trains a few a second or less)
    rounds = lambda rs: ", ".join(f"{r['rate']:.{0 if r['rate'] >= 10 else 1}f}" for r in rs)  # noqa: E731
    return report.table(["loop", "samples/s (median)", "rounds", "ratio", "step ms (median)", "waiting for input",
                         "wall s (median)"], [
        ["plain PyTorch (DataLoader + AdamW + ClipLoss, 1 process)", plain, rounds(runs["plain"]), "1.00",
         v["plain_step_ms"], _waiting(plain, v["plain_step_ms"], batch), _wall(runs["plain"])],
        ["clipstream (Ray Data → Ray Train, 1 DeepSpeed worker)", ours, rounds(runs["clipstream"]),
         f"{ours / plain:.2f}", v["clipstream_step_ms"], _waiting(ours, v["clipstream_step_ms"], batch),
         _wall(runs["clipstream"])]])


def cpu_per_pair(runs: dict, trained: int) -> dict[str, dict[str, float]]:
    """ms of CPU per pair trained (`trained` = pairs × epochs) by process, median over rounds, for each side whose
    runs recorded it ("all": the whole side); empty when either side did not (a run from before the breakdown)."""
    out = {}
    for side in ("plain", "clipstream"):
        recorded = [r["cpu_by"] for r in runs[side] if r.get("cpu_by")]
        if not recorded:
            return {}
        kinds = {k for by in recorded for k in by}
        per = {k: 1000 * statistics.median(by.get(k, 0.0) for by in recorded) / trained for k in kinds}
        out[side] = {**dict(sorted(per.items(), key=lambda kv: -kv[1])),
                     "all": 1000 * statistics.median(sum(by.values()) for by in recorded) / trained}
    return out


def cpu_lines(cpu: dict, pairs: int, epochs: int) -> list[str]:
    """Where each side's CPU goes, per pair trained."""
    if not cpu:
        return []
    rows = [[side, kind, f"{ms:.2f}"] for side, by in cpu.items() for kind, ms in by.items() if kind != "all" and ms >= 0.005]
    rows += [[side, "**all**", f"**{by['all']:.2f}**"] for side, by in cpu.items()]
    return ["", "## Where each side's CPU goes", "",
            f"CPU ms per pair trained ({pairs} pairs × {epochs} epochs), median over rounds, over the whole loop or job: "
            "for the plain loop its own process (model creation, the steps) and its DataLoader worker (decoding and "
            "augmenting images); for the job, each kind of process it started: the Ray Train worker (process start, "
            "imports, DeepSpeed's initialisation, the steps, Ray Data's batch iterator, the checkpoint), the workers "
            "that run Ray Data's read and preprocessing tasks (each a new process that imports torch and open_clip "
            "before its first batch), the Train controller and the helper actors, and the driver (planning, "
            "evaluation, registration). On 2 cores both sides are CPU-bound, so samples/s follows the CPU per pair. "
            "The step itself is not where the job's extra goes: `method-step.md` times clipstream's finetune step "
            "(DeepSpeed engine and method lifecycle) against a plain open_clip + AdamW step on the same batches.", "",
            *report.table(["side", "process", "CPU ms per pair"], rows)]


def _waiting(rate: float, step_ms: float, batch: int) -> str:
    """The share of the epoch's time per step not spent in the step itself."""
    per_step_ms = 1000 * batch / rate
    return f"{max(0.0, 1 - step_ms / per_step_ms):.0%}"


if __name__ == "__main__":
    from clipstream.settings import configure_process

    configure_process()  # (under `clipstream bench` the CLI does it)
    main()
