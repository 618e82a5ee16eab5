"""The demo `python3 dev.py serve` loads: consistent (billing it again changes nothing, and
time passing only adds the hours its open claims hold after the load), and showing what Tally
is for (an outlier node, a partly used MIG GPU, a denied claim, a claim idle for days).

The demo is loaded once for the module, at a stopped clock, in a transaction rolled back at
the end; each test runs in a savepoint inside it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from io import StringIO
from typing import Any

import pytest
import time_machine
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.test import Client, override_settings
from django.urls import reverse

from billing import tasks
from billing.idle import idle_claims
from billing.models import Period, Statement, StatementLine
from frontend import selectors as portal
from inventory import selectors as fleet
from inventory.models import Allocation, Device, DeviceKind, ResourceClaim
from metering.hours import epoch_ms, hour_start
from metering.models import DirtyHour, UsageHour
from quota.models import AdmissionDecision, Reservation
from teams.models import Team
from tests.factories import owner_of

pytestmark = pytest.mark.django_db

# A moment of the demo's life: mid-hour, three days into December, so November (the period
# before) is due to close (TALLY_CLOSE_PERIOD_DAY=3) and the week of history spans both.
LOADED_AT = datetime(2026, 12, 3, 21, 30, 17, 250_000, tzinfo=UTC)
CSRF = re.compile(r'(name="csrfmiddlewaretoken" value=|csrf[-_]token[^"]*" content=)"[^"]*"')


@pytest.fixture(scope="module")
def demo(django_db_setup: None, django_db_blocker: Any) -> Iterator[str]:
    """`load_demo` as `dev.py serve` runs it, at `LOADED_AT` with the clock stopped there; its
    output."""
    out = StringIO()
    with (
        time_machine.travel(LOADED_AT, tick=False),
        override_settings(
            TALLY_BILLING_PERIOD="month",
            TALLY_CLOSE_PERIOD_DAY=3,
            TALLY_SAMPLE_HOLD_SECONDS=120,
            PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"],
        ),
        django_db_blocker.unblock(),
        transaction.atomic(),
    ):
        call_command("load_demo", stdout=out)
        yield out.getvalue()
        transaction.set_rollback(True)


def as_user(username: str) -> Client:
    client = Client()
    client.force_login(get_user_model().objects.get(username=username))
    return client


def page(client: Client, url: str) -> str:
    response = client.get(url)
    assert response.status_code == 200, (url, response.status_code)
    return CSRF.sub("", response.content.decode())


def figures() -> dict[str, Any]:
    """Every figure the demo shows or bills: statement totals and lines, usage rows, and each
    team's page and statement CSVs as finance (who sees every team) gets them."""
    finance = as_user("finance")
    pages = {}
    for team in Team.objects.order_by("slug"):
        url = reverse("team", kwargs={"slug": team.slug})
        pages[url] = page(finance, url)
        pages[url + "?days=30"] = page(finance, url + "?days=30")
        for period_id in Statement.objects.filter(team=team).values_list("period_id", flat=True):
            csv = reverse("statement-csv", kwargs={"slug": team.slug, "period_id": period_id})
            pages[csv] = page(finance, csv)
    return {
        "totals": list(
            Statement.objects.order_by("team__slug", "period__start", "currency").values_list(
                "team__slug", "period__start", "currency", "total"
            )
        ),
        "lines": list(
            StatementLine.objects.order_by(
                "statement__team__slug", "statement__period__start", "kind", "product_name", "pk"
            ).values_list(
                "statement__team__slug",
                "statement__period__start",
                "kind",
                "product_name",
                "profile",
                "allocated_gpu_hours",
                "utilised_gpu_hours",
                "idle_gpu_hours",
                "unmeasured_gpu_hours",
                "amount",
            )
        ),
        "usage": usage_rows(),
        "periods": list(Period.objects.order_by("start").values_list("start", "closed_at")),
        "pages": pages,
    }


def usage_rows() -> dict[tuple[datetime, int], tuple[int, int, int]]:
    return {
        (hour, allocation): (allocated, utilised, unmeasured)
        for hour, allocation, allocated, utilised, unmeasured in UsageHour.objects.values_list(
            "hour", "allocation_id", "allocated_gpu_ms", "utilised_gpu_ms", "unmeasured_gpu_ms"
        )
    }


def sampled_allocations() -> list[Allocation]:
    """The allocations of devices that are metered (every accelerator, by its meter id: a
    partition not created yet, without a UUID, too)."""
    return list(
        Allocation.objects.filter(device__isnull=False)
        .exclude(device__meter_id="")
        .select_related("device")
    )


# --- consistent -------------------------------------------------------------------------------


