"""A registered version made without training (a real tiny open_clip model, really registered in MLflow)."""

import io
import json
import socket

import grpc
import mlflow
import pytest
import torch
from PIL import Image

from training import models
from training.registry import MANIFEST, Registry


def register_version(settings, seed: int, alias: str | None = None, lineage=()) -> str:
    torch.manual_seed(seed)
    bundle = models.create("clipstream-vit-tiny")
    folder = settings.home / f"export-{seed}" / "checkpoint"
    models.export(bundle, folder)
    torch.save({}, folder / "method_state.pt")
    (folder / MANIFEST).write_text(json.dumps({"lineage": list(lineage), "matrix": {}}))
    registry = Registry(settings)
    with registry.run(f"seed-{seed}", {}) as _:
        mlflow.log_metrics({"known/AA": 50.0, "known/forgetting": 0.0})
        version = registry.register(folder, {"task": f"t{seed}", "task_index": "0", "method": "finetune",
                                             "parent_version": "", "data_sha": "x"})
    if alias:
        registry.client.set_registered_model_alias(registry.name, alias, version)
    return version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 40), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def served(ray_cluster, tmp_path_factory):
    from ray import serve

    from clipstream.settings import Settings
    from clipstream.v1 import encoder_pb2_grpc
    from services import app
    from services.encoder import Limits

    settings = Settings(home=tmp_path_factory.mktemp("serve") / "home", grpc_port=_free_port()).ensure_dirs()
    v1 = register_version(settings, seed=1, alias="production")
    v2 = register_version(settings, seed=2)
    # no CPU reserved: the session's 2-CPU Ray cluster must still fit the training tests that follow
    app.start(settings, limits=Limits(max_items=8, max_text_chars=100, max_image_bytes=200_000), batch_size=16,
              cpus=(0, 0))
    channel = grpc.insecure_channel(f"127.0.0.1:{settings.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    yield settings, channel, encoder_pb2_grpc.EncoderStub(channel), (v1, v2)
    channel.close()
    serve.shutdown()




COLOURS = ["red", "navy", "green", "yellow", "purple", "orange"]


@pytest.fixture(scope="session")
def indexed(served):
    """Two tasks of coloured squares indexed with version 1 (the production version)."""
    settings, channel, _, (v1, _) = served
    from clipstream.v1 import search_pb2_grpc
    from services.index import TaskVectors, open_index
    from services.versions import VersionStore

    bundle = VersionStore(settings.mlflow_tracking_uri, settings.stream, settings.home / "cache").load(v1)
    from io import BytesIO

    from PIL import Image

    with open_index(settings) as index:
        for t, task in enumerate(("squares", "discs")):
            captions = [f"a {c} {task[:-1]} {t}" for c in COLOURS]
            pixels = torch.stack([bundle.preprocess_val(Image.open(BytesIO(png(c))).convert("RGB")) for c in COLOURS])
            with torch.no_grad():
                img = bundle.model.encode_image(pixels, normalize=True).numpy()
                txt = bundle.model.encode_text(bundle.tokenizer(captions), normalize=True).numpy()
            index.append(TaskVectors(task, t, v1, [f"{task}-{i}" for i in range(len(COLOURS))], img, txt, captions))
    return settings, search_pb2_grpc.SearchStub(channel), bundle, v1
