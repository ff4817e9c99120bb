"""A bad `--set` is refused before anything starts (reliability): `clipstream train` exits 2 with one line
`clipstream: error: ...` that names the override and says what is expected, and nothing is started or written (no
Ray, no MLflow run), where it used to start a Ray job that failed three times in the workers, exit 1 with a
traceback and leave a FAILED run behind. The values are checked against the schema of a resolved preset
(training/methods/schema.py)."""

import os
import sqlite3

import pytest
import ray

import clipstream.training.job  # noqa: F401  (imported here: what its libraries log on import is no command's output)
from clipstream.cli import main

EPOCHS = "expected an integer >= 1 (passes over the task's data)"

BAD = [
    (["--set", "train.epochs=abc"], f"--set train.epochs=abc: {EPOCHS}"),
    (["--set", "train.epochs=-1"], f"--set train.epochs=-1: {EPOCHS}"),
    (["--set", "train.epochs=2.5"], f"--set train.epochs=2.5: {EPOCHS}"),
    (["--set", "train.zero_stage=7"], "--set train.zero_stage=7: expected an integer in [0, 3] (DeepSpeed ZeRO stage"),
    (["--set", "train.precision=fp8"], "--set train.precision=fp8: expected one of fp32, bf16, fp16"),
    (["--set", "train.betas=[0.9]"], "--set train.betas=[0.9]: expected a list of 2 numbers, each in [0, 1)"),
    (["--set", "train.lr=0"], "--set train.lr=0: expected a number > 0 (peak learning rate of AdamW)"),
    (["--method", "ewc", "--set", "method.ewc.weight=-3"], "--set method.ewc.weight=-3: expected a number >= 0"),
    (["--set", "train.epoch=2"], "--set train.epoch=2: preset 'finetune' has no key 'train.epoch' (did you mean "
                                 "train.epochs?)"),
    (["--method", "nope"], "unknown method preset 'nope'; known: base, cclip, cllclip, cllclip-no-cross-lingual, "
                                   "cllclip-no-decay, ctp, ctp_er, er, ewc"),
    (["--set", "train.epochs"], "--set train.epochs: must look like key.sub=value"),
    (["--set", "train.epochs=abc", "--set", "train.lr=-1"],  # every problem, still one line
     f"--set train.epochs=abc: {EPOCHS}; --set train.lr=-1: expected a number > 0"),
]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """One small valid task: what fails is the override, never the data."""
    from clipstream.training.data.synth import synthesize

    (folder,) = synthesize(tmp_path_factory.mktemp("overrides"), tasks=1, seed=0, train_pairs=64, test_per_task=8,
                           digits=False, held_out=False, progress=False)
    return folder


@pytest.fixture
def home(tmp_path, monkeypatch):
    """CLIPSTREAM_HOME in this test's tmp dir (not created), no other clipstream settings, and `ray.init` refused
    (and recorded): a command that tried to start Ray would fail the test."""
    for name in [n for n in os.environ if n.startswith("CLIPSTREAM_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLIPSTREAM_HOME", str(tmp_path / "home"))
    started, before = [], ray.is_initialized()

    def refuse(*args, **kwargs):
        started.append((args, kwargs))
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(ray, "init", refuse)
    yield tmp_path / "home"
    assert started == [] and ray.is_initialized() == before


def _error_line(capsys) -> str:
    """The command's one `clipstream: error:` line, the last on stderr; nothing on stdout, no traceback."""
    out, err = capsys.readouterr()
    said = [line for line in err.splitlines() if line.startswith("clipstream:")]
    assert len(said) == 1 and said[0].startswith("clipstream: error: ") and err.strip().endswith(said[0]), err
    assert "Traceback" not in err and not out.strip()
    return said[0].removeprefix("clipstream: error: ")


def _runs(home) -> int:
    db = home / "mlflow.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        return con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_override_exits_2_in_one_line_and_starts_nothing(args, message, task, home, capsys):
    assert main(["train", "--task", str(task), *args]) == 2
    assert _error_line(capsys).startswith(message)
    assert _runs(home) == 0  # no MLflow run, FAILED or other (the fixture checks that Ray never started)
    assert not (home / "mlartifacts").exists() and not (home / "logs").exists()  # no artifacts, no crash log
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())  # no Ray Train storage


def test_a_bad_override_writes_nothing_and_says_only_the_error(task, home, capsys):
    assert main(["train", "--task", str(task), "--set", "train.epochs=abc"]) == 2
    err = capsys.readouterr().err
    assert err == f"clipstream: error: --set train.epochs=abc: {EPOCHS}\n"
    assert not home.exists(), sorted(str(p.relative_to(home)) for p in home.rglob("*"))


@pytest.mark.parametrize("command", [["job", "--task", "s3://b/t"], ["stream", "--tasks", "s3://b/t0", "s3://b/t1"]])
def test_k8s_with_a_bad_override_exits_2_and_prints_no_manifest(command, home, capsys):
    assert main(["k8s", *command, "--method", "ctp", "--set", "method.ctp.momentum=1.5"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("clipstream: error: --set method.ctp.momentum=1.5: expected a number in [0, 1] (m of the ")
    assert err.count("\n") == 1 and err.endswith("\n") and not out and not home.exists()
