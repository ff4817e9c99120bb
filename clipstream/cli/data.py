"""`clipstream data`: synthesise the benchmark's tasks, import and check a task folder, fetch open image sets."""

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


def _fetch(args) -> None:
    import json

    from clipstream.settings import Settings
    from clipstream.training.data.sources import fetch

    done = fetch(Settings(), list(dict.fromkeys(args.sources)), refetch=args.refetch)
    rows = [{"source": f.source.name, "licence": f.source.licence, "attribution": f.source.attribution,
             "homepage": f.source.homepage, "packages": [{"package": p.name, "version": p.version, "path": str(d)}
                                                         for p, d in zip(f.source.packages, f.dirs)]} for f in done]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(f"{row['source']}: {row['licence']}; {row['attribution']} ({row['homepage']})")
        for package in row["packages"]:
            print(f"  {package['package']}@{package['version']} {package['path']}")


def _stream(args) -> None:
    from pathlib import Path

    from clipstream.cli.render import print_json
    from clipstream.settings import Settings
    from clipstream.training.data.emoji import DEFAULT_LANGS, TARGET_TEST_PAIRS, packages, write_stream
    from clipstream.training.data.sources import package_dir

    if args.langs and args.name != "emoji-languages":
        raise ValueError("--langs chooses the locales of emoji-languages; the other streams are captioned in English")
    settings = Settings()
    roots = {package: package_dir(settings, source, package) for source, package in packages(args.name)}
    written = write_stream(args.name, Path(args.out), roots, seed=args.seed, test_fraction=args.test_fraction,
                           image_size=args.image_size, langs=args.langs or DEFAULT_LANGS)
    if args.json:
        return print_json({"stream": args.name, "out": args.out, "tasks": [w.summary() for w in written]})
    for w in written:
        c = w.counts
        print(f"{w.task.root}: train {c['train_pairs']} pairs ({c['train_concepts']} concepts), test {c['test_pairs']} "
              f"pairs ({c['test_concepts']} concepts), {w.seconds:.0f} s")
    small = [f"{w.task.name} ({w.counts['test_pairs']})" for w in written if w.counts["test_pairs"] < TARGET_TEST_PAIRS]
    if small:  # (the concept split is shared: a small group has few test concepts; its Rm is the noisier for it)
        print(f"test galleries under {TARGET_TEST_PAIRS} pairs: {', '.join(small)}", file=console.err())


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
