"""Tests for method presets (training/methods/config.py): inherit_from composition and key=value overrides."""
import copy

import pytest

from clipstream.training.methods import build
from clipstream.training.methods.config import load_presets, merge, method_presets, resolve

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
           "teir": ["cllclip"]}


def test_shipped_presets_resolve_with_all_base_keys_and_build_their_methods():
    from clipstream.training.methods import build

    presets = load_presets()
    assert set(presets) == {"base", *SHIPPED}
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
    assert resolve("finetune")["train"]["lr"] == pytest.approx(1e-3)
    assert resolve("ctp_er")["method"]["er"] == resolve("er")["method"]["er"]  # composed, each with its own params


def test_component_overrides_and_unknown_components():
    from clipstream.training.methods import build

    config = resolve("ctp_er", ["method.ctp.momentum=0.5", "method.er.buffer_pairs=7"])
    stack = build(config)
    assert stack.components[0].params["momentum"] == 0.5 and stack.components[1].params["buffer_pairs"] == 7
    with pytest.raises(ValueError, match="has no key 'method.ctp.nope'"):
        resolve("ctp", ["method.ctp.nope=1"])
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['bogus'\]"):
        build({"preset": "x", "method": {"bogus": {}}})


def test_parents_merge_in_order_and_own_keys_win():
    config = resolve("ctp_er", presets=CUSTOM)
    assert config["method"] == {"name": "ctp_er", "topology": 8, "buffer": 100, "shared": "er"}  # later parent wins
    assert config["train"] == {"lr": 3.0, "epochs": 5, "betas": [0.9, 0.98]}  # deep merge keeps base keys
    assert config["model"] == {"arch": "a"}
    assert config["preset"] == "ctp_er"
    own = resolve("ctp_er_own", presets=CUSTOM)
    assert own["train"]["lr"] == 4.0 and own["train"]["epochs"] == 5
    assert own["method"]["name"] == "mine" and own["method"]["topology"] == 8


def test_parent_order_matters():
    presets = dict(CUSTOM, er_ctp={"inherit_from": ["er", "ctp"]})
    config = resolve("er_ctp", presets=presets)
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
    config = resolve("ctp_er", presets=presets)
    assert config["train"] == {"lr": 2.0, "epochs": 2}
    assert config["method"] == {"name": "er", "buffer": 5}  # a key both parents set: the later one wins


def test_single_parent_deep_merge():
    config = resolve("ctp", presets=CUSTOM)
    assert config["train"] == {"lr": 2.0, "epochs": 2, "betas": [0.9, 0.98]}
    assert config["method"] == {"name": "ctp", "topology": 8, "shared": "ctp"}


def test_preset_without_parents():
    assert resolve("plain", presets=CUSTOM) == {"train": {"lr": 5.0}, "preset": "plain"}


def test_cycle_is_reported():
    with pytest.raises(ValueError, match="cycle") as info:
        resolve("loop_a", presets=CUSTOM)
    assert "loop_a -> loop_b -> loop_c -> loop_a" in str(info.value)
    with pytest.raises(ValueError, match="self_loop -> self_loop"):
        resolve("self_loop", presets=CUSTOM)


def test_diamond_is_not_a_cycle():
    # ctp and er both inherit base: visiting base twice along different paths is fine
    assert resolve("ctp_er", presets=CUSTOM)["train"]["betas"] == [0.9, 0.98]


def test_unknown_preset_lists_known():
    with pytest.raises(ValueError, match="'nope'") as info:
        resolve("nope")
    assert "finetune" in str(info.value) and "joint" in str(info.value)
    with pytest.raises(ValueError, match="'nowhere'") as info:
        resolve("orphan", presets=CUSTOM)
    assert "ctp_er" in str(info.value)


def test_overrides_parse_yaml_values():
    config = resolve("finetune", ["train.lr=1e-4", "train.betas=[0.9,0.99]", "train.epochs=7",
                                  "model.pretrained=/ckpt/a=b.pt", "train.precision=bf16", "model.arch=null"])
    assert config["train"]["lr"] == pytest.approx(1e-4) and isinstance(config["train"]["lr"], float)
    assert config["train"]["betas"] == [0.9, 0.99]
    assert config["train"]["epochs"] == 7 and isinstance(config["train"]["epochs"], int)
    assert config["model"]["pretrained"] == "/ckpt/a=b.pt"  # only the first '=' splits
    assert config["train"]["precision"] == "bf16"
    assert config["model"]["arch"] is None
    assert config["train"]["weight_decay"] == pytest.approx(0.1)  # untouched keys stay


@pytest.mark.parametrize("raw, value", [("1e-4", 1e-4), ("-2E+3", -2000.0), ("3.5e-1", 0.35), ("[1e-3, 2]", [1e-3, 2]),
                                        ("5", 5), ("1e", "1e"), ("abc", "abc"), ("true", True)])
def test_override_values_typed(raw, value):
    got = resolve("finetune", [f"train.lr={raw}"])["train"]["lr"]
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
    config = resolve("plain", ["train={lr: 0.5, epochs: 3}"], presets=CUSTOM)
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
    config = resolve("ctp_er_own", ["train.lr=9", "train.betas=[1,2]", "method.topology=1"], presets=presets)
    config["train"]["betas"].append(3)
    config["model"]["arch"] = "changed"
    assert presets == snapshot
    # and resolving again gives the pristine result
    assert resolve("ctp_er_own", presets=presets)["train"] == {"lr": 4.0, "epochs": 5, "betas": [0.9, 0.98]}


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
