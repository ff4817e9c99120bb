"""`clipstream data`: synthesise the benchmark's tasks, check a task folder."""

from __future__ import annotations

from clipstream import console


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
    task.split("test")  # what training evaluates on: a task without it is refused before its job, so here too
    for split in task.splits:
        check = task.check(split, args.on_bad_image)
        print(f"{task.name} {split}: {len(check.rows)} rows ok, {len(check.skipped)} skipped")
        for line in check.skipped:
            print(f"  skipped {line}")


def _import(args) -> None:
    from pathlib import Path

    from clipstream.training.data.importers import import_task, read_pairs

    source, out = Path(args.source), Path(args.out)
    pairs = read_pairs(args.format, source, Path(args.image_root) if args.image_root else None, args.img_key,
                       args.caption_key, args.separator)
    task = import_task(pairs, out, args.name or out.name, split=args.split, test_fraction=args.test_fraction,
                       seed=args.seed, kind="language" if args.lang else "domain", lang=args.lang,
                       description=f"imported from {source} ({args.format})")
    counts = ", ".join(f"{split} {len(task.check(split).rows)}" for split in task.splits)
    print(f"{out}: task {task.name!r}, pairs {counts}")
