"""Property: the sync marks only the hours a claim change touches, and never too few.

Claim events go through `inventory.services.apply_watch_event` (whose `claims_changed` signal
marks hours in `metering.dirty`), rollups through `metering.rollup.rollup_pending` as the beat
runs it (at least once an hour, and now and then in between, or not at all for hours while
the workers are down). After each step, the usage rows of every complete hour equal those of a
rollup of every hour from scratch (`metering.rollup.rollup_hours`) once beat has run: a narrowed
mark never leaves a stale hour, nor an outage a missed one. And before it has run, the team's
budget use (`billing.selectors.team_gpu_hours`) is what its allocations held: whichever hours
are rolled up, stale or missed, the figure the webhook enforces is the same.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import transaction
from django.test import TestCase
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from billing.pricing import period_holding
from billing.selectors import team_gpu_hours
from inventory import owners
from inventory import services as inventory_services
from inventory.models import Allocation, ResourceClaim, Unit
from inventory.signals import claims_changed
from metering import dirty, ingest, rollup
from metering.hours import HOUR, MS_PER_HOUR, epoch_ms, hour_start
from metering.ingest import SampleRow
from metering.models import DirtyHour, UsageHour
from quota.models import Reservation, ReservationState
from teams.models import Team, TeamNamespace
from tests.billing.test_chargeback import SLICE, T10

T0 = T10
EARLIEST = T0 - timedelta(hours=12)  # late-seen allocations start at most 8 hours back
DEVICES = ("gpu-0", "gpu-1-mig-3g40gb-0")
NAMES = ("a", "b", "c")
MINUTE = timedelta(minutes=1)
USAGE_FIELDS = [field.attname for field in UsageHour._meta.concrete_fields if field.attname != "id"]


def cluster() -> Any:
    return inventory_services.get_cluster("default")


def claim_object(
    name: str,
    uid: str,
    *,
    device: str | None,
    allocated_at: datetime | None,
    label: str = "",
    namespace: str = "vision",
) -> dict[str, Any]:
    """A claim of one device allocated at `allocated_at` (`device=None`: not allocated)."""
    status: dict[str, Any] = {}
    if device is not None and allocated_at is not None:
        status["allocation"] = {
            "allocationTimestamp": allocated_at.isoformat(),
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "gpu.nvidia.com",
                        "pool": "node-a",
                        "device": device,
                    }
                ]
            },
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "labels": {"revision": label} if label else {},
            "ownerReferences": [{"kind": "Job", "name": f"job-{name}", "controller": True}],
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": status,
    }


def apply(
    event_type: str, obj: dict[str, Any], at: datetime, jobs: dict[str, Any] | None = None
) -> None:
    report = inventory_services.apply_watch_event(
        cluster=cluster(), event_type=event_type, obj=obj, at=at, jobs=jobs
    )
    assert report.errors == []


def usage_rows(before: datetime) -> list[tuple[Any, ...]]:
    return sorted(UsageHour.objects.filter(hour__lt=before).values_list(*USAGE_FIELDS), key=repr)


def rows_from_scratch(now: datetime) -> list[tuple[Any, ...]]:
    """The complete hours' rows as a rollup of every hour from scratch makes them (rolled
    back: what is stored stays as the marks left it)."""
    end = hour_start(now)
    hours = [EARLIEST + index * HOUR for index in range((end - EARLIEST) // HOUR)]
    with transaction.atomic():
        UsageHour.objects.all().delete()
        rollup.rollup_hours(hours=hours, now=now)
        rows = usage_rows(end)
        transaction.set_rollback(True)
    return rows


def fleet() -> None:
    """The node's slice (an H100 and a MIG device), its namespace's team, and a sample every
    ten minutes of each device over the hours the machine can reach."""
    report = inventory_services.import_snapshot(
        cluster=cluster(), objects=[SLICE], at=EARLIEST - timedelta(hours=1)
    )
    assert report.errors == []
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace="vision")
    rows = [
        SampleRow(
            uuid, epoch_ms(EARLIEST + index * 10 * MINUTE), float(index * 7 % 101), None, None
        )
        for uuid in ("GPU-H", "MIG-A")
        for index in range(6 * 80)
    ]
    ingest.ingest(node="node-a", samples=rows, received_at=EARLIEST)


@dataclass
class Claim:
    uid: str
    device: str | None = None
    allocated_at: datetime | None = None
    label: str = ""
    job_owner: str = ""  # the workload the sync learnt owns the claim's Job ("" for none)


@settings(
    max_examples=15, stateful_step_count=18, deadline=None, suppress_health_check=list(HealthCheck)
)
class DirtyMarksMachine(RuleBasedStateMachine):
    """Claims allocated, released, allocated again, seen late, reattributed or touched in
    nothing, with the beat's rollups between; the clock only moves forward."""

    def __init__(self) -> None:
        super().__init__()
        self._transaction = transaction.atomic()
        self._transaction.__enter__()  # each example rolls back to the fleet
        self.now = T0
        self.claims: dict[str, Claim] = {}
        self.serial = itertools.count()
        rollup.rollup_pending(now=self.now, limit=10_000)

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._transaction.__exit__(None, None, None)

    def _send(self, name: str, event_type: str = "MODIFIED") -> None:
        held = self.claims[name]
        jobs = None
        if held.job_owner:
            jobs = {
                held.uid: owners.Resolution(
                    chain=(f"Job/job-{name}", held.job_owner), complete=True
                )
            }
        apply(
            event_type,
            claim_object(
                name, held.uid, device=held.device, allocated_at=held.allocated_at, label=held.label
            ),
            self.now,
            jobs,
        )

    # --- The claims -------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), device=st.sampled_from(DEVICES), late=st.integers(0, 480))
    def allocate(self, name: str, device: str, late: int) -> None:
        """A new claim, allocated now, or `late` minutes ago and seen only now."""
        if name in self.claims and self.claims[name].device is not None:
            return
        held = self.claims.get(name) or Claim(uid=f"uid-{name}-{next(self.serial)}")
        self.claims[name] = held
        held.device, held.allocated_at = device, self.now - late * MINUTE
        self._send(name, "ADDED")

    @precondition(lambda self: any(c.device for c in self.claims.values()))
    @rule(data=st.data(), deleted=st.booleans())
    def release(self, data: st.DataObject, deleted: bool) -> None:
        """A claim deallocated (status cleared) or deleted."""
        name = data.draw(st.sampled_from(sorted(n for n, c in self.claims.items() if c.device)))
        held = self.claims[name]
        held.device = held.allocated_at = None
        if deleted:
            self._send(name, "DELETED")
            del self.claims[name]
        else:
            self._send(name)

    @precondition(lambda self: any(c.device for c in self.claims.values()))
    @rule(data=st.data())
    def allocate_again(self, data: st.DataObject) -> None:
        """A claim's device changed: its allocation ends and another starts, now."""
        name = data.draw(st.sampled_from(sorted(n for n, c in self.claims.items() if c.device)))
        held = self.claims[name]
        held.device = next(device for device in DEVICES if device != held.device)
        held.allocated_at = self.now
        self._send(name)

    @precondition(lambda self: bool(self.claims))
    @rule(data=st.data())
    def reattribute(self, data: st.DataObject) -> None:
        """The sync learns who owns the claim's Job: its allocations are charged to it, over
        all their hours."""
        name = data.draw(st.sampled_from(sorted(self.claims)))
        self.claims[name].job_owner = f"CronJob/nightly-{next(self.serial)}"
        self._send(name)

    @precondition(lambda self: bool(self.claims))
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        """A change of nothing the usage rows read (a label, the resourceVersion)."""
        name = data.draw(st.sampled_from(sorted(self.claims)))
        self.claims[name].label = f"r{next(self.serial)}"
        self._send(name)

    # --- Time and the beat ------------------------------------------------------------------

    @rule(minutes=st.integers(1, 200))
    def advance(self, minutes: int) -> None:
        """Time passes; the beat rolls up at least once in each hour."""
        end = self.now + minutes * MINUTE
        beat = hour_start(self.now) + HOUR + MINUTE
        while beat < end:
            rollup.rollup_pending(now=beat, limit=10_000)
            beat += HOUR
        self.now = end

    @rule(minutes=st.integers(1, 300))
    def outage(self, minutes: int) -> None:
        """Time passes with no worker running: no rollup at all."""
        self.now += minutes * MINUTE

    @rule()
    def roll_up_now(self) -> None:
        rollup.rollup_pending(now=self.now, limit=10_000)

    @invariant()
    def complete_hours_are_as_from_scratch(self) -> None:
        self._budget_use_is_what_the_allocations_held()  # before beat's next run
        rollup.rollup_pending(now=self.now, limit=10_000)
        assert usage_rows(hour_start(self.now)) == rows_from_scratch(self.now)
        self._budget_use_is_what_the_allocations_held()

    def _budget_use_is_what_the_allocations_held(self) -> None:
        period = period_holding(self.now)
        team = Team.objects.get(slug="vision")
        held = Decimal(0)
        for start, end, share in (
            rollup.held_allocations(period.start, self.now)
            .filter(claim__namespace="vision", unit=Unit.GPU)  # vision's since always
            .values_list("start", "end", "gpu_share")
        ):
            since, until = max(start, period.start), min(end or self.now, self.now)
            if since < until:
                held += Decimal(epoch_ms(until) - epoch_ms(since)) * share
        used = team_gpu_hours(team=team, period=period, now=self.now) * MS_PER_HOUR
        # Rolled-up rows round each allocation-hour to the millisecond, half up (and the hours
        # are a quotient of 28 digits).
        assert abs(used - held) <= UsageHour.objects.count() + 1, (used, held)


