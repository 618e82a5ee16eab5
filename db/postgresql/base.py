"""Django's PostgreSQL backend (psycopg 3), except that a connect timeout under two seconds is
honoured.

The admission webhook must answer within two seconds when the database cannot be reached,
and the API server gives up after three. psycopg follows libpq and raises any
`connect_timeout` below two seconds to two; with the request's own time on top, a server that
accepts connections and never answers (a hung host, a full backlog) made the webhook answer
just after two seconds.

Here such a connect runs psycopg's public `Connection.connect()` in a helper thread, and the
caller waits for it at most the timeout given: past it, the caller gets psycopg's
`OperationalError` at once, while the attempt runs on to psycopg's own timeout in the
background and a connection it makes after all is closed. Timeouts of two seconds or more
connect as psycopg does, in the caller's thread. `tests/quota/test_unreachable_database.py`
checks the bound with a server that accepts and never answers.
"""

from __future__ import annotations

import threading
import types
from concurrent.futures import Future
from typing import Any

import psycopg
from django.db.backends.postgresql import base

# libpq's floor (connectDBComplete), which psycopg follows (conninfo.timeout_from_conninfo).
LIBPQ_SHORTEST_TIMEOUT = 2.0

Connection = psycopg.Connection[Any]


def connect(conninfo: str = "", **kwargs: Any) -> Connection:
    """`psycopg.connect`, within `connect_timeout` seconds even when that is under two."""
    asked = kwargs.get("connect_timeout")
    timeout = float(asked) if asked is not None else 0.0
    if not 0 < timeout < LIBPQ_SHORTEST_TIMEOUT:
        return psycopg.Connection.connect(conninfo, **kwargs)
    attempt: Future[Connection] = Future()

    def run() -> None:
        try:
            attempt.set_result(psycopg.Connection.connect(conninfo, **kwargs))
        except BaseException as exc:
            attempt.set_exception(exc)

    threading.Thread(target=run, name="tally-db-connect", daemon=True).start()
    try:
        return attempt.result(timeout=timeout)
    except TimeoutError:
        attempt.add_done_callback(_close_if_connected)
        raise psycopg.OperationalError(
            f"connection timeout expired: no connection within {timeout:g} s"
        ) from None


def _close_if_connected(attempt: Future[Connection]) -> None:
    """A connection made after its caller stopped waiting is nobody's: closed."""
    if attempt.exception() is None:
        attempt.result().close()


class DatabaseWrapper(base.DatabaseWrapper):
    # The psycopg module as Django's backend uses it (errors, types, adapters), with
    # connections made by `connect`.
    Database = types.SimpleNamespace(**{**vars(psycopg), "connect": connect})
