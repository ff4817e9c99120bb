"""An Encoder replica's model path without Ray: placement, preprocessing, and one batch of requests encoded."""

import numpy as np
import torch

from clipstream import models
from clipstream.services import app
from clipstream.services.encoding import ModelPath
from clipstream.settings import Settings
from tests.services.conftest import png


def _bundle(seed: int) -> models.ClipBundle:
    torch.manual_seed(seed)
    return models.create("clipstream-vit-tiny")


def test_a_batch_is_split_by_version_and_modality_and_answered_in_request_order():
    path = ModelPath(gpu=False)
    one, two = path.place(_bundle(0)), path.place(_bundle(1))
    pictures = [png("red"), png("navy"), png("olive")]
    requests = [("1", "text", ["a red cup", "a lamp"]), ("2", "text", ["a red cup"]),
                ("1", "image", path.prepare(one, pictures[:2])), ("1", "text", ["a striped background"]),
                ("2", "image", path.prepare(two, pictures[2:]))]
    out = ModelPath.encode(requests, {"1": one, "2": two})
    expected = [one.embed_texts(["a red cup", "a lamp"]), two.embed_texts(["a red cup"]), one.embed_images(pictures[:2]),
                one.embed_texts(["a striped background"]), two.embed_images(pictures[2:])]
    assert [o.shape for o in out] == [e.shape for e in expected]
    for got, want in zip(out, expected):
        assert got.dtype == np.float32 and np.allclose(got, want, atol=1e-5)
    assert not np.allclose(out[0][0], out[1][0], atol=1e-3)  # each version through its own model


def test_a_replica_without_a_gpu_keeps_fp32_on_the_cpu_and_takes_bf16_when_asked():
    default = ModelPath("auto", gpu=False).place(_bundle(0))
    assert (default.device.type, default.dtype, default.model.training) == ("cpu", torch.float32, False)
    half = ModelPath("bf16", gpu=False).place(_bundle(0))
    assert half.dtype == torch.bfloat16 and np.allclose(np.linalg.norm(half.embed_texts(["a cup"]), axis=1), 1, atol=1e-6)


def test_only_the_encoder_asks_ray_for_the_gpus_the_settings_give(tmp_path):
    def options(application):
        encoder = application._bound_deployment
        return encoder.ray_actor_options, encoder.init_args[0]._bound_deployment.ray_actor_options

    encoder, search = options(app.build(Settings(home=tmp_path, serve_encoder_gpus=1)))
    assert encoder["num_gpus"] == 1 and "num_gpus" not in search  # Search holds no model
    encoder, _ = options(app.build(Settings(home=tmp_path)))
    assert encoder["num_gpus"] == 0  # the embedded default: the CPU
