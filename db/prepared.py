"""Statements prepared on the server once per connection, for hot paths (the webhook's)."""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections

# Cursors kept per connection, one per statement (the webhook has a handful; past this many,
# from statements made on the fly, they are all let go and made again as needed).
MAX_CURSORS = 64


def fetch_prepared(sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """Run one statement and fetch its rows.

    It runs as a prepared statement of the connection (server-side binding, `prepare=True`):
    planned once per connection instead of once per call, and without the ORM's cursor
    wrapper. Errors are Django's `DatabaseError`s, as from any other query. Set
    `DATABASE_PREPARED_STATEMENTS=false` behind a pooler that cannot keep them (PgBouncer in
    transaction mode before 1.21): it then runs through a Django cursor.
    """
    # The connection wrapper itself, looked up once: each attribute read through Django's
    # `connection` proxy is a thread-local lookup.
    db = connections[DEFAULT_DB_ALIAS]
    if not settings.DATABASE_PREPARED_STATEMENTS:
        with db.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())
    db.ensure_connection()
    with db.wrap_database_errors:
        # One server-side-binding cursor per statement and psycopg connection, kept on
        # Django's wrapper and replaced when Django reconnects (its own cursors bind
        # client-side and cannot prepare; making one each time costs more than the
        # statement). Per statement: a cursor run again with the very query it ran last
        # keeps its adapters (the loaders of its columns), which it makes anew for any
        # other; the webhook's statements come from caches, the same string each time.
        raw = db.connection
        cursors: dict[str, Any] | None = getattr(db, "_tally_prepared_cursors", None)
        if cursors is None or getattr(db, "_tally_prepared_for", None) is not raw:
            cursors = {}
            db._tally_prepared_cursors = cursors  # type: ignore[attr-defined]
            db._tally_prepared_for = raw  # type: ignore[attr-defined]
        prepared: Any = cursors.get(sql)
        if prepared is None or prepared.closed:
            if len(cursors) >= MAX_CURSORS:
                cursors.clear()
            prepared = cursors[sql] = psycopg.Cursor(raw)
        prepared.execute(sql, params, prepare=True)
        rows: list[tuple[Any, ...]] = prepared.fetchall()
        return rows
