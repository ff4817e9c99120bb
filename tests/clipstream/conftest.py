import numpy as np
import pytest
import torch

from clipstream import models


@pytest.fixture
def model_sources(tmp_path):
    """Model sources in open_clip's formats, good and bad, made here: {name: what `--from` / models.from_source take}."""
    torch.manual_seed(0)
    tiny = models.create("clipstream-vit-tiny")
    torch.save(tiny.model.state_dict(), tmp_path / "tiny.pt")
    torch.save(models.create("clipstream-vit-small").model.state_dict(), tmp_path / "small.pt")  # another architecture
    (tmp_path / "garbage.pt").write_bytes(np.random.default_rng(0).bytes(4096))
    whole = (tmp_path / "tiny.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(whole[:len(whole) // 2])
    (tmp_path / "not-an-export").mkdir()
    (tmp_path / "not-an-export" / "weights.pt").write_bytes(whole)
    models.export(tiny, tmp_path / "export")
    return {"checkpoint": f"clipstream-vit-tiny:{tmp_path / 'tiny.pt'}", "export": str(tmp_path / "export"),
            **{name: f"clipstream-vit-tiny:{tmp_path / (name + '.pt')}" for name in ("small", "garbage", "truncated")},
            "missing": f"clipstream-vit-tiny:{tmp_path / 'missing.pt'}", "not-an-export": str(tmp_path / "not-an-export"),
            "missing-folder": str(tmp_path / "missing-folder")}
