"""CLL-CLIP + TEIR's checklist (the method card, §8): the grown version is stock open_clip; old rows and features
unchanged by growth, new rows from the old table's statistics; λ; only token embeddings and the temperature learn,
and rows with λ = 0 stay bit-identical; each ablation preset switches one thing off. The vocabulary itself:
test_vocabulary.py; a 3-task stream: test_streams.py."""

import copy

import open_clip
import pytest
import torch

from clipstream import models
from clipstream.training.data.synth import synthesize_languages
from clipstream.training.engine import prepare_for_deepspeed
from clipstream.training.losses import clip_loss
from clipstream.training.methods import build, resolve
from clipstream.training.methods.base import TaskContext, forward_features
from clipstream.training.methods.cllclip import TRAINED

EOT = 49407
# CLL-CLIP's ablation presets: the one knob each changes from `cllclip`, and its value there
ABLATIONS = {"cllclip-no-cross-lingual": ("method.cllclip.cross_lingual_weight", 0.0),
             "cllclip-no-decay": ("method.cllclip.weight_decay", 0.0)}


@pytest.fixture(scope="module")
def languages(tmp_path_factory):
    """English and one synthetic language, and a random-init tiny CLIP exported as the version they start from."""
    root = tmp_path_factory.mktemp("cllclip")
    tasks = synthesize_languages(root / "data", 2, seed=1, train_pairs=60, test_per_task=4, progress=False)
    torch.manual_seed(0)
    source = models.export(models.create("clipstream-vit-tiny"), root / "v1")
    return source, tasks


def _grow(languages, tmp_path, preset="teir", overrides=()):
    source, tasks = languages
    config = resolve(preset, overrides)
    method = build(config)
    history = [{"task": tasks[0].name, "path": str(tasks[0])}]
    grown = method.prepare_version(str(source), "1", config, {"task": tasks[1].name, "path": str(tasks[1])},
                                   history, tmp_path)
    return method, grown


@pytest.mark.parametrize("preset, mean, std", [("teir", None, None), ("cllclip", 0.0, 0.02)])
def test_growth_keeps_every_old_row_and_draws_new_rows_from_the_old_tables_statistics(languages, tmp_path, preset, mean, std):
    method, grown = _grow(languages, tmp_path, preset)
    model, *_ = open_clip.create_model_and_transforms(f"local-dir:{grown}")  # stock open_clip loads it
    assert isinstance(open_clip.get_tokenizer(f"local-dir:{grown}"), open_clip.tokenizer.HFTokenizer)
    old = models.load_exported(languages[0]).model.token_embedding.weight
    new = model.token_embedding.weight
    added = method.components[0].state["added"]
    assert added > 0 and new.shape[0] == old.shape[0] + added
    assert torch.equal(new[:old.shape[0]], old)
    mean = old.mean() if mean is None else mean
    std = old.std() if std is None else std
    rows = new[old.shape[0]:]
    tolerance = 3 * std / rows.numel() ** 0.5
    assert abs(rows.mean() - mean) < tolerance and abs(rows.std() - std) < 3 * tolerance


def test_growth_alone_keeps_features_and_pooling_takes_the_end_of_text_position(languages, tmp_path):
    _, grown = _grow(languages, tmp_path)
    before, after = models.load_exported(languages[0]), models.load_exported(grown)
    english = ["a photo of a large green clock in the top left on a checkered background", "a red mug"]
    ids = before.tokenizer(english)
    assert torch.allclose(before.model.encode_text(ids), after.model.encode_text(after.tokenizer(english)), atol=1e-6)

    foreign = after.tokenizer([open_clip_rows(languages[1][1])[0]["caption"]])
    assert foreign.max() > EOT  # new ids exceed end of text: argmax pooling would take a new token instead
    m = after.model
    with torch.no_grad():
        x = m.ln_final(m.transformer(m.token_embedding(foreign) + m.positional_embedding, attn_mask=m.attn_mask))
        at = int((foreign[0] == EOT).nonzero()[0])
        assert torch.allclose(m.encode_text(foreign)[0], x[0, at] @ m.text_projection, atol=1e-6)
        assert not torch.allclose(x[0, int(foreign[0].argmax())], x[0, at])


