"""Bulk inserts: one COPY on PostgreSQL, `bulk_create` elsewhere.

Django's `bulk_create` on PostgreSQL sends each batch as arrays that psycopg escapes value by
value; for rows carrying JSON (device attributes, slice specs) that dominated a large import.
COPY streams the same rows in PostgreSQL's own format.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, models

ModelT = TypeVar("ModelT", bound=models.Model)


def bulk_insert(model: type[ModelT], rows: Sequence[ModelT]) -> None:
    """Insert `rows` (unsaved instances, primary keys unset); their `pk` stays unset."""
    if not rows:
        return
    # The connection itself, not the `django.db.connection` proxy: this loop runs per value.
    connection = connections[DEFAULT_DB_ALIAS]
    if connection.vendor != "postgresql":
        model._default_manager.bulk_create(rows, batch_size=1000)
        return
    fields = [field for field in model._meta.concrete_fields if not field.primary_key]
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    table = connection.ops.quote_name(model._meta.db_table)
    with connection.cursor() as cursor, cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(
                [
                    field.get_db_prep_save(getattr(row, field.attname), connection)
                    for field in fields
                ]
            )


def insert_rows(
    model: type[models.Model],
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    types: Sequence[str] | None = None,
) -> None:
    """Insert plain tuples of already-prepared values (in `columns` order) into `model`'s
    table: COPY on PostgreSQL, one executemany elsewhere. For hot paths that never need model
    instances; values must be what the driver adapts itself (str, int, Decimal, datetime).

    With `types` (PostgreSQL type names, one per column) the COPY is in the binary format,
    which costs this process about a third of the text format per row."""
    if not rows:
        return
    connection = connections[DEFAULT_DB_ALIAS]
    table = connection.ops.quote_name(model._meta.db_table)
    quoted = ", ".join(connection.ops.quote_name(column) for column in columns)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            binary = " (FORMAT BINARY)" if types else ""
            with cursor.copy(f"COPY {table} ({quoted}) FROM STDIN{binary}") as copy:
                if types:
                    copy.set_types(types)
                for row in rows:
                    copy.write_row(row)
        else:
            # Other backends store some types their own way (SQLite: datetimes as naive UTC
            # text): let each field prepare its value.
            fields = [model._meta.get_field(column) for column in columns]
            prepared = [
                [
                    field.get_db_prep_save(value, connection)  # type: ignore[union-attr]
                    for field, value in zip(fields, row, strict=True)
                ]
                for row in rows
            ]
            marks = ", ".join(["%s"] * len(columns))
            cursor.executemany(f"INSERT INTO {table} ({quoted}) VALUES ({marks})", prepared)


# The rows of one JSON parameter, an array of arrays: a single parameter rather than several per
# row, which the driver would splice into the statement one by one (for a thousand rows that
# took longer than the query).
_JSON_ROWS = {
    "postgresql": "SELECT {columns} FROM json_array_elements({placeholder}::json) AS item(value)",
    "sqlite": "SELECT {columns} FROM json_each({placeholder})",
}
_JSON_ITEM = {
    "postgresql": "CAST(value ->> {index} AS {type})",
    "sqlite": "CAST(json_extract(value, '$[{index}]') AS {type})",
}


def json_rows(*types: str, placeholder: str = "%s") -> str:
    """A SELECT of the rows of one JSON parameter (arrays of values of `types`, SQL type names
    both databases know: bigint, text, double precision), for the default database; the
    parameter is `placeholder` in the statement (`%(name)s` among named ones)."""
    vendor = connections[DEFAULT_DB_ALIAS].vendor
    item = _JSON_ITEM[vendor]
    columns = ", ".join(item.format(index=index, type=type_) for index, type_ in enumerate(types))
    return _JSON_ROWS[vendor].format(columns=columns, placeholder=placeholder)
