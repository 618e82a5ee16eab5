"""A ledger that is always true (issue 16): closing a period serializes with everything that
writes its statements, whatever the entry point; who is charged for an allocation is fixed
when it starts, whatever happens to its namespace and claim afterwards.

The concurrency tests run real threads on their own PostgreSQL connections.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import partial
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from billing import services, tasks
from billing.models import LineKind, Period, RateCard, Statement, StatementLine
from billing.periods import PricingError
from billing.pricing import period_for, refresh_statements
from inventory import services as inventory_services
from inventory.models import Allocation, Cluster, Device, ResourceClaim
from metering import rollup
from metering.hours import MS_PER_HOUR, hours_between
from metering.models import UsageHour
from quota.models import Reservation
from teams.models import AuditEntry, Team, TeamNamespace
from teams.ownership import assign_namespace
from teams.selectors import FINANCE_GROUP
from tests.factories import AllocationFactory, DeviceFactory, owner_of
from tests.quota.fixtures import claim, decide, gpu_request, make_team

H100 = "NVIDIA H100 80GB HBM3"


# --- Closing a period races with adjustments (finding 4) --------------------------------------


def month(year: int, number: int) -> datetime:
    return datetime(year, number, 1, tzinfo=UTC)


def seed_billing(teams: list[Team]) -> list[Device]:
    """A rate card, a GPU per team, and a closed period (Dec 2024) that late data reached
    after its close, so every refresh of a later period writes late-data adjustment lines."""
    RateCard.objects.create(
        product_name=H100,
        currency="USD",
        valid_from=date(2024, 1, 1),
        per_gpu_hour=Decimal("2.5000"),
        idle_factor=Decimal("0.5000"),
    )
    gpus = [DeviceFactory.create() for _ in teams]
    earlier = month(2024, 12)
    hold(gpus[0], teams[0], earlier, hours=3)
    services.bill_period(period_start=earlier, now=month(2025, 1), close=True, actor="finance")
    hold(gpus[0], teams[0], earlier + timedelta(hours=5), hours=2)  # seen after the close
    return gpus


def hold(gpu: Device, team: Team, start: datetime, *, hours: int) -> None:
    """`gpu` held by a claim of `team` for `hours` from `start`, rolled up."""
    TeamNamespace.objects.get_or_create(team=team, namespace=team.slug)
    AllocationFactory.create(
        device=gpu,
        claim__namespace=team.slug,
        start=start,
        end=start + timedelta(hours=hours),
        team=team,
    )
    end = start + timedelta(hours=hours)
    rollup.rollup_hours(hours=hours_between(start, end), now=end)


def lines_of(period: Period) -> dict[int, tuple[Any, ...]]:
    return {
        line.pk: (line.statement_id, line.kind, line.amount, line.corrects_period_id, line.reason)
        for line in StatementLine.objects.filter(statement__period=period)
    }


def totals_of(period: Period) -> dict[int, Decimal]:
    return dict(Statement.objects.filter(period=period).values_list("pk", "total"))


@dataclass
class Round:
    """What the threads of one round saw."""

    added: list[int] = field(default_factory=list)  # adjustment lines created
    refused: list[str] = field(default_factory=list)  # why an adjustment was refused
    refresh_refused: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)


def in_thread(run: Round, work: Callable[[], None]) -> threading.Thread:
    def target() -> None:
        try:
            work()
        except BaseException as exc:  # reported by the test
            run.errors.append(exc)
        finally:
            connection.close()

    return threading.Thread(target=target)


def close_via(entry: int, period: Period, finance: User) -> None:
    """Close `period` through one of its four entry points."""
    if entry == 0:
        services.close_period(period=period, actor="finance")
    elif entry == 1:
        client = APIClient()
        client.force_authenticate(finance)
        response = client.post(f"/api/v1/periods/{period.pk}/close/")
        assert response.status_code == 200, response.content
    elif entry == 2:
        call_command("run_billing", period=period.label, close=True, stdout=StringIO())
    else:
        beat_now = period.end + timedelta(days=2, hours=1)  # the 3rd of the next month
        assert tasks.close_previous_period(now=beat_now.isoformat()) == period.label


def add_via(entry: int, *, team: Team, period: Period, finance: User, amount: Decimal) -> int:
    """Add an adjustment through the service or the API; the line's id (PricingError when
    refused)."""
    if entry == 0:
        return services.add_adjustment(
            team=team, period=period, currency="USD", amount=amount, reason="r", actor="fin"
        ).pk
    client = APIClient()
    client.force_authenticate(finance)
    body = {"team": team.slug, "period": period.pk, "currency": "USD", "amount": str(amount)}
    response = client.post("/api/v1/adjustments/", {**body, "reason": "r"}, format="json")
    if response.status_code == 400:
        raise PricingError(response.json()["detail"])
    assert response.status_code == 201, response.content
    line_id: int = response.json()["id"]
    return line_id


@pytest.mark.django_db(transaction=True)
def test_closing_serializes_with_adjustments_and_refreshes_from_every_entry_point() -> None:
    teams = [Team.objects.create(slug=f"team-{n}", name=f"Team {n}") for n in range(3)]
    finance = User.objects.create(username="fin")
    finance.groups.add(Group.objects.create(name=FINANCE_GROUP))
    gpus = seed_billing(teams)
    for round_number in range(12):
        # One closer (by each of the four entry points in turn), three writers adding
        # adjustments (by the service and the API), one refreshing the statements (as beat
        # and `run_billing` do), all from the moment the period can close.
        start = month(2025, round_number + 1)
        for gpu, team in zip(gpus, teams, strict=True):
            hold(gpu, team, start, hours=round_number % 7 + 1)
        check_round(
            start=start, entry=round_number % 4, teams=teams, finance=finance, seed=round_number
        )


def check_round(
    *, start: datetime, entry: int, teams: list[Team], finance: User, seed: int
) -> None:
    stale = period_for(start)  # read before the close, as every writer below holds it
    refresh_statements(period=stale)
    run = Round()
    go, closed, compared = threading.Barrier(5), threading.Event(), threading.Event()

    def closer() -> None:
        go.wait()
        time.sleep(random.Random(seed).uniform(0.01, 0.05))  # let the writers in first
        close_via(entry, stale, finance)
        closed.set()

    def adder(pick: random.Random) -> None:
        go.wait()
        while True:
            amount = Decimal(pick.randint(-5000, 5000) or 1) / 100
            try:
                run.added.append(
                    add_via(
                        pick.randint(0, 1),
                        team=pick.choice(teams),
                        period=stale,
                        finance=finance,
                        amount=amount,
                    )
                )
            except PricingError as exc:
                run.refused.append(str(exc))
                return

    def refresher() -> None:
        go.wait()
        while not closed.is_set():
            try:
                services.bill_period(period_start=start, now=stale.end + timedelta(days=1))
                refresh_statements(period=stale)
            except PricingError as exc:
                run.refresh_refused.append(str(exc))
        assert compared.wait(30)
        try:
            refresh_statements(period=stale)  # once more, surely after the close
        except PricingError as exc:
            run.refresh_refused.append(str(exc))

    threads = [
        in_thread(run, closer),
        *(in_thread(run, partial(adder, random.Random(seed * 10 + n))) for n in range(3)),
        in_thread(run, refresher),
    ]
    for thread in threads:
        thread.start()
    assert closed.wait(60), run.errors
    frozen_lines, frozen_totals = lines_of(stale), totals_of(stale)
    compared.set()
    for thread in threads:
        thread.join(60)
    assert run.errors == []

    period = Period.objects.get(pk=stale.pk)
    assert period.closed_at is not None
    # Nothing wrote the period's statements after it closed.
    assert lines_of(period) == frozen_lines
    assert totals_of(period) == frozen_totals
    # Each adjustment landed before the close, in the closed statement, or was refused.
    assert len(run.refused) == 3
    assert all("is closed" in reason for reason in run.refused), run.refused
    assert run.refresh_refused, "the refresh after the close was not refused"
    assert all("closed" in reason for reason in run.refresh_refused), run.refresh_refused
    finance_lines = StatementLine.objects.filter(
        statement__period=period, kind=LineKind.ADJUSTMENT, corrects_period__isnull=True
    )
    assert sorted(finance_lines.values_list("pk", flat=True)) == sorted(run.added)
    created_at = {
        entry.after["id"]: entry.at
        for entry in AuditEntry.objects.filter(object_type="statement line", action="create")
        if entry.after is not None
    }
    assert all(created_at[line_id] < period.closed_at for line_id in run.added)
    # A closed statement's total is the sum of its lines.
    for statement in Statement.objects.filter(period=period):
        lines = sum((line.amount for line in statement.lines.all()), Decimal(0))
        assert statement.total == lines, statement


@pytest.mark.django_db
def test_a_refresh_that_read_the_period_before_its_close_writes_nothing() -> None:
    team = Team.objects.create(slug="vision", name="Vision")
    (gpu,) = seed_billing([team])
    stale = period_for(month(2025, 3))
    hold(gpu, team, month(2025, 3), hours=4)
    refresh_statements(period=stale)
    services.close_period(period=Period.objects.get(pk=stale.pk), actor="finance")
    before = lines_of(stale), totals_of(stale)
    with pytest.raises(PricingError, match="is closed"):
        refresh_statements(period=stale)
    with pytest.raises(PricingError, match="is closed"):
        services.add_adjustment(
            team=team, period=stale, currency="USD", amount=Decimal(1), reason="r", actor="f"
        )
    assert (lines_of(stale), totals_of(stale)) == before


# --- Attribution is fixed when an allocation starts (finding 7) -------------------------------

WEEK_START = datetime(2026, 11, 2, tzinfo=UTC)  # a Monday
GPU_UUID = "GPU-h100-a-0"


def claim_object(
    name: str,
    *,
    uid: str,
    device: str = "gpu-0",
    namespace: str = "research",
    owned: bool = True,
) -> dict[str, Any]:
    """A claim as the API server shows it once the scheduler allocated `device`; `owned`: made
    for a Job (its controller owner)."""
    body = claim(name, [gpu_request()], namespace=namespace)
    body["metadata"]["uid"] = uid
    if owned:
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": f"{name}-job", "controller": True}
        ]
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "h100-a", "device": device}
    body["status"] = {"allocation": {"devices": {"results": [result]}}}
    return body


def sync(obj: dict[str, Any], at: datetime, event: str = "ADDED") -> None:
    report = inventory_services.apply_watch_event(
        cluster=Cluster.objects.get(name="default"), event_type=event, obj=obj, at=at
    )
    assert report.errors == []


def usage_rows() -> list[tuple[Any, ...]]:
    return list(
        UsageHour.objects.order_by("hour", "allocation_id").values_list(
            "hour", "allocation_id", "team__slug", "job", "username", "allocated_gpu_ms"
        )
    )


def charged(allocation: Allocation) -> tuple[str | None, str, str]:
    allocation.refresh_from_db()
    team = owner_of(allocation)
    return (team.slug if team else None, allocation.job, allocation.username)


@pytest.mark.django_db
@pytest.mark.usefixtures("fleet")
def test_a_week_held_then_released_keeps_its_user_and_job_through_any_rerun(
    client: Client,
) -> None:
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 8}])
    # Alice's claim passes the webhook, is allocated, held a week (168 GPU-hours), released.
    admitted = claim_object("train-gpu", uid="uid-alice")
    assert decide(client, admitted, username="alice")["allowed"]
    sync(admitted, WEEK_START)
    allocation = Allocation.objects.get()
    assert charged(allocation) == ("research", "Job/train-gpu-job", "alice")
    week = hours_between(WEEK_START, WEEK_START + timedelta(days=7))
    rollup.rollup_hours(hours=week, now=WEEK_START + timedelta(days=8))
    rows = usage_rows()
    assert len(rows) == 168
    assert {row[2:5] for row in rows} == {("research", "Job/train-gpu-job", "alice")}
    assert sum(row[5] for row in rows) == 168 * MS_PER_HOUR
    sync(admitted, WEEK_START + timedelta(days=7), "DELETED")
    assert Allocation.objects.get().end == WEEK_START + timedelta(days=7)

    # Rolled up again after the release, and again after the claim's row says something
    # else (another claim of the same name recorded over it, its owners resolved anew):
    # every GPU-hour is still Alice's, for her job.
    rollup.rollup_hours(hours=week, now=WEEK_START + timedelta(days=9))
    assert usage_rows() == rows
    ResourceClaim.objects.update(created_by="bob", admitted_job="Job/bob", job="")
    rollup.rollup_hours(hours=week, now=WEEK_START + timedelta(days=10))
    assert usage_rows() == rows
    assert charged(allocation) == ("research", "Job/train-gpu-job", "alice")


@pytest.mark.django_db
@pytest.mark.usefixtures("fleet")
def test_the_webhooks_record_fills_the_user_and_an_empty_job_once_never_over(
    client: Client,
) -> None:
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 8}])
    # The webhook saw the claim made for a Job; the sync sees no owner (so no job of its own).
    assert decide(client, claim_object("train-gpu", uid="uid-1"), username="alice")["allowed"]
    sync(claim_object("train-gpu", uid="uid-1", owned=False), WEEK_START)
    # Written by the sync without them, filled by quota's handler in the same transaction.
    allocation = Allocation.objects.get()
    assert charged(allocation) == ("research", "Job/train-gpu-job", "alice")
    # A later record on the claim (whatever its cause) never rewrites who was charged.
    Reservation.objects.update(username="mallory", owner_kind="Job", owner_name="other")
    sync(claim_object("train-gpu", uid="uid-1", owned=False), WEEK_START + timedelta(hours=1))
    assert ResourceClaim.objects.get().created_by == "mallory"
    assert charged(allocation) == ("research", "Job/train-gpu-job", "alice")


@pytest.mark.django_db
@pytest.mark.usefixtures("fleet")
def test_a_namespace_moved_to_another_team_charges_each_hour_to_its_owner_then() -> None:
    make_team([])
    sync(claim_object("before-gpu", uid="uid-before", device="gpu-0"), WEEK_START)
    rollup.rollup_hours(hours=[WEEK_START], now=WEEK_START + timedelta(hours=2))
    nlp = Team.objects.create(slug="nlp", name="NLP")
    # Moved during hour 1: from that hour on the namespace is nlp's, hour 0 stays research's.
    assign_namespace(
        namespace="research",
        team=nlp,
        actor="test",
        at=WEEK_START + timedelta(hours=1, minutes=20),
        open_since=None,
    )
    sync(
        claim_object("after-gpu", uid="uid-after", device="gpu-1"), WEEK_START + timedelta(hours=1)
    )
    hours = hours_between(WEEK_START, WEEK_START + timedelta(hours=3))
    rollup.rollup_hours(hours=hours, now=WEEK_START + timedelta(hours=4))
    teams = set(UsageHour.objects.values_list("claim_name", "hour", "team__slug"))
    assert teams == {
        ("before-gpu", WEEK_START, "research"),
        ("before-gpu", WEEK_START + timedelta(hours=1), "nlp"),
        ("before-gpu", WEEK_START + timedelta(hours=2), "nlp"),
        ("after-gpu", WEEK_START + timedelta(hours=1), "nlp"),
        ("after-gpu", WEEK_START + timedelta(hours=2), "nlp"),
    }
    # Released, and every rollup run again, twice: who is charged never changes.
    sync(claim_object("before-gpu", uid="uid-before"), WEEK_START + timedelta(hours=2), "DELETED")
    rollup.rollup_hours(hours=hours, now=WEEK_START + timedelta(hours=5))
    once = usage_rows()
    assert {(row[1], row[2]) for row in once} == {
        (Allocation.objects.get(claim__name=name).pk, team)
        for name, team in (("before-gpu", "research"), ("before-gpu", "nlp"), ("after-gpu", "nlp"))
    }
    assert len(once) == 2 + 2  # before-gpu: hours 0 and 1; after-gpu: hours 1 and 2
    for _ in range(2):
        rollup.rollup_hours(hours=hours, now=WEEK_START + timedelta(hours=6))
        assert usage_rows() == once
