"""C-CLIP's checklist (the method card): adapters on a real tiny open_clip model, fused attention projections
included; embedding layers trained in full; merge and removal; the previous model by switching adapters off; CKC's
algebra; where gradients flow; the text tower's rate."""

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from clipstream import models
from clipstream.training.engine import param_groups, prepare_for_deepspeed
from clipstream.training.losses import ckc_loss, clip_loss
from clipstream.training.methods import build, lora, resolve
from clipstream.training.methods.base import TaskContext, forward_features
from clipstream.training.methods.cclip import PROJECTOR

TARGETS = resolve("cclip")["method"]["cclip"]["targets"]
EMBEDDINGS = resolve("cclip")["method"]["cclip"]["embeddings"]


@pytest.fixture
def model():
    torch.manual_seed(0)
    return prepare_for_deepspeed(models.create("clipstream-vit-tiny").model).eval()


@pytest.fixture(scope="module")
def batch():
    bundle = models.create("clipstream-vit-tiny")
    return {"image": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)),
            "text": bundle.tokenizer([f"a {c} disc on a striped background" for c in ("red", "blue", "green", "pink")])}


def _features(model, batch):
    return torch.cat([model.encode_image(batch["image"]), model.encode_text(batch["text"])])


def _randomise(model, seed=3):
    """Adapters as training leaves them: B (and a full delta D) no longer zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in lora.adapters(model).values():
            delta = a.B if isinstance(a, lora.LoRA) else a.D
            delta.copy_(torch.randn(delta.shape, generator=g) * 0.05)


def test_adapters_cover_the_fused_attention_weights_of_both_towers_and_start_as_the_base_model(model, batch):
    base = copy.deepcopy(model)
    adapted = lora.inject(model, TARGETS, rank=4, alpha=8.0)
    for tower in ("visual.transformer", "transformer"):
        for weight in ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
            assert f"{tower}.resblocks.0.{weight}" in adapted
    assert torch.equal(_features(model, batch), _features(base, batch))  # B = 0
    _randomise(model)
    assert not torch.allclose(_features(model, batch), _features(base, batch), atol=1e-4)  # the eval fast path sees them
    with lora.disabled(model):  # the previous model, no copy
        assert torch.equal(_features(model, batch), _features(base, batch))
    assert not torch.allclose(_features(model, batch), _features(base, batch), atol=1e-4)  # back on afterwards


@pytest.mark.parametrize("coefficient", [0.5, 1.0, 0.0])
def test_the_merged_model_is_the_adapter_model_at_scale_s_times_the_merge_coefficient(model, batch, coefficient):
    base = copy.deepcopy(model)
    lora.inject(model, TARGETS, rank=4, alpha=8.0)
    _randomise(model)
    scaled = copy.deepcopy(model)
    for a in lora.adapters(scaled).values():
        a.scale *= coefficient
    expected = _features(scaled, batch)
    merged = lora.merge(copy.deepcopy(model), coefficient)
    assert torch.allclose(_features(merged, batch), expected, atol=1e-5)
    if coefficient == 0.0:
        assert all(torch.equal(merged.state_dict()[k], v) for k, v in base.state_dict().items())


def test_a_merged_version_is_stock_open_clip_with_only_the_targeted_weights_changed(model, batch, tmp_path):
    base = copy.deepcopy(model)
    method = build(resolve("cclip", ["method.cclip.rank=4"]))
    method.prepare_model(model)
    _randomise(model)
    live = _features(model, batch)
    plain = method.export_model(model)
    assert lora.adapters(model) and hasattr(model, PROJECTOR)  # the training model is left as it was
    assert torch.equal(_features(model, batch), live)  # and still runs (every epoch exports it; training goes on)
    assert torch.allclose(_features(method.export_model(model), batch), _features(plain, batch))
    assert not lora.adapters(plain) and not hasattr(plain, PROJECTOR)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {k: v.shape for k, v in base.state_dict().items()}
    changed = {k for k, v in plain.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    assert set(EMBEDDINGS) <= changed and all(k.endswith(tuple(TARGETS)) or k in EMBEDDINGS for k in changed)

    # the export loads in stock open_clip, whose state dict has exactly these names and shapes
    import open_clip

    bundle = models.create("clipstream-vit-tiny")
    bundle.model = plain
    folder = models.export(bundle, tmp_path / "v")
    stock, _, _ = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    assert {k: v.shape for k, v in stock.state_dict().items()} == {k: v.shape for k, v in load_file(folder / "open_clip_model.safetensors").items()}
    stock.eval()
    assert torch.allclose(stock.encode_text(batch["text"]), plain.encode_text(batch["text"]), atol=1e-6)


def test_after_two_tasks_the_weights_are_the_base_plus_each_tasks_merged_delta(model):
    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    deltas = []
    for seed in (3, 4):
        lora.inject(model, TARGETS, rank=4, alpha=8.0)
        _randomise(model, seed)
        deltas.append({name: 0.5 * a.scale * (a.B @ a.A).detach() for name, a in lora.adapters(model).items()})
        lora.merge(model, 0.5)
    for name, value in model.state_dict().items():
        expected = w0[name] + sum(d[name] for d in deltas if name in d)
        assert torch.allclose(value, expected, atol=1e-6), name


def test_only_adapters_embeddings_and_the_projector_learn_and_the_previous_model_gets_no_gradient(model, batch):
    method = build(resolve("cclip", ["method.cclip.rank=4", "method.cclip.dropout=0"]))
    model = method.prepare_model(model).train()
    _randomise(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith((".A", ".B", ".D")) or n.startswith(PROJECTOR) for n in trainable)
    assert "logit_scale" not in trainable
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ctx = TaskContext(model=model, task_index=1, rank=0, world_size=1, device=torch.device("cpu"))
    feats = forward_features(model, batch["image"], batch["text"])
    terms = method.loss_terms(ctx, batch, feats)
    loss = clip_loss(feats.image, feats.text, feats.logit_scale) + terms["ckc"]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n in trainable)
    optimizer.step()
    assert all(torch.equal(p, frozen_before[n]) for n, p in model.named_parameters() if not p.requires_grad)

    # CKC alone trains the projector and, through the new features, the adapters of both towers
    model.zero_grad()
    method.loss_terms(ctx, batch, forward_features(model, batch["image"], batch["text"]))["ckc"].backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert f"{PROJECTOR}.weight" in grads
    assert any(n.startswith("visual.") for n in grads) and any(n.startswith("transformer.") for n in grads)


def test_ckc_is_infonce_on_the_stacked_items_twice_and_ignores_batch_order():
    g = torch.Generator().manual_seed(0)
    hi, ht, zi, zt = (F.normalize(torch.randn(5, 8, generator=g), dim=-1) for _ in range(4))
    scale = torch.tensor(10.0)
    loss = ckc_loss([hi, ht], [zi, zt], scale)
    h, z = torch.cat([hi, ht]), torch.cat([zi, zt])
    logits, labels = scale * h @ z.T, torch.arange(10)
    assert torch.allclose(loss, F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
    order = torch.randperm(5, generator=g)
    assert torch.allclose(ckc_loss([hi[order], ht[order]], [zi[order], zt[order]], scale), loss)
    # N = 1 by hand: two items, each scored against both old features
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    s = scale.item()
    row = -torch.log(torch.exp(torch.tensor(s)) / (torch.exp(torch.tensor(s)) + 1))  # own: cos 1; other: cos 0
    assert torch.allclose(ckc_loss([a, b], [a, b], scale), 2 * row)


def test_embedding_layers_train_in_full_at_the_text_rate_and_the_export_keeps_them_whole(model, batch):
    """§5.2: "most of the trainable parameters are embedding layers"; Appendix A.2: text rate 10 x the image one."""
    base = copy.deepcopy(model)
    config = resolve("cclip", ["method.cclip.rank=4", "method.cclip.dropout=0"])  # the preset's embeddings and rate
    lr = config["train"]["lr"]
    method = build(config)
    model = method.prepare_model(model).train()
    deltas = {name: a.D for name, a in lora.adapters(model).items() if isinstance(a, lora.Full)}
    assert set(deltas) == set(EMBEDDINGS) and "token_embedding.weight" in deltas
    groups = param_groups(model, config["train"]["weight_decay"], lr, method.lr_scale)
    rate = {id(p): (g.get("lr", lr), g["weight_decay"]) for g in groups for p in g["params"]}
    assert rate[id(deltas["token_embedding.weight"])] == (pytest.approx(10 * lr), 0.0)  # text rate, no decay
    assert rate[id(deltas["positional_embedding"])] == (pytest.approx(10 * lr), 0.0)
    assert rate[id(deltas["visual.positional_embedding"])] == (pytest.approx(lr), 0.0)

    optimizer = torch.optim.AdamW(groups, lr=lr)
    ctx = TaskContext(model=model, task_index=1, rank=0, world_size=1, device=torch.device("cpu"))
    feats = forward_features(model, batch["image"], batch["text"])
    (clip_loss(feats.image, feats.text, feats.logit_scale) + method.loss_terms(ctx, batch, feats)["ckc"]).backward()
    optimizer.step()
    table, before = model.token_embedding.weight.detach(), base.token_embedding.weight
    used = torch.zeros(len(table), dtype=torch.bool)  # the tokens up to each end of text (the padding is unseen)
    used[torch.cat([ids[:int(ids.argmax()) + 1] for ids in batch["text"]])] = True
    moved = (table != before).any(1)
    assert moved[used].all() and not moved[~used].any()  # the batch's tokens learnt, in full
    with lora.disabled(model):  # the previous model, embeddings included
        assert torch.equal(_features(model.eval(), batch), _features(base, batch))

    plain = method.export_model(model)  # LoRA merged at 0.5, the embeddings whole
    for name in EMBEDDINGS:
        owner, _, attr = name.rpartition(".")
        trained = getattr(model.get_submodule(owner), attr)
        assert torch.equal(plain.state_dict()[name], trained), name


def _rates(rank, world):
    """{parameter name: its learning rate} in a real DeepSpeed engine after two scheduler steps, for the C-CLIP
    preset (text_lr_scale 10)."""
    import os

    import deepspeed

    from clipstream.training.engine import deepspeed_config, param_groups

    # the gloo group is up already; these tell DeepSpeed so (else it looks for MPI)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    config = resolve("cclip", ["train.lr=0.001", "train.warmup_steps=0"])
    method = build(config)
    model = method.prepare_model(prepare_for_deepspeed(models.create("clipstream-vit-tiny").model))
    groups = param_groups(model, config["train"]["weight_decay"], config["train"]["lr"], method.lr_scale)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=groups,
                                                           config=deepspeed_config(config["train"], 1, 100))
    scheduler.step()
    scheduler.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}


@pytest.mark.component
def test_the_text_tower_trains_at_text_lr_scale_times_the_rate_through_deepspeeds_schedule():
    from tests.conftest import on_gloo

    rates = on_gloo(_rates, world=1)[0]
    text = [n for n in rates if n.startswith("transformer.")]
    image = [n for n in rates if n.startswith("visual.")]
    assert text and image
    lr = rates[image[0]]
    assert 0 < lr < 0.001  # the cosine schedule moved every group
    assert all(rates[n] == pytest.approx(10 * lr) for n in text) and all(rates[n] == pytest.approx(lr) for n in image)
    assert rates["cclip_projector.weight"] == pytest.approx(lr)
    # the embeddings' full deltas: the text tower's at its rate, the image tower's at the image rate
    assert rates["token_embedding.parametrizations.weight.0.D"] == pytest.approx(10 * lr)
    assert rates["parametrizations.text_projection.0.D"] == pytest.approx(10 * lr)
    assert rates["visual.parametrizations.positional_embedding.0.D"] == pytest.approx(lr)
