"""Artifacts are data, never code: a method state planted in a registered version runs nothing when a job reads
it (issue 14, security)."""

import os
import pickle
from pathlib import Path

import pytest
import torch

from clipstream.training.methods.state import LEGACY_FILE, STATE_FILE, StateError, load_state


class _Payload:
    """What an attacker would pickle: unpickling it calls `touch` on the marker."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (self.marker,))


def test_a_pickled_legacy_state_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    with open(tmp_path / LEGACY_FILE, "wb") as f:
        pickle.dump({"ewc": _Payload(pathlib_path(marker))}, f)
    with pytest.raises(StateError, match="refused to load this method state"):
        load_state(tmp_path)
    assert not marker.exists()


def test_a_legacy_state_of_tensors_and_plain_values_still_loads(tmp_path):
    torch.save({"ewc": {"importance": {"w": torch.ones(2)}, "tasks": 1}, "er": {"pairs": [{"image": b"x"}]}},
               tmp_path / LEGACY_FILE)
    state = load_state(tmp_path)
    assert state["ewc"]["tasks"] == 1 and state["er"]["pairs"][0]["image"] == b"x"


def test_the_safe_format_wins_over_a_planted_pickle_next_to_it(tmp_path):
    from clipstream.training.methods.state import save_state

    marker = tmp_path / "pwned"
    save_state({"ewc": {"tasks": 2}}, tmp_path / STATE_FILE)
    with open(tmp_path / LEGACY_FILE, "wb") as f:
        pickle.dump(_Payload(pathlib_path(marker)), f)
    assert load_state(tmp_path) == {"ewc": {"tasks": 2}} and not marker.exists()


def pathlib_path(p):
    import pathlib

    return pathlib.Path(p)


@pytest.mark.component
def test_the_registered_pyfunc_brings_its_own_code_and_pins_only_public_dependencies(settings):
    """Restoring a version's environment must not install "clipstream" from the public index (someone else's
    package): the project travels as the model's code, and the requirements are pinned public packages."""
    import subprocess
    import sys

    import mlflow

    from clipstream.registry import Registry
    from tests.conftest import register_version

    version = register_version(settings, seed=5)
    registry = Registry(settings)
    folder = mlflow.artifacts.download_artifacts(registry.client.get_model_version_download_uri(settings.stream, version),
                                                 tracking_uri=settings.mlflow_tracking_uri)
    requirements = (Path(folder) / "requirements.txt").read_text().split()
    assert requirements and all("==" in r for r in requirements), requirements
    assert not [r for r in requirements if r.split("==")[0].lower() in ("clipstream", "mlflow-skinny") and r != "mlflow"]
    code = Path(folder) / "code" / "clipstream"
    for module in ("models.py", "mlflow_model.py", "training/job.py", "services/encoder.py", "model_configs"):
        assert (code / module).exists(), module
    assert not (code / "benchmarks").exists()
    # and it loads as a stock pyfunc in a fresh process
    script = (f"import mlflow; m = mlflow.pyfunc.load_model({f'models:/{settings.stream}/{version}'!r}); "
              "import pandas as pd; print(len(m.predict(pd.DataFrame({'text': ['a red cube']}))[0]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri})
    assert out.stdout.strip().splitlines()[-1] == "64", out.stderr[-2000:]
