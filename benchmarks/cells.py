"""The cells of a benchmark that trains streams over several seeds (`bench methods`, `bench languages`): one cell per
(method variant, seed), a stream of task jobs (`job.run_task`) whose every version's per-query ranks are kept.

- Shared start: a seed's cells that train their first task the same way (`--start-with finetune`, the English
  teacher of the language stream) start from ONE version of it, trained once in the seed's stream (one MLflow
  experiment and registered model per seed: a parent must be a version of the stream) and then the parent of each.
- Resumable: a finished cell is written under the cache as JSON (what it measured) + npz (the ranks, no pickles),
  named by the digest of everything that determines it (the benchmark's options, the seed, the preset and its
  overrides, how its first task was trained, and the content of the code that trains and scores it: `sources`);
  the commit is recorded too. A rerun with the same options and code reads the finished cells and says so; a cell
  made by other code is trained again; stopping a run loses only the cell it was in. Its task jobs then train
  again as new versions (`retrain`), a job stopped part way resuming from its last epoch checkpoint.
- Sweeps: `--vary KEY=V1,V2` runs each method whose resolved preset has KEY once per value, a grid over several
  `--vary`, each row labelled `ewc weight=100`; the baseline is never varied.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

import clipstream
from clipstream import training
from clipstream.benchmarks import report, stats
from clipstream.registry import Registry, RegistryError
from clipstream.settings import Settings
from clipstream.training.evaluate import flat_ranks, nested_ranks
from clipstream.training.job import run_task
from clipstream.training.methods.config import flatten, load_presets, resolve

VARY_HELP = ("KEY=V1,V2,...: run each method whose resolved preset has KEY once per value (repeatable: a grid over "
             "every --vary); KEY is a method parameter's name (weight: method.ewc.weight, method.mas.weight, ...) or "
             "a dotted --set key (method.ctp.momentum, train.lr); rows are labelled e.g. 'ewc weight=100'; the "
             "baseline is never varied, a method without KEY runs once")


def parse_seeds(text: str) -> list[int]:
    """`0,1,2` -> [0, 1, 2]; ValueError (one line) for none, a non-integer, a negative or a repeated seed."""
    parts = [p.strip() for p in str(text).split(",")]
    if not any(parts):
        raise ValueError("--seeds: give at least one seed, e.g. --seeds 0,1,2")
    try:
        seeds = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"--seeds {text}: comma-separated integers >= 0, e.g. 0,1,2") from None
    if min(seeds) < 0:
        raise ValueError(f"--seeds {text}: seeds are integers >= 0")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ValueError(f"--seeds {text}: seed(s) {', '.join(map(str, repeated))} given more than once")
    return seeds


def parse_vary(items: Iterable[str]) -> list[tuple[str, list[str]]]:
    """`--vary KEY=V1,V2` options as [(KEY, [V1, V2])]; ValueError for a malformed one or a key given twice."""
    out: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key, values = key.strip(), [v.strip() for v in raw.split(",")]
        if not sep or not key or not all(values):
            raise ValueError(f"--vary {item}: must look like KEY=V1,V2,... (e.g. --vary weight=100,1000)")
        if len(set(values)) != len(values):
            raise ValueError(f"--vary {item}: a value given more than once")
        if key in [k for k, _ in out]:
            raise ValueError(f"--vary {key}: given more than once; put every value in one --vary {key}=V1,V2")
        out.append((key, values))
    return out


@dataclass(frozen=True)
class Variant:
    """One row of the tables: a preset with its overrides (a stream's own, then the --vary values)."""

    label: str
    preset: str
    sets: tuple[str, ...] = ()


def keys_of(flat: dict, key: str) -> list[str]:
    """The dotted keys `key` names in a resolved preset (`flatten`ed): itself when it is one (method.ewc.weight,
    train.lr), else every method parameter of that name (weight: both methods' of a composed preset that has two)."""
    if key in flat:
        return [key]
    if "." in key:
        return []
    return [k for k in flat if k.startswith("method.") and k.count(".") == 2 and k.rsplit(".", 1)[1] == key]


def expand(streams: dict[str, tuple[str, Sequence[str]]], vary: Sequence[tuple[str, list[str]]], baseline: str,
           overrides: Sequence[str] = ()) -> list[Variant]:
    """The rows: each stream (name -> (preset, its own overrides)) once per combination of the --vary values of the
    keys its resolved preset has (once if it has none; the baseline once). Every row's preset is resolved now: a bad
    value, or a --vary key no stream has, is a ValueError before anything trains."""
    variants, used, presets = [], set(), load_presets()
    for name, (preset, sets) in streams.items():
        flat = flatten(resolve(preset, [*overrides, *sets], presets))
        axes = [] if name == baseline else [(key, keys_of(flat, key), values) for key, values in vary
                                             if keys_of(flat, key)]
        used.update(key for key, _, _ in axes)
        for combo in itertools.product(*(values for _, _, values in axes)):
            extra = [f"{dotted}={value}" for (_, keys, _), value in zip(axes, combo) for dotted in keys]
            varied = flatten(resolve(preset, [*overrides, *sets, *extra], presets))
            # a value the preset already has adds no override: the row is the preset's own cell (cached alike)
            extra = [e for e in extra if varied[e.split("=", 1)[0]] != flat[e.split("=", 1)[0]]]
            variants.append(Variant(" ".join([name, *(f"{key}={value}" for (key, _, _), value in zip(axes, combo))]),
                                    preset, (*sets, *extra)))
    unused = [key for key, _ in vary if key not in used]
    if unused:
        others = ", ".join(n for n in streams if n != baseline) or "no method"
        raise ValueError(f"--vary {unused[0]}: none of {others} has that key (give a method parameter such as weight, "
                         f"or a dotted key such as method.ewc.weight or train.lr; {baseline}, the baseline, is never "
                         "varied)")
    return variants


# the files whose content is code or configuration (not caches, notes or results)
SOURCE_SUFFIXES = (".py", ".yaml", ".json")


def sources() -> dict[str, Path]:
    """What a cell's numbers depend on beyond its key, each file or folder by a name that is the same in a checkout
    and in an installed package: the training code (the job, the methods and their presets, the data, the
    evaluation), how a model is built and from which configs, how a version is stored and read back (each task
    starts from its parent), and the benchmark code that makes the cells. Not what only reads them (stats.py, the
    report): those are recomputed from the cached ranks on every run."""
    package, here = Path(clipstream.__file__).resolve().parent, Path(__file__).resolve().parent
    return {"training": Path(training.__file__).resolve().parent, "clipstream/models.py": package / "models.py",
            "clipstream/model_configs": package / "model_configs", "clipstream/registry.py": package / "registry.py",
            **{f"benchmarks/{name}": here / name for name in ("cells.py", "continual_methods.py", "languages.py")}}


def fingerprint(named: dict[str, Path]) -> str:
    """A digest of the content of the code and configuration files under `named` (name -> file or folder), each by
    its name there: the same for the same content, committed or not, in a checkout or an installed copy (the files
    are read: a few dozen small ones)."""
    listing = []
    for name, path in named.items():
        files = {name: path} if path.is_file() else {f"{name}/{file.relative_to(path).as_posix()}": file
                                                     for file in path.rglob("*") if file.is_file()}
        listing += [f"{label}\0{hashlib.sha256(file.read_bytes()).hexdigest()}\n" for label, file in files.items()
                    if label.endswith(SOURCE_SUFFIXES) and "__pycache__" not in file.parts]
    return hashlib.sha256("".join(sorted(listing)).encode()).hexdigest()[:20]


@functools.cache
def code_fingerprint() -> str:
    """`fingerprint` of this package's `sources()`, once per process (it runs the code it imported at its start)."""
    return fingerprint(sources())


class Cache:
    """Finished cells under `root`: DIGEST.json (the record) and DIGEST.npz (each version's ranks), DIGEST naming
    what determines the cell and the code that made it (`code`: a `fingerprint`, by default this process's
    `code_fingerprint`). `fresh`: cells from before this run are not read (this run's own are)."""

    def __init__(self, root: Path, fresh: bool = False, code: Optional[str] = None):
        self.root, self.fresh, self._written, self._code = Path(root), fresh, set(), code

    @property
    def code(self) -> str:
        if self._code is None:
            self._code = code_fingerprint()
        return self._code

    @staticmethod
    def digest(what: dict) -> str:
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]

    def keyed(self, what: dict) -> dict:
        """`what` with the code: a cell made by other code is another cell."""
        return {**what, "code_fingerprint": self.code}

    def path(self, what: dict) -> Path:
        return self.root / f"{self.digest(self.keyed(what))}.json"

    def load(self, what: dict) -> Optional[dict]:
        """The cell `what` names, with its `rows` of ranks; None when it has not finished (or `fresh`), or was made by
        other code."""
        path = self.path(what)
        if (self.fresh and path not in self._written) or not path.is_file() or not path.with_suffix(".npz").is_file():
            return None
        record = json.loads(path.read_text())
        if record.get("key") != json.loads(json.dumps(self.keyed(what), default=str)):
            return None  # (a digest collision)
        with np.load(path.with_suffix(".npz"), allow_pickle=False) as arrays:
            rows: list[dict] = [{} for _ in record["tasks"]]
            by_row: dict[int, dict] = {}
            for key in arrays.files:
                row, _, rest = key.partition("/")
                by_row.setdefault(int(row), {})[rest] = arrays[key]
        for row, flat in by_row.items():
            rows[row] = nested_ranks(flat)
        return {**record, "rows": rows}

    def save(self, what: dict, record: dict) -> Path:
        """Write the cell (its npz first, the JSON that marks it finished last, each by an atomic rename)."""
        path = self.path(what)
        self.root.mkdir(parents=True, exist_ok=True)
        arrays = {f"{i}/{key}": r for i, row in enumerate(record["rows"]) for key, r in flat_ranks(row).items()}
        kept = {**{k: v for k, v in record.items() if k != "rows"}, "key": self.keyed(what)}
        for target, write in ((path.with_suffix(".npz"), lambda f: np.savez_compressed(f, **arrays)),
                              (path, lambda f: f.write(json.dumps(kept, indent=1, default=str).encode()))):
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, target)
        self._written.add(path)
        return path


