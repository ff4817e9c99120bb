"""`clipstream bench languages`: the report from hand-made R matrices."""

import pytest

from clipstream.benchmarks import languages as bench
from clipstream.training.evaluate import ResultMatrix

TASKS = ["task-00-lang-en", "task-01-lang-xa", "task-02-lang-xb"]


def _matrix(rows):
    m = ResultMatrix()
    for task, row in zip(TASKS, rows):
        m.add_row(task, dict(zip(TASKS, row)))
    return m


def test_the_report_has_aa_forgetting_and_the_first_languages_forgetting_per_stream(tmp_path):
    matrices = {"embeddings": _matrix([[80.0], [50.0, 60.0], [40.0, 30.0, 70.0]]),
                "teir": _matrix([[80.0], [78.0, 50.0], [79.0, 48.0, 60.0]])}
    out = tmp_path / "languages.md"
    text = bench.languages_report(matrices, 3, 0, ["train.epochs=2"], out)
    assert "`clipstream bench languages --languages 3 --seed 0 --set train.epochs=2 --out " + str(out) + "`" in text
    # AA (40+30+70)/3; forgetting: en 80-40, xa 60-30; English's own
    assert "| embeddings | cllclip | 46.7 | 35.0 | 40.0 | 40.0 |" in text
    assert "| teir | teir | 62.3 | 1.5 | 1.0 | 79.0 |" in text
    assert (tmp_path / "languages.png").stat().st_size > 0


def test_unknown_streams_and_a_stream_without_a_second_language_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown stream"):
        bench.main(["--streams", "teir,nope"])
    with pytest.raises(ValueError, match="at least one more language"):
        bench.languages(None, 1, ["teir"])
