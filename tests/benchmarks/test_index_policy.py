"""`clipstream bench index-policy`: the report from hand-made scores."""

from clipstream.benchmarks import index_policy as bench
from clipstream.training.evaluate import ResultMatrix

TASKS = ["t0", "t1", "t2"]


def test_index_policy_report_has_each_policy_per_task_and_their_mean(tmp_path):
    def scores(base):
        return {mode: {t: {c: base + i + (mode == "unknown") * 10 for c in bench.COLUMNS} for i, t in enumerate(TASKS)}
                for mode in ("known", "unknown")}

    results = {"reindex": scores(30.0), "no-reindex": scores(20.0)}
    out = tmp_path / "ip.md"
    text = bench.index_policy_report(results, TASKS, 3, 0, "modx", ["train.epochs=2"], out)
    assert "`clipstream bench index-policy --tasks 3 --seed 0 --method modx --set train.epochs=2 --out " + str(out) + "`" in text
    assert "| reindex | t1 | 31.0 | 31.0 | 31.0 | 31.0 |" in text
    assert "| no-reindex | mean | 21.0 | 21.0 | 21.0 | 21.0 |" in text  # (20 + 21 + 22) / 3
    unknown = text.split("## Task-unknown")[1]
    assert "| no-reindex | mean | 31.0 |" in unknown and "| reindex | t2 | 42.0 |" in unknown
    assert "](ip.png)" in text and (tmp_path / "ip.png").read_bytes()[:4] == b"\x89PNG"  # the plot beside it


def test_the_cost_table_shows_what_keeping_image_vectors_saved_on_a_language_stream(tmp_path):
    results = {"reindex": {m: {t: {c: 1.0 for c in bench.COLUMNS} for t in TASKS} for m in ("known", "unknown")}}
    costs = [("t0", "finetune", {"no-reindex": 1.0, "reindex": 1.0, "full": 1.0}),
             ("t1", "teir", {"no-reindex": 1.0, "reindex": 2.0, "full": 5.0})]
    text = bench.index_policy_report(results, TASKS, 3, 0, "teir", [], tmp_path / "ip.md", costs, languages=3)
    assert "`clipstream bench index-policy --languages 3 --seed 0 --method teir --out" in text
    assert "| t1 | teir | 1.0 | 2.0 | 5.0 | 3.0 (60%) |" in text


def test_the_report_shows_the_evaluations_matrices_under_both_policies_and_checks_the_final_row(tmp_path):
    def matrix(rows):
        m = ResultMatrix()
        for i, row in enumerate(rows):
            m.add_row(TASKS[i], dict(zip(TASKS, row)))
        return m

    matrices = {"known": matrix([[60.0], [50.0, 70.0], [40.0, 45.0, 80.0]]),
                "unknown": matrix([[60.0], [48.0, 66.0], [30.0, 40.0, 75.0]]),
                "noreindex_known": matrix([[60.0], [55.0, 70.0], [52.0, 50.0, 80.0]]),
                "noreindex_unknown": matrix([[60.0], [50.0, 64.0], [44.0, 42.0, 71.0]])}
    final = {"reindex": [40.0, 45.0, 80.0, 30.0, 40.0, 75.0], "no-reindex": [52.0, 50.0, 80.0, 44.0, 42.0, 70.0]}
    results = {policy: {mode: {t: {**{c: 0.0 for c in bench.COLUMNS}, "Rm": values[3 * m + j]}
                               for j, t in enumerate(TASKS)} for m, mode in enumerate(("known", "unknown"))}
               for policy, values in final.items()}
    text = bench.index_policy_report(results, TASKS, 3, 0, "finetune", [], tmp_path / "ip.md", matrices=matrices)
    section = text.split("### no-reindex, task-known")[1]
    assert "| t2 | 52.0 | 50.0 | 80.0 | 60.7 |" in section  # row 3 with its AA
    assert "AA 60.7, forgetting 14.0, BWT -14.0" in section  # forgetting: t0 60 - 52 = 8, t1 70 - 50 = 20
    assert "### reindex, task-unknown" in text
    # the index path's final row beside the evaluation's: equal, except the one entry made to differ
    check = text.split("### Final row")[1]
    assert "| no-reindex | task-unknown | t2 | 71.00 | 70.00 | -1.00 |" in check
    assert "| reindex | task-known | t0 | 40.00 | 40.00 | +0.00 |" in check
