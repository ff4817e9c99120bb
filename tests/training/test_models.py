"""Models by name, exports that stock open_clip loads, and the DeepSpeed logit_scale shape fix."""

import open_clip
import pytest
import torch
from PIL import Image

from training import models


def _inputs(bundle):
    images = torch.stack([bundle.preprocess_val(Image.new("RGB", (40, 40), c)) for c in ("red", "navy")])
    return images, bundle.tokenizer(["a red cup", "a navy lamp on a striped background"])


def test_our_architectures_are_registered_with_open_clip():
    assert {"clipstream-vit-tiny", "clipstream-vit-small"} <= set(open_clip.list_models())
    bundle = models.create("clipstream-vit-tiny")
    assert bundle.image_size == 32 and bundle.embed_dim == 64
    assert bundle.tokenizer(["a cup"]).shape == (1, 32)  # context length comes from our JSON config


def test_export_loads_in_stock_open_clip_with_identical_embeddings(tmp_path):
    torch.manual_seed(0)
    bundle = models.create("clipstream-vit-tiny")
    models.prepare_for_deepspeed(bundle.model)  # as after training
    with torch.no_grad():
        bundle.model.logit_scale.fill_(2.5)
    models.export(bundle, tmp_path / "v1")

    stock, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'v1'}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'v1'}")
    assert stock.logit_scale.dim() == 0 and float(stock.logit_scale.detach()) == pytest.approx(2.5)
    images, texts = _inputs(bundle)
    assert torch.equal(tokenizer(["a red cup"]), bundle.tokenizer(["a red cup"]))
    bundle.model.eval(), stock.eval()
    with torch.no_grad():
        assert torch.allclose(stock.encode_image(images), bundle.model.encode_image(images), atol=1e-6)
        assert torch.allclose(stock.encode_text(texts), bundle.model.encode_text(texts), atol=1e-6)


def test_prepare_for_deepspeed_reshapes_logit_scale_and_keeps_training_maths():
    bundle = models.create("clipstream-vit-tiny")
    before = float(bundle.model.logit_scale.exp())
    model = models.prepare_for_deepspeed(bundle.model)
    assert model.logit_scale.shape == (1,) and model.logit_scale.requires_grad
    assert float(model.logit_scale.exp()) == pytest.approx(before)
    assert "logit_scale" in dict(model.named_parameters())  # still trained


def test_create_from_a_checkpoint_file_and_from_an_export_folder(tmp_path):
    torch.manual_seed(1)
    bundle = models.create("clipstream-vit-tiny")
    torch.save(bundle.model.state_dict(), tmp_path / "ckpt.pt")
    from_file = models.create("clipstream-vit-tiny", str(tmp_path / "ckpt.pt"))
    models.export(bundle, tmp_path / "export")
    from_folder = models.create("ignored-when-a-folder-is-given", str(tmp_path / "export"))
    for other in (from_file, from_folder):
        for (name, a), (_, b) in zip(bundle.model.state_dict().items(), other.model.state_dict().items()):
            assert torch.equal(a.reshape(-1), b.reshape(-1)), name
    assert from_folder.arch == "clipstream-vit-tiny"


def test_bad_references_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture 'no-such-arch'"):
        models.create("no-such-arch")
    with pytest.raises(ValueError, match="neither a checkpoint file nor a pretrained tag"):
        models.create("clipstream-vit-tiny", str(tmp_path / "missing.pt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="open_clip_config.json missing"):
        models.load_exported(tmp_path / "empty")
