"""Every continual method trains a 3-task stream from the CLI (`clipstream train`) through Ray Train +
DeepSpeed on 2 workers, and its state, registered with each version, carries into the next task's job."""

import itertools

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from safetensors.torch import load_file

from clipstream import models
from clipstream.models import WEIGHTS_FILE
from clipstream.registry import Registry
from clipstream.training.data.task import Task
from clipstream.training.methods import resolve
from clipstream.training.methods.state import load_state

# (preset, ZeRO stage): teacher and momentum copies must stay outside the partitioned optimizers of ZeRO 1
# and 2 (ZeRO 0 partitions nothing; test_job trains with it). Each stream runs several methods together
# (tests/streams.OWN_PRESETS, the second built on the shipped `ctp_er`): the checks of each method run on
# its own part of the composed state and its own loss terms, as they would alone. Seven methods in three
# streams of three jobs each: a stream costs ~2.5 minutes on 2 cores, mostly Ray and torch start-up, so they
# train in the background while the other tests run (tests/streams.py).
# C-CLIP, which changes which parameters train (adapters on frozen weights, merged at export), trains alone.
STREAMS = [("mas_lwf", 1), ("ewc_modx_ctp_er", 2), ("cclip", 2)]  # (+ the language stream below)


def assert_both_policies(matrices: dict) -> None:
    """A version's manifest holds the R matrices of both index policies over the same tasks. Task-known, the
    diagonal is the same under both (task i's gallery as version i embeds it), and so is the first trained row;
    later rows of no-reindex rank today's queries against older versions' vectors."""
    from clipstream.training.evaluate import ResultMatrix

    m = {name: ResultMatrix.from_dict(d) for name, d in matrices.items()}
    assert set(m) == {"known", "unknown", "noreindex_known", "noreindex_unknown"}
    for mode in ("known", "unknown"):
        assert m[f"noreindex_{mode}"].tasks == m[mode].tasks
        assert m[f"noreindex_{mode}"].values[0, 0] == m[mode].values[0, 0]
    assert np.diag(m["noreindex_known"].values).tolist() == np.diag(m["known"].values).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("method, stage", [pytest.param(m, s, marks=pytest.mark.stream(m, s)) for m, s in STREAMS])
def test_a_three_task_stream_carries_the_method_state(trained_stream, method, stage):
    settings, three_tasks = trained_stream(method, stage)
    registry = Registry(settings)
    versions = registry.versions()
    assert [v.tags["method"] for v in versions] == [method] * 3
    assert [v.tags["parent_version"] for v in versions] == ["", "1", "2"]
    states = [load_state(registry.resolve(v.version).folder) for v in versions]
    client = MlflowClient(settings.mlflow_tracking_uri)
    metrics = [client.get_run(v.run_id).data.metrics for v in versions]

    def peak(key):  # the largest value a term took in each task's run (0 at a task's first step: θ = θ*)
        return [max([m.value for m in client.get_metric_history(v.run_id, key)], default=None) for v in versions]
    rows = [len(Task.load(d).check("train").rows) for d in three_tasks]
    assert registry.resolve("3").manifest["matrix"]["known"]["tasks"] == [d.name for d in three_tasks]
    assert_both_policies(registry.resolve("3").manifest["matrix"])
    assert all("sd/image_rotation_mean" in m for m in metrics[1:])  # Mod-X's diagnostics, from task 2 on
    if method == "ewc_modx_ctp_er":  # EWC, Mod-X and CTP train both towers: its own image vectors are indexed
        assert registry.resolve("3").manifest["unchanged_towers"] == [] and registry.resolve("3").image_tower == "3"

    for component in method.split("_"):
        state = [s[component] for s in states]
        if component in ("ewc", "mas"):
            assert [s["tasks"] for s in state] == [1, 2, 3]  # merged across jobs, not restarted
            assert peak("loss/penalty")[0] is None and all(p > 0 for p in peak("loss/penalty")[1:])
            totals = [sum(float(v.sum()) for v in s["importance"].values()) for s in state]
            assert all(t > 0 for t in totals) and len(set(totals)) == 3  # each job's task merged in (running mean)
        elif component == "er":
            assert [s["seen"] for s in state] == [rows[0], rows[0] + rows[1], sum(rows)]
            assert [len(s["pairs"]) for s in state] == [40] * 3
            assert {p["task"] for p in state[2]["pairs"]} == {d.name for d in three_tasks}
            trained = [int(client.get_run(v.run_id).data.params["train_rows"]) for v in versions]
            assert trained == [rows[0], rows[1] + 40, rows[2] + 40]  # the parent's buffer was replayed
        elif component == "ctp":
            steps = sum(int(m["train/step"]) for m in metrics)
            k = len(state[2]["queue_image"]["rows"])
            assert state[2]["queue_image"]["ptr"] == steps * 2 * 8 % k  # one queue through all three jobs
            assert peak("loss/topology_c")[0] is None and all(p > 0 for p in peak("loss/topology_c")[1:])
            assert all(p > 0 for p in peak("loss/topology_s")[1:]) and all(p > 0 for p in peak("loss/cmc"))
        elif component in ("lwf", "modx"):
            distill = peak("loss/distill")
            assert distill[0] is None and all(p is not None for p in distill[1:])  # from the second task on
            if component == "lwf":  # (Mod-X's may be 0: it keeps only rows an untrained teacher gets right)
                assert all(p > 0 for p in distill[1:])
        elif component == "cclip":
            assert state == [{}] * 3  # adapters and projector live and die within a task
            assert all(p > 0 for p in peak("loss/ckc"))
            weights = [load_file(registry.resolve(v.version).folder / WEIGHTS_FILE) for v in versions]
            preset = resolve("cclip")
            stock = models.create(preset["model"]["arch"]).model.state_dict()
            targets, whole = tuple(preset["method"]["cclip"]["targets"]), set(preset["method"]["cclip"]["embeddings"])
            for before, after in itertools.pairwise(weights):
                # a plain open_clip model, and only the adapted weights and the embeddings trained whole moved (the
                # rest was frozen under ZeRO 2)
                assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in stock.items()}
                changed = {k for k in after if not torch.equal(after[k], before[k])}
                assert changed and all(k.endswith(targets) or k in whole for k in changed), sorted(changed)[:5]
        else:
            raise AssertionError(f"no checks for method {component!r}")


