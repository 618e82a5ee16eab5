"""The agents' bearer tokens: stored and looked up by their SHA-256 only."""

from __future__ import annotations

import hashlib

from django.db import DEFAULT_DB_ALIAS, connection

from inventory.models import Cluster
from metering.models import AgentToken

# Tokens


def token_sha256(token: str) -> str:
    """How an agent token is stored and looked up: its SHA-256, never the token."""
    return hashlib.sha256(token.encode()).hexdigest()


_TOKEN_FIELDS = [field.attname for field in AgentToken._meta.concrete_fields]
_CLUSTER_FIELDS = [field.attname for field in Cluster._meta.concrete_fields]
# What `AgentToken.objects.select_related("cluster").get(...)` reads, written once: every
# batch an agent posts looks its token up, and building the ORM's query cost several times
# what the database spends answering it.
_LOOKUP = (
    "SELECT "
    + ", ".join(
        [f"t.{connection.ops.quote_name(name)}" for name in _TOKEN_FIELDS]
        + [f"c.{connection.ops.quote_name(name)}" for name in _CLUSTER_FIELDS]
    )
    + f" FROM {AgentToken._meta.db_table} AS t JOIN {Cluster._meta.db_table} AS c"
    " ON c.id = t.cluster_id WHERE t.token_sha256 = %s AND t.revoked_at IS NULL"
)


def authenticate(token: str) -> AgentToken | None:
    """The unrevoked token `token` is, with its cluster, or None.

    The lookup is by the token's SHA-256, so how long it takes says nothing about the token.
    """
    if not token:
        return None
    with connection.cursor() as cursor:
        cursor.execute(_LOOKUP, [token_sha256(token)])
        row = cursor.fetchone()
    if row is None:
        return None
    split = len(_TOKEN_FIELDS)
    agent = AgentToken.from_db(DEFAULT_DB_ALIAS, _TOKEN_FIELDS, row[:split])
    agent.cluster = Cluster.from_db(DEFAULT_DB_ALIAS, _CLUSTER_FIELDS, row[split:])
    return agent
