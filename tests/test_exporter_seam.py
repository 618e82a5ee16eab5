"""How a series names its device is written once, as each exporter profile's declared rule
(`agent.exporters.MatchBy`): the code that matches series (the Prometheus source's
`match_series` and its helpers, the agent's `parse_metrics` and `ExporterSource`) dispatches on
that rule and never asks which exporter it is (issue 36). Checked on the source's syntax tree:
no exporter name as a string, no profile object named, no comparison with an exporter's or a
profile's `.name`."""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from types import ModuleType

import pytest

from agent import exporters
from metering import prometheus

EXPORTER_NAMES = frozenset({"dcgm", "amd", "intel", "gaudi", "tpu"})
PROFILE_OBJECTS = frozenset({"DCGM", "AMD", "INTEL", "GAUDI", "TPU"})

# The functions (and classes, all their methods) that match a series to a device.
MATCHING: dict[ModuleType, tuple[str, ...]] = {
    prometheus: (
        "match_series",
        "_by_uuid",
        "_by_pci_order",
        "_by_serial",
        "_by_name",
        "_pci_order_indexes",
        "_node_buses",
        "_node_serials",
    ),
    exporters: ("parse_metrics", "ExporterSource", "_device_level"),
}


def name_checks(tree: ast.AST) -> Iterator[str]:
    """Where `tree` asks which exporter it is: an exporter's name as a string, a profile
    object named, or an exporter's or profile's `.name` compared."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.strip().lower() in EXPORTER_NAMES:
                yield f"line {node.lineno}: the string {node.value!r}"
        elif isinstance(node, ast.Name) and node.id in PROFILE_OBJECTS:
            yield f"line {node.lineno}: the profile {node.id}"
        elif isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if (
                    isinstance(side, ast.Attribute)
                    and side.attr == "name"
                    and any(word in ast.unparse(side.value) for word in ("exporter", "profile"))
                ):  # an exporter's or a profile's name (a sample's metric name is no matter)
                    yield f"line {node.lineno}: a comparison with {ast.unparse(side)}"


def test_the_check_finds_a_dispatch_on_an_exporters_name() -> None:
    """The check fails on what it forbids: each way of asking which exporter it is."""
    code = (
        "def match(exporter, profile):\n"
        "    if exporter.name == 'amd':\n"
        "        return 1\n"
        "    if profile is AMD:\n"
        "        return 2\n"
        "    return PROFILES['Gaudi']\n"
    )
    assert list(name_checks(ast.parse(code))) == [
        "line 2: a comparison with exporter.name",
        "line 2: the string 'amd'",
        "line 4: the profile AMD",
        "line 6: the string 'Gaudi'",
    ]
    rule = "def match(profile):\n    return profile.match is MatchBy.SERIAL\n"
    assert list(name_checks(ast.parse(rule))) == []


@pytest.mark.parametrize(
    ("module", "name"), [(module, name) for module, names in MATCHING.items() for name in names]
)
def test_matching_code_dispatches_on_the_declared_rule_not_the_exporters_name(
    module: ModuleType, name: str
) -> None:
    source = inspect.getsource(getattr(module, name))
    found = list(name_checks(ast.parse(source)))
    assert found == [], f"{module.__name__}.{name} asks which exporter it is: {found}"


def test_every_profile_declares_its_rule_and_the_roles_it_reads() -> None:
    """Each rule's roles are among the profile's labels: what the source reads a series by is
    the profile's own description."""
    needs = {
        exporters.MatchBy.UUID: {"uuid"},
        exporters.MatchBy.PCI_ORDER: {"serial", "gpu_id"},
        exporters.MatchBy.PCI_BUS: {"pci_bus_id"},
        exporters.MatchBy.SERIAL: {"serial"},
        exporters.MatchBy.DEVICE_NAME: {"chip"},
    }
    for profile in exporters.PROFILES.values():
        assert isinstance(profile.match, exporters.MatchBy)
        assert needs[profile.match] <= set(profile.labels), profile.name
        if profile.match is not exporters.MatchBy.UUID:
            assert profile.driver, f"{profile.name}: a rule naming devices by driver needs one"
