"""The model bundle: open_clip models by name (built-in or our small JSON architectures, pretrained tags,
local checkpoints), their export, and the one way to embed texts and images with them.

Architectures are data (`model_configs/*.json`, registered with open_clip at import). A model version
is exported in open_clip's own folder layout (`open_clip_config.json` + `open_clip_model.safetensors`),
so stock open_clip loads it with `create_model_and_transforms("local-dir:DIR")`.

Training, evaluation, the registry's pyfunc, the gRPC encoder, the indexing job and the benchmarks all
embed through `ClipBundle.embed_texts` / `embed_images`, and read images through `load_image`.
"""

from __future__ import annotations

import ctypes
import difflib
import hashlib
import io
import json
import pickle
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import open_clip
import torch
from open_clip.push_to_hf_hub import save_config_for_hf
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import save_file

CONFIG_DIR = Path(__file__).parent / "model_configs"
open_clip.add_model_config(CONFIG_DIR)

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
TOKENIZER_FILE = "clipstream_tokenizer.json"  # not tokenizer.json: a Hugging Face tokenizer saves its own under that name
# The most pixels an image may declare (in its header, read before decoding): far above what a model reads
# (it downscales to image_size), far below what a few KB of PNG can claim (a decompression bomb). PIL's own
# limit is ~89M pixels, and above it only a warning up to twice that.
MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass
class ClipBundle:
    """A model with everything needed to feed it: the two transforms and the tokenizer."""

    model: torch.nn.Module
    preprocess_train: Callable
    preprocess_val: Callable
    tokenizer: Callable
    arch: str
    model_cfg: dict[str, Any]

    @property
    def image_size(self) -> int:
        size = self.model.visual.image_size
        return size[0] if isinstance(size, (tuple, list)) else int(size)

    @property
    def embed_dim(self) -> int:
        return int(self.model_cfg["embed_dim"])

    def to(self, device: str | torch.device, dtype: torch.dtype = torch.float32) -> "ClipBundle":
        """The model moved to `device` and cast to `dtype` (what `placement` chose), for embedding: in place,
        returns the bundle. The embeddings stay unit float32 rows whatever the dtype (`_embed`)."""
        self.model = self.model.to(device=device, dtype=dtype)
        return self

    def embed_texts(self, texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
        """Unit rows float32 [N, D] for `texts`, in batches of `batch_size`."""
        texts = [str(t) for t in texts]
        return self._embed(texts, batch_size, lambda chunk: self.model.encode_text(self.tokenizer(chunk).to(self.device)))

    def embed_images(self, images: Sequence[ImageSource], batch_size: int = 256) -> np.ndarray:
        """Unit rows float32 [N, D] for images given as PIL images, encoded bytes or paths (`load_image`),
        each decoded only when its batch is embedded."""
        return self._embed(list(images), batch_size, lambda chunk: self._encode_pixels(self.pixels(chunk)))

    def pixels(self, images: Sequence[ImageSource]) -> torch.Tensor:
        """The model's input for `images`: each decoded (`load_image`) and put through the eval transform, stacked
        [N, 3, H, W]. Apart from the model, so that a server can prepare requests while the model runs."""
        return torch.stack([self.preprocess_val(load_image(x)) for x in images])

    def embed_pixels(self, pixels: torch.Tensor, batch_size: int = 256) -> np.ndarray:
        """Unit rows float32 [N, D] for images already made into the model's input (`pixels`)."""
        return self._embed(pixels, batch_size, self._encode_pixels)

    def _encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(pixels.to(device=self.device, dtype=self.dtype))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def _embed(self, items: list | torch.Tensor, batch_size: int, encode: Callable) -> np.ndarray:
        """Eval mode while embedding (dropout off), the caller's mode restored, so this can run between
        training steps. Normalised here, in float32: a model in bf16 or fp16 gives unit float32 rows too."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        was_training = self.model.training
        self.model.eval()
        try:
            out = [torch.nn.functional.normalize(encode(items[s:s + batch_size]).float(), dim=-1).cpu()
                   for s in range(0, len(items), batch_size)]
        finally:
            self.model.train(was_training)
        return torch.cat(out).numpy() if out else np.zeros((0, self.embed_dim), np.float32)


ImageSource = Union[Image.Image, bytes, str, Path, IO[bytes]]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # what a model embeds in (Settings.embed_precision)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def placement(precision: str = "auto", gpu: Optional[bool] = None,
              bf16: Optional[bool] = None) -> tuple[torch.device, torch.dtype]:
    """Where a model embeds and in which dtype, from what the process was given: on the GPU when it has one (`gpu`;
    None: torch.cuda.is_available(), which under Ray means the task or actor was given a GPU), else on the CPU.
    `auto`: half precision on a GPU, bf16 where it supports it (`bf16`; None: ask torch), fp16 otherwise; fp32 on
    the CPU. An explicit precision the device cannot run is refused with a ValueError: bf16 on a GPU without it,
    fp16 on the CPU (which has no fast half kernels); bf16 on the CPU runs (slowly where the CPU lacks it)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if gpu and bf16 is None:
        bf16 = torch.cuda.is_bf16_supported()
    if precision == "auto":
        precision = ("bf16" if bf16 else "fp16") if gpu else "fp32"
    elif precision == "bf16" and gpu and not bf16:
        raise ValueError("precision bf16: this GPU does not support bfloat16; use fp16, fp32 or auto")
    elif precision == "fp16" and not gpu:
        raise ValueError("precision fp16 needs a GPU (this process has none); use fp32, bf16 or auto")
    return torch.device("cuda" if gpu else "cpu"), DTYPES[precision]


# glibc's malloc hands a freed block above its mmap threshold straight back to the kernel, and trims the heap whenever
# more than its trim threshold lies free at the top. A training or encoding step frees and re-allocates tens of MB
# (activations, gradients, temporaries) every step, so every step faulted those pages in again, zero-filled by the
# kernel: EWC's penalty (a few passes over 5.4M parameters) spent ~80% of its time there, where the kernel backed
# those blocks with 4 KiB pages (with transparent huge pages it faults far less, and this changes little). Keeping
# freed memory for reuse is what tcmalloc and jemalloc do (PyTorch's CPU tuning guide recommends them for this); the
# price is a resident set that stays near its peak, as under the CUDA caching allocator.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
_MMAP_ABOVE = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit: blocks up to it come from the heap
_TRIM_ABOVE = 1 << 30   # free memory at the heap's top goes back to the kernel only beyond this


def keep_freed_memory() -> bool:
    """Tell the C library's malloc to keep freed memory for reuse, for the life of this process: called where a
    process sets up to run a model (training worker, encoder replica, indexing task). False where the C library has
    no `mallopt` (not glibc): nothing changes there."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, _MMAP_ABOVE) and mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE))


class ImageTooLarge(ValueError):
    """An image that declares more pixels than we decode (`load_image`'s `max_pixels`, or PIL's own limit)."""


def load_image(source: ImageSource, max_pixels: Optional[int] = MAX_IMAGE_PIXELS) -> Image.Image:
    """An RGB PIL image from a PIL image, encoded bytes (PNG, JPEG, ...), a path or a binary file object.

    The size is checked from the header, before anything is decoded: more than `max_pixels` (None: only PIL's
    limit), or more than PIL's decompression-bomb limit, raises ImageTooLarge (a ValueError). Decoding errors
    propagate (PIL's UnidentifiedImageError / OSError) for the caller to word; truncated data is one of them,
    never padded (PIL's ImageFile.LOAD_TRUNCATED_IMAGES stays off)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(bytes(source))
    # PIL warns between its limit and twice it, and raises above: both mean "too large" here. Set per call,
    # not once at import: test runners and other code reset warning filters.
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            if isinstance(source, Image.Image):
                _check_pixels(source.size, max_pixels)
                return source.convert("RGB")
            with Image.open(source) as img:
                _check_pixels(img.size, max_pixels)
                return img.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            found = re.search(r"\((\d+) pixels\)", str(exc))  # PIL: "Image size (N pixels) exceeds limit of M pixels"
            limit = min(x for x in (max_pixels, Image.MAX_IMAGE_PIXELS) if x)
            size = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
            raise ImageTooLarge(f"image has {size}, more than the {limit:,} allowed; downscale it") from exc


def _check_pixels(size: tuple[int, int], max_pixels: Optional[int]) -> None:
    width, height = size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLarge(f"image is {width}x{height} ({width * height:,} pixels), more than the {max_pixels:,} "
                            "allowed; downscale it")


def architecture(arch: str) -> dict[str, Any]:
    """The model config of `arch`, any architecture open_clip knows by name (its built-in ones such as ViT-B-32,
    and ours in model_configs/); an unknown name is a one-line ValueError naming the close ones."""
    config = open_clip.get_model_config(arch)
    if config is None:
        close = difflib.get_close_matches(str(arch), open_clip.list_models(), n=5, cutoff=0.5)
        raise ValueError(f"unknown architecture {arch!r}; {'close ones: ' + ', '.join(close) if close else 'none is close'}"
                         f" (open_clip.list_models() lists all {len(open_clip.list_models())})")
    return config


class ModelUnavailable(ConnectionError):
    """A model that could not be fetched (a pretrained tag's weights, an hf-hub model) because the network or the hub
    did not answer: not the input's fault (the CLI exits 1); the same command may work where the network allows."""


HF_HUB = "hf-hub:"


def create(arch: str, pretrained: Optional[str] = None) -> ClipBundle:
    """`arch` is an open_clip architecture name, or `hf-hub:ORG/NAME` (open_clip fetches that model's config and
    weights; `pretrained` unused); `pretrained` a pretrained tag, a checkpoint file, or an exported model folder
    (then `arch` may be None-like and the folder's own config wins).

    What open_clip cannot load is one ValueError naming the source (a corrupt or truncated checkpoint, one whose
    shapes do not fit `arch`, a hub model that does not exist), or ModelUnavailable where the download failed."""
    if pretrained and Path(pretrained).is_dir():
        return load_exported(pretrained)
    if arch and arch.startswith(HF_HUB):  # open_clip's own hub loading; without its weights it would go on random
        name, options = arch, {"require_pretrained": True}
    else:
        architecture(arch)
        if pretrained and not Path(pretrained).is_file() and pretrained not in open_clip.list_pretrained_tags_by_model(arch):
            tags = ", ".join(open_clip.list_pretrained_tags_by_model(arch)) or "none"
            raise ValueError(f"{pretrained!r} is neither a checkpoint file nor a pretrained tag of {arch} (its tags: {tags})")
        name, options = arch, {"pretrained": pretrained}
    with _loading(f"{arch}:{pretrained}" if pretrained else arch):
        model, pre_train, pre_val = open_clip.create_model_and_transforms(name, **options)
        return ClipBundle(model, pre_train, pre_val, open_clip.get_tokenizer(name), arch, open_clip.get_model_config(name))


def from_source(source: str) -> tuple[ClipBundle, str]:
    """The model `source` names, as `clipstream register --from` takes it: `ARCH:PRETRAINED` (a pretrained tag or a
    checkpoint file of that open_clip architecture), `hf-hub:ORG/NAME`, or an exported folder (`export`); with the
    source as it is recorded (a local file or folder as an absolute path)."""
    text = str(source).strip()
    if text.startswith(HF_HUB):
        return create(text), text
    if Path(text).is_dir():
        return load_exported(text), str(Path(text).absolute())
    arch, sep, pretrained = text.partition(":")
    if not (sep and arch and pretrained):
        raise ValueError(f"{text!r}: give ARCH:PRETRAINED (a pretrained tag or a checkpoint file, e.g. "
                         f"ViT-B-32:laion2b_s34b_b79k or ViT-B-32:/data/ckpt.pt), {HF_HUB}ORG/NAME or an exported "
                         "model folder")
    bundle = create(arch, pretrained)
    return bundle, f"{arch}:{Path(pretrained).absolute()}" if Path(pretrained).is_file() else text


# what the hub or the network raise when they cannot be reached (huggingface_hub's LocalEntryNotFoundError: not
# reachable and not cached), found anywhere in the chain of causes of open_clip's error
_OFFLINE = ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "ReadTimeout",
            "URLError", "gaierror")
# (open_clip asserts on some shapes: a checkpoint of another architecture)
_LOAD_ERRORS = (RuntimeError, OSError, ValueError, KeyError, EOFError, AssertionError, pickle.UnpicklingError,
                SafetensorError)


@contextmanager
def _loading(what: str) -> Iterator[None]:
    """open_clip's failure to load `what` as one line: ModelUnavailable where the network failed, else a ValueError
    (its first lines: open_clip's messages and torch's list every mismatched tensor)."""
    try:
        yield
    except _LOAD_ERRORS as exc:
        chain, cause = [], exc
        while cause is not None and len(chain) < 16:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        detail = " ".join(" ".join(str(exc).split("\n")[:2]).split()).split(". ")[0]
        detail = detail if len(detail) <= 240 else detail[:237] + "..."
        if any(type(c).__name__ in _OFFLINE or isinstance(c, (ConnectionError, TimeoutError)) for c in chain):
            raise ModelUnavailable(f"{what}: could not be downloaded (no network or hub?): {detail}") from exc
        raise ValueError(f"{what}: open_clip cannot load it (a corrupt or truncated file, or weights of another "
                         f"architecture?): {type(exc).__name__}: {detail}") from exc


def _exported_meta(folder: Path) -> dict:
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} is not an exported model: {CONFIG_FILE} missing")
    return json.loads(config_path.read_text())


def exported_arch(folder: str | Path) -> str:
    """The open_clip architecture an exported folder was made from (its folder name for a stock open_clip export)."""
    return _exported_meta(Path(folder)).get("arch", Path(folder).name)


def load_exported(folder: str | Path) -> ClipBundle:
    folder = Path(folder)
    meta = _exported_meta(folder)
    with _loading(str(folder)):
        model, pre_train, pre_val = open_clip.create_model_and_transforms(f"local-dir:{folder}")
        tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    return ClipBundle(model, pre_train, pre_val, tokenizer, meta.get("arch", folder.name), meta["model_cfg"])


def tokenizer_digest(folder: str | Path) -> str:
    """A short digest naming an exported version's tokenizer: of its Hugging Face tokenizer file (a grown
    vocabulary), else `clip-bpe` (open_clip's built-in CLIP BPE, the same for every such version)."""
    path = Path(folder) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else "clip-bpe"


def export(bundle: ClipBundle, folder: str | Path) -> Path:
    """Write an open_clip-loadable folder: weights, architecture config (+ preprocessing), tokenizer description."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in bundle.model.state_dict().items()}
    state["logit_scale"] = state["logit_scale"].reshape(())  # stock open_clip keeps a 0-dim scalar
    save_file(state, folder / WEIGHTS_FILE)
    save_config_for_hf(bundle.model, folder / CONFIG_FILE, model_config=bundle.model_cfg)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    meta["arch"] = bundle.arch
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
    tok = bundle.tokenizer
    description = {"class": type(tok).__name__, "context_length": getattr(tok, "context_length", None)}
    if hasattr(tok, "save_pretrained"):  # HF tokenizers carry their own files
        tok.save_pretrained(folder)
    (folder / TOKENIZER_FILE).write_text(json.dumps(description, indent=2))
    return folder


