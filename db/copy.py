"""Bulk loads with PostgreSQL's COPY, and many rows sent as one JSON parameter.

Django's `bulk_create` sends each batch as arrays that psycopg escapes value by value; for rows
carrying JSON (device attributes, slice specs) that dominated a large import. COPY streams the
same rows in PostgreSQL's own format, and its binary format costs this process about a third
of the text format per row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

import orjson
from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.utils import CursorWrapper
from psycopg import postgres
from psycopg.abc import Dumper
from psycopg.pq import Format

ModelT = TypeVar("ModelT", bound=models.Model)


def bulk_insert(model: type[ModelT], rows: Sequence[ModelT]) -> None:
    """Insert `rows` (unsaved instances, primary keys unset) with one COPY; their `pk` stays
    unset."""
    insert_values(model, [row.__dict__ for row in rows])


def insert_values(model: type[models.Model], rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert `rows`, mappings of field attnames (`node_id`, not `node`) to values, with one
    COPY; a field a row does not name takes its default. `bulk_insert` gives it instances' own
    values; an import's devices give it plain mappings, where making a model instance of each
    row cost more than writing it."""
    if not rows:
        return
    # The connection itself, not the `django.db.connection` proxy: this loop runs per value.
    connection = connections[DEFAULT_DB_ALIAS]
    fields = [field for field in model._meta.concrete_fields if not field.primary_key]
    columns = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    table = connection.ops.quote_name(model._meta.db_table)
    # A default is made anew for each row that lacks it, as an instance would make it.
    preparers = [
        (field.attname, _preparer(field, connection), field.get_default) for field in fields
    ]
    with connection.cursor() as cursor, cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(
                [
                    prepare(row[attname] if attname in row else default())
                    for attname, prepare, default in preparers
                ]
            )


# Field classes whose `get_db_prep_save` gives PostgreSQL a value of one of these Python types
# back as it is (Django's PostgreSQL operations adapt datetimes and decimals unchanged): such
# a value skips the field's preparation, the rest (a float for a decimal, a naive datetime, an
# expression) go through it as before. A large import prepared a million values one by one.
_PASSED_AS_IS: tuple[tuple[type[models.Field[Any, Any]], tuple[type, ...]], ...] = (
    (models.BooleanField, (bool,)),
    (models.IntegerField, (int,)),  # and its subclasses, BigIntegerField and the like
    (models.CharField, (str,)),
    (models.TextField, (str,)),
    (models.DecimalField, (Decimal,)),
)


def _preparer(field: models.Field[Any, Any], connection: Any) -> Callable[[Any], Any]:
    """A function from an instance's value of `field` to what the COPY writes: the field's
    `get_db_prep_save`, with shortcuts that give the same value for the common cases."""

    def slow(value: Any) -> Any:
        return field.get_db_prep_save(value, connection)

    if field.is_relation:
        target = field.target_field  # type: ignore[attr-defined]
        if isinstance(target, models.AutoField | models.IntegerField):
            return lambda value: value if value is None or type(value) is int else slow(value)
        return slow
    if isinstance(field, models.JSONField):
        if field.encoder is not None:
            return slow

        def json_text(value: Any) -> Any:
            # jsonb from JSON text (the text COPY format takes it as PostgreSQL would the
            # literal); orjson writes what `json.dumps` does for JSON's own types, several
            # times as fast. What it will not write (integers over 64 bits, keys that are not
            # strings) goes the way it went.
            if value is None:
                return slow(value)
            try:
                return orjson.dumps(value).decode()
            except TypeError:
                return slow(value)

        return json_text
    if isinstance(field, models.DateTimeField):
        return lambda value: (
            value
            if value is None or (type(value) is datetime and value.utcoffset() is not None)
            else slow(value)
        )
    if isinstance(field, models.DateField | models.AutoField):
        return slow
    for field_class, types in _PASSED_AS_IS:
        if isinstance(field, field_class):
            return lambda value: value if value is None or type(value) in types else slow(value)
    return slow


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


def json_rows(*types: str, placeholder: str = "%s", jsonb: bool = False) -> str:
    """A SELECT of the rows of one JSON parameter, an array of arrays of values of `types`
    (SQL type names: bigint, text, double precision); the parameter is `placeholder` in the
    statement (`%(name)s` among named ones).

    One parameter rather than several per row, which the driver would splice into the
    statement one by one (for a thousand rows that took longer than the query). `jsonb`: the
    parameter parsed once into jsonb, whose elements' values are then looked up rather than
    parsed again from the row's text for each column, as json's are (a thousand rows of 15
    columns: 5 ms rather than 15); for rows of one or two columns json's single pass is
    cheaper."""
    kind = "jsonb" if jsonb else "json"
    columns = ", ".join(f"CAST(value ->> {index} AS {type_})" for index, type_ in enumerate(types))
    return f"SELECT {columns} FROM {kind}_array_elements({placeholder}::{kind}) AS item(value)"
