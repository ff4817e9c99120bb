"""Promotion gates, history and rollback on a real MLflow registry (SQLite) with versions made without
training: a tiny exported model registered with chosen lineage and metrics."""

import getpass
import json
import shutil

import pytest

from clipstream.cli import main
from clipstream.index import open_index
from clipstream.promotion import PromotionError, history, promote, rollback
from clipstream.registry import Registry
from clipstream.training.data.task import DataError, Task
from tests.conftest import register_version


@pytest.fixture
def make(settings):
    """make(task_dirs, aa, forgetting, parent) registers the next version with that lineage and metrics."""
    seeds = iter(range(100, 200))
    return lambda dirs, aa, forgetting, parent="": register_version(settings, next(seeds), task_dirs=dirs, aa=aa,
                                                                    forgetting=forgetting, parent=parent)


def _production(settings):
    return Registry(settings).resolve("production", download=False).version


def test_promote_checks_gates_moves_production_and_records_history(settings, stream, make):
    assert history(settings) == []
    v1 = make(stream[:1], aa=50.0, forgetting=0.0)
    v2 = make(stream, aa=48.0, forgetting=5.0, parent=v1)
    first = promote(settings, v1, index=False)
    assert _production(settings) == v1 and first["from_version"] == "" and first["index"] is None
    assert {g.name: g.passed for g in first["gates"]} == {"forgetting": True, "aa": True, "not-production": True,
                                                           "lineage": True}
    settings = settings.model_copy(update={"promote_max_aa_drop": 2.0})  # 48 >= 50 - 2
    promote(settings, f"models:/{settings.stream}/{v2}", index=False)
    assert _production(settings) == v2
    records = history(settings)
    assert [(r["from_version"], r["to_version"], r["reason"], r["forced"]) for r in records] == [
        ("", v1, "promote", False), (v1, v2, "promote", False)]
    assert records[0]["time"] < records[1]["time"] and records[1]["user"] == getpass.getuser()
    aa = next(g for g in records[1]["gates"] if g.name == "aa")
    assert aa.value == 48.0 and aa.threshold == 48.0 and aa.passed


def test_failing_gates_refuse_and_name_every_failure_unless_forced(settings, stream, make):
    v1 = make(stream[:1], aa=50.0, forgetting=0.0)
    bad = make(stream, aa=30.0, forgetting=40.0, parent=v1)
    branch = make(stream[1:], aa=60.0, forgetting=0.0)  # another branch of the stream: starts at task 1
    promote(settings, v1, index=False)
    with pytest.raises(PromotionError) as refused:
        promote(settings, bad, index=False)
    message = str(refused.value)
    assert "forgetting 40.00 vs threshold 25.00" in message and "aa 30.00 vs threshold 50.00" in message
    assert "lineage" not in message and {g.name for g in refused.value.gates if not g.passed} == {"forgetting", "aa"}
    with pytest.raises(PromotionError, match="lineage task-01-furnishing vs threshold task-00-household"):
        promote(settings, branch, index=False)
    with pytest.raises(PromotionError, match=r"not-production 1 vs threshold != 1"):
        promote(settings, "production", index=False)
    assert _production(settings) == v1 and len(history(settings)) == 1

    forced = promote(settings, bad, force=True, index=False)
    assert _production(settings) == bad and forced["forced"] and forced["reason"] == "force"
    assert (history(settings)[-1]["reason"], history(settings)[-1]["forced"]) == ("force", True)


def test_promoting_a_version_a_registry_user_made_production_completes_that_move(settings, stream, make):
    """Moving `production` with MLflow's own client bypasses gates and indexing; promoting that version then
    gates it against the version last promoted (not against itself), and records the move."""
    from mlflow import MlflowClient

    v1 = make(stream[:1], aa=50.0, forgetting=0.0)
    v2 = make(stream, aa=30.0, forgetting=0.0, parent=v1)
    promote(settings, v1, index=False)
    MlflowClient(settings.mlflow_tracking_uri).set_registered_model_alias(settings.stream, "production", v2)
    with pytest.raises(PromotionError, match=f"aa 30.00 vs threshold 50.00 .*production v{v1}'s"):
        promote(settings, v2, index=False)  # the gates still hold against what was promoted
    assert _production(settings) == v2 and len(history(settings)) == 1  # nothing changed
    settings = settings.model_copy(update={"promote_max_aa_drop": 25.0})
    done = promote(settings, v2, index=False)
    assert (done["from_version"], done["to_version"], done["forced"]) == (v1, v2, False)
    assert [(r["from_version"], r["to_version"]) for r in history(settings)] == [("", v1), (v1, v2)]
    with pytest.raises(PromotionError, match=f"not-production {v2} vs threshold != {v2}"):
        promote(settings, v2, index=False)


