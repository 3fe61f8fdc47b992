"""The package's layout, read from its imports: engine code apart from notebook code, and one
module that talks to ipyparallel."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ddp_magics

PACKAGE = Path(ddp_magics.__file__).parent
# What engine code may import of ddp_magics: itself, the shared records, process lifetime,
# private files, addresses, MPI's shared memory segments.
SHARED_MODULES = (
    "ddp_magics.protocol",
    "ddp_magics.lifetime",
    "ddp_magics.private_files",
    "ddp_magics.addresses",
    "ddp_magics.shared_memory",
)
ENGINE_MAY_IMPORT = ("ddp_magics.engine", *SHARED_MODULES)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, type_checking: bool = False) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions (those imported for
    type annotations only, under ``if TYPE_CHECKING:``, if ``type_checking``)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = node.body if type_checking else []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def ours(names: set[str]) -> set[str]:
    return {name for name in names if name == "ddp_magics" or name.startswith("ddp_magics.")}


def allowed_for_engine(name: str) -> bool:
    return any(name == allowed or name.startswith(allowed + ".") for allowed in ENGINE_MAY_IMPORT)


def test_engine_code_imports_no_notebook_code():
    engine_files = sorted((PACKAGE / "engine").glob("*.py"))
    assert len(engine_files) >= 4
    wrong = {}
    for path in engine_files:
        imports = sorted(ours(imported_modules(path)))
        wrong[module_name(path)] = [name for name in imports if not allowed_for_engine(name)]
    assert {module: names for module, names in wrong.items() if names} == {}


def test_shared_modules_import_nothing_of_either_side():
    """They may use one another (lifetime removes directories as private_files does, and MPI's
    segments as shared_memory does)."""
    for shared in SHARED_MODULES:
        path = PACKAGE / f"{shared.rpartition('.')[2]}.py"
        either_side = {
            name
            for name in ours(imported_modules(path))
            if not any(name == other or name.startswith(other + ".") for other in SHARED_MODULES)
        }
        assert either_side == set(), shared


def notebook_side() -> list[Path]:
    return [path for path in PACKAGE.rglob("*.py") if "engine" not in path.relative_to(PACKAGE).parts]


def in_cluster_layer(path: Path) -> bool:
    return path.relative_to(PACKAGE).parts[0] == "cluster" or path.name == "controller.py"


def test_the_engine_side_is_not_imported_by_the_notebook_side_except_to_send_its_functions():
    """The notebook side sends engine functions by reference and starts engine processes (the
    cluster layer); nothing else of it needs engine code."""
    importers = [
        path
        for path in notebook_side()
        if any(name.startswith("ddp_magics.engine") for name in imported_modules(path))
    ]
    assert importers and all(in_cluster_layer(path) for path in importers), importers


# What only a client of ipyparallel does: import it, or call what a client, view or result offers.
CLIENT_MODULES = ("ipyparallel.client", "ipyparallel.error")
CLIENT_CALLS = {
    "Client",
    "DirectView",
    "AsyncResult",
    "connect_client_sync",
    "apply_async",
    "_send_control_request",
    "wait_for_engines",
    "wait_for_output",
    "metadata",
}


def client_uses(path: Path) -> set[str]:
    uses = {name for name in imported_modules(path) if name.startswith(CLIENT_MODULES)}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in CLIENT_CALLS:
            uses.add(node.attr)
    return uses


def test_only_the_engines_module_talks_to_ipyparallels_client():
    talking = {str(path.relative_to(PACKAGE)) for path in notebook_side() if client_uses(path)}
    assert talking == {"cluster/engines.py"}
    for path in notebook_side():
        if path.name != "engines.py":
            assert "._metadata" not in path.read_text(), path.name


def test_only_the_cluster_layer_imports_ipyparallel():
    importing = {
        str(path.relative_to(PACKAGE))
        for path in notebook_side()
        if any(name.split(".")[0] == "ipyparallel" for name in imported_modules(path))
    }
    assert importing <= {"cluster/engines.py", "cluster/lifecycle.py", "cluster/launcher.py", "controller.py"}


# What the user sees and says: the cluster layer knows none of it.
PRESENTATION = {
    "ddp_magics.magics",
    "ddp_magics.settings",
    "ddp_magics.arguments",
    "ddp_magics.cell_run",
    "ddp_magics.cell_view",
    "ddp_magics.reports",
    "ddp_magics.errors",
    "ddp_magics.output",
    "ddp_magics.live_view",
    "ddp_magics.diagrams",
    "ddp_magics.figures",
    "ddp_magics.timeline",
    "ddp_magics.diff",
}


def test_the_cluster_package_imports_no_presentation_code():
    cluster_files = sorted((PACKAGE / "cluster").glob("*.py"))
    assert len(cluster_files) >= 8
    for path in cluster_files:
        imports = imported_modules(path)
        shown = sorted(ours(imports) & PRESENTATION) + sorted(n for n in imports if n.startswith("IPython"))
        assert shown == [], path.name


def test_nothing_imports_the_magics():
    """The magics are the top: only the extension's loader (the package itself) registers them."""
    importers = [
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent != PACKAGE
        if "ddp_magics.magics" in imported_modules(path)
    ]
    assert importers == []