def test_every_hour_the_claims_held_is_measured_and_rolled_up(demo: str) -> None:
    allocations = sampled_allocations()
    assert allocations
    rows = UsageHour.objects.values("allocation_id").annotate(
        rows=Count("pk"), allocated=Sum("allocated_gpu_ms"), unmeasured=Sum("unmeasured_gpu_ms")
    )
    by_allocation = {row["allocation_id"]: row for row in rows}
    for allocation in allocations:
        assert allocation.device is not None
        held_ms = epoch_ms(LOADED_AT) - epoch_ms(allocation.start)
        row = by_allocation[allocation.pk]
        expected = held_ms * allocation.device.gpu_share
        # Each row rounds to the GPU-millisecond once.
        assert abs(row["allocated"] - expected) <= row["rows"], allocation
        assert row["unmeasured"] == 0, allocation
    # Nothing left to roll up but the hour the demo was loaded in, rolled up to then: marked,
    # to be rolled up again once it has ended.
    assert list(DirtyHour.objects.values_list("hour", flat=True)) == [hour_start(LOADED_AT)]


def test_the_previous_period_is_closed_and_the_current_one_billed_to_now(demo: str) -> None:
    periods = list(Period.objects.order_by("start"))

    assert [(period.label, period.is_closed) for period in periods] == [
        ("2026-11", True),
        ("2026-12", False),
    ]
    assert periods[0].closed_by == "load_demo"
    for period in periods:
        assert Statement.objects.filter(period=period).exclude(total=0).exists(), period
    assert "Period 2026-11 billed and closed:" in demo
    assert "Period 2026-12 billed to 2026-12-03 21:30 UTC, open:" in demo
    # The frozen statements are what their period's usage prices now: nothing to adjust.
    assert not StatementLine.objects.filter(corrects_period__isnull=False).exists()


def test_billing_again_changes_nothing(demo: str) -> None:
    before = figures()

    for period in Period.objects.order_by("start"):
        if period.is_closed:
            with pytest.raises(CommandError, match=f"period {period.label} .* is already closed"):
                call_command("run_billing", period=period.label)
        else:
            call_command("run_billing", period=period.label, stdout=StringIO())
    # What beat runs: the rollup of the hour just ended and the marked ones, and the close.
    tasks.rollup_pending()
    assert tasks.close_previous_period() is None

    assert figures() == before


def test_a_minute_after_the_load_nothing_held_is_unmeasured(demo: str) -> None:
    """Every claim still held was sampled at the load: billing a minute later adds allocated
    time, all of it measured."""
    with time_machine.travel(LOADED_AT + timedelta(minutes=1), tick=False):
        call_command("run_billing", period="2026-12", stdout=StringIO())
    assert sum(row[2] for row in usage_rows().values()) == 0


def test_an_hour_later_only_the_hours_since_the_load_are_added(demo: str) -> None:
    before = figures()
    load_hour = hour_start(LOADED_AT)
    open_allocations = [a for a in sampled_allocations() if a.end is None]
    assert open_allocations

    with time_machine.travel(LOADED_AT + timedelta(hours=1), tick=False):
        tasks.rollup_pending()
        call_command("run_billing", period="2026-12", stdout=StringIO())

    after = usage_rows()
    # The hours before the load's own are as they were, row for row.
    assert {key: row for key, row in after.items() if key[0] < load_hour} == {
        key: row for key, row in before["usage"].items() if key[0] < load_hour
    }
    # The open claims held one hour more, unmeasured past the last sample's hold.
    added_ms = sum(after[key][0] for key in after if key[0] >= load_hour) - sum(
        row[0] for key, row in before["usage"].items() if key[0] >= load_hour
    )
    expected = sum(3_600_000 * a.device.gpu_share for a in open_allocations if a.device)
    assert abs(added_ms - expected) <= 2 * len(open_allocations)
    assert sum(after[key][2] for key in after if key[0] >= load_hour) > 0
    # November is frozen; December's statements only grow.
    november = [row for row in before["totals"] if row[1].month == 11]
    assert november and [row for row in figures()["totals"] if row[1].month == 11] == november
    totals_after = {row[:3]: row[3] for row in figures()["totals"]}
    for team, start, currency, total in before["totals"]:
        assert totals_after[team, start, currency] >= total


def test_loading_the_demo_again_changes_nothing_and_says_so(demo: str) -> None:
    before = figures()
    decisions = AdmissionDecision.objects.count()
    out = StringIO()

    call_command("load_demo", stdout=out)

    assert "already has 247 devices; no import" in out.getvalue()
    assert AdmissionDecision.objects.count() == decisions
    assert figures() == before


# --- what it shows ----------------------------------------------------------------------------