def test_rollback_undoes_promotions_in_order(settings, stream, make):
    with pytest.raises(PromotionError, match="nothing to roll back to.*nothing was promoted yet"):
        rollback(settings)
    v1 = make(stream[:1], aa=50.0, forgetting=0.0)
    v2 = make(stream, aa=55.0, forgetting=1.0, parent=v1)
    v3 = make(stream, aa=56.0, forgetting=1.0, parent=v1)
    for v in (v1, v2, v3):
        promote(settings, v, index=False)
    back = rollback(settings, index=False)
    assert (back["from_version"], back["to_version"], back["reason"], back["forced"]) == (v3, v2, "rollback", False)
    assert not next(g for g in back["gates"] if g.name == "aa").passed  # recorded, not enforced
    rollback(settings, index=False)
    assert _production(settings) == v1
    with pytest.raises(PromotionError, match="no earlier production version than v1"):
        rollback(settings, index=False)
    assert [r["reason"] for r in history(settings)] == ["promote"] * 3 + ["rollback"] * 2


def test_cli_promote_history_rollback(settings, stream, make, capsys):
    v1 = make(stream[:1], aa=50.0, forgetting=0.0)
    v2 = make(stream, aa=20.0, forgetting=30.0, parent=v1)
    assert main(["history"]) == 0 and "no promotions yet" in capsys.readouterr().out
    assert main(["rollback"]) == 2 and "nothing to roll back to" in capsys.readouterr().err
    assert main(["promote", v1, "--no-index"]) == 0
    out = capsys.readouterr().out
    assert "production: none -> v1" in out
    assert [line.split()[3] for line in out.splitlines()[1:5]] == ["PASS"] * 4

    assert main(["promote", v2, "--no-index"]) == 2
    captured = capsys.readouterr()
    rows = {line.split()[0]: line for line in captured.out.splitlines()[1:]}
    assert "30.00" in rows["forgetting"] and "25.00" in rows["forgetting"] and "FAIL" in rows["forgetting"]
    assert "FAIL" in rows["aa"] and "PASS" in rows["lineage"]
    assert captured.err.startswith("clipstream: error: version 2 not promoted") and "Traceback" not in captured.err
    assert main(["promote", v2, "--force", "--no-index"]) == 0
    assert "production: v1 -> v2 [force] (forced past failed gates)" in capsys.readouterr().out
    assert main(["rollback", "--no-index"]) == 0 and "production: v2 -> v1 [rollback]" in capsys.readouterr().out
    assert main(["history"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2:] for line in lines[2:]] == [
        ["-", "1", "promote", getpass.getuser(), "no"], ["1", "2", "force", getpass.getuser(), "yes"],
        ["2", "1", "rollback", getpass.getuser(), "no"]]
    assert main(["history", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)["history"]
    assert [(r["from_version"], r["to_version"], r["reason"], r["forced"]) for r in records] == [
        (None, "1", "promote", False), ("1", "2", "force", True), ("2", "1", "rollback", False)]
    assert main(["promote", "7"]) == 2 and "7: no such model version" in capsys.readouterr().err


def _indexed(settings):
    with open_index(settings) as index:
        state = index.state()
    return state["generation"], {t: e["model_version"] for t, e in state["tasks"].items()}


@pytest.mark.component
def test_promotion_indexes_the_gallery_before_moving_the_alias(ray_cluster, settings, stream, make, tmp_path):
    t0, t1 = (Task.load(d).name for d in stream)
    v1 = make(stream[:1], aa=50.0, forgetting=0.0)
    gone = shutil.copytree(stream[1], tmp_path / "gone" / stream[1].name)
    broken = make([stream[0], gone], aa=55.0, forgetting=0.0, parent=v1)
    shutil.rmtree(gone)
    v2 = make(stream, aa=55.0, forgetting=0.0, parent=v1)

    assert promote(settings, v1)["index"]["tasks"][t0]["model_version"] == v1
    with pytest.raises(DataError, match="task directory not found"):
        promote(settings, broken)
    assert _production(settings) == v1 and len(history(settings)) == 1

    promote(settings, v2)  # no-reindex: task 0 keeps version 1's vectors, task 1 is appended with version 2
    assert _indexed(settings) == (1, {t0: v1, t1: v2})
    reindex = settings.model_copy(update={"index_policy": "reindex"})
    rollback(reindex)  # the gallery becomes exactly version 1's lineage, in one new generation
    assert _indexed(settings) == (2, {t0: v1}) and _production(settings) == v1
    assert Registry(settings).resolve(v1, download=False).tags["index_policy"] == "reindex"


def test_version_0_is_indexed_promoted_and_replaced_with_no_training(settings, stream, make, tmp_path):
    """A version 0 (`clipstream register --from`, trained on nothing) serves the tasks of its row 0: it indexes them,
    passes the gates when nothing is in production, and a trained child is promoted over it without an AA to
    compare; promoting it back over a trained version is refused with the reason."""
    import torch

    from clipstream import models
    from clipstream.indexing import index_task
    from clipstream.training.version0 import register_version0

    torch.manual_seed(0)
    torch.save(models.create("clipstream-vit-tiny").model.state_dict(), tmp_path / "ckpt.pt")
    v0 = register_version0(f"clipstream-vit-tiny:{tmp_path / 'ckpt.pt'}", stream[:1], settings=settings).version
    names = [Task.load(d).name for d in stream]
    state = index_task(settings, v0, stream[0])
    assert {n: (t["task_index"], t["model_version"]) for n, t in state["tasks"].items()} == {names[0]: (0, v0)}
    with pytest.raises(ValueError, match=f"version {v0} is a version 0 \\(trained on no task\\): it serves the tasks "
                                         f"it was evaluated on \\(its tasks: {names[0]}\\), not '{names[1]}'"):
        index_task(settings, v0, stream[1])

    first = promote(settings, v0)
    assert _production(settings) == v0 and all(g.passed for g in first["gates"])
    assert next(g for g in first["gates"] if g.name == "forgetting").detail == \
        f"version {v0} was trained on no task: nothing to forget"
    with open_index(settings) as index:
        assert index.state()["query_version"] == v0

    child = make(stream[:1], aa=20.0, forgetting=0.0, parent=v0)
    promoted = promote(settings, child)
    aa = next(g for g in promoted["gates"] if g.name == "aa")
    assert aa.passed and aa.detail == f"production v{v0} was trained on no task: no AA to compare"
    assert _production(settings) == child

    with pytest.raises(PromotionError) as refused:
        promote(settings, v0)
    assert {g.name for g in refused.value.gates if not g.passed} == {"aa", "lineage"}
    assert f"version {v0} was trained on no task: it has no task-known AA to compare with production v{child}'s" in \
        str(refused.value)

    # under reindex, the version 0 put back (a rollback) re-embeds exactly the tasks of its row 0
    back = rollback(settings.model_copy(update={"index_policy": "reindex"}))
    assert back["to_version"] == v0 and _production(settings) == v0
    with open_index(settings) as index:
        assert {n: t["model_version"] for n, t in index.state()["tasks"].items()} == {names[0]: v0}
    # a version 0 registered without --evaluate serves nothing: under reindex, promoting it would empty the index
    empty = register_version0(f"clipstream-vit-tiny:{tmp_path / 'ckpt.pt'}", settings=settings).version
    with pytest.raises(ValueError, match=f"version {empty} serves no task \\(a version 0 registered without --evaluate\\)"):
        promote(settings.model_copy(update={"index_policy": "reindex"}), empty)
    assert _production(settings) == v0
