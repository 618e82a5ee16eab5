"""Budgets in the admission webhook: hard denies, soft and 80% warn; each in hours of one unit
(GPU-hours, TPU chip-hours), counting only that unit's hours and weighing only claims of it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
import time_machine
from django.test import Client
from django.utils import timezone
from pytest_django.fixtures import SettingsWrapper

from billing.models import Period
from billing.periods import PricingError, period_bounds, period_label
from billing.pricing import period_for, period_holding
from billing.selectors import MOST_MARKED_SPANS, team_gpu_hours
from inventory import services as inventory_services
from inventory.dumps import iter_objects
from inventory.models import Device, Unit
from metering import rollup
from metering.dirty import mark_dirty
from metering.hours import HOUR, MS_PER_HOUR, hour_start
from metering.models import UsageHour
from metering.rollup import rollup_hours
from quota.admission.shapes import forget_fleet_shapes
from quota.models import Budget
from quota.policy import PolicyError, apply_policy, load_policy
from teams.models import Team
from teams.ownership import assign_namespace
from tests.factories import AllocationFactory, DeviceFactory, ResourceClaimFactory
from tests.fixtures import DRA
from tests.quota.fixtures import AT, claim, decide, fleet_objects, gpu_request, make_team

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet", "mid_period")]

# A budget counts the period's rolled-up rows up to the hour before the current one, and the
# allocations themselves since. The clock is set where a month and a week each have hours
# before that (a Wednesday afternoon mid-month, after the quota fleet's import at AT), so that
# the tests do not depend on the hour and day the suite runs.
MID_PERIOD = datetime(2026, 12, 16, 14, 30, tzinfo=UTC)


@pytest.fixture
def mid_period() -> Iterator[None]:
    assert MID_PERIOD > AT
    with time_machine.travel(MID_PERIOD, tick=True):
        yield


def used(team_hours: int, *, live_minutes: int = 0, unit: str = Unit.GPU) -> None:
    """The team held `team_hours` hours of `unit` (GPU-hours unless told) in an hour of this
    period rolled up already, and one device of that unit since `live_minutes` ago (counted
    from the allocation: the hours since the one before the current one are)."""
    now = timezone.now()
    device = DeviceFactory.create(unit=unit)
    claim_row = ResourceClaimFactory.create(cluster=device.cluster, namespace="research")
    allocation = AllocationFactory.create(
        cluster=device.cluster,
        claim=claim_row,
        device=device,
        start=now - timedelta(minutes=live_minutes),
        end=None if live_minutes else now,
        team=Team.objects.get(slug="research"),  # charged to the team owning "research"
    )
    period = period_for(now)
    earlier = hour_start(now) - 2 * HOUR
    assert earlier >= period.start
    if team_hours:
        UsageHour.objects.create(
            hour=earlier,
            allocation=allocation,
            cluster=device.cluster,
            device_uuid=device.uuid,
            gpu_share=1,
            unit=unit,
            namespace="research",
            claim_name=claim_row.name,
            team_id=Team.objects.get(slug="research").pk,
            allocated_gpu_ms=team_hours * MS_PER_HOUR,
            utilised_gpu_ms=0,
            unmeasured_gpu_ms=0,
        )


def test_hard_budget_denies_new_claims(client: Client, settings: Any) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0  # read the budget's use on every admission
    team = make_team([])
    Budget.objects.create(team=team, gpu_hours=Decimal(10), mode="hard")
    used(9)
    warned = decide(client, claim("a", [gpu_request(1)]))
    assert (
        warned["allowed"] and "has used 9.0 of its 10 GPU-hour hard budget" in warned["warnings"][0]
    )
    used(1)
    denied = decide(client, claim("b", [gpu_request(1)]))
    assert not denied["allowed"]
    assert denied["status"]["reason"] == "BudgetExceeded"
    assert (
        'team "research" has used 10.0 of its 10 GPU-hour hard budget'
        in denied["status"]["message"]
    )


def test_soft_budget_warns_past_it(client: Client) -> None:
    team = make_team([])
    Budget.objects.create(team=team, gpu_hours=Decimal(5), mode="soft")
    used(6)
    answer = decide(client, claim("a", [gpu_request(1)]))
    assert answer["allowed"]
    assert answer["warnings"][0].endswith("(past the soft budget)")


def test_usage_counts_open_allocations_not_yet_rolled_up() -> None:
    team = make_team([])
    used(0, live_minutes=30)
    now = timezone.now()
    hours = team_gpu_hours(team=team, period=period_for(now), now=now)
    assert abs(hours - Decimal("0.5")) < Decimal("0.01")
    # Its namespace moved to another team this hour: from the hour's start the hours are the
    # other team's (ownership is dated, per hour), and none is counted twice or lost.
    other = make_team([], slug="other")
    assign_namespace(namespace="research", team=other, actor="test", at=now, open_since=None)
    assert team_gpu_hours(team=team, period=period_for(now), now=now) == 0
    assert team_gpu_hours(team=other, period=period_for(now), now=now) == hours


def test_the_hours_since_the_last_rollup_count_whether_or_not_it_has_run() -> None:
    """An allocation ended within the current hour, and one held through the hour just ended,
    which beat rolls up minutes after it ends: the budget counts them before the rollup runs
    as after, and an hour rolled up is not counted twice."""
    team = make_team([])
    now = timezone.now()
    current = hour_start(now)

    def held(start: datetime, end: datetime | None) -> None:
        AllocationFactory.create(
            device=DeviceFactory.create(unit=Unit.GPU), start=start, end=end, team=team
        )

    held(current - HOUR + timedelta(minutes=10), current + timedelta(minutes=5))  # 55 min
    held(current - timedelta(minutes=50), current - timedelta(minutes=20))  # 30 min
    held(current + timedelta(minutes=1), current + timedelta(minutes=16))  # 15 min
    period = period_for(now)
    before = team_gpu_hours(team=team, period=period, now=now)
    assert before == Decimal(100) / 60
    assert rollup_hours(hours=[current - HOUR], now=now) == 2  # the hour just ended
    assert UsageHour.objects.filter(team=team).count() == 2
    assert team_gpu_hours(team=team, period=period, now=now) == before
    # An hour later the rolled-up rows count that hour.
    later = now + HOUR
    assert team_gpu_hours(team=team, period=period, now=later) == before


def budget_warning(client: Client) -> str:
    """The warning an admission of the research team gets: its budget is 10 GPU-hours, of
    which it has used 9 (so every admission warns, naming the period)."""
    answer = decide(client, claim(f"c-{Period.objects.count()}", [gpu_request(1)]))
    assert answer["allowed"], answer
    (warning,) = [text for text in answer["warnings"] if "budget" in text]
    return str(warning)


@pytest.mark.parametrize(("stored", "configured"), [("month", "week"), ("week", "month")])
def test_stored_periods_of_another_length_never_fail_admission(
    client: Client, settings: SettingsWrapper, stored: str, configured: str
) -> None:
    """After TALLY_BILLING_PERIOD changed, `period_for` refuses the configured period over the
    stored ones; the webhook counts the budget in the stored period holding now instead."""
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    settings.TALLY_BILLING_PERIOD = stored
    Budget.objects.create(team=make_team([]), gpu_hours=Decimal(10), mode="hard")
    used(9)  # stores the period holding now, of the stored length
    now = timezone.now()
    settings.TALLY_BILLING_PERIOD = configured
    with pytest.raises(PricingError, match="the period length cannot change"):
        period_for(now)
    start, end = period_bounds(now, length=stored)
    assert f"has used 9.0 of its 10 GPU-hour hard budget for {period_label(start, end)}" in (
        budget_warning(client)
    )
    assert Period.objects.count() == 1


def test_the_budget_warning_names_a_week_as_the_commands_do(
    client: Client, settings: SettingsWrapper
) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    settings.TALLY_BILLING_PERIOD = "week"
    Budget.objects.create(team=make_team([]), gpu_hours=Decimal(10), mode="hard")
    used(9)
    Period.objects.all().delete()  # admission counts the budget without creating a period
    now = timezone.now()
    week = period_label(*period_bounds(now))
    assert week.startswith(f"{now.isocalendar().year}-W")
    assert f"10 GPU-hour hard budget for {week}" in budget_warning(client)
    assert not Period.objects.exists()


# --- Hours of one unit --------------------------------------------------------------------------

TPU = "tpu.google.com"


def with_tpus() -> None:
    """The quota tests' fleet and a TPU v4 host of four chips, in the webhook's cluster."""
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[*fleet_objects(), *iter_objects(DRA / "vendors" / "tpu.yaml")],
        at=AT,
    )
    assert report.errors == []
    forget_fleet_shapes()


def tpu_request(count: int = 1) -> dict[str, Any]:
    return gpu_request(count, device_class_name=TPU)


def budget_warnings(answer: dict[str, Any]) -> list[str]:
    return [text for text in answer.get("warnings") or [] if "budget" in text]


def test_a_spent_gpu_hour_budget_leaves_tpu_claims_alone(
    client: Client, settings: SettingsWrapper
) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    with_tpus()
    Budget.objects.create(team=make_team([]), gpu_hours=Decimal(10), mode="hard")
    used(9)
    used(50, unit=Unit.TPU)  # TPU chip-hours: not GPU-hours, they count nothing toward it
    tpu = decide(client, claim("tpu", [tpu_request(2)]))
    assert tpu["allowed"] and budget_warnings(tpu) == []
    near = decide(client, claim("gpu", [gpu_request(1)]))
    assert near["allowed"]
    assert "has used 9.0 of its 10 GPU-hour hard budget" in budget_warnings(near)[0]
    used(1)
    denied = decide(client, claim("gpu-again", [gpu_request(1)]))
    assert denied["status"]["reason"] == "BudgetExceeded"
    assert "has used 10.0 of its 10 GPU-hour hard budget" in denied["status"]["message"]
    again = decide(client, claim("tpu-again", [tpu_request(2)]))
    assert again["allowed"] and budget_warnings(again) == []


def test_a_tpu_chip_hour_budget_denies_tpu_claims_naming_its_unit(
    client: Client, settings: SettingsWrapper
) -> None:
    settings.TALLY_BUDGET_CACHE_SECONDS = 0
    with_tpus()
    Budget.objects.create(team=make_team([]), gpu_hours=Decimal("3.5"), mode="hard", unit=Unit.TPU)
    used(3, unit=Unit.TPU)
    used(100)  # GPU-hours: not the budget's
    warned = decide(client, claim("a", [tpu_request(1)]))
    assert warned["allowed"]
    assert budget_warnings(warned) == [
        f'team "research" has used 3.0 of its 3.5 TPU chip-hour hard budget for '
        f"{period_holding(timezone.now()).label}"
    ]
    used(1, unit=Unit.TPU)
    denied = decide(client, claim("b", [tpu_request(1)]))
    assert (denied["allowed"], denied["status"]["reason"]) == (False, "BudgetExceeded")
    assert denied["status"]["message"] == (
        f'team "research" has used 4.0 of its 3.5 TPU chip-hour hard budget for '
        f"{period_holding(timezone.now()).label}"
    )
    # A GPU claim can be given no TPU chip: the budget does not weigh it.
    gpu = decide(client, claim("c", [gpu_request(1)]))
    assert gpu["allowed"] and budget_warnings(gpu) == []
    # One that could be given a TPU chip (any alternative), or anything (a class the inventory
    # does not know yet), is weighed.
    either = {
        "name": "either",
        "firstAvailable": [
            {"name": "gpu", "deviceClassName": "gpu.nvidia.com"},
            {"name": "tpu", "deviceClassName": TPU},
        ],
    }
    assert decide(client, claim("d", [either]))["status"]["reason"] == "BudgetExceeded"
    unknown = decide(client, claim("e", [gpu_request(1, device_class_name="npu.example.com")]))
    assert unknown["status"]["reason"] == "BudgetExceeded"


def test_hours_of_each_unit_are_counted_apart_exactly() -> None:
    """On PostgreSQL, to the millisecond: rolled-up rows of the unit in the period before the
    hour before the current one, and the allocations of the unit since, open or ended, at
    their share."""
    team = make_team([])
    now = datetime(2026, 3, 10, 12, 30, tzinfo=UTC)
    period = period_for(now)

    def usage(unit: str, hour: datetime, hours: int) -> None:
        allocation = AllocationFactory.create(
            device=DeviceFactory.create(unit=unit), start=hour, end=hour, team=team
        )
        UsageHour.objects.create(
            hour=hour,
            allocation=allocation,
            cluster=allocation.cluster,
            device_uuid=allocation.meter_id,
            gpu_share=1,
            unit=unit,
            namespace="research",
            claim_name=allocation.claim.name,
            team=team,
            allocated_gpu_ms=hours * MS_PER_HOUR,
            utilised_gpu_ms=0,
            unmeasured_gpu_ms=0,
        )

    def held(unit: str, since: datetime, share: str, until: datetime | None = None) -> None:
        device = DeviceFactory.create(unit=unit, gpu_share=Decimal(share))
        AllocationFactory.create(device=device, start=since, end=until, team=team)

    ten = datetime(2026, 3, 10, 10, tzinfo=UTC)
    usage(Unit.GPU, ten, 3)
    usage(Unit.TPU, ten, 5)
    usage(Unit.GAUDI, ten, 2)
    usage(Unit.TPU, datetime(2026, 2, 27, 10, tzinfo=UTC), 7)  # the period before
    # Rows of the hour before this one and of this hour: their allocations are counted.
    usage(Unit.TPU, datetime(2026, 3, 10, 11, tzinfo=UTC), 4)
    usage(Unit.TPU, datetime(2026, 3, 10, 12, tzinfo=UTC), 9)
    held(Unit.TPU, datetime(2026, 3, 10, 11, 15, tzinfo=UTC), "1")  # 75 min since 11:00
    held(Unit.TPU, datetime(2026, 3, 10, 12, 6, tzinfo=UTC), "0.5")  # 24 min at half a chip
    held(Unit.GPU, datetime(2026, 3, 10, 12, 0, tzinfo=UTC), "1")  # 30 min
    held(
        Unit.TPU,
        datetime(2026, 3, 10, 9, 0, tzinfo=UTC),
        "1",
        until=datetime(2026, 3, 10, 11, 45, tzinfo=UTC),
    )  # 45 min since 11:00
    held(
        Unit.TPU,
        datetime(2026, 3, 10, 9, 0, tzinfo=UTC),
        "1",
        until=datetime(2026, 3, 10, 10, 59, tzinfo=UTC),
    )  # ended before
    assert period.start <= datetime(2026, 3, 1, tzinfo=UTC) < ten
    hours = {unit: team_gpu_hours(team=team, period=period, now=now, unit=unit) for unit in Unit}
    assert hours == {
        Unit.GPU: Decimal("3.5"),
        Unit.TPU: Decimal("7.2"),
        Unit.GAUDI: Decimal(2),
        Unit.ACCELERATOR: Decimal(0),
    }
    assert team_gpu_hours(team=team, period=period, now=now) == Decimal("3.5")  # GPU-hours


BUDGET_POLICY = """\
teams:
- slug: vision
  name: Vision Research
  budget: {gpuHours: 2000, mode: hard, unit: UNIT}
