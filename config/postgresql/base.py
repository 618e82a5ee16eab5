"""Django's PostgreSQL backend (psycopg 3), except that a connect timeout of one second is one
second.

The admission webhook must answer within two seconds when the database cannot be reached,
and the API server gives up after three. psycopg follows libpq and raises any
`connect_timeout` below two seconds to two; with the request's own time on top, a server that
accepts connections and never answers (a hung host, a full backlog) made the webhook answer
just after two seconds. Here the timeout given is the timeout used.

`Connection._connect_gen` is psycopg's own step that `connect()` drives with the timeout it
worked out; it is not public API, so psycopg is pinned, and
`tests/quota/test_unreachable_database.py` fails if the bound stops holding.
"""

from __future__ import annotations

import types
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from psycopg.conninfo import conninfo_to_dict


class _Connection(psycopg.Connection[Any]):
    @classmethod
    def _connect_gen(cls, conninfo: str = "", *, timeout: float = 0.0) -> Any:
        asked = conninfo_to_dict(conninfo).get("connect_timeout")
        if asked is not None and 0 < float(asked) < timeout:
            timeout = float(asked)
        return super()._connect_gen(conninfo, timeout=timeout)


class DatabaseWrapper(base.DatabaseWrapper):
    # The psycopg module as Django's backend uses it (errors, types, adapters), with
    # connections made by `_Connection`.
    Database = types.SimpleNamespace(**{**vars(psycopg), "connect": _Connection.connect})
