"""The `clipstream` command: bad input is a message and exit status 2, never a traceback."""

import subprocess
import sys

import pytest

from clipstream.cli import main


def test_console_script_synthesises_and_checks_a_task(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, "-m", "clipstream.cli", "data", "synth", "--out", str(out), "--tasks", "1",
                           "--train-pairs", "60", "--test-per-task", "8", "--no-digits"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    task = done.stdout.split()[0]
    assert task.endswith("task-00-household")
    check = subprocess.run([sys.executable, "-m", "clipstream.cli", "data", "check", "--task", task], capture_output=True, text=True)
    assert check.returncode == 0 and "train: 60 rows ok, 0 skipped" in check.stdout


@pytest.mark.parametrize("argv, message", [
    (["train", "--task", "/no/such/task"], "/no/such/task: task directory not found"),
    (["train", "--task", "{task}", "--method", "nope"], "unknown method preset 'nope'"),
    (["train", "--task", "{task}", "--set", "train.nope=1"], "has no key 'train.nope'"),
    (["train", "--task", "{task}", "--set", "justtext"], "must look like key.sub=value"),
    (["train", "--task", "{task}", "--workers", "0"], "workers must be >= 1"),
    (["train", "--task", "{task}", "--parent", "7"], "7: no such model version"),
    (["eval", "--version", "candidate"], "candidate: no such model version"),
    (["data", "synth", "--out", "{task}", "--tasks", "1"], "{task}"),
])
def test_bad_input_exits_2_with_a_message(argv, message, settings, stream, capsys):
    argv = [a.replace("{task}", str(stream[0])) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("clipstream: error: ") and message.replace("{task}", str(stream[0])) in last
    assert "Traceback" not in err


def test_corrupt_image_is_reported_with_file_and_row(tmp_path, stream, capsys, settings):
    import shutil

    task = shutil.copytree(stream[0], tmp_path / "task")
    first = (task / "train.jsonl").read_text().splitlines()[0]
    import json

    (task / json.loads(first)["image"]).write_bytes(b"not a png")
    assert main(["data", "check", "--task", str(task)]) == 2
    assert f"{task / 'train.jsonl'}:1: corrupt image" in capsys.readouterr().err
    assert main(["data", "check", "--task", str(task), "--on-bad-image", "skip"]) == 0
    out = capsys.readouterr().out
    assert "1 skipped" in out and "train.jsonl:1: corrupt image" in out


def test_runs_on_an_empty_registry_says_so(settings, capsys):
    assert main(["runs"]) == 0
    assert "no registered versions in stream 'clipstream'" in capsys.readouterr().out


def test_a_missing_presets_file_is_an_error_not_a_traceback(settings, stream, monkeypatch, capsys):
    monkeypatch.setenv("CLIPSTREAM_PRESETS", str(settings.home / "missing.yaml"))
    assert main(["train", "--task", str(stream[0])]) == 2
    err = capsys.readouterr().err
    assert "missing.yaml: no such file" in err.strip().splitlines()[-1] and "Traceback" not in err
