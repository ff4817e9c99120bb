"""Tests for method presets (training/methods/config.py): inherit_from composition, key=value overrides and the
schema every resolved config is checked against (training/methods/schema.py)."""
import copy

import pytest

from clipstream.training.methods import METHODS, build, schema
from clipstream.training.methods.config import BASE, PRESETS, SCALES, load_presets, merge, method_presets, resolve


def raw(name, overrides=(), presets=None):
    """`resolve` without the schema: composition and override parsing on presets of any shape (CUSTOM)."""
    return resolve(name, overrides, presets, validate=False)

CUSTOM = {
    "base": {"train": {"lr": 1.0, "epochs": 2, "betas": [0.9, 0.98]}, "method": {"name": "finetune"},
             "model": {"arch": "a"}},
    "ctp": {"inherit_from": ["base"], "method": {"name": "ctp", "topology": 8, "shared": "ctp"},
            "train": {"lr": 2.0}},
    "er": {"inherit_from": ["base"], "method": {"name": "er", "buffer": 100, "shared": "er"},
           "train": {"lr": 3.0, "epochs": 5}},
    "ctp_er": {"inherit_from": ["ctp", "er"], "method": {"name": "ctp_er"}},
    "ctp_er_own": {"inherit_from": ["ctp", "er"], "train": {"lr": 4.0}, "method": {"name": "mine"}},
    "loop_a": {"inherit_from": ["loop_b"], "x": 1},
    "loop_b": {"inherit_from": ["loop_c"]},
    "loop_c": {"inherit_from": ["loop_a"]},
    "self_loop": {"inherit_from": ["self_loop"]},
    "orphan": {"inherit_from": ["nowhere"]},
    "plain": {"train": {"lr": 5.0}},
}


SHIPPED = {"finetune": [], "joint": ["joint"], "ewc": ["ewc"], "mas": ["mas"], "lwf": ["lwf"], "er": ["er"],
           "modx": ["modx"], "ctp": ["ctp"], "ctp_er": ["ctp", "er"], "cclip": ["cclip"], "cllclip": ["cllclip"],
           "teir": ["cllclip"], "cllclip-no-cross-lingual": ["cllclip"], "cllclip-no-decay": ["cllclip"]}
LANGUAGE = ("cllclip", "teir", "cllclip-no-cross-lingual", "cllclip-no-decay")  # CLL-CLIP's: fp32, ZeRO 0


def test_shipped_presets_resolve_with_all_base_keys_and_build_their_methods():
    from clipstream.training.methods import build

    presets = load_presets()
    assert set(presets) == {"base", *SHIPPED, *(f"{name}-{scale}" for name in SHIPPED for scale in SCALES),
                            "pretrain-emoji"}  # (version 0 of the emoji world: finetune's lifecycle, its own model)
    base = presets["base"]
    for name, components in SHIPPED.items():
        config = resolve(name)
        assert config["preset"] == name
        for section, values in base.items():
            if isinstance(values, dict):
                assert set(values) <= set(config[section]), f"{name} lacks keys of base.{section}"
        for key, value in base["train"].items():
            assert config["train"][key] == value
        assert "inherit_from" not in config
        stack = build(config)
        assert stack.name == name and [c.name for c in stack.components] == components
        assert all(c.params == config["method"][c.name] for c in stack.components)
    assert resolve("finetune")["model"]["arch"] == "clipstream-vit-tiny"
    assert resolve("pretrain-emoji")["model"]["arch"] == "clipstream-vit-emoji"
    assert build(resolve("pretrain-emoji")).components == []
    assert resolve("finetune")["train"]["lr"] == pytest.approx(1e-3)
    assert resolve("ctp_er")["method"]["er"] == resolve("er")["method"]["er"]  # composed, each with its own params