"""


def test_a_policy_budget_in_tpu_chip_hours_is_applied_and_printed_so() -> None:
    report = apply_policy(
        policy=load_policy(BUDGET_POLICY.replace("UNIT", "tpu")), prune=False, actor="tester"
    )
    budget = Budget.objects.get(team__slug="vision")
    assert (budget.gpu_hours, budget.mode, budget.unit) == (2000, "hard", Unit.TPU)
    assert "created budget vision: 2000 TPU chip-hours (hard)" in report.changes
    # Without `unit:` a budget is in GPU-hours: declaring so changes the unit, audited.
    report = apply_policy(
        policy=load_policy(BUDGET_POLICY.replace(", unit: UNIT", "")), prune=False, actor="tester"
    )
    assert report.changes == ["updated budget vision: 2000 GPU-hours (hard): unit 'tpu' → 'gpu'"]
    assert Budget.objects.get().unit == Unit.GPU


def test_a_policy_budget_of_an_unknown_unit_is_one_error_naming_the_key() -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy(BUDGET_POLICY.replace("UNIT", "tpus"))
    assert caught.value.errors == [
        "teams[0].budget.unit: must be one of gpu, tpu, gaudi, accelerator, got 'tpus'"
    ]
    assert "\n" not in str(caught.value)


def test_apply_policy_prints_each_rate_per_hour_of_its_models_unit() -> None:
    with_tpus()
    tpu_model = Device.objects.filter(unit=Unit.TPU).values_list("product_name", flat=True)[0]
    rates = f"""\
