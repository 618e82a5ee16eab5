"""The quota ledger has one writer: no module but `quota/ledger.py` writes a rule's `in_use` or
a reservation's (or gang hold's) lines, by the ORM or in SQL (issue 37).

Read from the source with `ast`, so the rule stays true as the code changes: an ORM write
(`update(in_use=...)`, `F("in_use")` in an update, a line model's `create`/`update`/`delete`)
or SQL text that sets `in_use` or inserts or updates a line table, anywhere else, fails here.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
OWNER = REPO / "quota" / "ledger.py"

LINE_MODELS = {"ReservationLine", "GangReservationLine"}
# Within quota, `lines` is a reservation's or hold's lines (the relation's name, and the name
# the code gives a queryset of them); billing's statements have lines of their own.
QUOTA_LINES = LINE_MODELS | {"lines"}
ORM_WRITES = {
    "update",
    "create",
    "bulk_create",
    "bulk_update",
    "update_or_create",
    "get_or_create",
    "delete",
}
# SQL that sets `in_use` (an UPDATE's SET, an upsert's SET).
SQL_SETS_IN_USE = re.compile(r"\bSET\b[^;]*?\bin_use\s*=", re.IGNORECASE | re.DOTALL)
# SQL that writes a table whose name the f-string interpolates from a name about lines
# (`{line}`, `{hold_line}`): the way the webhook's statements name the line tables.
SQL_WRITES_LINES = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s*$", re.IGNORECASE)


def _product_modules() -> Iterator[Path]:
    for path in sorted(REPO.rglob("*.py")):
        parts = path.relative_to(REPO).parts
        if parts[0] in ("tests", "docs") or parts[0].startswith(".") or "migrations" in parts:
            continue
        yield path


def _chain_names(node: ast.AST) -> set[str]:
    """The names a call's receiver is built from (`ReservationLine.objects.filter(...)`)."""
    names = set()
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
            node = node.value
        elif isinstance(node, ast.Name):
            names.add(node.id)
            return names
        else:
            return names


def _mentions_in_use(node: ast.AST) -> bool:
    return any(
        isinstance(child, ast.Constant) and child.value == "in_use" for child in ast.walk(node)
    )


def _sql_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _writes(tree: ast.AST, *, in_quota: bool) -> Iterator[tuple[int, str]]:
    line_names = QUOTA_LINES if in_quota else LINE_MODELS
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in ORM_WRITES:
                if any(keyword.arg == "in_use" for keyword in node.keywords):
                    yield node.lineno, f"{method}(in_use=...)"
                elif method in ("update", "bulk_update") and any(
                    _mentions_in_use(arg) for arg in [*node.args, *node.keywords]
                ):
                    yield node.lineno, f"{method}(... in_use ...)"
                if _chain_names(node.func.value) & line_names:
                    yield node.lineno, f"{method}() of a line model"
            if method == "save" and any(
                keyword.arg == "update_fields" and _mentions_in_use(keyword.value)
                for keyword in node.keywords
            ):
                yield node.lineno, "save(update_fields=[... in_use ...])"
        text = _sql_text(node)
        if text is not None and SQL_SETS_IN_USE.search(text):
            yield getattr(node, "lineno", 0), "SQL that sets in_use"
        if isinstance(node, ast.JoinedStr):
            literal = "".join(
                part.value
                for part in node.values
                if isinstance(part, ast.Constant) and isinstance(part.value, str)
            )
            if SQL_SETS_IN_USE.search(literal):
                yield node.lineno, "SQL that sets in_use"
            for before, after in zip(node.values, node.values[1:], strict=False):
                if (
                    isinstance(before, ast.Constant)
                    and isinstance(before.value, str)
                    and SQL_WRITES_LINES.search(before.value)
                    and isinstance(after, ast.FormattedValue)
                    and "line" in ast.unparse(after.value).lower()
                ):
                    yield node.lineno, "SQL that writes a line table"


def test_only_the_ledger_writes_in_use_and_the_lines() -> None:
    found = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in _product_modules()
        if path != OWNER
        for line, what in _writes(
            ast.parse(path.read_text(), filename=str(path)),
            in_quota=path.relative_to(REPO).parts[0] == "quota",
        )
    ]
    assert found == []


def test_the_check_sees_each_kind_of_write() -> None:
    # The ledger itself writes in each of the ways the check looks for, so the check can fail.
    kinds = {what for _, what in _writes(ast.parse(OWNER.read_text()), in_quota=True)}
    assert kinds >= {
        "update(in_use=...)",
        "create() of a line model",
        "update() of a line model",
        "delete() of a line model",
        "SQL that sets in_use",
        "SQL that writes a line table",
    }
