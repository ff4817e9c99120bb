"""Quiet output: the process's own lines reach the terminal, everything its libraries and children write goes to
the log file, however they write it."""

import subprocess
import sys

import pytest

QUIET_PROCESS = """
import logging, os, subprocess, sys, warnings
from pathlib import Path
from clipstream import console

assert console.err() is sys.stderr and not console.is_quiet()
path = console.quiet(Path(sys.argv[1]), "cmd")
assert console.is_quiet() and console.quiet(Path(sys.argv[1]), "again") == path  # once per process
print("clipstream's own line")
print("a bar or an error", file=console.err())
stdout_logger = logging.getLogger("like-deepspeed")  # a handler given sys.stdout, as DeepSpeed's is
stdout_logger.addHandler(logging.StreamHandler(sys.stdout))
stdout_logger.warning("a library's log line to stdout")
logging.getLogger("like-ray").warning("a library's log line to stderr")
warnings.warn("a library's warning")
exec(compile('print("a library print")', "/site-packages/ray/_private/worker.py", "exec"), {"__name__": "ray.worker"})
os.write(2, b"a C++ line on descriptor 2\\n")
os.write(1, b"a C++ line on descriptor 1\\n")
subprocess.run(["sh", "-c", "echo a child line; echo its error >&2"], check=True)
print(path)
"""


@pytest.mark.component
def test_quiet_keeps_the_terminal_for_clipstreams_lines_and_sends_the_rest_to_the_log(tmp_path):
    done = subprocess.run([sys.executable, "-c", QUIET_PROCESS, str(tmp_path / "logs")], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "clipstream's own line" and len(out) == 2
    assert done.stderr == "a bar or an error\n"
    log = (tmp_path / "logs" / out[1].rsplit("/", 1)[-1]).read_text()
    assert out[1].startswith(str(tmp_path / "logs" / "cmd-"))
    for line in ("a library print", "a library's log line to stdout", "a library's log line to stderr", "a library's warning",
                 "a C++ line on descriptor 2", "a C++ line on descriptor 1", "a child line", "its error"):
        assert line in log, line


def test_where_the_streams_are_not_the_processes_own_nothing_changes(tmp_path, capsys):
    from clipstream import console

    assert console.quiet(tmp_path / "logs", "cmd") is None  # (pytest captures sys.stdout: not descriptor 1)
    assert not console.is_quiet() and not (tmp_path / "logs").exists()
    print("to the caller")
    assert capsys.readouterr().out == "to the caller\n"
