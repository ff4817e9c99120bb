"""clipstream.training.shared: what a job's driver shares with its workers under runs_dir, on a mounted folder or
a URI (here a real file:// filesystem through fsspec, as s3:// and gs:// go), and runs_dir reaching Ray Train. A
real stream of jobs on a file:// runs_dir is the quick tier's (tests/conftest.py `two_tasks`)."""

from pathlib import Path

from clipstream.settings import Settings
from clipstream.training import shared
from clipstream.training.job import run_config


def test_a_uri_runs_dir_reaches_ray_train_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings(home=tmp_path / "h", runs_dir="s3://bucket/prefix").ensure_dirs()
    config = run_config("stream-task-run", settings, max_failures=2)
    assert config.storage_path == "s3://bucket/prefix" and config.name == "stream-task-run"
    assert not list(tmp_path.rglob("s3*")) and not (tmp_path / "bucket").exists()


def test_a_model_folder_and_a_file_go_to_the_workers_through_a_uri(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "sub" / "weights.bin").write_bytes(b"\0\1")
    state = tmp_path / "state.pt"
    state.write_bytes(b"state")
    settings = Settings(home=tmp_path / "h", runs_dir=(tmp_path / "store").as_uri())
    inputs = settings.runs_path / "inputs" / "run-1"
    for _ in range(2):  # a rerun of the job finds the folder there: it is replaced, not nested
        # (the file first: a job with no model folder to share shares its method state alone)
        file, folder = shared.share(str(state), inputs / "state.pt"), shared.share(str(model), inputs / "model")
    assert folder == f"{settings.runs_dir}/inputs/run-1/model" and file.startswith("file://")
    assert shared.share("ViT-B-32:laion2b", inputs / "teacher") == "ViT-B-32:laion2b"  # not a file: as it is
    stored = tmp_path / "store/inputs/run-1"
    assert sorted(str(p.relative_to(stored)) for p in stored.rglob("*")) == [
        "model", "model/config.json", "model/sub", "model/sub/weights.bin", "state.pt"]

    local_model, local_state = Path(shared.local(folder)), Path(shared.local(file))  # what a worker reads
    assert (local_model / "sub" / "weights.bin").read_bytes() == b"\0\1" and local_state.read_bytes() == b"state"
    assert not str(local_model).startswith(str(tmp_path / "store"))  # a copy of its own
    assert shared.local(str(model)) == str(model) and shared.local(None) is None

    shared.remove(inputs)
    shared.remove(inputs)  # (nothing there: nothing to do)
    assert not stored.exists()
