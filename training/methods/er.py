"""Experience replay (ER): a reservoir sample of every image-text pair seen so far, `buffer_pairs` in
size, mixed into the next task's training data.

The buffer holds the pairs themselves (image bytes and caption), not paths, so it survives the raw data
of old tasks being deleted, and it travels in the method state registered with each version. At the
end of a task every rank runs the same seeded reservoir update (Algorithm R) over the task's rows, so
after n pairs each has been kept with probability buffer_pairs / n. The next job writes the buffer out
as a task directory that the data pipeline reads like any other.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from clipstream.training.data.task import Task
from clipstream.training.methods.base import Method

REPLAY = "replay-buffer"


def reservoir(buffer: list, seen: int, items, size: int, rng: np.random.Generator) -> tuple[list, int]:
    """Algorithm R over `items` continuing a stream of `seen` earlier items; returns (buffer, seen)."""
    buffer = list(buffer)
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
        else:
            j = int(rng.integers(0, seen + 1))
            if j < size:
                buffer[j] = item
        seen += 1
    return buffer, seen


class ER(Method):
    name = "er"

    def __init__(self, params: dict):
        super().__init__(params)
        self.pairs: list[dict] = []  # {task, id, caption, image: bytes, suffix}
        self.seen = 0

    def extra_tasks(self, current, history, workdir):
        if not self.pairs:
            return []
        root = Path(workdir) / REPLAY
        (root / "images").mkdir(parents=True, exist_ok=True)
        with open(root / "train.jsonl", "w", encoding="utf-8") as f:
            for k, pair in enumerate(self.pairs):
                rel = f"images/{k:06d}{pair['suffix']}"
                (root / rel).write_bytes(pair["image"])
                f.write(json.dumps({"id": f"replay-{pair['task']}-{pair['id']}", "image": rel,
                                    "caption": pair["caption"]}) + "\n")
        (root / "task.yaml").write_text(yaml.safe_dump({"name": REPLAY, "splits": {"train": "train.jsonl"}}))
        return [{"task": REPLAY, "path": str(root)}]

    def after_task(self, ctx, batches):
        task = Task.load(ctx.current["path"])
        rows = task.check("train", "skip").rows
        rng = np.random.default_rng([self.params.get("seed", 0), ctx.task_index])
        chosen, self.seen = reservoir([("kept", p) for p in self.pairs], self.seen, (("new", r) for r in rows),
                                      self.params["buffer_pairs"], rng)
        self.pairs = [item if kind == "kept" else _pair(task, item) for kind, item in chosen]

    def state_dict(self):
        return {"pairs": self.pairs, "seen": self.seen}

    def load_state_dict(self, state):
        self.pairs, self.seen = list(state.get("pairs", [])), int(state.get("seen", 0))


def _pair(task: Task, row: dict) -> dict:
    source = task.image(row)
    data = source if isinstance(source, bytes) else source.read_bytes()
    return {"task": task.name, "id": str(row["id"]), "caption": str(row["caption"]), "image": data,
            "suffix": Path(str(row["image"])).suffix or ".png"}
