"""The `clipstream` command: synthesise data, train task after task, evaluate, list versions, demo.

parser (parses), one module of handlers per theme, render (what they print), demo and ui (the pipelines they
run), entry (`main` and the error policy)."""

from clipstream.cli.entry import main

__all__ = ["main"]
