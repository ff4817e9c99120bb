"""`clipstream bench cli-startup`: every command it times answers, and the file holds the table and the checks."""

import json

import pytest

from clipstream.benchmarks import cli_startup


@pytest.mark.component
def test_it_times_each_command_and_checks_the_one_second_target(tmp_path):
    out = tmp_path / "cli-startup.md"
    text = cli_startup.main(["--rounds", "1", "--out", str(out)])
    assert out.read_text() == text
    for name in cli_startup.COMMANDS:
        assert f"| {name} |" in text
    checks = json.loads(out.with_suffix(".json").read_text())["checks"]
    assert [c["check"] for c in checks] == [f"{n} (median s)" for n in cli_startup.COMMANDS if n.startswith("clipstream")]
    assert all(c["target"] == "≤ 1.00" and float(c["value"]) > 0 for c in checks)
