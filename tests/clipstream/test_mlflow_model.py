"""The registered MLflow model: captions and images in, unit embeddings out, with a signature and an input example,
loaded as a stock pyfunc and served by `mlflow models serve`."""

import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from clipstream import models
from clipstream.registry import Registry
from clipstream.runtime import free_port
from tests.conftest import register_version


def _png(color) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), color).save(buffer, format="PNG")
    return buffer.getvalue()


def _loaded(settings, version):
    import mlflow

    return mlflow.pyfunc.load_model(f"models:/{settings.stream}/{version}")


def test_the_pyfunc_embeds_captions_and_images_as_its_signature_says(settings, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", settings.mlflow_tracking_uri)
    version = register_version(settings, 0)
    model = _loaded(settings, version)
    signature = model.metadata.signature
    assert [(c.name, c.type.name, c.required) for c in signature.inputs.inputs] == [("text", "string", False),
                                                                                    ("image", "binary", False)]
    assert signature.outputs.inputs[0].shape == (-1, 64)
    assert model.metadata.saved_input_example_info is not None  # (an input example was saved with it)

    red = _png((220, 30, 30))
    out = np.array(model.predict(pd.DataFrame({"text": ["a red square", None], "image": [None, red]})))
    assert out.shape == (2, 64) and np.allclose(np.linalg.norm(out, axis=1), 1, atol=1e-5)
    bundle = models.load_exported(Registry(settings).resolve(version).folder)
    np.testing.assert_allclose(out[0], bundle.embed_texts(["a red square"])[0], atol=1e-5)
    np.testing.assert_allclose(out[1], bundle.embed_images([red])[0], atol=1e-5)
    with pytest.raises(Exception, match="each row embeds one of them"):
        model.predict(pd.DataFrame({"text": ["a cup"], "image": [red]}))


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_real_http_request(settings):
    """`mlflow models serve` (on loopback, this environment: --env-manager local) loads the registered version and
    answers /invocations with a caption and a base64 image, as a hosted endpoint would be called."""
    version = register_version(settings, 1)
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": settings.mlflow_tracking_uri,  # (it runs `uvicorn` from PATH)
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m",
                               f"models:/{settings.stream}/{version}", "--env-manager", "local", "-h", "127.0.0.1",
                               "-p", str(port), "-w", "1"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "mlflow models serve did not answer /ping in 180 s"
            time.sleep(1)
        body = {"dataframe_split": {"columns": ["text", "image"],
                                    "data": [["a red square", ""],  # (no null in a binary column: see predict)
                                             [None, base64.b64encode(_png((30, 30, 220))).decode()]]}}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                predictions = np.array(json.loads(r.read())["predictions"])
        except urllib.error.HTTPError as exc:
            raise AssertionError(exc.read().decode()[:2000]) from exc
        assert predictions.shape == (2, 64) and np.allclose(np.linalg.norm(predictions, axis=1), 1, atol=1e-4)
    finally:
        os.killpg(server.pid, 15)  # the server and the workers it started: its own session
        server.wait(timeout=30)
