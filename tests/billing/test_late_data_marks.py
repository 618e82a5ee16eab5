"""Late data since close (issue 22): a refresh reads a closed period's usage only while the
period holds late-data marks; every write of usage rows marks its hours, whatever its path; a
close clears only the marks it read, so one made while it runs survives it; and a closed
period left unread yields exactly the adjustments a full read of every closed period would.

The race runs two real PostgreSQL connections; the property compares each refresh and close
against a full read of every closed period, over random sequences of late data, closes and
refreshes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pytest_django.fixtures import SettingsWrapper

from billing import late_data, services
from billing.models import LineKind, Period, RateCard, Statement, StatementLine, UsageChange
from billing.pricing import period_for, refresh_statements
from inventory.models import Allocation
from metering import rollup
from metering.hours import MS_PER_HOUR
from metering.models import UsageHour
from teams.models import Team
from tests.factories import AllocationFactory, owner_of

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"
HOUR = timedelta(hours=1)
JAN, FEB, MAR, APR, MAY = (datetime(2025, month, 1, tzinfo=UTC) for month in range(1, 6))


@pytest.fixture(autouse=True)
def monthly(settings: SettingsWrapper) -> None:
    settings.TALLY_BILLING_PERIOD = "month"


@dataclass
class Ledger:
    """Two teams, each holding a GPU from January to May 2025, and the open months January to
    April, priced by one rate card."""

    allocations: list[Allocation]
    periods: list[Period]


def make_ledger() -> Ledger:
    RateCard.objects.create(
        product_name=H100,
        currency="USD",
        valid_from=date(2024, 1, 1),
        per_gpu_hour=Decimal("2.5000"),
        idle_factor=Decimal("0.4000"),
    )
    allocations = [
        AllocationFactory.create(
            start=JAN,
            end=MAY,
            claim__namespace=f"team-{i}",
            team=Team.objects.create(slug=f"team-{i}", name=f"Team {i}"),
        )
        for i in range(2)
    ]
    return Ledger(allocations, [period_for(month) for month in (JAN, FEB, MAR, APR)])


def team_of(allocation: Allocation) -> Team:
    """The team the allocation's hours are charged to: its namespace's, since always."""
    team = owner_of(allocation)
    assert team is not None
    return team


@pytest.fixture
def ledger() -> Ledger:
    return make_ledger()


def use(allocation: Allocation, hour: datetime, *, utilised: int = 0, unmeasured: int = 0) -> None:
    """The allocation's usage row of `hour` written (made, or its figures replaced), as a
    rollup writes it: the whole hour allocated, `utilised` and `unmeasured` milliseconds."""
    UsageHour.objects.update_or_create(
        hour=hour,
        allocation=allocation,
        defaults={
            "cluster_id": allocation.cluster_id,
            "device_uuid": allocation.meter_id,
            "product_name": allocation.product_name,
            "profile": allocation.profile,
            "gpu_share": allocation.gpu_share,
            "unit": allocation.unit,
            "namespace": allocation.claim.namespace,
            "claim_name": "train",
            "team_id": team_of(allocation).pk,
            "allocated_gpu_ms": MS_PER_HOUR,
            "utilised_gpu_ms": utilised,
            "unmeasured_gpu_ms": unmeasured,
        },
    )


def marks() -> dict[datetime, int]:
    return dict(UsageChange.objects.values_list("hour", "version"))


def marked(period: Period) -> bool:
    return UsageChange.objects.filter(hour__gte=period.start, hour__lt=period.end).exists()


Lines = list[tuple[Any, ...]]


def lines_of(period: Period) -> tuple[Lines, Lines]:
    """The period's statement lines (what each says) and statements (totals), sorted."""
    lines = sorted(
        StatementLine.objects.filter(statement__period=period).values_list(
            "statement__team_id",
            "statement__currency",
            "kind",
            "product_name",
            "profile",
            "unit",
            "rate",
            "idle_factor",
            "gpu_share",
            "allocated_gpu_hours",
            "utilised_gpu_hours",
            "idle_gpu_hours",
            "unmeasured_gpu_hours",
            "amount",
            "corrects_period_id",
            "reason",
        ),
        key=repr,
    )
    totals = sorted(
        Statement.objects.filter(period=period).values_list("team_id", "currency", "total")
    )
    return lines, totals


