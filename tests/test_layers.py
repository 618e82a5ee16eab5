"""The apps' one direction of dependency, and no import cycle inside an app.

Read from the source with `ast`, imports inside functions included (an import hidden in a
function to dodge a cycle is still a dependency).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The layers, lowest first: each package may import only the packages listed before it here
# (and the ones named beside it). `core` (metrics registry, logging, input limits, parsers) and
# `db` sit at the bottom; `config` (settings, URLconfs, the Celery app, middleware) sits on top
# and no package imports it: no arrow runs back up.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "db": set(),
    "agent": set(),
    "teams": {"core", "db"},
    "inventory": {"core", "db", "teams"},
    "metering": {"core", "db", "teams", "inventory", "agent"},
    "billing": {"core", "db", "teams", "inventory", "agent", "metering"},
    "quota": {"core", "db", "teams", "inventory", "metering", "billing"},
    "frontend": {"core", "db", "teams", "inventory", "metering", "billing", "quota"},
    "demo": {"core", "db", "teams", "inventory", "metering", "billing", "quota"},
}
PACKAGES = {*ALLOWED, "config"}


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports, anywhere in it (`from a import b` counts `a.b`
    when that is a module, else `a`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in MODULES
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] in PACKAGES)
    return found


IMPORTS = {module: _imports(path) for module, path in MODULES.items()}


def test_each_app_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, imported in sorted(IMPORTS.items()):
        package = module.split(".")[0]
        if package == "config":
            continue  # the top: settings, URLconfs and the Celery app import what they wire
        for name in sorted(imported):
            target = name.split(".")[0]
            if target != package and target not in ALLOWED[package]:
                wrong.append(f"{module} -> {name}")
    assert wrong == []


def test_nothing_imports_config() -> None:
    """`config` is on top: no app, no bottom package, the agent and the demo never import it
    (they read settings through `django.conf.settings`)."""
    wrong = [
        f"{module} -> {name}"
        for module, imported in sorted(IMPORTS.items())
        if module.split(".")[0] != "config"
        for name in sorted(imported)
        if name.split(".")[0] == "config"
    ]
    assert wrong == []


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle_inside_a_package(package: str) -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, imported in IMPORTS.items():
        if module.split(".")[0] != package:
            continue
        for name in imported:
            # `from pkg import x` where x is no module names the package itself: that is the
            # package's `__init__`, which imports nothing of its own here.
            if name in MODULES and name.split(".")[0] == package and name != package:
                graph[module].add(name)
    cycles = []
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for name in sorted(graph[module]):
            if state.get(name) == 1:
                cycles.append(" -> ".join([*trail[trail.index(name) :], name]))
            elif name not in state:
                visit(name, [*trail, name])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


# Of the agent, apps (and the settings) import only the exporters' profiles: the one place an
# exporter's metrics, labels and device matching are written, read by the node agent and by
# the Prometheus source alike. The agent itself knows no app and no Django.
AGENT_SEAMS = {"agent.exporters"}


def test_apps_import_of_the_agent_only_the_exporters_seam() -> None:
    wrong = [
        f"{module} -> {name}"
        for module, imported in sorted(IMPORTS.items())
        if module.split(".")[0] != "agent"
        for name in sorted(imported)
        if name.split(".")[0] == "agent" and name not in AGENT_SEAMS
    ]
    assert wrong == []


def test_the_exporters_seam_needs_no_django() -> None:
    source = MODULES["agent.exporters"].read_text()
    assert "django" not in {
        name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
        )
    }


def test_the_agent_core_and_db_know_no_app() -> None:
    """The agent runs on GPU nodes without Django's apps; `core` and `db` are below every app."""
    for module, imported in IMPORTS.items():
        if module.split(".")[0] in ("agent", "core", "db"):
            assert {name.split(".")[0] for name in imported} <= {module.split(".")[0]}, module


def _top_level_imports(path: Path) -> set[str]:
    """The top-level package of every absolute import in `path`, inside functions too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", ["bench", "devtools"])
def test_benchmarks_and_devtools_import_nothing_of_the_tests(package: str) -> None:
    """The benchmarks run without the suite (what they share with it is in `devtools`)."""
    wrong = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / package).rglob("*.py")
        if "tests" in _top_level_imports(path)
    )
    assert wrong == []
