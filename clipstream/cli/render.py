"""What the commands print: tables, search hits, a trained task's R matrices, a promotion's gates.

Imported by the local cluster's demo too: nothing here imports the rest of the command."""

from __future__ import annotations


def print_json(data) -> None:
    """`data` as one JSON document on stdout (`--json`): NaN (a metric not measured) as null, arrays as lists."""
    import json
    import math

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if hasattr(x, "tolist"):  # numpy arrays and scalars
            return clean(x.tolist())
        return x
    print(json.dumps(clean(data), indent=1, default=str))


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell (the last one left ragged); the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows)


def format_hits(hits: list[dict], query, task, names: dict[str, str] | None = None) -> str:
    """The hits as a table; with `names` (item id -> a name: the demo's emoji), each hit by its name."""
    scope = f"task-known ({task})" if task else "task-unknown (all tasks)"
    version = hits[0]["query_model_version"] if hits else "-"
    last = "name" if names is not None else "caption, or the image's file"
    lines = [f"query {str(query)!r}, {scope}, encoded by version {version}",
             f"{'#':>2} {'score':>6}  {'task':<20} {'item':<28} {'ver':>3} {'gen':>3}  {last}"]
    for i, h in enumerate(hits, 1):
        shown = (names or {}).get(h["item_id"]) or h["caption"] or h.get("image_uri") or ""
        lines.append(f"{i:>2} {h['score']:6.3f}  {h['task']:<20} {h['item_id']:<28} {h['model_version']:>3} "
                     f"{h['index_generation']:>3}  {shown}")
    return "\n".join(lines)


def task_line(result, i: int, tasks: int, parent) -> str:
    """One line per trained task: what it made, how long it took, where the stream stands."""
    known = result.known
    return (f"task {i + 1}/{tasks} {result.task:<22} version {result.version} (parent {parent or 'none'}) "
            f"{result.seconds:4.0f} s   task-known AA {known.average_accuracy():5.1f}  forgetting "
            f"{known.mean_forgetting():4.1f}  BWT {known.bwt():+5.1f}")


def print_result(result) -> None:
    print(f"\nregistered version {result.version} (alias candidate) for task {result.task} "
          f"[{result.seconds:.0f} s, {result.skipped} rows skipped]")
    print("\ntask-known Rm, R[i][j] = after task i, on task j:\n" + result.known.format_table())
    print("\ntask-unknown Rm:\n" + result.unknown.format_table())
    if result.zero_shot:
        print("\n" + zero_shot_line(result.zero_shot))
    print(f"\nheatmap: {result.heatmap}")


def zero_shot_line(history: list[float]) -> str:
    """The held-out tasks' Rm now, and which way it moved since the first version evaluated on them (a rise is not
    a "drop" with a sign to decode)."""
    first, last = history[0], history[-1]
    moved = "unchanged" if abs(last - first) < 0.005 else f"{'up' if last > first else 'down'} {abs(last - first):.2f}"
    return (f"zero-shot (held-out tasks, never trained on) Rm: {last:.2f}, {moved} from {first:.2f} (the first "
            "version evaluated on them)" if len(history) > 1 else
            f"zero-shot (held-out tasks, never trained on) Rm: {last:.2f} (the baseline later versions move from)")


def print_registered(result) -> None:
    """What `clipstream register` made: a version 0 and its row 0."""
    print(f"registered version {result.version} (alias candidate) from {result.source}: untrained, stream position 0 "
          f"[{result.seconds:.0f} s]")
    if result.known.baseline:
        print("\ntask-known Rm before any training (row 0):\n" + result.known.format_table())
        print("\ntask-unknown Rm:\n" + result.unknown.format_table())
    if result.zero_shot:
        print(f"\nzero-shot (held-out tasks) Rm: {result.zero_shot[-1]:.2f}: later versions' drop is measured from it")
    if result.heatmap:
        print(f"\nheatmap: {result.heatmap}")
    print(f"next: clipstream train --task TASK --parent {result.version}")


def print_promotion(result: dict) -> None:
    from clipstream.promotion import gate_rows

    print(format_table(gate_rows(result["gates"])))
    before = f"v{result['from_version']}" if result["from_version"] else "none"
    forced = " (forced past failed gates)" if result["forced"] else ""
    print(f"production: {before} -> v{result['to_version']} [{result['reason']}]{forced}")
