"""Experience replay (ER): a sample of the image-text pairs seen so far, mixed into the next task's training data.
Its size is one of:

- `buffer_pairs`: a fixed number over the whole stream, a reservoir sample (Algorithm R): after n pairs each has been
  kept with probability buffer_pairs / n. CTP's ER: 10,000 pairs, full from the first task on, 8.9% of its mean task
  (the `er` preset scales that to the tasks here);
- `buffer_fraction` f: a share of the pairs seen so far (10k is ~1% of CTP's ~1M pairs), so the buffer grows as pairs
  arrive, and on small tasks replays a handful of them (1% of a 900-pair task is 9). Each task keeps ⌊f·m⌋ of its m
  pairs, plus one more with probability f·m − ⌊f·m⌋, drawn uniformly without replacement, and nothing kept is ever
  dropped: every pair seen has been kept with probability exactly f, and after n pairs over T tasks the buffer holds
  f·n of them up to T (one per task's rounding). (A reservoir whose capacity grows cannot be uniform: a pair it once
  dropped would have to come back.)

The buffer holds the pairs themselves (image bytes and caption), not paths, so it survives the raw data
of old tasks being deleted, and it travels in the method state registered with each version. At the
end of a task every rank runs the same seeded update over the task's rows. The next job writes the buffer out
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


def fraction_sample(n: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of the rows of a task of `n` that a `fraction` buffer keeps: ⌊f·n⌋, one more with probability
    f·n − ⌊f·n⌋, uniformly without replacement; each row is kept with probability exactly f."""
    share = fraction * n
    size = int(share) + int(rng.random() < share - int(share))
    return np.sort(rng.choice(n, size=size, replace=False))


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
        if self.params.get("buffer_fraction") is not None:
            kept = fraction_sample(len(rows), self.params["buffer_fraction"], rng)
            self.pairs += [_pair(task, rows[i]) for i in kept]
            self.seen += len(rows)
            return
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
