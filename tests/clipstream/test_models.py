"""The model bundle: models by name, exports that stock open_clip loads, and the one embed path."""

import io
import subprocess
import sys

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from clipstream import models
from clipstream.training.engine import prepare_for_deepspeed


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
    prepare_for_deepspeed(bundle.model)  # as after training
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


def _same_weights(a, b):
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x.reshape(-1), y.reshape(-1)), name


def test_from_source_loads_open_clips_checkpoint_formats_and_export_folders(tmp_path, monkeypatch):
    torch.manual_seed(2)
    bundle = models.create("clipstream-vit-tiny")
    torch.save(bundle.model.state_dict(), tmp_path / "plain.pt")  # torch.save(model.state_dict())
    # as open_clip's trainer writes it: epoch, optimizer, and the DDP-wrapped model's state under "state_dict"
    torch.save({"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in bundle.model.state_dict().items()}},
               tmp_path / "epoch_3.pt")
    models.export(bundle, tmp_path / "export")
    monkeypatch.chdir(tmp_path)
    for source, recorded in (("clipstream-vit-tiny:plain.pt", f"clipstream-vit-tiny:{tmp_path / 'plain.pt'}"),
                             (f"clipstream-vit-tiny:{tmp_path / 'epoch_3.pt'}", f"clipstream-vit-tiny:{tmp_path / 'epoch_3.pt'}"),
                             ("export", str(tmp_path / "export"))):
        loaded, named = models.from_source(source)
        _same_weights(bundle, loaded)
        assert loaded.arch == "clipstream-vit-tiny" and named == recorded


def test_from_source_refuses_what_open_clip_cannot_load_in_one_line(model_sources):
    """The refusals themselves (the CLI's exit 2 and "nothing registered": tests/clipstream/test_cli.py); a truncated
    file names what torch found."""
    cases = {
        "no-such-arch:x.pt": "unknown architecture 'no-such-arch'",
        "ViT-B-32:no_such_tag": "'no_such_tag' is neither a checkpoint file nor a pretrained tag of ViT-B-32 (its tags: openai,",
        model_sources["missing"]: "is neither a checkpoint file nor a pretrained tag",
        model_sources["garbage"]: "open_clip cannot load it (a corrupt or truncated file",
        model_sources["truncated"]: "PytorchStreamReader failed reading zip archive",
        model_sources["small"]: "open_clip cannot load it",
        "clipstream-vit-tiny": "give ARCH:PRETRAINED",
        model_sources["missing-folder"]: "give ARCH:PRETRAINED",
    }
    for source, message in cases.items():
        with pytest.raises(ValueError) as refused:
            models.from_source(source)
        assert message in str(refused.value) and "\n" not in str(refused.value) and len(str(refused.value)) < 600, source
    with pytest.raises(FileNotFoundError, match="not-an-export is not an exported model"):
        models.from_source(model_sources["not-an-export"])


def test_a_download_that_cannot_reach_the_hub_is_a_dependency_failure_not_bad_input(monkeypatch):
    """This machine reaches no hub; offline mode makes the same failure at once (no retries)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for source in ("ViT-B-32:laion2b_s34b_b79k", "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K"):
        with pytest.raises(models.ModelUnavailable, match="could not be downloaded") as failed:
            models.from_source(source)
        assert isinstance(failed.value, ConnectionError) and source in str(failed.value)


def test_an_hf_hub_model_that_does_not_exist_is_bad_input(monkeypatch):
    """The hub answering "no such repository" cannot be produced without a network: its error is raised where
    huggingface_hub would raise it."""
    import httpx
    from huggingface_hub import errors

    def missing(repo_id, filename, **kwargs):
        response = httpx.Response(404, request=httpx.Request("GET", f"https://huggingface.co/{repo_id}/{filename}"))
        raise errors.RepositoryNotFoundError(f"404 Client Error: Repository Not Found for url: {repo_id}",
                                             response=response)

    monkeypatch.setattr("open_clip.pretrained.hf_hub_download", missing)
    with pytest.raises(ValueError, match="hf-hub:nobody/nothing: open_clip cannot load it") as refused:
        models.from_source("hf-hub:nobody/nothing")
    assert not isinstance(refused.value, ConnectionError)


def _images(tmp_path):
    """Five image files, the first grayscale (embedding must convert it to RGB)."""
    rng = np.random.default_rng(0)
    paths = []
    for i in range(5):
        mode = "L" if i == 0 else "RGB"
        shape = (40, 48) if mode == "L" else (40, 48, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(tmp_path / f"{i}.png")
        paths.append(tmp_path / f"{i}.png")
    return paths


def test_embed_equals_open_clip_direct_encoding_batched_or_not(tmp_path):
    torch.manual_seed(0)
    bundle = models.create("clipstream-vit-tiny")
    paths = _images(tmp_path)
    captions = ["a red dress", "a blue car", "a cat on a mat", "two dogs", "a red dress"]

    bundle.model.train()
    img, txt = bundle.embed_images(paths, batch_size=2), bundle.embed_texts(captions, batch_size=2)
    assert bundle.model.training  # the caller's mode is restored (embedding runs in eval mode)
    assert img.shape == txt.shape == (5, 64) and img.dtype == txt.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(img, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(txt, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(txt[0], txt[4])  # identical captions embed identically

    bundle.model.eval()
    with torch.no_grad():
        pixels = torch.stack([bundle.preprocess_val(Image.open(p).convert("RGB")) for p in paths])
        np.testing.assert_allclose(img, bundle.model.encode_image(pixels, normalize=True).numpy(), atol=1e-5)
        np.testing.assert_allclose(txt, bundle.model.encode_text(bundle.tokenizer(captions), normalize=True).numpy(),
                                   atol=1e-5)
    np.testing.assert_allclose(bundle.embed_images(paths, batch_size=256), img, atol=1e-6)  # batching changes nothing
    np.testing.assert_array_equal(bundle.embed_images(paths, batch_size=2), img)  # deterministic
    # the two halves a server runs apart (decode + transform on one thread, the model on another) give the same rows
    prepared = bundle.pixels(paths)
    assert prepared.shape == (5, 3, bundle.image_size, bundle.image_size)
    np.testing.assert_array_equal(bundle.embed_pixels(prepared, batch_size=2), img)
    assert bundle.embed_texts([]).shape == (0, 64)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        bundle.embed_texts(["a"], batch_size=0)


def test_one_image_loader_for_paths_bytes_files_and_pil_images(tmp_path):
    path = _images(tmp_path)[0]  # grayscale on disk
    data = path.read_bytes()
    loaded = [models.load_image(x) for x in (path, str(path), data, io.BytesIO(data), Image.open(path))]
    assert all(im.mode == "RGB" and im.size == (48, 40) for im in loaded)
    assert all(np.array_equal(np.asarray(loaded[0]), np.asarray(im)) for im in loaded[1:])
    bundle = models.create("clipstream-vit-tiny")
    np.testing.assert_array_equal(bundle.embed_images([path]), bundle.embed_images([data]))
    with pytest.raises(OSError):  # PIL's UnidentifiedImageError: callers word it for their users
        models.load_image(b"not an image")


def _png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels (a one-row body): a decompression bomb's header,
    made in microseconds."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1)))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("width, height, shown", [
    (5000, 5000, "5000x5000"),  # above our limit, below PIL's
    (10000, 10000, "100,000,000 pixels"),  # where PIL only warns
    (20000, 20000, "400,000,000 pixels"),  # where PIL raises DecompressionBombError
])
def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(tmp_path, width, height, shown):
    import warnings

    data = _png_declaring(width, height)
    (tmp_path / "big.png").write_bytes(data)
    for source in (data, tmp_path / "big.png", io.BytesIO(data)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # PIL's DecompressionBombWarning is an error here, never a printed warning
            with pytest.raises(models.ImageTooLarge, match=f"{shown}.*more than the 16,777,216 allowed; downscale"):
                models.load_image(source)
    assert issubclass(models.ImageTooLarge, ValueError)  # the encoder answers ValueErrors with INVALID_ARGUMENT


def test_the_pixel_limit_is_an_argument_and_matches_checking_data():
    from clipstream.training.data import task

    assert models.MAX_IMAGE_PIXELS == task.MAX_IMAGE_PIXELS == 4096 * 4096
    data = _png_declaring(64, 64)
    assert models.load_image(data).size == (64, 64)
    with pytest.raises(models.ImageTooLarge, match="64x64 .*4,095 allowed"):
        models.load_image(data, max_pixels=4095)
    with pytest.raises(models.ImageTooLarge, match="40x40"):
        models.load_image(Image.new("RGB", (40, 40)), max_pixels=100)
    assert models.load_image(_png_declaring(5000, 5000), max_pixels=None).size == (5000, 5000)


def test_truncated_images_raise_and_are_never_padded():
    from PIL import ImageFile

    import clipstream.training.data.reader  # noqa: F401  (what the data path imports, open_clip included)
    assert not ImageFile.LOAD_TRUNCATED_IMAGES
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    with pytest.raises(OSError, match="(?i)truncated"):
        models.load_image(buf.getvalue()[: len(buf.getvalue()) // 2])
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buf, "JPEG")
    with pytest.raises(OSError, match="(?i)truncated"):
        models.load_image(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_empty_and_one_pixel_images():
    with pytest.raises(OSError):  # PIL's UnidentifiedImageError
        models.load_image(b"")
    buf = io.BytesIO()
    Image.new("RGB", (1, 1), "red").save(buf, "PNG")
    assert models.load_image(buf.getvalue()).getpixel((0, 0)) == (255, 0, 0)


FAULTS = """
import ctypes, resource, sys, torch
from clipstream import models
libc = ctypes.CDLL(None)
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, or a huge page would fault 2 MiB at once
if sys.argv[1] == "keep":
    assert models.keep_freed_memory()
else:  # glibc's documented starting thresholds (128 KiB), pinned: left dynamic, glibc raises them after a first free
    # by its own rules, and the clean-clone CI's subprocess then kept its memory (1024 faults) where this one did not
    assert libc.mallopt(-3, 128 << 10) and libc.mallopt(-1, 128 << 10)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD

def step():  # what a step does to memory: allocate 64 MB in 32 blocks, touch them, free them all
    blocks = [torch.empty(512 << 10).fill_(1) for _ in range(32)]
    del blocks

step()  # a first step: glibc raises its thresholds after a first free on its own, to the largest block freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.component
@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_keep_freed_memory_stops_every_step_faulting_its_memory_in_again():
    """With glibc's default thresholds a step's 2 MiB blocks are mmapped and unmapped again (or trimmed from the heap's
    top), so each of 10 steps faults its 16k pages in again; kept, the next step reuses them (a few faults).
    Transparent huge pages are off in that process: one huge page faults 2 MiB in at once."""
    procs = {mode: subprocess.Popen([sys.executable, "-c", FAULTS, mode], stdout=subprocess.PIPE, text=True)
             for mode in ("default", "keep")}  # side by side: each is mostly torch's import
    faults = {mode: int(proc.communicate()[0]) for mode, proc in procs.items()}
    assert [proc.returncode for proc in procs.values()] == [0, 0]
    assert faults["default"] > 10 * 16384 * 0.9, faults
    assert faults["keep"] < 1000, faults


@pytest.mark.parametrize("precision, gpu, bf16, device, dtype", [
    ("auto", False, None, "cpu", torch.float32),  # the embedded default: as before, fp32 on the CPU
    ("auto", True, True, "cuda", torch.bfloat16),
    ("auto", True, False, "cuda", torch.float16),  # a GPU without bf16 (V100, T4)
    ("fp32", True, True, "cuda", torch.float32),
    ("fp16", True, True, "cuda", torch.float16),
    ("bf16", False, None, "cpu", torch.bfloat16)])
def test_placement_follows_the_gpu_the_process_has_and_the_precision_asked(precision, gpu, bf16, device, dtype):
    assert models.placement(precision, gpu=gpu, bf16=bf16) == (torch.device(device), dtype)


@pytest.mark.parametrize("precision, gpu, bf16, words", [
    ("bf16", True, False, "this GPU does not support bfloat16"), ("fp16", False, None, "fp16 needs a GPU"),
    ("half", False, None, "precision must be one of auto, fp32, bf16, fp16")])
def test_placement_refuses_a_precision_the_device_cannot_run(precision, gpu, bf16, words):
    with pytest.raises(ValueError, match=words):
        models.placement(precision, gpu=gpu, bf16=bf16)


def test_placement_asks_torch_what_the_process_has_when_not_told(monkeypatch):
    # (no GPU here: what torch answers is set, so that both answers run on any machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models.placement() == (torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert models.placement() == (torch.device("cuda"), torch.float16)


def test_a_bundle_in_half_precision_still_embeds_unit_float32_rows():
    torch.manual_seed(0)
    bundle = models.create("clipstream-vit-tiny")
    texts, images = ["a red cup", "a navy lamp on a striped background"], [Image.new("RGB", (40, 40), c) for c in ("red", "navy")]
    full = bundle.embed_texts(texts), bundle.embed_images(images)
    assert bundle.to("cpu", torch.bfloat16) is bundle and bundle.dtype == torch.bfloat16
    half = bundle.embed_texts(texts), bundle.embed_images(images)
    for h, f in zip(half, full):
        assert h.dtype == np.float32 and np.allclose(np.linalg.norm(h, axis=1), 1, atol=1e-6)
        assert (h * f).sum(axis=1).min() > 0.99  # the same directions, to bf16's precision
