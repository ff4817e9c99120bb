"""CLL-CLIP's vocabulary and embedding growth, checked against the card's testable properties 1, 2 and 4
(../shared/methods/cll-clip.md §8)."""

import random

import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer

from clipstream.training.methods import vocabulary

ENGLISH = ["a small red cup in the top left on a striped background",
           "There is a LARGE blue kettle, on a dotted background!",
           "a photo of a green teddy in the centre on a plain background"]


@pytest.fixture(scope="module")
def clip():
    return vocabulary.clip_tokenizer(32)


def _language(seed: int, syllables: str, n: int = 300) -> list[str]:
    """Captions of a made-up language: words of 2-4 syllables of one script, so languages of a script share
    pieces (as real ones do)."""
    rng = random.Random(seed)
    pieces = syllables.split()
    lexicon = ["".join(rng.choice(pieces) for _ in range(rng.randint(2, 4))) for _ in range(60)]
    return [" ".join(rng.choice(lexicon) for _ in range(rng.randint(5, 9))) for _ in range(n)]


LATIN = "ka lo me na ti ro su ve da pi ne kor tam"
ACCENTED = "ðø åæ þe øra kå ðil mø"


def _ids(tokenizer, texts):
    return tokenizer(texts).input_ids


def test_the_hf_tokenizer_gives_open_clips_ids(clip):
    simple = SimpleTokenizer()(ENGLISH + ["héllo wörld naïve café"], context_length=32)
    ours = clip(ENGLISH + ["héllo wörld naïve café"], padding="max_length", max_length=32, truncation=True,
                return_tensors="pt").input_ids
    for a, b in zip(simple, ours):
        end = int((a == 49407).nonzero()[0]) + 1  # (padding differs: 0 there, end of text here; both after EOT)
        assert torch.equal(a[:end], b[:end])
    assert len(clip) == 49408 and clip.bos_token_id == 49406 and clip.eos_token_id == 49407


def test_growth_appends_tokens_and_merges_and_never_changes_an_old_id(clip):
    grown = vocabulary.grow(clip, _language(1, LATIN), vocab_size=1000, protected=vocabulary.words(clip, ENGLISH))
    old, new = clip.get_vocab(), grown.tokenizer.get_vocab()
    assert grown.added and len(new) == len(old) + len(grown.added)
    assert all(new[t] == i for t, i in old.items())
    assert [new[t] for t in grown.added] == list(range(len(old), len(new)))  # appended, in order
    old_merges = vocabulary._model(clip)["merges"]
    assert vocabulary._model(grown.tokenizer)["merges"][:len(old_merges)] == old_merges  # a prefix
    # the new language now takes fewer tokens per caption
    text = _language(1, LATIN)[:20]
    assert sum(map(len, _ids(grown.tokenizer, text))) < sum(map(len, _ids(clip, text)))


def test_text_of_every_earlier_language_tokenises_identically_as_languages_are_added(clip):
    streams = [ENGLISH, _language(1, LATIN), _language(2, LATIN), _language(3, ACCENTED), _language(4, ACCENTED)]
    tokenizer, seen, refused = clip, [], 0
    for captions in streams:
        before = {i: _ids(tokenizer, texts) for i, texts in enumerate(seen)}
        grown = vocabulary.grow(tokenizer, captions, vocab_size=700,
                                protected=vocabulary.words(tokenizer, [c for texts in seen for c in texts]))
        assert grown.added or not seen
        tokenizer, refused = grown.tokenizer, refused + len(grown.refused)
        assert all(_ids(tokenizer, texts) == ids for texts, ids in zip(seen, before.values()))
        seen.append(captions)
    # and what the protection stops does happen: the same growths unprotected re-tokenise earlier text
    assert refused > 0
    drift, tokenizer = 0, clip
    for k, captions in enumerate(streams):
        before = [_ids(tokenizer, texts) for texts in streams[:k]]
        tokenizer = vocabulary.grow(tokenizer, captions, vocab_size=700).tokenizer
        drift += sum(_ids(tokenizer, texts) != ids for texts, ids in zip(streams[:k], before))
    assert drift > 0


def test_new_rows_follow_the_old_tables_statistics_and_old_rows_are_kept(clip):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(5000, 16, generator=g) * 0.3 + 0.1
    n = 4000
    grown = vocabulary.grow_embedding(table, n, teir=True, generator=g)
    assert grown.shape == (9000, 16) and torch.equal(grown[:5000], table)
    new = grown[5000:]
    tolerance = 3 * table.std() / (n * 16) ** 0.5
    assert abs(new.mean() - table.mean()) < tolerance and abs(new.std() - table.std()) < 0.02 * table.std()
    baseline = vocabulary.grow_embedding(table, n, teir=False, generator=g)[5000:]
    assert abs(baseline.mean()) < 3 * 0.02 / (n * 16) ** 0.5 and abs(baseline.std() - 0.02) < 0.001


def test_teirs_row_scale_is_one_over_the_tasks_that_saw_a_token_and_zero_for_absent_and_special_rows():
    present = torch.tensor([True, True, False, True, True])
    freq = torch.tensor([1, 2, 5, 4, 1])
    lam = vocabulary.row_scale(present, freq, special=[4])
    assert lam.tolist() == [1.0, 0.5, 0.0, 0.25, 0.0]
