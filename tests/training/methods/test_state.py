"""Method state without pickle: every kind of value the methods keep comes back equal; what cannot be stored
safely is refused when saving, naming where it sits."""

import math

import pytest
import torch

from clipstream.training.methods.state import STATE_FILE, StateError, load_state, read_state, save_state


def test_a_state_of_every_kind_round_trips(tmp_path):
    state = {
        "cllclip": {"freq": torch.arange(5.0), "lam": torch.zeros(0), "teacher": {"version": "1"}, "words": ["a", "bé"],
                    "tokenizer_version": 2, "on": True, "none": None, "ratio": 0.5, "nan": math.nan},
        "er": {"pairs": [{"task": "t", "id": "1", "image": b"\x89PNG\x00\xff", "empty": b""}], "seen": 40},
        "ctp": {"queue_image": {"rows": torch.randn(4, 3), "keys": torch.full((4, 5), -1), "ptr": 3},
                "momentum": {"w": torch.ones(2, 2, dtype=torch.bfloat16)}},
        "shared": (torch.ones(3), torch.ones(3)[1:]),  # views of one storage, and a tuple
    }
    save_state(state, tmp_path / STATE_FILE)
    back = load_state(tmp_path)
    assert torch.equal(back["cllclip"]["freq"], state["cllclip"]["freq"]) and back["cllclip"]["lam"].shape == (0,)
    assert back["cllclip"]["words"] == ["a", "bé"] and back["cllclip"]["teacher"] == {"version": "1"}
    assert back["cllclip"]["none"] is None and back["cllclip"]["on"] is True and math.isnan(back["cllclip"]["nan"])
    assert back["er"] == {"pairs": [{"task": "t", "id": "1", "image": b"\x89PNG\x00\xff", "empty": b""}], "seen": 40}
    assert torch.equal(back["ctp"]["queue_image"]["rows"], state["ctp"]["queue_image"]["rows"])
    assert torch.equal(back["ctp"]["queue_image"]["keys"], state["ctp"]["queue_image"]["keys"])  # int64 token ids
    assert back["ctp"]["momentum"]["w"].dtype == torch.bfloat16
    assert [t.tolist() for t in back["shared"]] == [[1.0] * 3, [1.0] * 2]
    assert load_state(tmp_path / "nothing-here") == {}


@pytest.mark.parametrize("state, where", [
    ({"a": {"b": object()}}, "/a/b: object cannot be stored without pickle"),
    ({"a": {1: 2}}, "at /a: keys must be strings"),
    ({"$tensor": 1}, "keys must be strings not starting with '$'"),
])
def test_what_pickle_alone_could_store_is_refused_when_saving(tmp_path, state, where):
    with pytest.raises(StateError, match=where.replace("$", r"\$")):
        save_state(state, tmp_path / STATE_FILE)
    assert not (tmp_path / STATE_FILE).exists()


def test_a_file_that_is_not_a_state_is_refused_with_its_path(tmp_path):
    (tmp_path / STATE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(StateError, match=f"{tmp_path / STATE_FILE}: not a clipstream method state"):
        read_state(tmp_path / STATE_FILE)