@pytest.mark.parametrize("scale,arch,batch", [("vit-b-16", "ViT-B-16-quickgelu", 128), ("vit-b-32", "ViT-B-32-quickgelu", 256)])
def test_every_method_at_scale_is_a_pretrained_clip_in_bf16_with_its_papers_values(scale, arch, batch):
    import open_clip

    for name, components in SHIPPED.items():
        config = resolve(f"{name}-{scale}")
        assert [c.name for c in build(config).components] == components  # the same method, at another scale
        assert config["method"] == {k: {**resolve(name)["method"][k], **v} for k, v in config["method"].items()}
        model, train = config["model"], config["train"]
        # OpenAI's weights were trained with QuickGELU: open_clip's `-quickgelu` config is the one that matches them
        assert model["arch"] == arch and "openai" in open_clip.list_pretrained_tags_by_model(arch)
        # CLL-CLIP's per-row decay edits fp32 weights that ZeRO and mixed precision would overwrite
        fp32 = name in LANGUAGE
        assert (train["precision"], train["zero_stage"]) == (("fp32", 0) if fp32 else ("bf16", 2)), name
        assert train["micro_batch"] == (128 if fp32 else 70 if (name, scale) == ("modx", "vit-b-32") else batch), name
        assert train["warmup_ratio"] > 0 or name in ("ctp", "ctp_er")  # CTP's schedule has no warm-up
    # C-CLIP: text LR = 10 x image LR (Appendix A.2), at every scale
    assert resolve(f"cclip-{scale}")["method"]["cclip"]["text_lr_scale"] == resolve("cclip")["method"]["cclip"][
        "text_lr_scale"] == 10.0
    assert resolve(f"cclip-{scale}")["train"]["epochs"] == 40
    ctp = resolve(f"ctp-{scale}")
    assert ctp["method"]["ctp"]["queue_size"] == 1024 and ctp["train"]["weight_decay"] == 0.05
    for workers in (1, 2, 4):  # the queue is filled by whole global batches
        assert ctp["method"]["ctp"]["queue_size"] % (ctp["train"]["micro_batch"] * workers) == 0
    assert resolve(f"ctp_er-{scale}")["method"]["er"]["buffer_pairs"] == 10000
    assert resolve(f"modx-{scale}")["method"]["modx"]["alpha"] == 20.0
    assert resolve(f"ewc-{scale}")["method"]["ewc"]["weight"] == 2500.0  # λ/2, CTP's λ = 5000
    assert resolve(f"teir-{scale}")["method"]["cllclip"]["teir_init"] is True
    assert resolve(f"teir-{scale}")["train"] == resolve(f"cllclip-{scale}")["train"]


def test_mod_x_on_vit_b_32_starts_from_openai_weights_at_its_papers_rate():
    train = resolve("modx-vit-b-32")["train"]
    assert train["lr"] == pytest.approx(1e-6) and train["epochs"] == 35 and train["betas"] == [0.9, 0.99]


def test_component_overrides_and_unknown_components():
    from clipstream.training.methods import build

    config = resolve("ctp_er", ["method.ctp.momentum=0.5", "method.er.buffer_pairs=7",
                                "method.er.buffer_fraction=null"])
    stack = build(config)
    assert stack.components[0].params["momentum"] == 0.5 and stack.components[1].params["buffer_pairs"] == 7
    with pytest.raises(ValueError, match="has no key 'method.ctp.nope'"):
        resolve("ctp", ["method.ctp.nope=1"])
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['bogus'\]"):
        build({"preset": "x", "method": {"bogus": {}}})


def test_parents_merge_in_order_and_own_keys_win():
    config = raw("ctp_er", presets=CUSTOM)
    assert config["method"] == {"name": "ctp_er", "topology": 8, "buffer": 100, "shared": "er"}  # later parent wins
    assert config["train"] == {"lr": 3.0, "epochs": 5, "betas": [0.9, 0.98]}  # deep merge keeps base keys
    assert config["model"] == {"arch": "a"}
    assert config["preset"] == "ctp_er"
    own = raw("ctp_er_own", presets=CUSTOM)
    assert own["train"]["lr"] == 4.0 and own["train"]["epochs"] == 5
    assert own["method"]["name"] == "mine" and own["method"]["topology"] == 8