def test_the_fleet_has_an_outlier_node_and_the_fleet_page_shows_it(demo: str) -> None:
    versions = fleet.version_matrix()
    outlier = "default/gpu-h100-00001"

    assert versions["outlier_nodes"] == [outlier]
    baseline = [row for row in versions["rows"] if row["baseline"]]
    # One baseline per model; every model's is the same pair here.
    assert {(row["driver_version"], row["cuda_driver_version"]) for row in baseline} == {
        ("580.82.7", "13.0.0")
    }
    assert any(
        not row["baseline"] and row["driver_version"] == "570.172.8" and outlier in row["nodes"]
        for row in versions["rows"]
    )
    html = page(as_user("operator"), reverse("fleet"))
    outlier_gpus = versions["outlier_gpus"]
    assert f"{outlier_gpus} outlier GPUs</strong> on 1 node," in html and "gpu-h100-00001" in html
    report = StringIO()
    call_command("fleet_report", stdout=report)
    assert "Outlier nodes, undocumented (1)" in report.getvalue()


def test_a_mig_gpu_is_partly_used_and_its_team_sees_the_slice(demo: str) -> None:
    held = Q(allocations__pk__isnull=False, allocations__end__isnull=True)
    gpus = (
        Device.objects.filter(kind=DeviceKind.MIG, gone_at__isnull=True)
        .exclude(uuid="")
        .values("physical_gpu_key")
        .annotate(slices=Count("pk", distinct=True), held=Count("pk", filter=held, distinct=True))
        .filter(held__gt=0)
    )
    partly = [gpu for gpu in gpus if gpu["held"] < gpu["slices"]]
    assert partly, list(gpus)

    slice_held = Allocation.objects.select_related("device", "claim").get(
        end__isnull=True, device__physical_gpu_key=partly[0]["physical_gpu_key"]
    )
    team = owner_of(slice_held)
    assert team is not None and slice_held.device is not None
    lead = as_user(f"lead-{team.slug}")
    html = page(lead, reverse("team", kwargs={"slug": team.slug}))
    assert slice_held.claim.name in html and slice_held.device.profile in html
    node = slice_held.device.node
    assert node is not None
    assert any(
        row["node"] == node.name and 0 < row["allocated"] < row["gpus"]
        for row in fleet.fragmentation(cluster=node.cluster)["nodes"]
    )


def test_the_decision_log_shows_a_claim_the_quota_denied(demo: str) -> None:
    (denied,) = AdmissionDecision.objects.filter(allowed=False)

    assert denied.team is not None
    assert re.fullmatch(
        rf'team "{denied.team.slug}": quota rule "[a-z0-9-]+" \(enforce\) would be exceeded: '
        r"[\d.]+ GPUs? in use, [\d.]+ GPUs? requested, limit [\d.]+ GPUs?",
        denied.message,
    ), denied.message
    # Denied, so nothing reserved and no claim in the cluster.
    assert not Reservation.objects.filter(namespace=denied.namespace, name=denied.name).exists()
    assert not ResourceClaim.objects.filter(name=denied.name).exists()
    assert f"Denied {denied.namespace}/{denied.name}: {denied.message}" in demo
    html = page(as_user("operator"), reverse("decisions"))
    assert denied.name in html and "would be exceeded" in html


def test_a_claim_idle_for_days_tops_its_teams_wasters(demo: str) -> None:
    found = re.search(r"Idle since it began: claim ([a-z0-9-]+)/([a-z0-9-]+)\.", demo)
    assert found, demo
    claim = ResourceClaim.objects.get(namespace=found[1], name=found[2])
    held = claim.allocations.filter(end__isnull=True)
    usage = UsageHour.objects.filter(allocation__claim=claim).aggregate(
        allocated=Sum("allocated_gpu_ms"), utilised=Sum("utilised_gpu_ms")
    )

    assert held.exists() and all(a.start <= LOADED_AT - timedelta(days=2) for a in held)
    assert usage["allocated"] > 0 and usage["utilised"] < Decimal("0.02") * usage["allocated"]
    team = Team.objects.get(namespaces__namespace=claim.namespace)
    wasters = portal.top_wasters(team=team, since=LOADED_AT - timedelta(days=7), until=LOADED_AT)
    assert wasters[0].claim_name == claim.name
    html = page(as_user(f"lead-{team.slug}"), reverse("team", kwargs={"slug": team.slug}))
    assert claim.name in html


def test_idle_alerts_are_on_by_default_for_the_demos_teams(demo: str) -> None:
    """Issue 35, finding 2: vision and speech have no `idleAlert` in the demo's policy, yet
    their claims idle for days are alerted (the default rule) and their pages say so."""
    with time_machine.travel(LOADED_AT, tick=False):
        alerted = {(claim.team.slug, claim.claim_name) for claim in idle_claims(now=LOADED_AT)}
    teams = {slug for slug, _ in alerted}
    assert {"vision", "speech"} <= teams, alerted
    assert any(slug == "speech" and name.startswith("tts-serve") for slug, name in alerted)
    html = page(as_user("lead-speech"), reverse("team", kwargs={"slug": "speech"}))
    assert "Tally&#x27;s default rule" in html or "Tally's default rule" in html
