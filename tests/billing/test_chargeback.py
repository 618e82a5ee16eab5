"""Allocated versus utilised GPU-hours, priced: a scenario worked out by hand, to the cent.

The fleet and its claims come from dump files loaded with `sync_inventory --from-file --at`,
as an operator replays a cluster's history; the samples go through `metering.ingest`, as the
node agents' do.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command

from billing import pricing, services
from billing.models import RateCard, StatementLine
from billing.periods import PricingError
from inventory import services as inventory_services
from metering import ingest, rollup
from metering.hours import epoch_ms
from metering.ingest import SampleRow
from metering.models import UsageHour
from teams.models import Team, TeamNamespace

pytestmark = pytest.mark.django_db
T10 = datetime(2026, 10, 15, 10, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def device(name: str, attributes: dict[str, Any], memory: str = "80Gi") -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {key: {"string": value} for key, value in attributes.items()},
        "capacity": {"memory": {"value": memory}},
    }


SLICE = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceSlice",
    "metadata": {"name": "node-a-gpus"},
    "spec": {
        "driver": "gpu.nvidia.com",
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "devices": [
            device(
                "gpu-0", {"type": "gpu", "uuid": "GPU-H", "productName": "NVIDIA H100 80GB HBM3"}
            ),
            device(
                "gpu-1-mig-3g40gb-0",
                {
                    "type": "mig",
                    "uuid": "MIG-A",
                    "parentUUID": "GPU-A",
                    "profile": "3g.40gb",
                    "productName": "NVIDIA A100-SXM4-80GB",
                },
                "40Gi",
            ),
        ],
    },
}


def claim(name: str, device_name: str, at: datetime, *, allocated: bool = True) -> dict[str, Any]:
    """A claim of one device from `at`; `allocated=False`: the same claim once deallocated."""
    allocation = {
        "allocationTimestamp": at.isoformat(),
        "devices": {
            "results": [
                {
                    "request": "gpu",
                    "driver": "gpu.nvidia.com",
                    "pool": "node-a",
                    "device": device_name,
                }
            ]
        },
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": "vision",
            "uid": f"uid-{name}",
            "ownerReferences": [{"kind": "Job", "name": f"job-{name}", "controller": True}],
        },
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}},
        "status": {"allocation": allocation} if allocated else {},
    }


def load_dump(folder: Path, objects: list[dict[str, Any]], at: datetime) -> None:
    """Load `objects` as `sync_inventory --from-file DUMP --at ISO` does: a dump (what
    `kubectl get ... -o json` prints) applied as a full snapshot of the kinds in it, at `at`."""
    dump = folder / f"dump-{at:%Y%m%dT%H%M%S}.json"
    dump.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    out = StringIO()
    call_command("sync_inventory", "--from-file", str(dump), "--at", at.isoformat(), stdout=out)
    assert "rejected" not in out.getvalue()


def snapshot(objects: list[dict[str, Any]], at: datetime, kinds: list[str] | None = None) -> None:
    """Apply a snapshot through the service, for tests that need a kind in scope with no
    objects of it (a dump file cannot say "no claims": an empty list names no kind)."""
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=objects, at=at, kinds=kinds
    )
    assert report.errors == []


def send_samples(uuid: str, start: datetime, minutes: int, util: float) -> None:
    """A sample a minute from `start`, ingested as the node agent's would be."""
    rows = [SampleRow(uuid, epoch_ms(start + i * MINUTE), util, None, None) for i in range(minutes)]
    report = ingest.ingest(node="node-a", samples=rows, received_at=start)
    assert report.accepted == minutes


