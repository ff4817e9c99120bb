"""`benchmarks/cells.py`: --seeds and --vary, and the cache of cells: a rerun trains nothing it finished, a new row
trains only its own tasks from the seed's shared start, --fresh trains again (the task jobs counted through the
`train_task` seam, with ranks made up: no Ray)."""

import json
import re

import numpy as np
import pytest

from clipstream.benchmarks import cells
from clipstream.benchmarks.cells import Variant


@pytest.mark.parametrize("text, seeds", [("0,1,2", [0, 1, 2]), ("7", [7]), (" 3 , 1 ", [3, 1])])
def test_seeds_parse(text, seeds):
    assert cells.parse_seeds(text) == seeds


@pytest.mark.parametrize("text, message", [("", "give at least one seed"), (" , ", "give at least one seed"),
                                           ("0,0,1", "seed(s) 0 given more than once"), ("0,x", "comma-separated"),
                                           ("0,,1", "comma-separated"), ("-1", "integers >= 0")])
def test_bad_seeds_are_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cells.parse_seeds(text)


def test_vary_expands_a_grid_over_the_methods_that_have_the_key():
    vary = cells.parse_vary(["weight=100,1000", "batches=4"])
    variants = cells.expand({n: (n, []) for n in ("finetune", "ewc", "lwf", "er")}, vary, "finetune")
    labels = [v.label for v in variants]
    assert labels == ["finetune", "ewc weight=100 batches=4", "ewc weight=1000 batches=4", "lwf weight=100",
                      "lwf weight=1000", "er"]  # finetune is never varied; er has neither key
    assert variants[2] == Variant("ewc weight=1000 batches=4", "ewc",
                                  ("method.ewc.weight=1000", "method.ewc.batches=4"))
    dotted = cells.expand({"finetune": ("finetune", []), "ctp": ("ctp", [])},
                          cells.parse_vary(["method.ctp.momentum=0.9,0.99"]), "finetune")
    assert [v.label for v in dotted] == ["finetune", "ctp method.ctp.momentum=0.9", "ctp method.ctp.momentum=0.99"]
    # a value the preset already has is no override: that row is the preset's own (cached) cell
    default = cells.expand({"ewc": ("ewc", [])}, cells.parse_vary(["weight=2500,25000"]), "finetune")
    assert [(v.label, v.sets) for v in default] == [("ewc weight=2500", ()),
                                                    ("ewc weight=25000", ("method.ewc.weight=25000",))]
    # a stream's own overrides come first (the language streams')
    own = cells.expand({"embeddings": ("cllclip", ["method.cllclip.cross_lingual_weight=0.0"])},
                       cells.parse_vary(["train.lr=0.01"]), "teir")
    assert own == [Variant("embeddings train.lr=0.01", "cllclip",
                           ("method.cllclip.cross_lingual_weight=0.0", "train.lr=0.01"))]


