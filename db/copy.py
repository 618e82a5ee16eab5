"""Bulk loads with PostgreSQL's COPY, and many rows sent as one JSON parameter.

Django's `bulk_create` sends each batch as arrays that psycopg escapes value by value; for rows
carrying JSON (device attributes, slice specs) that dominated a large import. COPY streams the
same rows in PostgreSQL's own format, and its binary format costs this process about a third
of the text format per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.utils import CursorWrapper
from psycopg import postgres
from psycopg.abc import Dumper
from psycopg.pq import Format

ModelT = TypeVar("ModelT", bound=models.Model)


def bulk_insert(model: type[ModelT], rows: Sequence[ModelT]) -> None:
    """Insert `rows` (unsaved instances, primary keys unset) with one COPY; their `pk` stays
    unset."""
    if not rows:
        return
    # The connection itself, not the `django.db.connection` proxy: this loop runs per value.
    connection = connections[DEFAULT_DB_ALIAS]
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
    types: Sequence[str],
) -> None:
    """Insert plain tuples of already-prepared values (in `columns` order, of the PostgreSQL
    `types`) into `model`'s table with one binary COPY. For hot paths that never need model
    instances; values must be what the driver adapts itself (str, int, Decimal, datetime)."""
    if not rows:
        return
    connection = connections[DEFAULT_DB_ALIAS]
    table = connection.ops.quote_name(model._meta.db_table)
    quoted = ", ".join(connection.ops.quote_name(column) for column in columns)
    # As Django's own cursors raise them (`django.db.DataError`, `IntegrityError`): callers
    # tell a row the database refuses from other failures the same way whatever wrote it.
    with connection.cursor() as cursor, connection.wrap_database_errors:
        copy_rows(cursor, f"{table} ({quoted})", rows, types)


class _JsonTextBinaryDumper(Dumper):
    """jsonb in COPY's binary format from JSON text (psycopg's own jsonb dumper would encode
    the text again, as a JSON string)."""

    format = Format.BINARY
    oid = postgres.types["jsonb"].oid

    def dump(self, obj: Any) -> bytes:
        return b"\x01" + obj.encode()  # jsonb's binary format: version 1, then the text


def copy_rows(
    cursor: CursorWrapper, into: str, rows: Iterable[Sequence[Any]], types: Sequence[str]
) -> None:
    """COPY `rows` into `into` (a table and its columns, quoted as needed) in the binary
    format, each value of the PostgreSQL type in `types`; a `jsonb` value is JSON text."""
    cursor.adapters.register_dumper(None, _JsonTextBinaryDumper)  # for this cursor only
    with cursor.copy(f"COPY {into} FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(types)
        for row in rows:
            copy.write_row(row)


def json_rows(*types: str, placeholder: str = "%s") -> str:
    """A SELECT of the rows of one JSON parameter, an array of arrays of values of `types`
    (SQL type names: bigint, text, double precision); the parameter is `placeholder` in the
    statement (`%(name)s` among named ones).

    One parameter rather than several per row, which the driver would splice into the
    statement one by one (for a thousand rows that took longer than the query)."""
    columns = ", ".join(f"CAST(value ->> {index} AS {type_})" for index, type_ in enumerate(types))
    return f"SELECT {columns} FROM json_array_elements({placeholder}::json) AS item(value)"
