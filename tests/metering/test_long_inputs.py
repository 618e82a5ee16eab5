"""Text from the cluster at its longest reaches every table whole, and one row the database
refuses never stops the rollup of the others (issue 33, finding 4: a service account's
username of 339 characters in `tally.dev/created-by` made every rollup fail with DataError, so
no team's statements refreshed)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from inventory.models import Allocation
from metering import rollup
from metering.models import UsageHour
from teams.models import Team
from tests.factories import AllocationFactory, DeviceFactory

pytestmark = pytest.mark.django_db

T10 = datetime(2026, 10, 15, 10, 0, tzinfo=UTC)
# A service account's username at its longest: namespace 63, name 253 (Kubernetes' limits).
LONGEST_USERNAME = f"system:serviceaccount:{'n' * 63}:{'s' * 253}"
# An owner reference's kind and name: the API server checks neither's length.
LONG_JOB = f"TrainingRun/{'j' * 500}"


def _held(team: Team, *, claim_name: str = "", **fields: str) -> Allocation:
    allocation = AllocationFactory.create(
        device=DeviceFactory.create(),
        start=T10 - timedelta(days=1),
        team=team,
        claim__namespace=team.slug,  # each team's claims in a namespace it owns
        **fields,
    )
    if claim_name:
        allocation.claim.name = claim_name
        allocation.claim.save(update_fields=["name"])
    return allocation


def _rows() -> dict[int, UsageHour]:
    return {row.allocation_id: row for row in UsageHour.objects.filter(hour=T10)}


def test_the_longest_username_and_an_unbounded_job_are_billed_whole() -> None:
    assert len(LONGEST_USERNAME) == 339
    vision = Team.objects.create(slug="vision", name="Vision")
    nlp = Team.objects.create(slug="nlp", name="NLP")
    long_named = _held(vision, username=LONGEST_USERNAME, job=LONG_JOB)
    other = _held(nlp, username="ana", job="Job/train")
    rollup.rollup_hours(hours=[T10], now=T10 + timedelta(hours=2))
    rows = _rows()
    assert set(rows) == {long_named.pk, other.pk}
    assert (rows[long_named.pk].username, rows[long_named.pk].job) == (LONGEST_USERNAME, LONG_JOB)
    assert rows[other.pk].allocated_gpu_ms == 3_600_000


@pytest.mark.parametrize("partial", [False, True], ids=["whole hour", "part of the hour"])
def test_a_row_the_database_refuses_leaves_the_others_rolled_up(
    caplog: pytest.LogCaptureFixture, partial: bool
) -> None:
    """Whatever a database refuses of one allocation's rows (here a check added for the test,
    standing in for any value a column cannot hold), the other allocations' rows of the same
    run are written, and the refused allocation is named in an error."""
    team = Team.objects.create(slug="vision", name="Vision")
    start = {"start": T10 + timedelta(minutes=30)} if partial else {}
    poisoned = _held(team, claim_name="poison")
    if partial:
        Allocation.objects.filter(pk=poisoned.pk).update(**start)
    healthy = [_held(team) for _ in range(2)]
    with connection.cursor() as cursor:
        cursor.execute(
            "ALTER TABLE billing_usagehour ADD CONSTRAINT test_refused "
            "CHECK (claim_name <> 'poison')"
        )
    with caplog.at_level(logging.ERROR, logger="metering.rollup"):
        written = rollup.rollup_hours(hours=[T10], now=T10 + timedelta(hours=2))
    assert set(_rows()) == {allocation.pk for allocation in healthy}
    assert written == 2
    assert f"allocation {poisoned.pk}: " in caplog.text
