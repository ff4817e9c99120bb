"""CLL-CLIP's append-only vocabulary and expandable token-embedding table (Yang et al., AAAI 2024,
arXiv:2401.17186, §2.1-2.3; ../shared/methods/cll-clip.md).

The tokenizer is open_clip's CLIP BPE as a Hugging Face fast tokenizer (`clip_tokenizer`: the same ids for the
same text as open_clip's `SimpleTokenizer`), which open_clip itself loads from an exported folder
(`text_cfg.hf_tokenizer_name`), so a grown version stays a stock open_clip model. Per language `grow` trains a
small byte-level BPE on its captions (HF `train_new_from_iterator`, CLIP's normaliser and pre-tokenizer) and
appends what is new: unseen merges after the old ones, unseen tokens with ids after the old ones. Old ids never
change.

The paper appends every unseen merge and notes that earlier text may then tokenise differently. Here a merge
is refused when its pair is adjacent in the old segmentation of any word of an earlier language (`protected`):
BPE applies merges lowest rank first, all old merges rank first, so an old word reaches its old segmentation and
then no new merge can start — its tokens stay exactly as they were (tested). A refused merge only means that
the new language's words containing that pair keep one more token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

SOT, EOT = "<|startoftext|>", "<|endoftext|>"


def clip_tokenizer(context_length: int):
    """open_clip's CLIP BPE (its `bpe_simple_vocab_16e6` tables, 49,408 tokens) as a HF `CLIPTokenizer`
    (fast): start/end of text keep their ids (49406/49407), padding is the end-of-text id (harmless under the
    causal mask, and pooling takes the first end of text)."""
    from open_clip.tokenizer import SimpleTokenizer
    from transformers import CLIPTokenizer

    simple = SimpleTokenizer()
    names = {"<start_of_text>": SOT, "<end_of_text>": EOT}
    vocab = {names.get(token, token): i for token, i in simple.encoder.items()}
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.get)
    return CLIPTokenizer(vocab=vocab, merges=list(merges), model_max_length=context_length)


def _model(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())["model"]


def words(tokenizer, texts: Iterable[str]) -> set[str]:
    """The pre-tokenised words of `texts` (normalised, byte-level), as the BPE model sees them."""
    backend = tokenizer.backend_tokenizer
    out = set()
    for text in texts:
        out.update(w for w, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(text)))
    return out


def segment(tokenizer, word: str) -> list[str]:
    """A pre-tokenised word's BPE tokens."""
    return [t.value for t in tokenizer.backend_tokenizer.model.tokenize(word)]


@dataclass
class Growth:
    """What `grow` did: the grown tokenizer, the tokens appended (in id order) and the merges refused."""

    tokenizer: object
    added: list[str]
    refused: list[tuple[str, str]]


def grow(tokenizer, texts: Sequence[str], vocab_size: int, protected: Iterable[str] = ()) -> Growth:
    """Append to `tokenizer` what a `vocab_size` BPE trained on `texts` has that it lacks, except merges that
    would re-tokenise a `protected` word (see the module's docstring)."""
    from transformers import CLIPTokenizer

    old = _model(tokenizer)
    old_merges = [tuple(m) for m in old["merges"]]
    known = set(old_merges)
    fresh = tokenizer.train_new_from_iterator(list(texts), vocab_size=vocab_size)
    blocked = {pair for seg in (segment(tokenizer, w) for w in protected) for pair in zip(seg, seg[1:])}
    vocab, merges, added, refused = dict(old["vocab"]), list(old_merges), [], []
    for a, b in (tuple(m) for m in _model(fresh)["merges"]):
        if (a, b) in known:
            continue
        if (a, b) in blocked or a not in vocab or b not in vocab:  # (an operand's own merge may have been refused)
            refused.append((a, b))
            continue
        merges.append((a, b))
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            added.append(a + b)
    grown = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=tokenizer.model_max_length)
    return Growth(grown, added, refused)


def grow_embedding(weight: torch.Tensor, rows: int, teir: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """The token-embedding table with `rows` new rows: old rows copied unchanged; new rows drawn from
    N(mean, std²) of all old entries (TEIR's initialisation, §2.2) or N(0, 0.02²) without it."""
    mean, std = (weight.float().mean(), weight.float().std()) if teir else (0.0, 0.02)
    new = torch.randn(rows, weight.shape[1], generator=generator, dtype=torch.float32) * std + mean
    return torch.cat([weight.detach(), new.to(weight.dtype)])


def row_scale(present: torch.Tensor, freq: torch.Tensor, special: Sequence[int]) -> torch.Tensor:
    """TEIR's per-row scale λ (the reference code's rule): 1/freq for the rows of tokens present in this
    task's captions, 0 for every other row and for the special tokens (§2.3)."""
    lam = torch.where(present, 1.0 / freq.float(), torch.zeros((), dtype=torch.float32))
    lam[list(special)] = 0.0
    return lam
