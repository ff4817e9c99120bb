"""The floors of the `clipstream` package (README "Layout"), enforced on every module's imports.

    top       clipstream.cli, the pipelines that join both sides (indexing, promotion), the benchmarks,
              the cluster manifests (k8s) and the local cluster (local_cluster)
    middle    clipstream.training (makes versions) | clipstream.services (serves them): never each other
    ground    settings, registry, vector index, model bundle, Ray start-up and ports (runtime), generated stubs

Every module must sit on exactly one floor, so a new module has to be placed before it can be imported.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"clipstream": "clipstream", "training": "clipstream.training", "services": "clipstream.services",
           "benchmarks": "clipstream.benchmarks"}  # repository folder -> installed package (pyproject package-dir)
GROUND = {"clipstream", "clipstream.console", "clipstream.settings", "clipstream.registry", "clipstream.index", "clipstream.models",
          "clipstream.mlflow_model", "clipstream.runtime", "clipstream.v1"}
TOP = {"clipstream.cli", "clipstream.indexing", "clipstream.promotion", "clipstream.benchmarks", "clipstream.k8s",
       "clipstream.local_cluster"}
MAY_IMPORT = {"ground": {"ground"}, "training": {"ground", "training"}, "services": {"ground", "services"},
              "top": {"ground", "training", "services", "top"}}


def floor(module: str) -> str | None:
    """The floor of a clipstream module (its longest listed prefix decides); None outside clipstream."""
    if module != "clipstream" and not module.startswith("clipstream."):
        return None
    for prefix in sorted(GROUND | TOP | {"clipstream.training", "clipstream.services"}, key=len, reverse=True):
        if module == prefix or (module.startswith(prefix + ".") and prefix != "clipstream"):  # the package's own
            # __init__ is ground; `from clipstream import X` names the module clipstream.X, placed by its own entry
            return {"clipstream.training": "training", "clipstream.services": "services"}.get(
                prefix, "ground" if prefix in GROUND else "top")
    return "unplaced"


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def imports(module: str, path: Path) -> set[str]:
    """Absolute names a module imports (`from a import b` counts as a.b, which may be a module or a name)."""
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


ALL = modules()


def test_every_module_sits_on_a_floor():
    assert {m for m in ALL if floor(m) == "unplaced"} == set()
    assert {"clipstream.registry", "clipstream.index", "clipstream.models", "clipstream.training.job",
            "clipstream.services.app", "clipstream.cli", "clipstream.benchmarks.report"} <= set(ALL)


@pytest.mark.parametrize("module", sorted(ALL))
def test_imports_point_down_or_sideways_never_across(module):
    mine = floor(module)
    bad = {name for name in imports(module, ALL[module]) if floor(name) not in (None, *MAY_IMPORT[mine])}
    assert not bad, f"{module} ({mine} floor) imports {bad}"


@pytest.mark.parametrize("module", sorted(ALL))
def test_nothing_imports_the_repository_folders_as_top_level_packages(module):
    bad = {n for n in imports(module, ALL[module]) if n.split(".")[0] in {"training", "services", "benchmarks"}}
    assert not bad, f"{module} imports {bad}: use clipstream.{{training,services,benchmarks}}"


def test_the_layer_rules_catch_a_violation():
    assert floor("clipstream.training.job") == "training" and floor("clipstream.services.search") == "services"
    assert floor("clipstream.registry.Registry") == "ground" and floor("clipstream.indexing.index_task") == "top"
    assert floor("clipstream.v1.encoder_pb2") == "ground" and floor("clipstream.newthing") == "unplaced"
    assert "services" not in MAY_IMPORT["training"] and "training" not in MAY_IMPORT["services"]
    assert MAY_IMPORT["ground"] == {"ground"}