def full_read(period: Period) -> tuple[Lines, Lines]:
    """`period`'s statements as a refresh that reads every closed period makes them (every
    closed period marked), then undone."""
    with transaction.atomic():
        late_data.mark_hours(
            closed.start for closed in Period.objects.filter(closed_at__isnull=False)
        )
        refresh_statements(period=period)
        made = lines_of(period)
        transaction.set_rollback(True)
    return made


def adjustments(period: Period) -> list[tuple[int, int | None, Decimal, Decimal]]:
    """The late-data lines of `period`: team, period corrected, utilised hours, amount."""
    return sorted(
        StatementLine.objects.filter(
            statement__period=period, kind=LineKind.ADJUSTMENT
        ).values_list("statement__team_id", "corrects_period_id", "utilised_gpu_hours", "amount")
    )


# --- Every write marks its hours ---------------------------------------------------------------


def test_every_write_of_usage_rows_marks_its_hours_with_a_new_version(ledger: Ledger) -> None:
    UsageChange.objects.all().delete()
    gpu = ledger.allocations[0]
    first, second = JAN + 5 * HOUR, JAN + 6 * HOUR
    use(gpu, first)
    inserted = marks()
    assert list(inserted) == [first]
    UsageHour.objects.filter(hour=first).update(utilised_gpu_ms=1000)
    updated = marks()
    assert list(updated) == [first] and updated[first] > inserted[first]
    UsageHour.objects.filter(hour=first).update(hour=second)  # a row moved: both its hours
    moved = marks()
    assert set(moved) == {first, second} and moved[first] > updated[first]
    UsageHour.objects.filter(hour=second).delete()
    assert marks()[second] > moved[second]


def test_the_rollups_writes_mark_the_hours_they_rewrite(ledger: Ledger) -> None:
    """INSERT ... SELECT of the hours held whole, COPY of an hour held in part, and the
    DELETE of the hours' old rows."""
    UsageChange.objects.all().delete()
    whole = [FEB + 2 * HOUR, FEB + 3 * HOUR]
    rollup.rollup_hours(hours=whole, now=MAY)
    assert sorted(marks()) == whole
    # An hour no other allocation holds, held by this one from half past: one row, by COPY.
    late = MAY + 30 * HOUR
    AllocationFactory.create(start=late + timedelta(minutes=30), end=late + HOUR)
    rollup.rollup_hours(hours=[late], now=late + 2 * HOUR)
    assert UsageHour.objects.filter(hour=late).count() == 1
    assert sorted(marks()) == [*whole, late]
    written = marks()
    rollup.rollup_hours(hours=whole, now=MAY)  # the same rows again: deleted and inserted
    assert all(marks()[hour] > written[hour] for hour in whole)


# --- A refresh reads only the closed periods that hold marks -----------------------------------


def test_a_closed_period_is_read_again_only_once_marked(ledger: Ledger) -> None:
    jan, feb = ledger.periods[:2]
    gpu = ledger.allocations[0]
    use(gpu, JAN + HOUR, utilised=MS_PER_HOUR)
    services.close_period(period=jan, actor="finance")
    assert not marked(jan), "the close accounts for January's usage: no marks left"
    # A change no trigger saw: no refresh notices it, so none reads January.
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(
            "UPDATE billing_usagehour SET utilised_gpu_ms = 0 WHERE hour = %s", [JAN + HOUR]
        )
        cursor.execute("SET LOCAL session_replication_role = DEFAULT")
    refresh_statements(period=feb)
    assert adjustments(feb) == []
    # Marked by a late write of another hour, January is read whole: both changes are billed.
    use(gpu, JAN + 2 * HOUR, utilised=MS_PER_HOUR)
    assert marked(jan)
    refresh_statements(period=feb)
    assert [(team, corrected, utilised) for team, corrected, utilised, _ in adjustments(feb)] == [
        (team_of(gpu).pk, jan.pk, Decimal(0))  # one hour's utilisation taken back, one added
    ]
    (line,) = StatementLine.objects.filter(statement__period=feb, kind=LineKind.ADJUSTMENT)
    assert line.allocated_gpu_hours == Decimal(1)  # the hour written late
    assert lines_of(feb) == full_read(feb)