@pytest.mark.parametrize("vary, message", [
    (["nope=1,2"], "--vary nope: none of ewc has that key"),
    (["method.ewc.nope=1"], "--vary method.ewc.nope: none of ewc"),
    (["weight"], "must look like KEY=V1,V2"),
    (["weight="], "must look like KEY=V1,V2"),
    (["weight=1,,2"], "must look like KEY=V1,V2"),
    (["weight=1,1"], "a value given more than once"),
    (["weight=1", "weight=2"], "given more than once; put every value in one"),
    (["weight=heavy"], "method.ewc.weight"),  # the schema's own message, naming the override
])
def test_bad_vary_is_refused_before_anything_trains(vary, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cells.expand({"finetune": ("finetune", []), "ewc": ("ewc", [])}, cells.parse_vary(vary), "finetune")


class FakeJobs:
    """`cells.train_task` without Ray: each call is one task job, its ranks made up from the call number."""

    def __init__(self):
        self.calls = []

    def __call__(self, settings, folder, preset, parent, workers, sets, zero_shot=()):
        self.calls.append((folder.name, preset, parent, tuple(sets)))
        n = len(self.calls)
        rng = np.random.default_rng(n)
        seen = [d.name for d in DIRS[: DIRS.index(folder) + 1]]
        ranks = {mode: {t: (rng.integers(0, 9, 6), rng.integers(0, 9, 6)) for t in seen}
                 for mode in ("known", "unknown")}
        return {"task": folder.name, "version": str(n), "ranks": {**ranks, "zero_shot": {}}, "seconds": 1.0,
                "step_ms": 10.0 * n, "zero_shot": [], "sd": {}}


DIRS = []


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    DIRS[:] = [tmp_path / "data" / f"task-0{i}" for i in range(3)]
    fake = FakeJobs()
    monkeypatch.setattr(cells, "train_task", fake)
    monkeypatch.setattr(cells, "registered", lambda settings, version: True)
    return fake


def run(settings, cache, variants, start=("finetune", ())):
    return cells.run_seed(settings, "methods", 0, DIRS, variants, lambda v: start, 1, ["train.seed=0"], cache,
                          {"bench": "methods", "tasks": 2})


def test_a_rerun_reads_finished_cells_and_a_new_row_trains_only_its_own_tasks(jobs, settings, tmp_path, capsys):
    cache = cells.Cache(tmp_path / "cache")
    rows = [Variant("finetune", "finetune"), Variant("lwf", "lwf")]
    first = run(settings, cache, rows)
    # the first task once (the shared start), then two tasks per row, each from its own previous version
    assert [c[:3] for c in jobs.calls] == [("task-00", "finetune", None), ("task-01", "finetune", "1"),
                                           ("task-02", "finetune", "2"), ("task-01", "lwf", "1"),
                                           ("task-02", "lwf", "4")]
    assert first["lwf"]["versions"] == ["1", "4", "5"] and first["lwf"]["trained_by"] == ["finetune", "lwf", "lwf"]
    assert first["lwf"]["step_ms"] == [10.0, 40.0, 50.0] and first["lwf"]["tasks"] == ["task-00", "task-01", "task-02"]
    assert len(list((tmp_path / "cache").glob("*.json"))) == 3  # the start and two cells
    capsys.readouterr()

    again = run(settings, cells.Cache(tmp_path / "cache"), rows)
    assert len(jobs.calls) == 5 and capsys.readouterr().out.count("finished before, read from") == 2
    for label in ("finetune", "lwf"):
        assert again[label]["versions"] == first[label]["versions"] and again[label]["code"]
        for row_a, row_b in zip(again[label]["rows"], first[label]["rows"]):
            for mode in ("known", "unknown"):
                for task, (i2t, t2i) in row_b[mode].items():
                    np.testing.assert_array_equal(row_a[mode][task][0], i2t)
                    np.testing.assert_array_equal(row_a[mode][task][1], t2i)

    ewc = Variant("ewc weight=1", "ewc", ("method.ewc.weight=1",))
    more = run(settings, cells.Cache(tmp_path / "cache"), [*rows, ewc])
    assert jobs.calls[5:] == [("task-01", "ewc", "1", ("train.seed=0", "method.ewc.weight=1")),
                              ("task-02", "ewc", "6", ("train.seed=0", "method.ewc.weight=1"))]
    assert more["ewc weight=1"]["rows"][0]["known"]["task-00"][0].tolist() == \
        first["lwf"]["rows"][0]["known"]["task-00"][0].tolist()  # the shared start's ranks

    run(settings, cells.Cache(tmp_path / "cache", fresh=True), rows)
    assert len(jobs.calls) == 7 + 5  # --fresh: the start and both rows again


def test_a_cell_stopped_part_way_is_not_kept(jobs, settings, tmp_path, monkeypatch):
    def stop(*args, **kwargs):
        if len(jobs.calls) == 2:  # Ctrl-C in the row's second task
            raise KeyboardInterrupt
        return jobs(*args, **kwargs)

    monkeypatch.setattr(cells, "train_task", stop)
    with pytest.raises(KeyboardInterrupt):
        run(settings, cells.Cache(tmp_path / "cache"), [Variant("lwf", "lwf")])
    records = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*.json")]
    assert [r["label"] for r in records] == ["start finetune"]  # the start is kept; the row is not
    assert not list((tmp_path / "cache").glob(".*.tmp"))


def test_seed_data_is_made_once(tmp_path):
    made = []

    def make(root):
        made.append(root)
        root.mkdir(parents=True)
        (root / "task-00").mkdir()
        return [root / "task-00"]

    assert cells.seed_data(tmp_path / "s0", make) == [tmp_path / "s0" / "task-00"]
    assert cells.seed_data(tmp_path / "s0", make) == [tmp_path / "s0" / "task-00"] and len(made) == 1


def test_run_seeds_makes_each_seeds_data_once_and_gives_each_seed_its_own_sets(jobs, settings, tmp_path):
    made, zero_shot = [], []

    def synth(root, seed):  # each seed's data: three task folders under its root, the fake jobs' DIRS, recorded
        made.append((root.name, seed))
        DIRS[:] = [root / f"task-0{i}" for i in range(3)]
        for d in DIRS:
            d.mkdir(parents=True)
        return list(DIRS)

    def held_out(root):
        zero_shot.append(root.name)
        return ()

    def both():
        return cells.run_seeds(settings, "methods", [0, 1], {"tasks": 2}, synth, [Variant("lwf", "lwf")],
                               lambda v: ("finetune", ()), 1, lambda seed: [f"train.seed={seed}"],
                               cells.Cache(tmp_path / "cache"), {"bench": "methods", "tasks": 2}, held_out)

    out = both()
    assert sorted(out["lwf"]) == [0, 1] and out["lwf"][0]["versions"] != out["lwf"][1]["versions"]
    roots = [name for name, _ in made]
    assert [seed for _, seed in made] == [0, 1] and roots[0].endswith("-s0") and roots[1].endswith("-s1")
    assert zero_shot == roots  # the zero-shot tasks read from each seed's own data
    assert {c[3][0] for c in jobs.calls} == {"train.seed=0", "train.seed=1"}  # every job has its seed's sets
    calls = len(jobs.calls)
    both()  # a rerun: no data made again, no job trained, the same cells
    assert len(made) == 2 and len(jobs.calls) == calls


def test_a_cell_made_by_other_code_is_trained_again_and_one_made_by_the_same_code_is_read(jobs, settings, tmp_path):
    rows = [Variant("lwf", "lwf")]
    run(settings, cells.Cache(tmp_path / "cache", code="a"), rows)
    assert len(jobs.calls) == 3  # the start, then the row's two tasks
    run(settings, cells.Cache(tmp_path / "cache", code="a"), rows)
    assert len(jobs.calls) == 3
    run(settings, cells.Cache(tmp_path / "cache", code="b"), rows)
    assert len(jobs.calls) == 6  # the start too: it was trained by the other code
    key = {"bench": "methods", "seed": 0}
    assert cells.Cache(tmp_path, code="a").path(key) != cells.Cache(tmp_path, code="b").path(key)
    assert cells.Cache(tmp_path).code == cells.code_fingerprint()  # by default, this process's code


def test_the_code_fingerprint_follows_the_source_files_content_only(tmp_path):
    """What keys a cell: the content of the code and configuration files under the sources, nothing else."""
    (tmp_path / "training" / "methods").mkdir(parents=True)
    (tmp_path / "clipstream").mkdir()
    files = {"training/job.py": "x = 1\n", "training/methods/presets.yaml": "ewc: {weight: 1}\n",
             "clipstream/models.py": "y = 2\n", "README.md": "notes\n", "training/notes.txt": "notes\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    named = {"training": tmp_path / "training", "clipstream/models.py": tmp_path / "clipstream" / "models.py"}
    first = cells.fingerprint(named)
    (tmp_path / "README.md").write_text("other notes\n")
    (tmp_path / "training" / "notes.txt").write_text("other notes\n")
    (tmp_path / "training" / "__pycache__").mkdir()
    (tmp_path / "training" / "__pycache__" / "job.cpython-312.pyc").write_bytes(b"\0")
    (tmp_path / "training" / "__pycache__" / "stale.py").write_text("w = 0\n")
    assert cells.fingerprint(named) == first  # no source file changed
    (tmp_path / "training" / "methods" / "presets.yaml").write_text("ewc: {weight: 2}\n")
    edited = cells.fingerprint(named)
    assert edited != first
    (tmp_path / "training" / "new.py").write_text("z = 4\n")  # a file added
    assert cells.fingerprint(named) not in (first, edited)
    (tmp_path / "training" / "new.py").unlink()
    assert cells.fingerprint(named) == edited
    (tmp_path / "training" / "job.py").rename(tmp_path / "training" / "moved.py")  # the same content, another name
    assert cells.fingerprint(named) not in (first, edited)
    copy = tmp_path / "copy"  # an installed copy of the same files: the same fingerprint
    (copy / "methods").mkdir(parents=True)
    (copy / "moved.py").write_text("x = 1\n")
    (copy / "methods" / "presets.yaml").write_text("ewc: {weight: 2}\n")
    assert cells.fingerprint({"training": copy, "clipstream/models.py": tmp_path / "clipstream" / "models.py"}) \
        == cells.fingerprint(named)


def test_the_code_fingerprint_covers_training_the_model_and_the_cell_code():
    named = cells.sources()
    assert all(path.exists() for path in named.values())
    listed = {f"{name}/{f.relative_to(path).as_posix()}" if path.is_dir() else name
              for name, path in named.items() for f in ([path] if path.is_file() else path.rglob("*"))}
    for name in ("training/job.py", "training/evaluate.py", "training/methods/presets.yaml", "clipstream/models.py",
                 "clipstream/model_configs/clipstream-vit-tiny.json", "benchmarks/cells.py"):
        assert name in listed
    assert not [name for name in listed if "README" in name or "results" in name or name.startswith("benchmarks/stats")]