@pytest.mark.slow
@pytest.mark.stream("teir", 0)
def test_a_language_stream_grows_the_vocabulary_and_trains_only_the_rows_of_its_language(trained_stream):
    """English (C-CLIP at ZeRO 0: the teacher), then two synthetic languages with CLL-CLIP + TEIR from the CLI."""
    settings, languages = trained_stream("teir", 0)
    registry = Registry(settings)
    versions = registry.versions()
    assert [v.tags["method"] for v in versions] == ["cclip", "teir", "teir"]
    folders = [registry.resolve(v.version).folder for v in versions]
    weights = [load_file(f / WEIGHTS_FILE) for f in folders]
    states = [load_state(f) for f in folders]
    stock = models.create(resolve("cclip")["model"]["arch"]).model.state_dict()
    assert {k: v.shape for k, v in weights[0].items()} == {k: v.shape for k, v in stock.items()}  # C-CLIP merged

    # each language appended rows; every other weight is the teacher's, bit for bit
    sizes = [w["token_embedding.weight"].shape[0] for w in weights]
    assert sizes[0] == 49408 < sizes[1] < sizes[2]
    for w in weights[1:]:
        assert all(torch.equal(w[k], weights[0][k]) for k in w if k not in ("token_embedding.weight", "logit_scale"))
    state = [s["cllclip"] for s in states[1:]]
    assert [s["teacher"] for s in state] == [{"version": "1"}] * 2  # pinned: the version the languages began from
    assert [s["languages"] for s in state] == [["xa"], ["xa", "xb"]] and [s["tokenizer_version"] for s in state] == [1, 2]

    # TEIR: rows with λ = 0 (absent tokens, specials, the earlier language's own) did not move; some with λ > 0 did
    lam, before, after = state[1]["lam"], weights[1]["token_embedding.weight"], weights[2]["token_embedding.weight"]
    old = before.shape[0]
    frozen_rows = (lam[:old] == 0).nonzero().squeeze(1)
    assert len(frozen_rows) > 49000 and torch.equal(after[frozen_rows], before[frozen_rows])
    moved = (lam[:old] > 0) & (after[:old] != before).any(1)
    assert moved.sum() > 0
    # λ = 1/freq on present tokens, freq counting each task a token appeared in, once
    present = lam > 0
    assert torch.allclose(lam[present], 1 / (state[1]["freq"][present] - 1))
    grown = torch.cat([state[0]["freq"], torch.ones(sizes[2] - sizes[1])])
    assert torch.equal(state[1]["freq"] - grown, present.float())

    # each version tokenises with its own tokenizer; English (the teacher's) tokenises as the teacher does
    english = [r["caption_en"] for r in Task.load(languages[2]).check("test").rows]
    teacher, last = (models.load_exported(f).tokenizer for f in (folders[0], folders[2]))
    eot = 49407
    for a, b in zip(teacher(english), last(english)):
        n = int((a == eot).nonzero()[0]) + 1
        assert torch.equal(a[:n], b[:n])
    assert registry.resolve("3").manifest["unchanged_towers"] == ["image"]
    # the registered version names its tokenizer and languages, and keeps the teacher's image tower
    assert [v.tags["tokenizer"] == "clip-bpe" for v in versions] == [True, False, False]
    assert versions[1].tags["tokenizer"] != versions[2].tags["tokenizer"]
    assert [v.languages for v in versions] == [["en"], ["en", "xa"], ["en", "xa", "xb"]]
    assert [v.image_tower for v in versions] == ["1", "1", "1"]
    client = MlflowClient(settings.mlflow_tracking_uri)
    assert all(max(m.value for m in client.get_metric_history(v.run_id, "loss/cross_lingual")) > 0 for v in versions[1:])
    # task-unknown: the other languages' copies of a query's image are its positives, so text->image ranks as in the
    # task's own gallery (the deduplicated union), where they used to tie with it as negatives (R@1 was always 0)
    logged = client.get_run(versions[2].run_id).data.metrics
    for name in (d.name for d in languages):
        assert logged[f"eval/unknown/{name}/t2i_R1"] == pytest.approx(logged[f"eval/known/{name}/t2i_R1"])
    assert_both_policies(registry.resolve("3").manifest["matrix"])