@pytest.fixture
def scenario(tmp_path: Path) -> Team:
    """An H100 held 10:00-12:30 and measured 50% for an hour, unmeasured for half an hour, then
    100%; a 3g.40gb MIG device (3/7 of an A100) held 10:00-11:00 and never measured.

    Three dumps: the node's slice and both claims allocated at 10:00; at 11:00 only the
    H100's claim (so the MIG device's claim is gone); at 12:30 that claim deallocated."""
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace="vision")
    RateCard.objects.create(
        product_name="NVIDIA H100 80GB HBM3",
        per_gpu_hour=Decimal("2.50"),
        idle_factor=Decimal("0.4"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-80GB",
        per_gpu_hour=Decimal("1.20"),
        idle_factor=Decimal("0.4"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    load_dump(
        tmp_path,
        [SLICE, claim("train", "gpu-0", T10), claim("tune", "gpu-1-mig-3g40gb-0", T10)],
        T10,
    )
    load_dump(tmp_path, [claim("train", "gpu-0", T10)], T10 + timedelta(hours=1))
    load_dump(
        tmp_path,
        [claim("train", "gpu-0", T10, allocated=False)],
        T10 + timedelta(hours=2, minutes=30),
    )
    send_samples("GPU-H", T10, 60, 50.0)
    send_samples("GPU-H", T10 + timedelta(minutes=90), 60, 100.0)
    for hour in range(10, 13):
        rollup.rollup_hours(hours=[T10.replace(hour=hour)], now=T10 + timedelta(days=1))
    return team


def seconds(gpu_ms: int) -> Decimal:
    return Decimal(gpu_ms) / 1000


def test_hourly_usage_splits_allocated_time(scenario: Team) -> None:
    h100 = {
        row.hour.hour: (
            seconds(row.allocated_gpu_ms),
            seconds(row.utilised_gpu_ms),
            seconds(row.unmeasured_gpu_ms),
        )
        for row in UsageHour.objects.filter(device_uuid="GPU-H")
    }
    # 10:00-11:00: 60 samples at 50%, each holding its minute.
    # 11:00-12:00: the 10:59 sample holds 2 min (to 11:01) at 50%; nothing until 11:30;
    #              then 30 samples at 100%.
    # 12:00-12:30: 30 samples at 100%; the allocation ends at 12:30.
    assert h100 == {
        10: (Decimal(3600), Decimal(1800), Decimal(0)),
        11: (Decimal(3600), Decimal(1830), Decimal(1740)),
        12: (Decimal(1800), Decimal(1800), Decimal(0)),
    }
    mig = UsageHour.objects.get(device_uuid="MIG-A")
    assert mig.gpu_share == Decimal("0.428571")
    assert mig.allocated_gpu_ms == mig.unmeasured_gpu_ms == 1_542_856  # 3,600,000 ms x 3/7
    assert mig.team == scenario and mig.job == "Job/job-tune"


def test_statement_to_the_cent(scenario: Team) -> None:
    (statement,) = pricing.refresh_statements(period=pricing.period_for(T10))
    lines = {line.product_name: line for line in statement.lines.all()}
    h100 = lines["NVIDIA H100 80GB HBM3"]
    # allocated 9000 s = 2.5 h; utilised 5430 s; unmeasured 1740 s; idle 1830 s = 0.508333 h.
    assert (h100.allocated_gpu_hours, h100.utilised_gpu_hours) == (
        Decimal("2.5"),
        Decimal("1.508333"),
    )
    assert (h100.unmeasured_gpu_hours, h100.idle_gpu_hours) == (
        Decimal("0.483333"),
        Decimal("0.508333"),
    )
    # 2.50 x (2.5 - 0.6 x 1830/3600) = 2.50 x 2.195 = 5.4875, half-up to 5.49.
    assert h100.amount == Decimal("5.49")
    mig = lines["NVIDIA A100-SXM4-80GB"]
    # 1.20 x 1542.856 s / 3600 = 0.514285..., all of it unmeasured (not idle): 0.51.
    assert mig.amount == Decimal("0.51")
    assert statement.total == Decimal("6.00")


def test_rerunning_rollups_and_pricing_changes_nothing(scenario: Team) -> None:
    before = sorted(
        UsageHour.objects.values_list(
            "hour", "device_uuid", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
        )
    )
    for hour in range(9, 14):
        rollup.rollup_hours(hours=[T10.replace(hour=hour)], now=T10 + timedelta(days=1))
    after = sorted(
        UsageHour.objects.values_list(
            "hour", "device_uuid", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
        )
    )
    assert before == after
    period = pricing.period_for(T10)
    first = [(s.total, s.lines.count()) for s in pricing.refresh_statements(period=period)]
    second = [(s.total, s.lines.count()) for s in pricing.refresh_statements(period=period)]
    assert first == second == [(Decimal("6.00"), 2)]


def test_late_data_for_a_closed_period_becomes_an_adjustment(scenario: Team) -> None:
    october = pricing.period_for(T10)
    services.close_period(period=october, actor="finance")
    frozen = list(
        StatementLine.objects.filter(statement__period=october).values_list("amount", flat=True)
    )
    with pytest.raises(PricingError, match="closed"):
        pricing.refresh_statements(period=october)
    # Late samples fill the H100's unmeasured half hour (11:01-11:30): it was idle.
    send_samples("GPU-H", T10 + timedelta(minutes=61), 29, 0.0)
    rollup.rollup_hours(hours=[T10.replace(hour=11)], now=T10 + timedelta(days=1))
    november = pricing.period_for(datetime(2026, 11, 10, tzinfo=UTC))
    (statement,) = pricing.refresh_statements(period=november)
    assert (
        list(
            StatementLine.objects.filter(statement__period=october).values_list("amount", flat=True)
        )
        == frozen
    )
    (adjustment,) = statement.lines.filter(kind="adjustment")
    assert adjustment.corrects_period == october
    assert adjustment.product_name == "NVIDIA H100 80GB HBM3"
    # 1740 s moved from unmeasured to idle: idle is now 3570 s, and the H100 line would be
    # 2.50 x (2.5 - 0.6 x 3570/3600) = 4.7625 -> 4.76 instead of the 5.49 billed.
    assert adjustment.unmeasured_gpu_hours == Decimal("-0.483333")
    assert adjustment.utilised_gpu_hours == Decimal(0)
    assert adjustment.allocated_gpu_hours == Decimal(0)
    assert adjustment.amount == Decimal("-0.73")
    assert statement.total == adjustment.amount
    # Refreshing again issues no second adjustment.
    (again,) = pricing.refresh_statements(period=november)
    assert again.lines.filter(kind="adjustment").count() == 1


def test_team_totals_add_up_to_the_fleet_total(scenario: Team) -> None:
    other = Team.objects.create(slug="nlp", name="NLP")
    TeamNamespace.objects.create(team=other, namespace="nlp")
    period = pricing.period_for(T10)
    statements = pricing.refresh_statements(period=period)
    fleet_ms = sum(UsageHour.objects.values_list("allocated_gpu_ms", flat=True))
    team_ms = sum(
        UsageHour.objects.filter(team__in=[s.team for s in statements]).values_list(
            "allocated_gpu_ms", flat=True
        )
    )
    unattributed = sum(
        UsageHour.objects.filter(team__isnull=True).values_list("allocated_gpu_ms", flat=True)
    )
    assert team_ms + unattributed == fleet_ms
    assert sum(s.total for s in statements) == sum(
        line.amount
        for team in (None, scenario, other)
        for line in pricing.usage_lines(team=team, period=period)
    )


def test_usage_of_every_team_in_one_pass_is_each_teams_usage(scenario: Team) -> None:
    """`usage_lines_by_team` (what statements are refreshed from: one pass over the period's
    rows) gives each team, and usage of no team, exactly the lines `usage_lines` gives it."""
    other = Team.objects.create(slug="nlp", name="NLP")
    TeamNamespace.objects.create(team=other, namespace="nlp")
    period = pricing.period_for(T10)
    by_team = pricing.usage_lines_by_team(period=period)
    assert by_team  # the scenario has usage
    for team in (None, scenario, other):
        expected = pricing.usage_lines(team=team, period=period)
        got = by_team.get(team.pk if team is not None else None, [])
        assert sorted(got, key=lambda line: line.key) == sorted(expected, key=lambda line: line.key)
    chosen = pricing.usage_lines_by_team(period=period, teams=[scenario])
    assert set(chosen) <= {scenario.pk}
    assert chosen.get(scenario.pk, []) == by_team.get(scenario.pk, [])


def test_a_mig_profile_card_prices_an_hour_of_the_slice(scenario: Team) -> None:
    """A rate card for the 3g.40gb profile takes precedence over the A100's own card, and its
    rate is the price of an hour of one slice, not of a GPU-hour: the MIG device's line keeps
    GPU-hours (its 3/7 share of the GPU), but is charged for slice-hours, at the profile's rate
    and idle factor, on a line of its own."""
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-80GB",
        profile="3g.40gb",
        per_gpu_hour=Decimal("0.90"),
        idle_factor=Decimal("0.5"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    # The MIG device measured idle (0%) all its hour: every minute's sample holds its minute.
    send_samples("MIG-A", T10, 60, 0.0)
    rollup.rollup_hours(hours=[T10], now=T10 + timedelta(days=1))
    (statement,) = pricing.refresh_statements(period=pricing.period_for(T10))
    lines = {(line.product_name, line.profile): line for line in statement.lines.all()}
    assert set(lines) == {("NVIDIA H100 80GB HBM3", ""), ("NVIDIA A100-SXM4-80GB", "3g.40gb")}
    mig = lines["NVIDIA A100-SXM4-80GB", "3g.40gb"]
    # 3,600,000 ms x 0.428571 = 1,542,856 GPU-ms = 0.428571 GPU-h, all of it idle.
    assert (mig.allocated_gpu_hours, mig.idle_gpu_hours) == (Decimal("0.428571"),) * 2
    assert (mig.utilised_gpu_hours, mig.unmeasured_gpu_hours) == (Decimal(0), Decimal(0))
    assert (mig.rate, mig.idle_factor) == (Decimal("0.90"), Decimal("0.5"))
    assert (mig.gpu_share, mig.rate_unit) == (Decimal("0.428571"), "slice-hour")
    # In slice-hours: 1,542,856 / 0.428571 = 3,600,000.93 ms = 1.00000026 h held, all idle.
    # 0.90 x (1.00000026 - (1 - 0.5) x 1.00000026) = 0.90 x 0.50000013 = 0.45000012 -> 0.45.
    # (Priced per GPU-hour, the same card would charge 0.90 x 0.2142855 = 0.19; the A100's
    # own card, 1.20 x (0.428571 - 0.6 x 0.428571) = 0.21.)
    assert mig.amount == Decimal("0.45")
    assert lines["NVIDIA H100 80GB HBM3", ""].amount == Decimal("5.49")
    assert lines["NVIDIA H100 80GB HBM3", ""].gpu_share is None
    assert statement.total == Decimal("5.94")


def test_without_its_profiles_card_a_slice_pays_its_share_of_the_gpus_price(
    scenario: Team,
) -> None:
    """A card for another profile changes nothing: the 3g.40gb slice is on the A100's line,
    priced per GPU-hour at the A100's rate, which is that rate times its share per slice-hour."""
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-80GB",
        profile="1g.10gb",
        per_gpu_hour=Decimal("0.30"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    (statement,) = pricing.refresh_statements(period=pricing.period_for(T10))
    (mig,) = statement.lines.filter(product_name="NVIDIA A100-SXM4-80GB")
    assert (mig.profile, mig.gpu_share, mig.rate_unit) == ("", None, "GPU-hour")
    # 1.20 x 1,542,856 / 3,600,000 = 1.20 x 3/7 x 1.00000026 = 0.514285... -> 0.51.
    assert (mig.rate, mig.amount) == (Decimal("1.20"), Decimal("0.51"))


@pytest.mark.parametrize(
    ("currency", "rate", "amount"),
    [
        # 0.7651 x (2.5 - 0.6 x 1830/3600) = 0.7651 x 2.195 = 1.6793945 -> 1.679 (fils).
        ("KWD", "0.7651", "1.679"),
        # 375 x 2.195 = 823.125 -> 823 (no minor unit).
        ("JPY", "375", "823"),
    ],
)
def test_amounts_are_stored_to_the_currencys_minor_unit(
    scenario: Team, currency: str, rate: str, amount: str
) -> None:
    RateCard.objects.filter(product_name="NVIDIA H100 80GB HBM3").update(
        currency=currency, per_gpu_hour=Decimal(rate)
    )
    period = pricing.period_for(T10)
    pricing.refresh_statements(period=period)
    line = StatementLine.objects.get(statement__currency=currency)
    assert (line.amount, line.statement.total) == (Decimal(amount), Decimal(amount))
    assert f"{pricing.round_money(line.amount, currency):f}" == amount
    # Every minor unit round_money knows fits what is stored.
    assert (
        max(pricing.MINOR_UNITS.values()) <= StatementLine._meta.get_field("amount").decimal_places
    )


@pytest.mark.parametrize(
    ("amount", "currency", "rounded"),
    [
        (Decimal("2.675"), "USD", "2.68"),
        (Decimal("-2.675"), "USD", "-2.68"),  # half away from zero
        (Fraction(1, 3), "USD", "0.33"),
        (Fraction(2469, 2000), "KWD", "1.235"),  # 1.2345
        (Fraction(-2469, 2000), "KWD", "-1.235"),
        (Fraction(1, 2), "JPY", "1"),
        (Decimal(0), "BHD", "0.000"),
    ],
)
def test_money_is_rounded_half_up_once_from_the_exact_amount(
    amount: Decimal | Fraction, currency: str, rounded: str
) -> None:
    assert str(pricing.round_money(amount, currency)) == rounded


def test_a_consumable_share_of_a_slice_pays_that_share_of_the_slices_price(
    scenario: Team, tmp_path: Path
) -> None:
    """A claim that consumed half the 3g.40gb slice's memory (KEP-5075) holds half the slice:
    an hour of it is half a slice-hour at the profile's price, not a whole one."""
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-80GB",
        profile="3g.40gb",
        per_gpu_hour=Decimal("0.90"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    half = claim("half", "gpu-1-mig-3g40gb-0", T10 + timedelta(hours=3))
    half["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = {"memory": "20Gi"}
    gone = claim("train", "gpu-0", T10, allocated=False)
    load_dump(tmp_path, [gone, half], T10 + timedelta(hours=3))
    load_dump(tmp_path, [gone], T10 + timedelta(hours=4))
    rollup.rollup_hours(hours=[T10.replace(hour=13)], now=T10 + timedelta(days=1))
    row = UsageHour.objects.get(claim_name="half")
    # 3,600,000 ms x 0.214286 (half of 3/7) = 771,430 GPU-ms, never measured.
    assert (row.gpu_share, row.allocated_gpu_ms) == (Decimal("0.214286"), 771_430)
    (statement,) = pricing.refresh_statements(period=pricing.period_for(T10))
    mig = statement.lines.get(profile="3g.40gb")
    # The tune claim's whole slice for an hour, 1,542,856 GPU-ms, and this half: 2,314,286
    # GPU-ms / 0.428571 = 5,400,006.07 ms = 1.50000169 slice-hours, all unmeasured (billed
    # whole): 0.90 x 1.50000169 = 1.35000152 -> 1.35. (Half a slice counted as a whole one
    # would be 0.90 x 2 = 1.80.)
    assert (mig.allocated_gpu_hours, mig.gpu_share) == (Decimal("0.642857"), Decimal("0.428571"))
    assert mig.amount == Decimal("1.35")


def test_a_price_change_within_a_closed_period_is_no_late_data(scenario: Team) -> None:
    """A month priced by two cards of one model has a line per price; once it is closed, the
    next period's statement has no adjustment for it until data for it arrives late."""
    h100_row = UsageHour.objects.filter(device_uuid="GPU-H").order_by("hour").first()
    assert h100_row is not None
    h100_row.pk, h100_row.hour = None, T10 - timedelta(days=1)  # an hour on 14 October too
    h100_row.save()
    RateCard.objects.filter(product_name="NVIDIA H100 80GB HBM3").update(
        valid_until=date(2026, 10, 15)
    )
    RateCard.objects.create(
        product_name="NVIDIA H100 80GB HBM3",
        per_gpu_hour=Decimal("3.00"),
        idle_factor=Decimal("0.4"),
        currency="USD",
        valid_from=date(2026, 10, 15),
    )
    october = pricing.period_for(T10)
    services.close_period(period=october, actor="finance")
    h100 = StatementLine.objects.filter(product_name="NVIDIA H100 80GB HBM3").order_by("rate")
    # 14 Oct: 1 h at 50% (0.5 h idle): 2.50 x (1 - 0.6 x 0.5) = 1.75. 15 Oct as before, at
    # 3.00: 3.00 x 2.195 = 6.585 -> 6.59.
    assert [(line.rate, line.amount) for line in h100] == [
        (Decimal("2.50"), Decimal("1.75")),
        (Decimal("3.00"), Decimal("6.59")),
    ]
    november = pricing.period_for(datetime(2026, 11, 10, tzinfo=UTC))
    assert pricing.refresh_statements(period=november) == []
    # Late data for the 14th is adjusted at that day's price.
    UsageHour.objects.filter(hour=T10 - timedelta(days=1)).update(utilised_gpu_ms=3_600_000)
    (statement,) = pricing.refresh_statements(period=november)
    (adjustment,) = statement.lines.all()
    # 2.50 x 1 = 2.50 instead of 1.75.
    assert (adjustment.rate, adjustment.amount) == (Decimal("2.50"), Decimal("0.75"))


def test_the_statement_says_a_rate_is_per_slice_hour(scenario: Team) -> None:
    RateCard.objects.create(
        product_name="NVIDIA A100-SXM4-80GB",
        profile="3g.40gb",
        per_gpu_hour=Decimal("0.90"),
        currency="USD",
        valid_from=date(2026, 1, 1),
    )
    call_command("run_billing", "--period", "2026-10", stdout=StringIO())
    out = StringIO()
    call_command(
        "statement", "--team", "vision", "--period", "2026-10", "--format", "json", stdout=out
    )
    lines = {line["product_name"]: line for line in json.loads(out.getvalue())["lines"]}
    mig, h100 = lines["NVIDIA A100-SXM4-80GB"], lines["NVIDIA H100 80GB HBM3"]
    # 1,542,856 GPU-ms / 0.428571 = 1.00000026 slice-hours, never measured: 0.90 -> 0.90.
    assert (mig["profile"], mig["unit"], mig["gpu_share"]) == ("3g.40gb", "slice-hour", "0.428571")
    assert (mig["allocated_gpu_hours"], mig["rate"], mig["amount"]) == (
        "0.428571",
        "0.9000",
        "0.90",
    )
    assert (h100["unit"], h100["gpu_share"]) == ("GPU-hour", None)
    out = StringIO()
    call_command("statement", "--team", "vision", "--period", "2026-10", stdout=out)
    text = out.getvalue()
    assert "0.9000/slice-h" in text
    assert "x idle) / the slice's share of its GPU (3g.40gb: 0.428571)" in text
