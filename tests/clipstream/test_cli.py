"""The `clipstream` command: bad input is a message and exit status 2, never a traceback."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from clipstream.cli import main


@pytest.mark.component
def test_console_script_synthesises_and_checks_a_task(cli_process, tmp_path):
    out = tmp_path / "bench"
    done = cli_process("data", "synth", "--out", out, "--tasks", "1", "--train-pairs", "60", "--test-per-task", "8",
                       "--no-digits")
    assert done.returncode == 0, done.stderr
    task = done.stdout.split()[0]
    assert task.endswith("task-00-household")
    check = cli_process("data", "check", "--task", task)
    assert check.returncode == 0 and "train: 60 rows ok, 0 skipped" in check.stdout


@pytest.mark.component
def test_a_benchmarks_own_help_and_option_errors_reach_the_terminal(cli_process):
    """`clipstream bench` sends the libraries' output to a log file, but only after the benchmark parsed its options."""
    shown = cli_process("bench", "search", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: clipstream bench search") and "--extra-arch" in shown.stdout
    refused = cli_process("bench", "search", "--sizes", "10", "--bogus")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.strip().splitlines()[-1] == "clipstream bench search: error: unrecognized arguments: --bogus"


def test_data_synth_languages_writes_the_language_stream(tmp_path, capsys):
    out = tmp_path / "langs"
    assert main(["data", "synth", "--out", str(out), "--languages", "3", "--train-pairs", "60", "--test-per-task", "8",
                 "--image-size", "16"]) == 0
    names = ["task-00-lang-en", "task-01-lang-xa", "task-02-lang-xb"]
    assert capsys.readouterr().out.split() == [str(out / n) for n in names]
    assert sorted(p.name for p in out.iterdir()) == names
    assert main(["data", "check", "--task", str(out / names[1])]) == 0
    assert "train: 60 rows ok, 0 skipped" in capsys.readouterr().out


def test_data_synth_names_the_held_out_task_on_stderr(tmp_path, capsys):
    small = ["--tasks", "1", "--train-pairs", "60", "--test-per-task", "8", "--image-size", "16", "--no-digits"]
    assert main(["data", "synth", "--out", str(tmp_path / "a"), *small]) == 0
    done = capsys.readouterr()
    assert done.out.split() == [str(tmp_path / "a" / "task-00-household")]
    assert f"held-out zero-shot task (no version trains on it): {tmp_path / 'a' / 'zero-shot-toys'}" in done.err
    assert main(["data", "synth", "--out", str(tmp_path / "b"), *small, "--no-held-out"]) == 0
    assert "zero-shot" not in capsys.readouterr().err and not (tmp_path / "b" / "zero-shot-toys").exists()


def test_data_synth_bad_language_count_exits_2_with_one_line(tmp_path, capsys):
    assert main(["data", "synth", "--out", str(tmp_path / "langs"), "--languages", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["clipstream: error: languages must be between 1 and 27 (codes en, xa..xz), got 0"]
    assert not (tmp_path / "langs").exists()
    with pytest.raises(SystemExit) as exit:  # one stream or the other
        main(["data", "synth", "--out", str(tmp_path / "langs"), "--tasks", "2", "--languages", "2"])
    assert exit.value.code == 2 and "not allowed with argument --tasks" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train", "--task", "/no/such/task"], "/no/such/task: task directory not found"),
    (["train", "--task", "{task}", "--method", "nope"], "unknown method preset 'nope'"),
    (["train", "--task", "{task}", "--set", "train.nope=1"], "has no key 'train.nope'"),
    (["train", "--task", "{task}", "--set", "justtext"], "must look like key.sub=value"),
    (["train", "--task", "{task}", "--workers", "0"], "workers must be >= 1"),
    (["train", "--task", "{task}", "--parent", "7"], "7: no such model version"),
    (["train", "--task", "{task}", "--method", "teir"], "teir teaches a trained CLIP new languages: start it from"),
    (["train", "--task", "{task}", "--method", "teir", "--set", "train.zero_stage=2"],
     "method cllclip runs with train.zero_stage=0 train.precision=fp32 only (got train.zero_stage=2)"),
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


def test_a_task_without_a_test_split_is_refused_by_data_check_and_before_training(tmp_path, stream, capsys, settings):
    """Training evaluates every task on its test pairs: without them the job used to fail after training."""
    import shutil

    import yaml

    task = shutil.copytree(stream[0], tmp_path / "task")
    meta = yaml.safe_load((task / "task.yaml").read_text())
    del meta["splits"]["test"]
    (task / "task.yaml").write_text(yaml.safe_dump(meta))
    for argv in (["data", "check", "--task", str(task)], ["train", "--task", str(task), "--workers", "1"]):
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "log to" not in line]
        assert len(err) == 1 and "has no split 'test' (has ['train']): training evaluates every task" in err[0], err
    from clipstream.registry import Registry

    assert Registry(settings).versions() == []  # nothing trained, nothing registered


@pytest.mark.parametrize("source, message", [
    ("ViT-B-99:openai", "unknown architecture 'ViT-B-99'; close ones: ViT-B-32"),
    ("ViT-B-32:laion9b_nope", "'laion9b_nope' is neither a checkpoint file nor a pretrained tag of ViT-B-32"),
    ("{missing}", "missing.pt' is neither a checkpoint file nor a pretrained tag of clipstream-vit-tiny"),
    ("{garbage}", "garbage.pt: open_clip cannot load it (a corrupt or truncated file"),
    ("{truncated}", "truncated.pt: open_clip cannot load it (a corrupt or truncated file"),
    ("{small}", "small.pt: open_clip cannot load it"),  # the weights of another architecture
    ("{not-an-export}", "not-an-export is not an exported model: open_clip_config.json missing"),
    ("ViT-B-32", "'ViT-B-32': give ARCH:PRETRAINED"),
])
def test_register_refuses_a_bad_source_in_one_line_and_registers_nothing(source, message, model_sources, settings,
                                                                        stream, capsys):
    from clipstream.registry import Registry

    source = source.format(**model_sources)
    assert main(["register", "--from", source, "--evaluate", str(stream[0])]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("clipstream: Ray, DeepSpeed")]
    assert len(lines) == 1 and lines[0].startswith("clipstream: error: ") and message in lines[0], err
    registry = Registry(settings)
    assert registry.versions() == [] and registry.client.get_experiment_by_name(registry.name) is None  # no run either


def test_register_a_download_the_network_refuses_exits_1_and_registers_nothing(settings, monkeypatch, capsys):
    """This machine reaches no hub; offline mode fails the same way at once."""
    import huggingface_hub.constants

    from clipstream.registry import Registry

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for source in ("ViT-B-32:laion2b_s34b_b79k", "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K"):
        assert main(["register", "--from", source]) == 1
        lines = [line for line in capsys.readouterr().err.strip().splitlines() if "log to" not in line]
        assert len(lines) == 1 and lines[0].startswith(f"clipstream: error: {source}: could not be downloaded"), lines
    assert Registry(settings).versions() == []


@pytest.mark.parametrize("kind", ["checkpoint", "export"])
def test_register_from_a_checkpoint_or_an_export_folder_makes_version_0(kind, model_sources, settings, stream, capsys):
    from clipstream.registry import Registry

    assert main(["register", "--from", model_sources[kind], "--evaluate", str(stream[0]), "--alias", "start"]) == 0
    out = capsys.readouterr().out
    assert f"registered version 1 (alias candidate) from {model_sources[kind]}: untrained, stream position 0" in out
    assert "pretrained" in out and "next: clipstream train --task TASK --parent 1" in out
    version = Registry(settings).resolve("start")
    assert version.tags["source"] == model_sources[kind] and version.manifest["lineage"] == []
    assert main(["runs"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:4] == ["1", "candidate,start", "pretrained", "-"]
    assert main(["runs", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["versions"]
    assert (row["version"], row["aliases"], row["task"], row["method"], row["parent_version"]) == (
        "1", ["candidate", "start"], None, "pretrained", None)  # (no task trained it: null, not "")
    assert set(row["metrics"]) == {"AA", "forgetting", "BWT", "zero_shot_Rm", "zero_shot_drop"}
    assert all(v is None or math.isfinite(v) for v in row["metrics"].values())  # (NaN is not JSON: null)
    assert main(["eval", "--version", "start"]) == 0  # on the tasks of its row 0
    out = capsys.readouterr().out
    assert "version 1 (pretrained, before any training), in memory" in out and Path(stream[0]).name in out
    assert main(["eval", "--version", "start", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["version"] == "1" and scores["source"] == "in memory"
    assert set(scores["scores"]) == {"known", "unknown"} and Path(stream[0]).name in scores["scores"]["known"]
    if kind == "export":  # registered again without --evaluate: it serves no task, and says so
        assert main(["register", "--from", model_sources[kind]]) == 0 and main(["eval", "--version", "2"]) == 2
        assert "version 2 was trained and evaluated on no task: name tasks with --task" in capsys.readouterr().err


def test_runs_on_an_empty_registry_says_so(settings, capsys):
    assert main(["runs"]) == 0
    assert "no registered versions in stream 'clipstream'" in capsys.readouterr().out
    assert main(["runs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"stream": "clipstream", "versions": []}


def test_a_server_that_does_not_answer_is_exit_3_at_once_and_the_exit_codes_are_in_help(capsys):
    """`health` is a probe: no retries, a distinct code for "nobody answered" (not 2, a bad input), with or
    without --json (nothing on stdout then)."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for extra in ([], ["--json"]):
        tic = time.monotonic()
        assert main(["health", "--address", f"127.0.0.1:{port}", *extra]) == 3
        assert time.monotonic() - tic < 5  # (gRPC's retry policy made it 17 s)
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("clipstream: error: UNAVAILABLE: ")
        assert "is `clipstream serve` running there?" in captured.err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and "  3  the server did not answer" in out


def test_a_missing_presets_file_is_an_error_not_a_traceback(settings, stream, monkeypatch, capsys):
    monkeypatch.setenv("CLIPSTREAM_PRESETS", str(settings.home / "missing.yaml"))
    assert main(["train", "--task", str(stream[0])]) == 2
    err = capsys.readouterr().err
    assert "missing.yaml: no such file" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_compact_merges_the_appended_segments_and_the_indexing_job_does_past_its_setting(settings, capsys):
    import numpy as np

    from clipstream.index import TaskVectors, open_index
    from clipstream.indexing import _compacted

    def task(i):
        rng = np.random.default_rng(i)
        return TaskVectors(f"t{i}", i, "1", [f"t{i}-{j}" for j in range(10)], rng.standard_normal((10, 8)),
                           rng.standard_normal((10, 8)), [f"caption {j}" for j in range(10)])

    with open_index(settings) as index:
        for i in range(3):
            index.append(task(i))
            # index_compact_segments 0: the indexing job never merges them
            _compacted(index, settings.model_copy(update={"index_compact_segments": 0}))
            assert index.segments() == i + 1
        assert _compacted(index, settings.model_copy(update={"index_compact_segments": 3}))["generation"] == 1
        assert index.segments() == 3
        assert set(_compacted(index, settings.model_copy(update={"index_compact_segments": 2}))["tasks"]) == {"t0", "t1", "t2"}
        assert index.segments() == 1
        index.append(task(3))
        index.append(task(4))
    assert main(["compact"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"index '{settings.stream}' generation 1: 5 tasks in 1 segment per modality (was 3)"
    with open_index(settings) as index:
        assert index.segments() == 1 and len(index.search(np.ones(8), "image", k=100)) == 50


STOCK_OPEN_CLIP = """
import json, sys
import open_clip, torch
model, _, preprocess = open_clip.create_model_and_transforms(sys.argv[1])
tokenizer = open_clip.get_tokenizer(sys.argv[1])
model.eval()
with torch.no_grad():
    text = model.encode_text(tokenizer(["a red bicycle"]))
    image = model.encode_image(torch.zeros(1, 3, *model.visual.image_size))
print(json.dumps({"text": text[0].tolist(), "image": image[0].tolist(),
                  "clipstream": any(m.startswith("clipstream") for m in sys.modules)}))
"""


@pytest.mark.component
def test_export_writes_a_folder_stock_open_clip_loads_and_never_overwrites_one(settings, stream, capsys, tmp_path):
    import json

    import torch

    from clipstream.registry import Registry
    from tests.conftest import register_version

    version = register_version(settings, seed=3, alias="production", task_dirs=[stream[0]])
    out = tmp_path / "exported"
    assert main(["export", "--version", "production", "--out", str(out)]) == 0
    assert f'create_model_and_transforms("local-dir:{out}")' in capsys.readouterr().out
    files = {p.name for p in out.iterdir()}
    assert {"open_clip_config.json", "open_clip_model.safetensors", "clipstream.json"} <= files
    assert "method_state.safetensors" not in files  # the next task's job reads it, not a user of the model
    # stock open_clip, in a process that never imports clipstream, gives the registered version's embeddings
    done = subprocess.run([sys.executable, "-c", STOCK_OPEN_CLIP, f"local-dir:{out}"], capture_output=True, text=True,
                          check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    stock = json.loads(done.stdout.splitlines()[-1])
    assert not stock["clipstream"]
    bundle = Registry(settings).load(version)
    with torch.no_grad():
        text = bundle.model.encode_text(bundle.tokenizer(["a red bicycle"]))[0]
        image = bundle.model.encode_image(torch.zeros(1, 3, *bundle.model.visual.image_size))[0]
    torch.testing.assert_close(torch.tensor(stock["text"]), text, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(stock["image"]), image, rtol=1e-5, atol=1e-5)
    # a folder that holds anything is never written into; an unknown version is one line and exit 2
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["export", "--version", version, "--out", str(out)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert main(["export", "--version", "99", "--out", str(tmp_path / "other")]) == 2
    assert "no such model version" in capsys.readouterr().err and not (tmp_path / "other").exists()


def _commands(p, path=()):
    """(command words, parser) for every (sub)command of `p`."""
    import argparse

    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


def test_every_option_has_help_that_names_its_default_and_the_main_verbs_show_examples(capsys):
    import argparse

    from clipstream.cli.parser import parser

    commands = dict(_commands(parser()))
    assert len(commands) > 20
    for path, p in commands.items():
        text = p.format_help()
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                continue
            assert action.help, f"clipstream {' '.join(path)} {action.option_strings or action.dest}: no help"
            if action.option_strings and action.default not in (None, False, [], "", argparse.SUPPRESS):
                shown = p._get_formatter()._get_help_string(action)
                assert "default" in shown, f"clipstream {' '.join(path)} {action.option_strings[0]}: default not named"
        if path and path[-1] in ("train", "index", "search", "export", "promote", "demo"):
            assert "\nexamples" in text and f"clipstream {path[-1]}" in text.split("\nexamples")[1]
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("clipstream 0.") and "ray 2." in out and "open_clip 3." in out


@pytest.mark.slow
@pytest.mark.stream("ewc_modx_ctp_er", 2)
def test_ui_serves_every_versions_run_with_its_heatmap_recall_curve_and_loss_curves(trained_stream, tmp_path):
    """`clipstream ui` starts MLflow's UI on the stream's store and prints its URL; through MLflow's REST API
    (what the UI's pages read) each trained version's run lists its plots; SIGTERM stops the server too."""
    import json
    import os
    import re
    import urllib.request

    settings, _ = trained_stream("ewc_modx_ctp_er", 2)
    ui = subprocess.Popen([sys.executable, "-m", "clipstream.cli", "ui"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env={**os.environ, **settings.env()}, cwd=tmp_path,
                          start_new_session=True)
    try:
        line = ui.stdout.readline()  # (the command gives up after --timeout, closing stdout)
        found = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert found, f"no URL in {line!r}"
        url = found.group(0)

        def get(path: str):
            with urllib.request.urlopen(url + path, timeout=30) as answer:
                return answer.read()

        for version in ("1", "2", "3"):
            run = json.loads(get(f"/api/2.0/mlflow/model-versions/get?name={settings.stream}&version={version}"))
            run_id = run["model_version"]["run_id"]
            files = [f["path"] for f in json.loads(get(f"/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=plots"))["files"]]
            for kind in ("known", "unknown", "known-recall", "unknown-recall", "loss"):
                assert any(f.endswith(f"-{kind}.png") for f in files), f"version {version}: no {kind} plot in {files}"
            image = get(f"/get-artifact?path={next(f for f in files if f.endswith('-loss.png'))}&run_uuid={run_id}")
            assert image[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        ui.terminate()  # SIGTERM: the command stops the server's process group, then exits
        assert ui.wait(timeout=60) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)


@pytest.mark.component  # (the session's Ray, which has no GPU: the refusal comes before Ray Train would wait)
def test_train_asking_gpus_a_cpu_machine_lacks_exits_1_in_one_line_and_registers_nothing(ray_cluster, settings, stream,
                                                                                         capsys):
    import time

    from clipstream.registry import Registry

    tic = time.monotonic()
    assert main(["train", "--task", str(stream[0]), "--workers", "2", "--gpus-per-worker", "1"]) == 1
    assert time.monotonic() - tic < 120  # (Ray Train would wait for the GPUs without end)
    assert capsys.readouterr().err.strip() == ("clipstream: error: the cluster cannot place the job: 2 workers × 1 GPUs, "
                                               "cluster has 0; lower --workers or --gpus-per-worker (0: CPU workers)")
    assert Registry(settings).versions() == []


@pytest.mark.component
def test_help_loads_neither_torch_nor_deepspeed_nor_ray_and_prints_nothing_of_theirs():
    """The parser reads the presets (training/methods), which must not pull DeepSpeed in (it logs its accelerator
    choice as a WARNING on import, which every quiet command then printed before its own lines), nor torch and
    open_clip, which made `clipstream --help` take seconds (benchmarks/cli_startup.py times it)."""
    import subprocess
    import sys

    code = ("import sys; from clipstream.cli.parser import parser; parser().format_help(); "
            "print(sorted(m for m in ('deepspeed', 'ray', 'mlflow', 'torch', 'open_clip') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    assert "WARNING" not in done.stderr


@pytest.mark.parametrize("history, says", [
    ([17.31, 34.24], "Rm: 34.24, up 16.93 from 17.31 (the first version evaluated on them)"),
    ([50.0, 38.3], "Rm: 38.30, down 11.70 from 50.00"), ([40.0, 40.0], "Rm: 40.00, unchanged from 40.00"),
    ([40.0], "Rm: 40.00 (the baseline later versions move from)")])
def test_the_zero_shot_line_says_which_way_the_score_moved(history, says):
    from clipstream.cli.render import zero_shot_line

    assert says in zero_shot_line(history)


@pytest.mark.parametrize("argv", [["runs"], ["history"], ["export", "--version", "1", "--out", "m"], ["promote", "1"],
                                  ["eval", "--version", "1"]])
def test_a_command_that_reads_the_store_makes_none_where_there_is_none(argv, tmp_path, monkeypatch, capsys):
    """Run in a directory that never trained: one line naming where the store was looked for and how to name
    another, exit 2, and no empty ./.clipstream left behind."""
    from clipstream.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CLIPSTREAM_HOME", raising=False)
    monkeypatch.delenv("CLIPSTREAM_MLFLOW_TRACKING_URI", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"no clipstream store at {tmp_path / '.clipstream'}" in err and "CLIPSTREAM_HOME" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / ".clipstream").exists()