def train_task(settings: Settings, folder: Path, preset: str, parent: Optional[str], workers: int,
               sets: Sequence[str], zero_shot: Sequence[Path] = ()) -> dict:
    """One task of a cell (`job.run_task`, retrained as a new version if a stopped run had registered it) and what
    the cell keeps of it."""
    result = run_task(folder, preset, parent, workers, sets, settings, zero_shot=zero_shot, retrain=True)
    metrics = Registry(settings).run_metrics(result.run_id)
    return {"task": result.task, "version": result.version, "ranks": result.ranks, "seconds": result.seconds,
            "step_ms": metrics.get("train/step_ms", math.nan), "zero_shot": result.zero_shot,
            "zero_shot_accuracy": result.zero_shot_accuracy,
            "sd": {k: v for k, v in metrics.items() if k.startswith("sd/")}}


def registered(settings: Settings, version: str) -> bool:
    """Whether the seed's stream still has `version` (a cached shared start is reused only then)."""
    try:
        Registry(settings).resolve(version, download=False)
        return True
    except RegistryError:
        return False


def _record(what: dict, label: str, steps: list[dict], trained_by: list[str], stream: str) -> dict:
    return {"key": what, "label": label, "tasks": [s["task"] for s in steps], "trained_by": trained_by,
            "versions": [s["version"] for s in steps], "stream": stream, "seconds": [s["seconds"] for s in steps],
            "step_ms": [s["step_ms"] for s in steps], "sd": [s["sd"] for s in steps],
            "zero_shot": steps[-1]["zero_shot"], "zero_shot_accuracy": steps[-1].get("zero_shot_accuracy", []),
            "rows": [s["ranks"] for s in steps], "code": report.code_version(),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_seed(settings: Settings, bench: str, seed: int, dirs: Sequence[Path], variants: Sequence[Variant],
             first: Callable[[Variant], tuple[str, tuple[str, ...]]], workers: int, base_sets: Sequence[str],
             cache: Cache, key: dict, zero_shot: Sequence[Path] = (),
             first_base: Optional[Sequence[str]] = None) -> dict[str, dict]:
    """Every variant's cell of one seed (label -> record with `rows` of ranks): a stream through `dirs` whose first
    task is trained by `first(variant)` = (preset, overrides) — once for every variant it is the same for, that
    version then the parent of each — and the others by the variant. `base_sets` go to every job (the seed's, the
    command's --set), to the first task's `first_base` instead if given; `key` is what else determines a cell (the
    benchmark's options); `zero_shot` is given to the first task (the versions after it inherit it)."""
    first_base = list(base_sets if first_base is None else first_base)
    settings = settings.model_copy(update={"stream": f"bench-{bench}-{Cache.digest(key)[:10]}-s{seed}"})
    starts: dict[str, dict] = {}
    cells = {}
    for n, variant in enumerate(variants, 1):
        first_preset, first_sets = first(variant)
        start_key = {**key, "seed": seed, "first": [first_preset, *first_base, *first_sets]}
        cell_key = {**start_key, "preset": variant.preset, "sets": list(variant.sets)}
        head = f"== seed {seed}, row {n}/{len(variants)} {variant.label}"
        found = cache.load(cell_key)
        if found is not None:
            print(f"{head}: finished before, read from {cache.path(cell_key)}", flush=True)
            cells[variant.label] = found
            continue
        digest = Cache.digest(start_key)
        if digest not in starts:
            start = cache.load(start_key)
            if start is None or not registered(settings, start["versions"][0]):
                print(f"{head}: task 1/{len(dirs)} {dirs[0].name} with {first_preset} (the start of every row that "
                      "starts so)", flush=True)
                step = train_task(settings, dirs[0], first_preset, None, workers, [*first_base, *first_sets], zero_shot)
                start = _record(start_key, f"start {first_preset}", [step], [first_preset], settings.stream)
                cache.save(start_key, start)
            else:
                print(f"{head}: starts from version {start['versions'][0]} ({first_preset}, trained before)",
                      flush=True)
            starts[digest] = start
        start = starts[digest]
        steps = [{"task": start["tasks"][0], "version": start["versions"][0], "ranks": start["rows"][0],
                  "seconds": start["seconds"][0], "step_ms": start["step_ms"][0], "zero_shot": start["zero_shot"],
                  "sd": start["sd"][0]}]
        for t, folder in enumerate(dirs[1:], 2):
            print(f"{head}: task {t}/{len(dirs)} {folder.name} with {variant.preset} (parent {steps[-1]['version']})",
                  flush=True)
            steps.append(train_task(settings, folder, variant.preset, steps[-1]["version"], workers,
                                    [*base_sets, *variant.sets]))
        trained_by = [first_preset] + [variant.preset] * (len(dirs) - 1)
        cells[variant.label] = _record(cell_key, variant.label, steps, trained_by, settings.stream)
        cache.save(cell_key, cells[variant.label])
    return cells


def streams(cells: dict[str, dict[int, dict]]) -> dict[str, dict[int, stats.Stream]]:
    """The cells' ranks as the bootstrap takes them."""
    return {label: {seed: stats.Stream(c["tasks"], c["rows"]) for seed, c in by_seed.items()}
            for label, by_seed in cells.items()}


def run_seeds(settings: Settings, bench: str, seeds: Sequence[int], spec: dict,
              synth: Callable[[Path, int], list[Path]], variants: Sequence[Variant],
              first: Callable[[Variant], tuple[str, tuple[str, ...]]], workers: int,
              base_sets: Callable[[int], Sequence[str]], cache: Cache, key: dict,
              zero_shot: Callable[[Path], Sequence[Path]] = lambda root: (),
              first_base: Optional[Callable[[int], Sequence[str]]] = None) -> dict[str, dict[int, dict]]:
    """`run_seed` for each seed, on the seed's own data (`synth(root, seed)`, made once per `spec` and seed under the
    settings' data folder): label -> seed -> cell. `base_sets`, `first_base` (per seed) and `zero_shot` (per data
    root) are run_seed's, as functions."""
    results: dict[str, dict[int, dict]] = {v.label: {} for v in variants}
    for seed in seeds:
        data = {**spec, "seed": seed}  # what the synthetic data depends on
        root = settings.data_dir / f"bench-{bench}-{Cache.digest(data)[:10]}-s{seed}"
        dirs = seed_data(root, lambda r: synth(r, seed))
        done = run_seed(settings, bench, seed, dirs, variants, first, workers, base_sets(seed), cache, key,
                        zero_shot(root), first_base(seed) if first_base else None)
        for label, cell in done.items():
            results[label][seed] = cell
    return results


def seed_data(root: Path, make: Callable[[Path], list[Path]]) -> list[Path]:
    """The seed's task folders under `root`, made by `make(root)` once (a marker lists them when complete): a rerun
    trains on the same files, so its lineage (data digests) matches the cached cells'."""
    marker = root / ".complete.json"
    if marker.is_file():
        return [root / name for name in json.loads(marker.read_text())]
    if root.exists():
        shutil.rmtree(root)  # (a synthesis stopped part way)
    dirs = make(root)
    marker.write_text(json.dumps([d.name for d in dirs]))
    return dirs