def test_parent_order_matters():
    presets = dict(CUSTOM, er_ctp={"inherit_from": ["er", "ctp"]})
    config = raw("er_ctp", presets=presets)
    assert config["method"]["shared"] == "ctp" and config["train"]["lr"] == 2.0
    assert config["train"]["epochs"] == 5  # only er sets it, so it survives ctp being merged after


def test_shared_grandparent_does_not_undo_an_earlier_parent():
    """ctp sets lr, er does not: composing [ctp, er] must keep ctp's lr, not base's default (via er)."""
    presets = {
        "base": {"train": {"lr": 1.0, "epochs": 2}, "method": {"name": "finetune"}},
        "ctp": {"inherit_from": ["base"], "train": {"lr": 2.0}, "method": {"name": "ctp"}},
        "er": {"inherit_from": ["base"], "method": {"name": "er", "buffer": 5}},
        "ctp_er": {"inherit_from": ["ctp", "er"]},
    }
    config = raw("ctp_er", presets=presets)
    assert config["train"] == {"lr": 2.0, "epochs": 2}
    assert config["method"] == {"name": "er", "buffer": 5}  # a key both parents set: the later one wins


def test_single_parent_deep_merge():
    config = raw("ctp", presets=CUSTOM)
    assert config["train"] == {"lr": 2.0, "epochs": 2, "betas": [0.9, 0.98]}
    assert config["method"] == {"name": "ctp", "topology": 8, "shared": "ctp"}


def test_preset_without_parents():
    assert raw("plain", presets=CUSTOM) == {"train": {"lr": 5.0}, "preset": "plain"}


def test_cycle_is_reported():
    with pytest.raises(ValueError, match="cycle") as info:
        resolve("loop_a", presets=CUSTOM)
    assert "loop_a -> loop_b -> loop_c -> loop_a" in str(info.value)
    with pytest.raises(ValueError, match="self_loop -> self_loop"):
        resolve("self_loop", presets=CUSTOM)


def test_diamond_is_not_a_cycle():
    # ctp and er both inherit base: visiting base twice along different paths is fine
    assert raw("ctp_er", presets=CUSTOM)["train"]["betas"] == [0.9, 0.98]


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="'nope'") as info:
        resolve("nope")
    assert "finetune" in str(info.value) and "joint" in str(info.value)
    # the scaled presets are named once, as a rule, not 24 more names in the line
    assert "ctp-vit-b-16" not in str(info.value) and "each also as NAME-vit-b-16 / NAME-vit-b-32" in str(info.value)
    with pytest.raises(ValueError, match=r"did you mean ctp-vit-b-16\?"):
        resolve("ctp-vit-b16")
    with pytest.raises(ValueError, match="'nowhere'") as info:
        resolve("orphan", presets=CUSTOM)
    assert "ctp_er" in str(info.value)


def test_overrides_parse_yaml_values():
    config = raw("finetune", ["train.lr=1e-4", "train.betas=[0.9,0.99]", "train.epochs=7",
                               "model.pretrained=/ckpt/a=b.pt", "train.precision=bf16", "model.arch=null"])
    assert config["train"]["lr"] == pytest.approx(1e-4) and isinstance(config["train"]["lr"], float)
    assert config["train"]["betas"] == [0.9, 0.99]
    assert config["train"]["epochs"] == 7 and isinstance(config["train"]["epochs"], int)
    assert config["model"]["pretrained"] == "/ckpt/a=b.pt"  # only the first '=' splits
    assert config["train"]["precision"] == "bf16"
    assert config["model"]["arch"] is None
    assert config["train"]["weight_decay"] == pytest.approx(0.1)  # untouched keys stay


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("-2E+3", -2000.0), ("3.5e-1", 0.35), ("[1e-3, 2]", [1e-3, 2]),
                                        ("5", 5), ("1e", "1e"), ("abc", "abc"), ("true", True)])