def test_lambda_is_one_over_the_tasks_a_token_appeared_in_and_zero_for_absent_and_special_tokens(languages, tmp_path):
    method, grown = _grow(languages, tmp_path)
    state, tokenizer = method.components[0].state, models.load_exported(grown).tokenizer.tokenizer
    captions = [r["caption"] for r in open_clip_rows(languages[1][1])]
    english = [r["caption"] for r in open_clip_rows(languages[1][0])]
    ids = lambda texts: {i for s in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in s}  # noqa: E731
    here, before = ids(captions), ids(english)
    lam = state["lam"]
    for token in list(here)[:50]:
        in_clip = token < 49408
        assert lam[token] == pytest.approx(1 / (1 + in_clip + (token in before)))
    absent = sorted(set(range(len(lam))) - here)
    assert torch.all(lam[absent] == 0) and lam[EOT] == 0 and lam[EOT - 1] == 0
    present = lam > 0  # counted once more after this task: the state the next language starts from
    assert torch.allclose(state["freq"][present], 1 / lam[present] + 1)
    assert state["teacher"] == {"version": "1"} and state["languages"] == ["xa"]


def open_clip_rows(task):
    from clipstream.training.data.task import Task

    return Task.load(task).check("train").rows


def _flat(config: dict, prefix: str = "") -> dict:
    """{"train.lr": 1e-3, ...}: every leaf of a resolved config by its dotted key."""
    out = {}
    for key, value in config.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("scale", ["", "-vit-b-16", "-vit-b-32"])
@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_each_ablation_preset_is_cllclip_with_exactly_one_knob_switched_off(ablation, scale):
    paper, ablated = _flat(resolve(f"cllclip{scale}")), _flat(resolve(f"{ablation}{scale}"))
    key, value = ABLATIONS[ablation]
    assert {k for k in paper.keys() | ablated.keys() if paper.get(k) != ablated.get(k)} == {"preset", key}
    assert paper[key] > 0 and ablated[key] == value


@pytest.mark.parametrize("preset", ["teir", "cllclip", *ABLATIONS])
def test_only_token_embeddings_and_temperature_learn_and_rows_with_zero_scale_stay_bit_identical(languages, tmp_path, preset):
    method, grown = _grow(languages, tmp_path, preset)
    student = models.load_exported(grown)
    teacher = models.load_exported(languages[0])
    model = method.prepare_model(prepare_for_deepspeed(student.model))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(TRAINED)
    start = copy.deepcopy(model.state_dict())
    rows = open_clip_rows(languages[1][1])[:16]
    batch = {"image": torch.stack([student.preprocess_val(models.load_image(languages[1][1] / r["image"])) for r in rows]),
             "text": student.tokenizer([r["caption"] for r in rows]),
             "text_en": teacher.tokenizer([r["caption_en"] for r in rows])}
    ctx = TaskContext(model=model, task_index=1, rank=0, world_size=1, device=torch.device("cpu"),
                      teacher=prepare_for_deepspeed(teacher.model).eval(), lr=0.01)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ctx.lr, weight_decay=0.0)
    for _ in range(3):
        feats = forward_features(model, batch["image"], batch["text"])
        terms = method.loss_terms(ctx, batch, feats)
        if preset == "cllclip-no-cross-lingual":  # switched off: no term (and no teacher pass)
            assert terms == {}
        else:
            assert set(terms) == {"cross_lingual"} and terms["cross_lingual"] > 0
        (method.clip_weight * clip_loss(feats.image, feats.text, feats.logit_scale, distributed=False)
         + sum(terms.values())).backward()
        assert all(p.grad is None for n, p in model.named_parameters() if n not in TRAINED)
        optimizer.step()
        optimizer.zero_grad()
        method.after_step(ctx)
    after = model.state_dict()
    assert all(torch.equal(after[k], start[k]) for k in after if k not in TRAINED)  # both towers frozen
    lam = method.components[0].state["lam"]
    table, old = after["token_embedding.weight"], start["token_embedding.weight"]
    moved = (table != old).any(1)
    used = torch.zeros(len(lam), dtype=torch.bool)
    used[batch["text"].unique()] = True
    if preset == "teir":  # rows of absent tokens and specials: bit-identical; present ones learnt
        assert not moved[lam == 0].any() and moved[used & (lam > 0)].all()
    elif preset == "cllclip-no-decay":  # λ ≡ 1 without decay: exactly the rows the captions feed, up to end of text
        seen = torch.zeros(len(lam), dtype=torch.bool)
        seen[torch.cat([ids[:int((ids == EOT).nonzero()[0]) + 1] for ids in batch["text"]])] = True
        assert torch.equal(moved, seen)
    else:  # λ ≡ 1: stock decay moves every row, those of absent languages too (the forgetting TEIR stops)
        assert moved.all()
