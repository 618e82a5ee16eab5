"""Many rows updated with one statement (`UPDATE ... FROM unnest(arrays)`), and many keys
looked up with one parameter (`column = ANY(array)`, `AnyOf`).

Django's `bulk_update` writes `CASE WHEN id = ... THEN ... END` per row and column, which
PostgreSQL plans and evaluates row by row and column by column; for the inventory writer's
batches that was most of the time spent writing. Here each column travels as one array
parameter and the rows are joined on their id, in id order, so that concurrent writers lock the
rows in the same order.

A JSON column travels as one JSON document instead, the array of the rows' values, each row
taking its element by position: in a text array every `"` of a value's JSON is escaped by the
driver's quoting, a regular-expression substitution per quote in Python (a third of the sync's
Python time on a batch of ResourceSlices, whose specs are full of quotes), where one document
is one string the driver escapes at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import orjson
from django.db import DEFAULT_DB_ALIAS, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, Expression, F, Lookup
from django.db.models.sql.compiler import SQLCompiler

from db.copy import json_rows

ModelT = TypeVar("ModelT", bound=models.Model)

# The PostgreSQL type each array is cast to, by Django field type. Character columns take
# `text`: a cast to `varchar(n)` would cut a value that is too long, where the assignment to
# the column refuses it, as any other write would.
_ARRAY_TYPES = {
    "AutoField": "integer",
    "BigAutoField": "bigint",
    "BigIntegerField": "bigint",
    "PositiveBigIntegerField": "bigint",
    "IntegerField": "integer",
    "PositiveIntegerField": "integer",
    "SmallIntegerField": "integer",
    "PositiveSmallIntegerField": "integer",
    "CharField": "text",
    "SlugField": "text",
    "TextField": "text",
    "DateTimeField": "timestamptz",
    "BooleanField": "boolean",
    "DecimalField": "numeric",
}


def update_rows(
    model: type[models.Model],
    fields: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    where_null: Sequence[str] = (),
) -> int:
    """Set `fields` (names, as `bulk_update` takes them) of `model`'s rows from `rows`, each
    `(pk, value, ...)` with the values as the model's attributes hold them (a foreign key as
    the id; None is NULL); how many rows changed. Only rows whose `where_null` fields are
    still NULL are changed: a conditional update (`filter(end__isnull=True).update(...)`)."""
    ordered = sorted(rows, key=lambda row: row[0])
    if not ordered:
        return 0
    connection = connections[DEFAULT_DB_ALIAS]
    quote = connection.ops.quote_name
    meta = model._meta
    assert meta.pk is not None
    targets = [meta.pk, *(_field(model, name) for name in fields)]
    names = [quote(field.column) for field in targets]
    # `v` names the incoming columns after the table's, quoted (`t.x = v.x`), and numbers the
    # rows from 1 (`v.ordinality`) for the JSON documents.
    arrays: list[list[Any]] = []
    casts: list[str] = []
    columns: list[str] = []
    documents: list[str] = []
    assignments: list[str] = []
    for index, (field, name) in enumerate(zip(targets, names, strict=True)):
        values = [row[index] for row in ordered]
        if isinstance(field, models.JSONField):
            # A row's None is SQL NULL, as the column's own writes make it.
            documents.append(json.dumps(values, cls=field.encoder))
            assignments.append(
                f"{name} = NULLIF((%s::jsonb) -> (v.ordinality - 1)::integer, 'null'::jsonb)"
            )
            continue
        arrays.append([field.get_db_prep_save(value, connection) for value in values])
        casts.append(f"%s::{_array_type(field)}[]")
        columns.append(name)
        if index:
            assignments.append(f"{name} = v.{name}")
    conditions = "".join(
        f" AND t.{quote(_field(model, name).column)} IS NULL" for name in where_null
    )
    sql = (
        f"UPDATE {quote(meta.db_table)} AS t SET {', '.join(assignments)}"
        f" FROM unnest({', '.join(casts)}) WITH ORDINALITY"
        f" AS v({', '.join(columns)}, ordinality)"
        f" WHERE t.{names[0]} = v.{names[0]}{conditions}"
    )
    with connection.cursor() as cursor:
        # The parameters in the order the statement names them: the documents in SET first.
        cursor.execute(sql, [*documents, *arrays])
        return cursor.rowcount


def update_instances(
    model: type[ModelT], instances: Sequence[ModelT], fields: Sequence[str]
) -> int:
    """`update_rows` from saved instances of `model`: write their `fields` as they hold them."""
    attnames = [_field(model, name).attname for name in fields]
    return update_rows(
        model,
        fields,
        [(instance.pk, *(getattr(instance, name) for name in attnames)) for instance in instances],
    )


class AnyOf(Lookup):
    """A filter on many values of one column, `Device.objects.filter(AnyOf("name", names),
    cluster=cluster)`: `column = ANY(ARRAY(...))` of one JSON parameter (`db.copy.json_rows`),
    the values' array, which PostgreSQL expands once and matches through the column's index.

    Django's `name__in=names` writes one placeholder per value and prepares each on its own;
    psycopg then splices each into the statement (it binds client-side, as Django has it),
    too long a statement for its cache of parsed queries: ~2 ms of CPU for 400 uids. An array
    parameter still quotes each element in Python (~0.6 ms); one JSON document, ~0.1 ms. The
    values are what JSON writes as the column's values (ints, strings); none matches
    nothing, as `__in=[]` does (but the query is sent)."""

    lookup_name = "any_of"
    prepare_rhs = False

    def __init__(self, field: str, values: Iterable[Any]) -> None:
        super().__init__(F(field), [[value] for value in values])

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> Any:
        column, params = self.process_lhs(compiler, connection)
        values = json_rows(_array_type(self.lhs.output_field))
        # Written by orjson (`json.dumps` took ~0.1 s for an import's 100,000 names).
        return f"{column} = ANY(ARRAY({values}))", [*params, json_text(self.rhs)]


class NoneOf(AnyOf):
    """The rows whose column holds none of many values, `Claim.objects.filter(NoneOf("uid",
    present))`: `NOT (column IN (SELECT ...))` of one JSON parameter, which PostgreSQL answers
    with a hash of the values. `exclude(AnyOf(...))` (`NOT (column = ANY(array))`) compared
    each row with every value: a snapshot of 30,000 claims took ~10 s to find those missing.
    For columns that hold no NULL (as `NOT IN` treats NULL, no row is returned for one)."""

    lookup_name = "none_of"

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> Any:
        column, params = self.process_lhs(compiler, connection)
        values = json_rows(_array_type(self.lhs.output_field))
        return f"NOT ({column} IN ({values}))", [*params, json_text(self.rhs)]


class AnyRowOf(Expression):
    """A filter on many tuples of columns, `Device.objects.filter(AnyRowOf(("driver", "pool"),
    pools), cluster=cluster)`: `(driver, pool) IN (SELECT ...)` of one JSON parameter (the
    tuples' array, `db.copy.json_rows`), the rows that hold one of the tuples exactly.

    `AnyOf` per column picks a superset (every driver with every pool name), and its `= ANY`
    compares each row it reads with every element of the array: with the 500 pools of a
    recount, each of a 100,000-device cluster's rows was compared 500 times per statement, a
    sync's batches over a growing table. PostgreSQL answers `IN (SELECT ...)` by looking each
    tuple up in an index of the columns, or with a hash of the tuples. No tuple matches nothing
    (the query is still sent)."""

    conditional = True
    output_field = BooleanField()

    def __init__(self, fields: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        super().__init__()
        self.fields: list[Any] = [F(name) for name in fields]
        self.rows = [list(row) for row in rows]

    def get_source_expressions(self) -> list[Any]:
        return list(self.fields)

    def set_source_expressions(self, exprs: Sequence[Any]) -> None:
        self.fields = list(exprs)

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper) -> Any:
        columns: list[str] = []
        params: list[Any] = []
        for expression in self.fields:
            sql, column_params = compiler.compile(expression)
            columns.append(sql)
            params.extend(column_params)
        values = json_rows(*(_array_type(expression.output_field) for expression in self.fields))
        return f"({', '.join(columns)}) IN ({values})", [*params, json_text(self.rows)]


def json_text(value: Any, *, sort_keys: bool = False) -> str:
    """`value` as JSON text; orjson where it can write it (not integers over 64 bits), else
    the standard library's encoder."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else None).decode()
    except TypeError:
        return json.dumps(value, sort_keys=sort_keys)


def _field(model: type[models.Model], name: str) -> models.Field[Any, Any]:
    field = model._meta.get_field(name)
    assert isinstance(field, models.Field)
    return field


def _array_type(field: models.Field[Any, Any]) -> str:
    """The PostgreSQL type of `field`'s values in an array; a foreign key's is its target's."""
    target = field.target_field if isinstance(field, models.ForeignKey) else field
    internal = target.get_internal_type()
    if internal not in _ARRAY_TYPES:
        raise TypeError(
            f"update_rows cannot write {field.model.__name__}.{field.name} ({internal})"
        )
    return _ARRAY_TYPES[internal]
