"""Migration 0011 gives each cluster synced before it its first sync: the earliest time
anything of it was stored (issue 33: allocations older than it are charged from it)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("inventory", "0010_versions_driver_scope")]
AFTER = [("inventory", "0011_clusters_identity_and_first_sync")]
T1 = datetime(2026, 10, 3, 8, tzinfo=UTC)
T2 = datetime(2026, 11, 5, 9, tzinfo=UTC)


@pytest.mark.django_db(transaction=True)
def test_the_migration_takes_the_earliest_row_stored_as_the_first_sync() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old_apps = executor.loader.project_state(BEFORE).apps
    clusters = old_apps.get_model("inventory", "Cluster").objects
    synced, empty = clusters.create(name="lab"), clusters.create(name="new")
    old_apps.get_model("inventory", "Node").objects.create(
        cluster=synced, name="node-a", first_seen=T2
    )
    old_apps.get_model("inventory", "ResourceClaim").objects.create(
        cluster=synced, uid="u-1", namespace="ns", name="c", first_seen=T1
    )
    try:
        executor = MigrationExecutor(connection)
        executor.migrate(AFTER)
        new_apps = executor.loader.project_state(AFTER).apps
        first = dict(
            new_apps.get_model("inventory", "Cluster").objects.values_list(
                "name", "first_synced_at"
            )
        )
        assert first == {"lab": T1, "new": None}
        assert synced.pk and empty.pk
    finally:
        # Back to the latest schema for the tests after this one on this database.
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