def test_a_close_clears_the_marks_it_read_and_freezes_the_adjustments(ledger: Ledger) -> None:
    jan, feb, mar = ledger.periods[:3]
    gpu = ledger.allocations[1]
    use(gpu, JAN + HOUR)
    services.close_period(period=jan, actor="finance")
    use(gpu, FEB + HOUR)
    use(gpu, JAN + 3 * HOUR, utilised=MS_PER_HOUR // 2)  # late for January
    assert marked(jan) and marked(feb)
    services.close_period(period=feb, actor="finance")
    assert not marked(jan) and not marked(feb)
    frozen = adjustments(feb)
    assert [(team, corrected) for team, corrected, _, _ in frozen] == [(team_of(gpu).pk, jan.pk)]
    refresh_statements(period=mar)
    assert adjustments(mar) == [], "January's late data is billed once, in February"
    assert lines_of(mar) == full_read(mar)


def test_adjustments_for_a_period_not_read_again_are_kept(ledger: Ledger) -> None:
    """March (open) billed January's late data; February (open too) then closed and cleared
    January's marks: March's adjustment stays, as a full read would make it."""
    jan, feb, mar = ledger.periods[:3]
    gpu = ledger.allocations[0]
    use(gpu, JAN + HOUR)
    services.close_period(period=jan, actor="finance")
    use(gpu, JAN + 4 * HOUR, utilised=MS_PER_HOUR)
    refresh_statements(period=mar)
    billed_in_march = adjustments(mar)
    assert [(team, corrected) for team, corrected, _, _ in billed_in_march] == [
        (team_of(gpu).pk, jan.pk)
    ]
    services.close_period(period=feb, actor="finance")
    assert adjustments(feb) == [], "March billed it already"
    assert not marked(jan)
    refresh_statements(period=mar)
    assert adjustments(mar) == billed_in_march
    assert lines_of(mar) == full_read(mar)


def test_a_rate_card_changed_over_closed_days_marks_their_periods(ledger: Ledger) -> None:
    """Its price and days there are kept (`rate_change_error`), but its currency may change:
    January's usage is then priced in euros, with no usage row written."""
    jan, feb = ledger.periods[:2]
    use(ledger.allocations[0], JAN + HOUR)
    services.close_period(period=jan, actor="finance")
    card = RateCard.objects.get()
    services.save_rate_card(card=card, values={"currency": "EUR"}, actor="finance")
    assert marked(jan)
    refresh_statements(period=feb)
    assert sorted(
        StatementLine.objects.filter(statement__period=feb, kind=LineKind.ADJUSTMENT).values_list(
            "statement__currency", "amount"
        )
    ) == [("EUR", Decimal(1)), ("USD", Decimal(-1))]  # an idle hour: 2.50 x (1 - 0.6)
    assert lines_of(feb) == full_read(feb)


# --- A mark made while a close runs survives it ------------------------------------------------


def waiting_for_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


class Connection(threading.Thread):
    """Work done on a connection of its own, in a transaction held open until `finish`."""

    def __init__(self, work: Callable[[], object]) -> None:
        super().__init__()
        self.work = work
        self.pid = 0
        self.done_work = threading.Event()
        self.finish = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with transaction.atomic():
                self.pid = connection.cursor().connection.info.backend_pid
                self.work()
                self.done_work.set()
                assert self.finish.wait(timeout=30)
        except BaseException as exc:  # reported by `end`
            self.error = exc
        finally:
            self.done_work.set()
            connection.close()

    def end(self) -> None:
        self.finish.set()
        self.join(timeout=30)
        assert self.error is None


def blocked(thread: threading.Thread, pid: Callable[[], int]) -> None:
    """Wait until `thread` waits for a lock, or has ended."""
    deadline = time.monotonic() + 30
    while thread.is_alive() and not (pid() and waiting_for_lock(pid())):
        assert time.monotonic() < deadline, "it never waited"
        time.sleep(0.05)


class OnItsOwn(threading.Thread):
    """Work started on a connection of its own, committed as it goes: its server process id
    once connected (`pid`) and what it raised (`errors`)."""

    def __init__(self, work: Callable[[], object]) -> None:
        super().__init__()
        self.work = work
        self.pid = 0
        self.errors: list[BaseException] = []
        self.start()

    def run(self) -> None:
        try:
            self.pid = connection.cursor().connection.info.backend_pid
            self.work()
        except BaseException as exc:  # reported by the caller
            self.errors.append(exc)
        finally:
            connection.close()

    def wait_blocked(self) -> None:
        """Until it waits for a lock, or has ended (`blocked`)."""
        blocked(self, lambda: self.pid)


def waited_for(writer: Connection, waiter: OnItsOwn, failure: str) -> None:
    """`waiter` is seen waiting for a lock while `writer` holds its transaction open, and is
    still waiting when `writer` is let commit (else `failure`); then both end without errors."""
    try:
        waiter.wait_blocked()
        assert waiter.is_alive(), f"{failure}: {waiter.errors}"
    finally:
        writer.end()
        waiter.join(timeout=30)
    assert not waiter.is_alive() and not waiter.errors


def closing(period: Period) -> OnItsOwn:
    """`close_period` of `period` started on a connection of its own."""
    return OnItsOwn(lambda: services.close_period(period=period, actor="finance"))


def late_write(gpu: Allocation) -> Callable[[], None]:
    """January's second hour written again, now utilised."""
    return lambda: use(gpu, JAN + 2 * HOUR, utilised=MS_PER_HOUR)


def check_billed_after(ledger: Ledger) -> None:
    """January's mark survived February's close: February billed the late hour as the close
    read it (not utilised), March bills its utilisation."""
    jan, feb, mar = ledger.periods[:3]
    assert Period.objects.get(pk=feb.pk).is_closed
    assert marked(jan), "the write's mark survived the close"
    assert [(corrected, utilised) for _, corrected, utilised, _ in adjustments(feb)] == [
        (jan.pk, Decimal(0))
    ]
    refresh_statements(period=mar)
    assert [(corrected, utilised) for _, corrected, utilised, _ in adjustments(mar)] == [
        (jan.pk, Decimal(1))
    ]


def late_january(ledger: Ledger) -> Allocation:
    """January closed, then an hour written late for it (so February's close reads it)."""
    gpu = ledger.allocations[0]
    use(gpu, JAN + HOUR)
    services.close_period(period=ledger.periods[0], actor="finance")
    use(gpu, JAN + 2 * HOUR)
    return gpu


@pytest.mark.django_db(transaction=True)
def test_a_mark_made_after_the_close_read_the_marks_survives_it() -> None:
    """The close reads January's mark and usage, then waits (a third connection holds
    February's statement); meanwhile a late write to the same hour commits, raising the mark's
    version: the close's compare-and-clear leaves it."""
    ledger = make_ledger()
    gpu = late_january(ledger)
    refresh_statements(period=ledger.periods[1])
    statement = Statement.objects.get(period=ledger.periods[1], team=team_of(gpu))
    holder = Connection(lambda: list(Statement.objects.select_for_update().filter(pk=statement.pk)))
    assert holder.done_work.wait(timeout=30)
    closer = closing(ledger.periods[1])
    closer.wait_blocked()
    assert closer.is_alive(), f"the close did not wait for the statement: {closer.errors}"
    writer = Connection(late_write(gpu))
    writer.end()  # committed while the close waits
    holder.end()
    closer.join(timeout=30)
    assert closer.errors == []
    check_billed_after(ledger)


@pytest.mark.django_db(transaction=True)
def test_a_mark_a_write_holds_while_the_close_clears_survives_it() -> None:
    """A late write to the same hour holds its raised mark uncommitted while February closes:
    the close neither waits for it nor deletes it, and the write then commits."""
    ledger = make_ledger()
    gpu = late_january(ledger)
    writer = Connection(late_write(gpu))
    assert writer.done_work.wait(timeout=30)
    closer = closing(ledger.periods[1])
    closer.join(timeout=30)
    assert not closer.is_alive(), "the close waited for the write"
    assert closer.errors == []
    writer.end()
    check_billed_after(ledger)


@pytest.mark.django_db(transaction=True)
def test_two_open_periods_refreshed_at_once_bill_a_closed_periods_late_data_once() -> None:
    """January closed, then an hour of it written late; February (not closed yet) and March
    are both open. February's refresh holds its transaction open while March's runs: March
    waits for it, then reads February's adjustment and bills none. Alone, each would bill
    it; at once, both did."""
    ledger = make_ledger()
    jan, feb, mar = ledger.periods[:3]
    gpu = ledger.allocations[0]
    use(gpu, JAN + HOUR)
    services.close_period(period=jan, actor="finance")
    use(gpu, JAN + HOUR, utilised=MS_PER_HOUR)
    first = Connection(lambda: refresh_statements(period=feb))
    assert first.done_work.wait(timeout=30) and first.error is None
    second = OnItsOwn(lambda: refresh_statements(period=mar))
    second.wait_blocked()
    assert second.is_alive(), f"March's refresh did not wait for February's: {second.errors}"
    first.end()
    second.join(timeout=30)
    assert second.errors == []
    billed = adjustments(feb) + adjustments(mar)
    assert [(corrected, utilised) for _, corrected, utilised, amount in billed if amount] == [
        (jan.pk, Decimal(1))
    ]
    assert sum(amount for *_, amount in billed) == sum(amount for *_, amount in adjustments(feb))
    assert sum(amount for *_, amount in adjustments(feb)) > 0


# --- Property: the marks change nothing a full read would bill ---------------------------------

Step = tuple[Any, ...]
steps_strategy = st.lists(
    st.one_of(
        # A usage row written late (or on time, in an open period): period, hour, allocation,
        # quarters of the hour utilised.
        st.tuples(
            st.just("write"),
            st.integers(min_value=0, max_value=3),
            st.integers(min_value=0, max_value=3),
            st.integers(min_value=0, max_value=1),
            st.integers(min_value=0, max_value=4),
        ),
        # An hour's rows gone (a rollup that found the allocations ended before it).
        st.tuples(st.just("delete"), st.integers(min_value=0, max_value=3), st.integers(0, 3)),
        # A refresh of one of the open periods.
        st.tuples(st.just("refresh"), st.integers(min_value=0, max_value=3)),
        # The earliest open period closed, while a later one stays open.
        st.tuples(st.just("close")),
    ),
    min_size=1,
    max_size=14,
)


def apply(ledger: Ledger, step: Step) -> None:
    """Do `step`; a refresh or close is checked against a full read of every closed period."""
    open_periods = [period for period in ledger.periods if not period.is_closed]
    if step[0] == "write":
        _, period, hour, allocation, quarters = step
        use(
            ledger.allocations[allocation],
            ledger.periods[period].start + hour * HOUR,
            utilised=quarters * MS_PER_HOUR // 4,
        )
    elif step[0] == "delete":
        _, period, hour = step
        UsageHour.objects.filter(hour=ledger.periods[period].start + hour * HOUR).delete()
    elif step[0] == "refresh":
        period = open_periods[step[1] % len(open_periods)]
        expected = full_read(period)
        refresh_statements(period=period)
        assert lines_of(period) == expected
    elif len(open_periods) > 1:
        period = open_periods[0]
        expected = full_read(period)
        services.close_period(period=period, actor="finance")
        assert lines_of(period) == expected


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=steps_strategy)
# March bills January's late data, February closes: March's adjustment is kept.
@example(steps=[("close",), ("write", 0, 1, 0, 2), ("refresh", 1), ("close",)])
# A late write to an hour February's close read, then January's again, then a gone hour.
@example(
    steps=[
        ("close",),
        ("write", 1, 0, 1, 4),
        ("write", 0, 2, 0, 1),
        ("close",),
        ("write", 0, 2, 0, 3),
        ("delete", 1, 0),
        ("refresh", 0),
    ]
)
def test_refreshes_and_closes_bill_what_a_full_read_of_every_closed_period_bills(
    steps: list[Step],
) -> None:
    with transaction.atomic():
        ledger = make_ledger()
        for step in steps:
            apply(ledger, step)
        for period in ledger.periods:
            if not period.is_closed:
                expected = full_read(period)
                refresh_statements(period=period)
                assert lines_of(period) == expected
        transaction.set_rollback(True)
