"""The sync's lookups of many keys (issue 22): one JSON parameter instead of a placeholder per
value (`db.bulk.AnyOf`), and the `claims_changed` receivers reading only what a batch needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from db.bulk import AnyOf
from inventory import services
from inventory.models import Allocation, Cluster, ResourceClaim
from metering import dirty
from metering.models import DirtyHour
from quota.services import sync_reservations

pytestmark = pytest.mark.django_db

AT = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


def claims(cluster: Cluster, count: int, *, namespace: str = "lab") -> list[ResourceClaim]:
    return ResourceClaim.objects.bulk_create(
        ResourceClaim(
            cluster=cluster,
            namespace=namespace,
            name=f"claim-{index}",
            uid=f"uid-{index}",
            api_version="resource.k8s.io/v1",
            spec={"devices": {"requests": []}},
            first_seen=AT,
        )
        for index in range(count)
    )


def allocations(stored: list[ResourceClaim]) -> list[Allocation]:
    return Allocation.objects.bulk_create(
        Allocation(
            cluster=claim.cluster,
            claim=claim,
            request="gpu",
            driver="gpu.nvidia.com",
            pool="node-a",
            device_name=f"gpu-{index}",
            start=AT + timedelta(hours=index % 3),
        )
        for index, claim in enumerate(stored)
    )


def test_any_of_matches_what_in_matches_by_text_and_by_id() -> None:
    cluster = services.get_cluster("lab")
    stored = claims(cluster, 12)
    uids = ["uid-1", "uid-5", "uid-5", "uid-11", "missing", 'quote"d']
    ids = [stored[2].pk, stored[7].pk, 10**12]
    by_uid = ResourceClaim.objects.filter(AnyOf("uid", uids), cluster=cluster)
    assert sorted(by_uid.values_list("uid", flat=True)) == sorted(
        ResourceClaim.objects.filter(uid__in=uids).values_list("uid", flat=True)
    )
    assert set(ResourceClaim.objects.filter(AnyOf("pk", ids))) == {stored[2], stored[7]}
    held = allocations(stored)
    assert set(Allocation.objects.filter(AnyOf("claim_id", ids))) == {held[2], held[7]}
    assert set(Allocation.objects.filter(AnyOf("claim", ids))) == {held[2], held[7]}
    assert not ResourceClaim.objects.filter(AnyOf("uid", [])).exists()
    # Negated, as a snapshot's "missing" objects are found: every other row.
    assert ResourceClaim.objects.exclude(AnyOf("uid", uids)).count() == 12 - 3
    assert ResourceClaim.objects.exclude(AnyOf("uid", [])).count() == 12


def test_any_of_is_one_statement_whatever_the_number_of_values() -> None:
    """The statement's text does not grow with the values: one parameter, which the driver
    quotes once, and a statement the driver's cache of parsed queries keeps."""
    few = ResourceClaim.objects.filter(AnyOf("uid", ["a", "b"])).query.sql_with_params()
    many = ResourceClaim.objects.filter(
        AnyOf("uid", [f"uid-{n}" for n in range(400)])
    ).query.sql_with_params()
    assert few[0] == many[0]
    assert len(few[1]) == len(many[1]) == 1


def test_claims_of_no_team_are_not_read_whole_by_the_reservations() -> None:
    """A batch's claims that no team's namespace holds and no reservation names are skipped
    from their names: their specs and owners are not read."""
    cluster = services.get_cluster("lab")
    stored = claims(cluster, 50)
    with CaptureQueriesContext(connection) as queries:
        sync_reservations(cluster=cluster, claim_ids=[claim.pk for claim in stored], at=AT)
    statements = [query["sql"] for query in queries]
    assert not any('"spec"' in sql for sql in statements)
    assert len(statements) <= 7  # names, savepoint, usage lock, owners, reservations, release


def test_filled_in_allocations_are_found_in_one_query_and_marked_whole() -> None:
    """Of the allocations sent as unfilled, only those whose (username, job) changed since
    mark all their hours; the others are compared in the database, not read back."""
    cluster = services.get_cluster("lab")
    held = allocations(claims(cluster, 30))
    unfilled = {allocation.pk: ("", "") for allocation in held}
    Allocation.objects.filter(pk=held[4].pk).update(username="alice")  # index 4: from 10:00
    now = AT + timedelta(hours=5, minutes=30)
    with CaptureQueriesContext(connection) as queries:
        dirty.mark_changes_dirty(at=now, spans=[], unfilled=unfilled)
    assert len(queries) == 2  # the comparison, the marks
    assert sorted(DirtyHour.objects.values_list("hour", flat=True)) == [
        AT + timedelta(hours=hour) for hour in range(1, 6)
    ]