def test_override_values_typed(text, value):
    got = raw("finetune", [f"train.lr={text}"])["train"]["lr"]
    assert got == value and type(got) is type(value)
    if isinstance(value, list):
        assert [type(v) for v in got] == [float, int]


def test_presets_file_floats_without_dot(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("base:\n  train:\n    lr: 1e-4\n    eps: 1.0e-6\n    name: 1e-4x\n")
    presets = load_presets(path)
    assert presets["base"]["train"] == {"lr": 1e-4, "eps": 1e-6, "name": "1e-4x"}
    assert isinstance(presets["base"]["train"]["lr"], float)


def test_overrides_apply_in_order_and_can_replace_a_section():
    config = resolve("finetune", ["train.epochs=1", "train.epochs=9"])
    assert config["train"]["epochs"] == 9
    config = raw("plain", ["train={lr: 0.5, epochs: 3}"], presets=CUSTOM)
    assert config["train"] == {"lr": 0.5, "epochs": 3}


@pytest.mark.parametrize("override, match", [
    ("train.lrr=1", "no key 'train.lrr'"),
    ("training.lr=1", "'training' is not a section"),
    ("train.lr.value=1", "'lr' is not a section"),
    ("train.lr", "must look like"),
    ("=1", "must look like"),
    ("nokey=1", "no key 'nokey'"),
])
def test_bad_overrides(override, match):
    with pytest.raises(ValueError, match=match) as info:
        resolve("finetune", [override])
    assert override in str(info.value)


def test_resolve_does_not_mutate_presets():
    presets = copy.deepcopy(CUSTOM)
    snapshot = copy.deepcopy(presets)
    config = raw("ctp_er_own", ["train.lr=9", "train.betas=[1,2]", "method.topology=1"], presets=presets)
    config["train"]["betas"].append(3)
    config["model"]["arch"] = "changed"
    assert presets == snapshot
    # and resolving again gives the pristine result
    assert raw("ctp_er_own", presets=presets)["train"] == {"lr": 4.0, "epochs": 5, "betas": [0.9, 0.98]}


def test_shipped_presets_file_unchanged_by_resolve():
    before = load_presets()
    resolve("joint", ["train.lr=0.5", "train.betas=[0.1,0.2]"])
    assert load_presets() == before
    assert resolve("joint")["train"]["lr"] == pytest.approx(1e-3)


def test_merge_is_deep_and_copies():
    base = {"a": {"b": 1, "c": [1]}, "d": 1}
    over = {"a": {"b": 2}, "d": {"e": 1}}
    out = merge(base, over)
    assert out == {"a": {"b": 2, "c": [1]}, "d": {"e": 1}}
    out["a"]["c"].append(2)
    out["d"]["e"] = 5
    assert base == {"a": {"b": 1, "c": [1]}, "d": 1} and over == {"a": {"b": 2}, "d": {"e": 1}}


def test_own_presets_file_adds_compositions_but_cannot_redefine_shipped_ones(tmp_path, monkeypatch):
    own = tmp_path / "mine.yaml"
    own.write_text("ewc_modx:\n  inherit_from: [ewc, modx]\n  train:\n    lr: 2e-4\n")
    monkeypatch.setenv("CLIPSTREAM_PRESETS", str(own))
    config = resolve("ewc_modx", ["method.modx.alpha=5"])
    assert set(config["method"]) == {"ewc", "modx"} and config["method"]["modx"]["alpha"] == 5
    assert config["train"]["lr"] == 2e-4 and config["train"]["epochs"] == resolve("ewc")["train"]["epochs"]
    assert [c.name for c in build(config).components] == ["ewc", "modx"]
    assert "ewc_modx" in method_presets() and "ewc" in method_presets()

    own.write_text("ewc:\n  train:\n    lr: 1.0\n")
    with pytest.raises(ValueError, match=r"presets \['ewc'\] are shipped ones"):
        resolve("ewc")
    monkeypatch.setenv("CLIPSTREAM_PRESETS", str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match="missing.yaml: no such file"):
        load_presets()


# -- the schema: every resolved config is checked before anything starts ------------------------------------------

def test_every_shipped_preset_validates_and_validation_changes_nothing():
    presets = load_presets()
    for name in method_presets(presets):
        unchecked = raw(name, presets=presets)
        assert schema.check(unchecked)[1] == [], name
        config = resolve(name, presets=presets)
        assert config == unchecked and list(config["method"]) == list(unchecked["method"])  # the methods' order kept
        assert _types(config) == _types(unchecked), name  # YAML's 1.0e-3 and [0.9, 0.98] as they were


def _types(tree):
    if isinstance(tree, dict):
        return {k: _types(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_types(v) for v in tree]
    return type(tree)


def test_the_schema_matches_the_methods_and_the_base_preset():
    assert set(schema.METHOD_PARAMS) == set(METHODS)  # a new method needs its params model
    base = load_presets(PRESETS)[BASE]
    sections = {"model": schema.ModelSection, "train": schema.TrainSection, "eval": schema.EvalSection}
    for section, model in sections.items():
        assert list(model.model_fields) == list(base[section]), section  # every key, in the file's order
    presets = load_presets()
    for name in method_presets(presets):
        for method, params in (presets[name].get("method") or {}).items():
            fields = schema.METHOD_PARAMS[method].model_fields
            assert set(params) <= set(fields), (name, method)
            required = {k for k, f in fields.items() if f.is_required()}
            assert required <= set(resolve(name, presets=presets)["method"][method])
    models = [schema.ModelSection, schema.TrainSection, schema.EvalSection, *schema.METHOD_PARAMS.values()]
    descriptions = [f.description for m in models for f in m.model_fields.values()]
    assert all(descriptions) and not any("; " in d for d in descriptions)  # quoted by error lines split on '; '


@pytest.mark.parametrize("method, override, line", [
    ("finetune", "train.epochs=abc", "--set train.epochs=abc: expected an integer >= 1 (passes over the task's data)"),
    ("finetune", "train.epochs=-1", "--set train.epochs=-1: expected an integer >= 1 (passes over the task's data)"),
    ("finetune", "train.epochs=2.5", "--set train.epochs=2.5: expected an integer >= 1 (passes over the task's data)"),
    ("finetune", "train.epochs=true", "--set train.epochs=true: expected an integer >= 1"),
    ("finetune", "train.zero_stage=7", "--set train.zero_stage=7: expected an integer in [0, 3] (DeepSpeed ZeRO stage, "
                                       "0-3 on CPU (gloo) and GPUs)"),
    ("finetune", "train.precision=fp8", "--set train.precision=fp8: expected one of fp32, bf16, fp16 (fp32, or "
                                        "DeepSpeed's bf16/fp16 mixed precision)"),
    ("finetune", "train.betas=[0.9]", "--set train.betas=[0.9]: expected a list of 2 numbers, each in [0, 1) "
                                      "(AdamW's β1 and β2)"),
    ("finetune", "train.betas=[0.9, 1.0]", "--set train.betas=[0.9, 1.0]: expected a list of 2 numbers"),
    ("finetune", "train.lr=0", "--set train.lr=0: expected a number > 0 (peak learning rate of AdamW)"),
    ("finetune", "train.lr='1e-3'", "--set train.lr='1e-3': expected a number > 0"),  # quoted: a string
    ("finetune", "train.lr=.nan", "--set train.lr=.nan: expected a number > 0"),
    ("finetune", "train.min_lr_ratio=1.5", "--set train.min_lr_ratio=1.5: expected a number in [0, 1]"),
    ("finetune", "train.deterministic=1", "--set train.deterministic=1: expected true or false"),
    ("finetune", "train.on_bad_image=ignore", "--set train.on_bad_image=ignore: expected one of fail, skip"),
    ("finetune", "train.data_cpus=0", "--set train.data_cpus=0: expected a number > 0"),
    ("finetune", "eval.batch_size=0", "--set eval.batch_size=0: expected an integer >= 1"),
    ("finetune", "model.arch=null", "--set model.arch=null: expected a non-empty string (open_clip architecture name"),
    ("finetune", "model.pretrained=7", "--set model.pretrained=7: expected a non-empty string or null"),
    ("ewc", "method.ewc.weight=-3", "--set method.ewc.weight=-3: expected a number >= 0 (penalty = weight"),
    ("lwf", "method.lwf.temperature=0", "--set method.lwf.temperature=0: expected a number > 0"),
    ("ctp", "method.ctp.momentum=1.5", "--set method.ctp.momentum=1.5: expected a number in [0, 1]"),
    ("ctp", "method.ctp.queue_size=0", "--set method.ctp.queue_size=0: expected an integer >= 1"),
    ("er", "method.er.buffer_pairs=-1", "--set method.er.buffer_pairs=-1: expected an integer >= 0"),
    ("cclip", "method.cclip.dropout=1", "--set method.cclip.dropout=1: expected a number in [0, 1)"),
    ("cclip", "method.cclip.targets=[]",
     "--set method.cclip.targets=[]: expected a non-empty list of non-empty strings"),
    ("teir", "method.cllclip.teir_init=2", "--set method.cllclip.teir_init=2: expected true or false"),
    ("finetune", "method={nope: {}}", "--set method={nope: {}}: method.nope={}: unknown method, known: cclip, cllclip, "
                                      "ctp, er, ewc, joint, lwf, mas, modx"),
    ("joint", "method.joint={x: 1}", "--set method.joint={x: 1}: method.joint.x=1: unknown key, it takes none"),
    ("finetune", "train={lr: 0.5}", "--set train={lr: 0.5}: missing epochs, micro_batch, grad_accum, weight_decay"),
    ("finetune", "train=5", "--set train=5: expected a section with keys epochs, micro_batch"),
    ("finetune", "train.epoch=2", "--set train.epoch=2: preset 'finetune' has no key 'train.epoch' (did you mean "
                                  "train.epochs?)"),
    ("finetune", "train.betas=[0.9", "--set train.betas=[0.9: '[0.9' is not a YAML value"),
])
def test_bad_values_are_one_line_naming_the_override(method, override, line):
    with pytest.raises(ValueError) as info:
        resolve(method, [override])
    message = str(info.value)
    assert message.startswith(line) and "\n" not in message and "; " not in message  # one problem, one line


def test_every_problem_is_reported_at_once_on_one_line():
    with pytest.raises(ValueError) as info:
        resolve("ctp_er", ["train.epochs=abc", "train.lr=-1", "method.er.buffer_pairs=-1", "train.epochs=0"])
    parts = str(info.value).split("; --set ")
    assert [p.split(":")[0].removeprefix("--set ") for p in parts] == [
        "train.epochs=0", "train.lr=-1", "method.er.buffer_pairs=-1"]  # the last write of a key is the one named
    assert "\n" not in str(info.value)


def test_validated_values_are_what_the_code_expects():
    config = resolve("ctp_er", ["train.lr=1", "train.betas=[0, 0.5]", "train.eps=1e-8", "method.ctp.tau=1",
                                "model.pretrained=/ckpt/a=b.pt", "train.zero_stage=2", "train.precision=bf16"])
    train = config["train"]
    assert train["lr"] == 1.0 and type(train["lr"]) is float  # an integer where the schema says a number
    assert train["betas"] == [0.0, 0.5] and all(type(b) is float for b in train["betas"])
    assert train["eps"] == pytest.approx(1e-8) and type(train["zero_stage"]) is int and train["precision"] == "bf16"
    assert type(config["method"]["ctp"]["tau"]) is float and config["model"]["pretrained"] == "/ckpt/a=b.pt"
    assert list(config["method"]) == ["ctp", "er"] and config["preset"] == "ctp_er"
    assert build(config).components[0].params["tau"] == 1.0


def test_a_bad_value_in_ones_own_presets_names_the_preset_and_its_file(tmp_path, monkeypatch):
    own = tmp_path / "mine.yaml"
    own.write_text("mine:\n  inherit_from: [ewc, modx]\n  train:\n    lr: -1\n    epoch: 3\n  method:\n"
                   "    ewc: {weight: -2}\n    nope: {}\nbare:\n  train: {lr: 1e-3}\n")
    monkeypatch.setenv("CLIPSTREAM_PRESETS", str(own))
    with pytest.raises(ValueError) as info:
        resolve("mine", ["method.modx.alpha=2"])
    lines = str(info.value).split("; ")
    assert lines == [
        f"preset 'mine' ({own}): train.lr=-1: expected a number > 0 (peak learning rate of AdamW)",
        f"preset 'mine' ({own}): train.epoch=3: unknown key (did you mean epochs?)",
        f"preset 'mine' ({own}): method.ewc.weight=-2: expected a number >= 0 (penalty = weight · Σ Ω (θ − θ*)², the "
        "pull toward the previous task's weights)",
        f"preset 'mine' ({own}): method.nope={{}}: unknown method, known: cclip, cllclip, ctp, er, ewc, joint, lwf, "
        "mas, modx"]
    with pytest.raises(ValueError, match=r"--set method.ewc.weight=-1: expected a number >= 0"):
        resolve("mine", ["method.ewc.weight=-1"])  # an override of the bad value is what is named
    with pytest.raises(ValueError) as info:
        resolve("bare")
    assert str(info.value).startswith(f"preset 'bare' ({own}): missing sections model, eval (a preset that inherits "
                                      "from 'base' has every key); ")
    with pytest.raises(ValueError, match=r"^preset 'ewc': method.ewc.weight=-1: expected a number >= 0"):
        resolve("ewc", presets={**load_presets(), "ewc": {"inherit_from": ["base"], "method": {"ewc": {"weight": -1}}}})
    own.write_text("mine:\n  train: [1\n")
    with pytest.raises(ValueError, match=rf"^{own}:3: not valid YAML"):
        resolve("ewc")
    own.write_text("mine:\n  inherit_from: ewc\n")
    with pytest.raises(ValueError, match=r"inherit_from must be a list of preset names, got 'ewc'"):
        resolve("mine")


def test_a_missing_param_names_the_preset_that_wrote_the_method():
    presets = {**load_presets(), "mine": {"inherit_from": ["base"], "method": {"ewc": {"batches": 4}}},
               "yours": {"inherit_from": ["mine"], "train": {"epochs": 1}}}
    with pytest.raises(ValueError) as info:
        resolve("yours", presets=presets)
    assert str(info.value) == ("preset 'mine': method.ewc.weight: missing, expected a number >= 0 (penalty = weight · "
                               "Σ Ω (θ − θ*)², the pull toward the previous task's weights)")


@pytest.mark.parametrize("preset, override, got", [("teir", "train.zero_stage=3", "train.zero_stage=3"),
                                                   ("cllclip", "train.precision=bf16", "train.precision=bf16")])
def test_a_method_refuses_what_it_cannot_train_under_in_one_line_naming_it_and_why(preset, override, got):
    with pytest.raises(ValueError) as refused:
        resolve(preset, [override])
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"preset {preset!r}: method cllclip runs with train.zero_stage=0 "
                                                f"train.precision=fp32 only (got {got}): it scales rows of the fp32")
    assert resolve(preset, ["train.zero_stage=0"])["train"]["zero_stage"] == 0