rates:
- productName: {tpu_model}
  perGpuHour: "1.20"
  currency: USD
  from: 2026-01-01
- productName: NVIDIA H100 80GB HBM3
  perGpuHour: "2.50"
  currency: USD
  from: 2026-01-01
- productName: NVIDIA A100-SXM4-80GB
  profile: 3g.40gb
  perGpuHour: "0.70"
  currency: USD
  from: 2026-01-01
"""
    report = apply_policy(
        policy=load_policy(BUDGET_POLICY.replace("UNIT", "tpu") + rates),
        prune=False,
        actor="tester",
    )
    assert [line for line in report.changes if "rate card" in line] == [
        f"created rate card {tpu_model}: 1.20 USD/TPU chip-hour from 2026-01-01",
        "created rate card NVIDIA H100 80GB HBM3: 2.50 USD/GPU-hour from 2026-01-01",
        "created rate card NVIDIA A100-SXM4-80GB 3g.40gb: 0.70 USD/slice-hour from 2026-01-01",
    ]
    # Pruned, the TPU card is named per TPU chip-hour too.
    pruned = apply_policy(
        policy=load_policy(BUDGET_POLICY.replace("UNIT", "tpu") + "rates: []\n"),
        prune=True,
        actor="tester",
    )
    assert f"deleted rate card {tpu_model}: 1.2000 USD/TPU chip-hour from 2026-01-01" in (
        pruned.changes
    )


@pytest.mark.parametrize("marked", [3, 12])
def test_hours_marked_to_be_rolled_up_again_are_counted_from_the_allocations(marked: int) -> None:
    """Rows a late change made stale, their hours marked: the budget counts those hours from
    the allocations, hour by hour or (past `MOST_MARKED_SPANS`) from the first on."""
    team = make_team([])
    now = timezone.now()
    start = hour_start(now) - 30 * HOUR
    device = DeviceFactory.create(unit=Unit.GPU)
    AllocationFactory.create(device=device, start=start, end=None, team=team)
    rollup_hours(hours=[start + index * HOUR for index in range(30)], now=now)
    rollup.record_rolled_through(hour_start(now) - HOUR)
    stale = [start + index * HOUR for index in range(0, 2 * marked, 2)]
    UsageHour.objects.filter(hour__in=stale).update(allocated_gpu_ms=0)
    mark_dirty(hours=set(stale), at=now)
    assert (marked > MOST_MARKED_SPANS) == (marked == 12)
    used = team_gpu_hours(team=team, period=period_for(now), now=now)
    assert abs(used - Decimal((now - start) / timedelta(microseconds=1)) / 3_600_000_000) < Decimal(
        "1e-9"
    )
