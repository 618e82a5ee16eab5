"""Migration 0006 names the cluster of the decisions made before it (issue 35): the cluster of
the reservation their admission made; a decision with no reservation (a denial) stays
unknown."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("quota", "0005_inputs_reservation_spec_digest")]
AFTER = [("quota", "0006_apivocab_decision_cluster")]
AT = datetime(2026, 11, 5, 9, tzinfo=UTC)


@pytest.mark.django_db(transaction=True)
def test_the_migration_takes_the_cluster_of_the_admissions_reservation() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old_apps = executor.loader.project_state(BEFORE).apps
    team = old_apps.get_model("teams", "Team").objects.create(slug="vision", name="Vision")
    old_apps.get_model("quota", "Reservation").objects.create(
        cluster="east", namespace="ns", name="admitted", team=team, admission_uid="uid-1",
        created_at=AT,
    )  # fmt: skip
    decisions = old_apps.get_model("quota", "AdmissionDecision").objects
    for uid, name, allowed in (("uid-1", "admitted", True), ("uid-2", "denied", False)):
        decisions.create(at=AT, uid=uid, namespace="ns", name=name, team=team, allowed=allowed)
    try:
        executor = MigrationExecutor(connection)
        executor.migrate(AFTER)
        new_apps = executor.loader.project_state(AFTER).apps
        found = dict(
            new_apps.get_model("quota", "AdmissionDecision").objects.values_list("name", "cluster")
        )
        assert found == {"admitted": "east", "denied": ""}
    finally:
        # Back to the latest schema for the tests after this one on this database.
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