def test_modules_and_classes_stay_small():
    """No module over 450 lines, no class over 350: each concern can be read in one sitting."""
    long_modules = {}
    long_classes = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 450:
            long_modules[module_name(path)] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 350:
                long_classes[f"{module_name(path)}.{node.name}"] = node.end_lineno - node.lineno + 1
    assert (long_modules, long_classes) == ({}, {})


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (anywhere in it, for
    type annotations too unless not ``type_checking``)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for target in ours(imported_modules(path, type_checking)):
            # ``from ddp_magics.engine import recorder`` names a module; ``from x import f`` its module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != "ddp_magics":
                imported.add(target)
        graph[name] = imported
    return graph


def test_the_imports_have_no_cycle():
    """Every import points one way (notebook side: protocol -> matching -> diagrams -> magics;
    engine side: zygote -> process -> rank), also through imports made inside functions and
    those for type annotations only."""
    graph = import_graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert "ddp_magics.matching" in graph["ddp_magics.diagrams"]  # the graph is read at all


def test_only_the_cluster_uses_its_launchers_and_hosts():
    """launcher.py (how engines come to be) and hosts.py (the other hosts, over ssh) are rooms of
    the cluster layer: the rest of the notebook side sees the cluster only."""
    users = {
        path.name
        for path in notebook_side()
        if ours(imported_modules(path)) & {"ddp_magics.cluster.launcher", "ddp_magics.cluster.hosts"}
    }
    assert users == {"lifecycle.py", "hosts.py"}


def architecture_rows() -> list[tuple[list[str], list[str]]]:
    """ARCHITECTURE.md's map of the notebook side: per row, its modules and what they may import,
    as the backticked names of its first and last columns."""
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    table = text.split("## Map of the modules", 1)[1].split("The cluster package", 1)[0]
    rows = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = line.strip().strip("|").split("|")
        modules = re.findall(r"`([\w/]+?)(?:\.py|/)`", cells[0])
        allowed = re.findall(r"`([\w./*]+?)/?`", cells[-1])
        rows.append((modules, allowed))
    return rows


def as_module(name: str) -> str:
    """``cell_run`` -> ``ddp_magics.cell_run``; ``cluster/`` and ``cluster.*`` -> ``ddp_magics.cluster``."""
    return "ddp_magics." + name.replace("/", ".").removesuffix(".*").rstrip(".")


def test_architecture_says_what_each_module_may_import():
    """Each row of ARCHITECTURE.md's map names what its modules may import (besides each other,
    their own package and the shared modules); the code imports nothing else, so the map
    cannot drift from it."""
    rows = architecture_rows()
    assert len(rows) >= 15, rows
    graph = import_graph(type_checking=True)
    shared = {*SHARED_MODULES, "ddp_magics.stack_dumps"}
    listed, wrong = set(), {}
    for modules, allowed in rows:
        if "magics" in modules:
            continue  # everything below it
        names = [as_module(module) for module in modules]
        permitted = {*names, *map(as_module, allowed), *shared}
        for name in names:
            for path_name in [m for m in graph if m == name or m.startswith(name + ".")]:
                listed.add(path_name)
                extra = sorted(
                    target
                    for target in graph[path_name]
                    if not any(target == p or target.startswith(p + ".") for p in permitted)
                )
                if extra:
                    wrong[path_name] = extra
    assert wrong == {}
    unlisted = sorted(m for m in graph if ".engine" not in m and m not in listed)
    assert unlisted == ["ddp_magics", "ddp_magics.magics"], unlisted
