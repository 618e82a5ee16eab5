"""The database router for a read replica (on with DATABASE_REPLICA_URL; see config/readonly.py).

Reads go to the `replica` alias only while `config.readonly` marks the request read-only and no
transaction is open on the primary: what a transaction reads is what it then writes against,
so it must be the primary's current rows. Every write, and every read outside a marked request
(tasks, commands, webhooks, the admin), uses the primary. Migrations run on the primary only;
the replica gets them through replication.
"""

from __future__ import annotations

from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Model

from config.readonly import replica_reads_allowed

REPLICA = "replica"


class ReplicaRouter:
    """Marked reads outside transactions to the replica; everything else to the primary."""

    def db_for_read(self, model: type[Model], **hints: Any) -> str:
        if replica_reads_allowed() and not connections[DEFAULT_DB_ALIAS].in_atomic_block:
            return REPLICA
        return DEFAULT_DB_ALIAS

    def db_for_write(self, model: type[Model], **hints: Any) -> str:
        return DEFAULT_DB_ALIAS

    def allow_relation(self, obj1: Model, obj2: Model, **hints: Any) -> bool | None:
        # The replica holds the primary's rows: an object read from one relates to the other's.
        if {obj1._state.db, obj2._state.db} <= {DEFAULT_DB_ALIAS, REPLICA}:
            return True
        return None

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool:
        return db == DEFAULT_DB_ALIAS
