"""Statements prepared on the server once per connection, for hot paths (the webhook's)."""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections


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
        # One server-side-binding cursor per psycopg connection, kept on Django's wrapper and
        # replaced when Django reconnects (its own cursors bind client-side and cannot
        # prepare; making one each time costs more than the statement).
        raw = db.connection
        prepared: Any = getattr(db, "_tally_prepared_cursor", None)
        if prepared is None or prepared.connection is not raw or prepared.closed:
            prepared = psycopg.Cursor(raw)
            db._tally_prepared_cursor = prepared  # type: ignore[attr-defined]
        prepared.execute(sql, params, prepare=True)
        rows: list[tuple[Any, ...]] = prepared.fetchall()
        return rows