MachineTestCase: Any = DirtyMarksMachine.TestCase


class TestDirtyMarks(MachineTestCase, TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        fleet()


del MachineTestCase  # collected as a test of its own otherwise, without the database


# --- The marks themselves ---------------------------------------------------------------------


def marked() -> list[datetime]:
    return sorted(DirtyHour.objects.values_list("hour", flat=True))


@pytest.mark.django_db
def test_each_change_marks_only_the_hours_it_touches() -> None:
    fleet()
    DirtyHour.objects.all().delete()
    now = T0 + timedelta(hours=5, minutes=30)
    # Seen late: allocated three hours before the sync saw it.
    apply("ADDED", claim_object("a", "uid-a", device="gpu-0", allocated_at=now - 3 * HOUR), now)
    assert marked() == [T0 + timedelta(hours=h) for h in (2, 3, 4, 5)]

    DirtyHour.objects.all().delete()
    later = now + timedelta(hours=2)
    touched = claim_object("a", "uid-a", device="gpu-0", allocated_at=now - 3 * HOUR, label="x")
    apply("MODIFIED", touched, later)
    assert marked() == []  # a label changes no usage row

    apply("MODIFIED", claim_object("a", "uid-a", device=None, allocated_at=None), later)
    assert marked() == [hour_start(later)]  # from the hour the allocation ended in

    DirtyHour.objects.all().delete()
    apply(
        "MODIFIED",
        claim_object("a", "uid-a", device=None, allocated_at=None),
        later + HOUR,
        jobs={"uid-a": owners.Resolution(chain=("Job/job-a", "CronJob/nightly"), complete=True)},
    )
    # Reattributed: every hour of the allocation, which ran from 02:30 to 07:30.
    assert marked() == [T0 + timedelta(hours=h) for h in range(2, 8)]
    assert set(Allocation.objects.values_list("job", flat=True)) == {"CronJob/nightly"}


@pytest.mark.django_db
def test_an_allocation_charged_late_by_quota_is_rolled_up_again_over_all_its_hours() -> None:
    # Quota's receiver fills in who the webhook saw create a claim on allocations the sync
    # wrote without one: here a claim of a namespace no team owned, then one owns it and its
    # reservation (by name, not yet tied to the claim) says who made it.
    fleet()
    start = T0 + HOUR
    apply(
        "ADDED",
        claim_object("a", "uid-a", device="gpu-0", allocated_at=start, namespace="lab"),
        start,
    )
    now = start + timedelta(hours=4)
    rollup.rollup_hours(hours=[start + index * HOUR for index in range(4)], now=now)
    DirtyHour.objects.all().delete()
    assert set(UsageHour.objects.values_list("username", flat=True)) == {""}

    team = Team.objects.get(slug="vision")
    TeamNamespace.objects.create(team=team, namespace="lab")
    Reservation.objects.create(
        cluster="default",
        namespace="lab",
        name="a",
        team=team,
        state=ReservationState.RESERVED,
        username="alice",
        created_at=start - MINUTE,
    )
    touched = claim_object(
        "a", "uid-a", device="gpu-0", allocated_at=start, namespace="lab", label="x"
    )
    apply("MODIFIED", touched, now)
    assert set(Allocation.objects.values_list("username", flat=True)) == {"alice"}
    assert marked() == [start + index * HOUR for index in range(5)]
    rollup.rollup_pending(now=now, limit=100)
    assert set(
        UsageHour.objects.filter(hour__lt=hour_start(now)).values_list("username", flat=True)
    ) == {"alice"}


def test_quota_fills_allocations_in_before_billing_reads_what_it_filled() -> None:
    # `unfilled` is compared after quota's step ran: one receiver runs both, quota's first
    # (quota/apps.py), not two whose order INSTALLED_APPS would decide. The order itself is
    # checked by what it does: test_an_allocation_charged_late_by_quota_is_rolled_up_again_...
    # marks only the change's own hours if billing's step runs first.
    uids = [key[0][0] for key in claims_changed.receivers]
    assert "quota.claims_changed" in uids
    assert "billing.mark_dirty" not in uids


@pytest.mark.django_db
def test_a_sender_that_gives_no_spans_marks_every_hour_of_the_claims() -> None:
    fleet()
    start = T0 + HOUR
    apply("ADDED", claim_object("a", "uid-a", device="gpu-0", allocated_at=start), start)
    DirtyHour.objects.all().delete()
    claim_id = ResourceClaim.objects.get(uid="uid-a").pk
    dirty.on_claims_changed(None, claim_ids=[claim_id], at=start + timedelta(hours=2, minutes=5))
    assert marked() == [start + index * HOUR for index in range(3)]


@pytest.mark.django_db
def test_an_allocation_seen_before_its_device_is_rolled_up_from_its_start_once_linked() -> None:
    fleet()
    start = T0 + HOUR
    apply("ADDED", claim_object("a", "uid-a", device="gpu-9", allocated_at=start), start)
    now = start + timedelta(hours=3, minutes=10)
    rollup.rollup_pending(now=now, limit=100)
    assert not UsageHour.objects.filter(claim_name="a").exists()  # no device: not metered yet
    DirtyHour.objects.all().delete()

    grown: dict[str, Any] = copy.deepcopy(SLICE)
    grown["spec"]["pool"]["generation"] = 2
    grown["spec"]["devices"].append(
        {
            "name": "gpu-9",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": "GPU-9"},
                "productName": {"string": "NVIDIA H100 80GB HBM3"},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
    )
    apply("MODIFIED", grown, now)
    assert Allocation.objects.get().device is not None
    assert marked() == [start + index * HOUR for index in range(4)]
    rollup.rollup_pending(now=now, limit=100)
    assert usage_rows(hour_start(now)) == rows_from_scratch(now)
    assert UsageHour.objects.filter(claim_name="a", hour__lt=hour_start(now)).count() == 3
