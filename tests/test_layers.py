"""The floors of the `clipstream` package (README "Layout"), enforced on every module's imports.

    top       clipstream.cli, the pipelines that join both sides (indexing, promotion), the benchmarks,
              the cluster manifests (k8s) and the local cluster (local_cluster)
    middle    clipstream.training (makes versions) | clipstream.services (serves them): never each other
    ground    settings, registry, vector index, model bundle, Ray start-up and ports (runtime), generated stubs:
              nothing above them

Every module must sit on exactly one floor, so a new module has to be placed before it can be imported. And no
module imports itself round a loop of others (function-local imports count): the graph of imports is acyclic.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"clipstream": "clipstream", "training": "clipstream.training", "services": "clipstream.services",
           "benchmarks": "clipstream.benchmarks"}  # repository folder -> installed package (pyproject package-dir)
GROUND = {"clipstream", "clipstream.console", "clipstream.settings", "clipstream.registry", "clipstream.index",
          "clipstream.catalogue", "clipstream.roots", "clipstream.models",
          "clipstream.mlflow_model", "clipstream.runtime", "clipstream.v1"}
TOP = {"clipstream.cli", "clipstream.indexing", "clipstream.promotion", "clipstream.benchmarks", "clipstream.k8s",
       "clipstream.controller", "clipstream.local_cluster"}
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
            if "client-dist" in path.parts:  # the client's own distribution: links to modules counted here
                continue
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
            "clipstream.services.app", "clipstream.cli", "clipstream.cli.render", "clipstream.runtime",
            "clipstream.benchmarks.report"} <= set(ALL)


@pytest.mark.parametrize("module", sorted(ALL))
def test_imports_point_down_or_sideways_never_across(module):
    mine = floor(module)
    bad = {name for name in imports(module, ALL[module]) if floor(name) not in (None, *MAY_IMPORT[mine])}
    assert not bad, f"{module} ({mine} floor) imports {bad}"


@pytest.mark.parametrize("module", sorted(ALL))
def test_nothing_imports_the_repository_folders_as_top_level_packages(module):
    bad = {n for n in imports(module, ALL[module]) if n.split(".")[0] in {"training", "services", "benchmarks"}}
    assert not bad, f"{module} imports {bad}: use clipstream.{{training,services,benchmarks}}"


def owner(name: str) -> str | None:
    """The module an imported name lives in: the longest prefix that is a module of the package (None outside it)."""
    parts = name.split(".")
    return next((m for m in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if m in ALL), None)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a module naming itself, e.g. `python -m`'s package, left out)."""
    return {m: {o for o in map(owner, imports(m, path)) if o and o != m} for m, path in ALL.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none (depth first, in sorted order)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return []

    return next((c for c in (visit(n, []) for n in sorted(graph)) if c), [])


def test_no_module_imports_itself_round_a_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_catches_a_made_up_cycle():
    assert owner("clipstream.cli.render.format_hits") == "clipstream.cli.render" and owner("ray.serve") is None
    assert owner("clipstream.training.job.run_task") == "clipstream.training.job"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"d": {"a"}, "a": {"b"}, "b": {"c", "e"}, "c": {"a"}, "e": set()}) == ["a", "b", "c", "a"]
    graph = import_graph()  # the tree's own graph with one import added: runtime (ground) naming the cli
    assert "clipstream.runtime" in graph["clipstream.cli.serving"]
    graph["clipstream.runtime"] = graph["clipstream.runtime"] | {"clipstream.cli.serving"}
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and sorted(cycle[1:]) == ["clipstream.cli.serving", "clipstream.runtime"], cycle


def test_the_layer_rules_catch_a_violation():
    assert floor("clipstream.training.job") == "training" and floor("clipstream.services.search") == "services"
    assert floor("clipstream.registry.Registry") == "ground" and floor("clipstream.indexing.index_task") == "top"
    assert floor("clipstream.v1.encoder_pb2") == "ground" and floor("clipstream.newthing") == "unplaced"
    assert "services" not in MAY_IMPORT["training"] and "training" not in MAY_IMPORT["services"]
    assert MAY_IMPORT["ground"] == {"ground"}
