"""The commands on registered versions: `index`, `export`, `compact`, `runs`, `promote`, `rollback`, `follow`,
`history`."""

from __future__ import annotations

from pathlib import Path

from clipstream.cli.render import format_table, print_json, print_promotion
from clipstream.settings import Settings


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


def _compact(args) -> None:
    from clipstream.index import open_index

    with open_index(Settings()) as index:
        index.progress = True
        before = index.segments()
        state = index.compact()
        after = index.segments()
    print(f"index {state['name']!r} generation {state['generation']}: {len(state['tasks'])} tasks in "
          f"{after} segment{'s' * (after != 1)} per modality (was {before})")


def _runs(args) -> None:
    from clipstream.registry import Registry

    registry = Registry(Settings())
    versions = registry.versions()
    if args.json:
        keys = {"AA": "known/AA", "forgetting": "known/forgetting", "BWT": "known/BWT", "zero_shot_Rm": "zero_shot/Rm",
                "zero_shot_drop": "zero_shot/drop"}

        def row(v) -> dict:
            metrics = registry.run_metrics(v.run_id)
            return {"version": v.version, "aliases": list(v.aliases), "task": v.tags.get("task") or None,
                    "method": v.tags.get("method") or None, "parent_version": v.tags.get("parent_version") or None,
                    "metrics": {name: metrics.get(key) for name, key in keys.items()}}
        return print_json({"stream": registry.name, "versions": [row(v) for v in versions]})
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
    print_promotion(result)


def _rollback(args) -> None:
    from clipstream.promotion import rollback

    print_promotion(rollback(Settings(), index=not args.no_index))


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
        print_promotion(result)


def _history(args) -> None:
    from clipstream.promotion import history

    records = history(Settings())
    if args.json:
        return print_json({"history": [{**r, "from_version": r["from_version"] or None} for r in records]})
    if not records:
        print("no promotions yet (promote a version with `clipstream promote VERSION`)")
        return
    header = f"{'time (UTC)':<19}  {'from':>5} {'to':>5}  {'reason':<9} {'user':<16} forced"
    print(header + "\n" + "-" * len(header))
    for r in records:
        print(f"{r['time'][:19].replace('T', ' '):<19}  {r['from_version'] or '-':>5} {r['to_version']:>5}  "
              f"{r['reason']:<9} {r['user']:<16} {'yes' if r['forced'] else 'no'}")
