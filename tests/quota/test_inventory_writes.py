"""Quota writes none of the inventory's rows itself: what it learns for them (who created a
claim, as the webhook saw it) goes through an inventory service,
`inventory.creators.record_claim_creator` (issue 37). Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

from django.apps import apps

QUOTA = Path(__file__).resolve().parents[2] / "quota"
WRITES = {"update", "create", "bulk_create", "bulk_update", "update_or_create", "delete"}


def _receiver_names(node: ast.AST) -> set[str]:
    names = set()
    while isinstance(node, ast.Call | ast.Attribute):
        node = node.func if isinstance(node, ast.Call) else node.value
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
    if isinstance(node, ast.Name):
        names.add(node.id)
    return names


def _inventory_writes(tree: ast.AST, models: set[str]) -> list[tuple[int, str]]:
    return [
        (node.lineno, node.func.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in WRITES
        and _receiver_names(node.func.value) & models
    ]


def test_quota_writes_no_inventory_rows() -> None:
    models = {model.__name__ for model in apps.get_app_config("inventory").get_models()}
    found = [
        f"{path.relative_to(QUOTA.parent)}:{line}: {method}"
        for path in sorted(QUOTA.rglob("*.py"))
        if "migrations" not in path.parts
        for line, method in _inventory_writes(ast.parse(path.read_text()), models)
    ]
    assert found == []


def test_the_check_sees_a_write_of_an_inventory_row() -> None:
    tree = ast.parse('Allocation.objects.filter(claim=claim, job="").update(job=job)')
    assert _inventory_writes(tree, {"Allocation"}) == [(1, "update")]
