"""Rooms and doors (DESIGN.md): training never imports services; services import only training.models."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(package: str) -> dict[str, set[str]]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from training import models` imports training.models; `from a.b import C` imports a.b
                names |= {f"{node.module}.{a.name}" for a in node.names} if "." not in node.module else {node.module}
        found[str(path.relative_to(ROOT))] = names
    return found


def test_training_never_imports_services_or_the_cli():
    for path, names in _imports("training").items():
        bad = {n for n in names if n.split(".")[0] == "services" or n == "clipstream.cli"}
        assert not bad, f"{path} imports {bad}"


def test_services_import_only_training_models():
    for path, names in _imports("services").items():
        bad = {n for n in names if n.split(".")[0] == "training" and n != "training.models"}
        assert not bad, f"{path} imports {bad}"
