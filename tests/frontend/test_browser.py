"""The portal in a real headless Chromium against the live server: log in through the form,
charts drawn by Chart.js with the seeded figures, the statement CSV downloaded, another
team's page refused with the portal's own page, the fleet's outlier node found, and the team
page at 1280 and 390 px wide without a spilling card, a hidden column or a clipped bar.
Full-page screenshots of the main pages go to tests/artifacts/ for a person to look at."""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from django.conf import LazySettings
from pytest_django.live_server_helper import LiveServer

from billing.models import RateCard
from frontend import selectors
from inventory.services import apply_watch_event
from metering.models import UsageHour
from quota.models import QuotaRule
from tests.factories import AllocationFactory, DeviceFactory, MigDeviceFactory, NodeFactory
from tests.frontend.browsing import PHONE, WIDE, log_in
from tests.frontend.conftest import watched_page
from tests.frontend.seed import OUTLIER_NODE, Portal

pytestmark = pytest.mark.browser

NARROW = {"width": 375, "height": 812}
# A claim and an owner with no place to break a line (the demo's look like these).
LONG_CLAIM = "tensorboard.experiment.resnet152.imagenet.finetune.run0042.gpu"
LONG_OWNER = "system:serviceaccount:researchplatform:pipelinerunner0042"

# Boxes on the page wider than their own width (content that spills or scrolls sideways).
OVERFLOWING = """() => [...document.querySelectorAll('.card, .table-scroll, table')]
    .filter(box => box.scrollWidth > box.clientWidth)
    .map(box => `${box.tagName}#${box.id || box.closest('section')?.getAttribute(
        'aria-labelledby')} ${box.scrollWidth} > ${box.clientWidth}`)"""
# Bars of the usage chart whose left or right edge lies outside the plot area.
BARS_OUTSIDE = """() => {
    const chart = Chart.getChart(document.getElementById('usage-chart'));
    const area = chart.chartArea;
    const outside = [];
    chart.data.datasets.forEach((dataset, index) => {
        chart.getDatasetMeta(index).data.forEach((bar, n) => {
            const left = bar.x - bar.width / 2, right = bar.x + bar.width / 2;
            if (left < area.left - 0.5 || right > area.right + 0.5) {
                outside.push(`${dataset.label} ${chart.data.labels[n]}: ${left}..${right}`
                    + ` outside ${area.left}..${area.right}`);
            }
        });
    });
    return outside;
}"""


@pytest.fixture
def page(chromium: Any) -> Iterator[Any]:
    context = chromium.new_context(viewport=WIDE, accept_downloads=True)
    context.set_default_timeout(15_000)
    with watched_page(context) as page:
        yield page


def _shot(page: Any, artifacts: Path, name: str) -> None:
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 1000, f"{path} is empty"


def _chart(page: Any, canvas_id: str) -> dict[str, Any]:
    """What Chart.js drew on the canvas: its size, and the chart's labels and datasets."""
    result: dict[str, Any] = page.evaluate(
        """(id) => {
            const canvas = document.getElementById(id);
            const chart = Chart.getChart(canvas);
            return {
                width: canvas.width,
                height: canvas.height,
                exists: chart !== undefined,
                labels: chart ? chart.data.labels : [],
                datasets: chart
                    ? chart.data.datasets.map(d => ({label: d.label, data: d.data}))
                    : [],
            };
        }""",
        canvas_id,
    )
    return result


def test_team_lead_sees_charts_and_downloads_the_statement(
    page: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    page.goto(f"{live_server.url}/login/")
    _shot(page, artifacts, "login")
    log_in(page, live_server, "lead_a")
    # A lead of one team lands on it.
    assert page.url == f"{live_server.url}/teams/vision/"
    assert page.get_by_role("heading", level=1).inner_text() == "Vision"
    assert page.evaluate("Chart.getChart(document.querySelector('canvas')) !== undefined")

    page.get_by_role("link", name="30 days").click()
    page.wait_for_load_state()
    usage = _chart(page, "usage-chart")
    assert usage["exists"] and usage["width"] > 0 and usage["height"] > 0
    assert len(usage["labels"]) == 30
    allocated = dict(zip(usage["labels"], usage["datasets"][0]["data"], strict=True))
    utilised = dict(zip(usage["labels"], usage["datasets"][1]["data"], strict=True))
    today = live_portal.now.date()
    seeded_days = [today - timedelta(days=n) for n in range(1, 30)]
    for day in seeded_days:
        seeded_allocated, seeded_utilised = live_portal.daily[day]
        assert Decimal(str(allocated[day.isoformat()])) == seeded_allocated.quantize(
            selectors.HOURS
        )
        assert Decimal(str(utilised[day.isoformat()])) == seeded_utilised.quantize(selectors.HOURS)
    assert allocated[today.isoformat()] == 0
    # The same figures are in the table beside the chart.
    page.get_by_text("Usage per day as a table").click()
    first_day = seeded_days[-1].isoformat()
    row = page.locator("#usage-table tbody tr", has_text=first_day)
    assert row.locator("td").first.inner_text() == str(
        live_portal.daily[seeded_days[-1]][0].quantize(selectors.HOURS)
    )

    burn = _chart(page, "burn-chart")
    assert burn["exists"] and burn["width"] > 0
    assert [dataset["label"] for dataset in burn["datasets"]] == ["Remaining budget", "Steady burn"]
    assert burn["datasets"][1]["data"][0] < 2000
    assert page.locator("#live-claims tbody tr").count() == live_portal.live_devices
    _shot(page, artifacts, "team")

    with page.expect_download() as download_info:
        page.locator("#statements a", has_text="CSV").last.click()
    download = download_info.value
    assert download.suggested_filename == (
        f"tally-vision-{live_portal.closed_period.start:%Y-%m}.csv"
    )
    rows = list(csv.reader(io.StringIO(Path(download.path()).read_text())))
    assert tuple(rows[0]) == selectors.CSV_COLUMNS
    line = dict(zip(rows[0], rows[1], strict=True))
    assert line["period_start"] == f"{live_portal.closed_period.start:%Y-%m-%d}"
    assert line["currency"] == "USD" and Decimal(line["amount"]) > 0

    # Another team's page is not found, not forbidden: its existence is not revealed.
    response = page.goto(f"{live_server.url}/teams/nlp/")
    assert response is not None and response.status == 404
    assert page.get_by_role("heading", name="Page not found").is_visible()
    _shot(page, artifacts, "not-found")

    # At a phone's width the page still fits: tables scroll inside their box.
    page.set_viewport_size(NARROW)
    page.goto(f"{live_server.url}/teams/vision/")
    assert page.evaluate("document.documentElement.scrollWidth") <= NARROW["width"]
    assert _chart(page, "usage-chart")["width"] > 0
    # The team's recent denials, each with why, inside its own scrolling box.
    assert page.get_by_role("heading", name="Denials and warnings").is_visible()
    denials = page.locator("table.objections tbody tr")
    assert denials.count() == 10
    assert "quota gpus exceeded: 17 > 16" in denials.first.inner_text()
    _shot(page, artifacts, "team-narrow")


def test_operator_finds_the_outlier_node(
    page: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    log_in(page, live_server, "operator")
    assert page.get_by_role("heading", name="Teams", exact=True).is_visible()
    page.get_by_role("link", name="Fleet", exact=True).click()
    page.wait_for_load_state()
    assert page.locator(".outlier-node").all_inner_texts() == [OUTLIER_NODE]
    outlier_row = page.locator("#nodes tbody tr.row-outlier")
    assert outlier_row.count() == 1
    assert outlier_row.locator("th").inner_text().startswith(OUTLIER_NODE)
    assert page.locator("#version-matrix tr.row-outlier").count() == 1
    _shot(page, artifacts, "fleet")

    # The outlier banner links the deviation register (empty: nothing is documented yet).
    page.locator("#version-banner").get_by_role("link", name="deviation register").click()
    page.wait_for_load_state()
    assert page.get_by_role("heading", name="Deviation register").is_visible()
    assert page.locator("#deviation-register tbody tr").all_inner_texts() == [
        "No deviation is documented: every GPU off its baseline is an outlier."
    ]
    page.get_by_role("link", name="Back to the fleet").click()
    page.wait_for_load_state()

    page.get_by_role("link", name="Admission decisions").click()
    page.wait_for_load_state()
    assert page.locator("#decisions tbody tr").count() == 50
    _shot(page, artifacts, "decisions")
    page.get_by_role("link", name="Older").click()
    assert page.locator("#decisions tbody tr").count() == 10

    # Filtered to one team's denials: 10 of team A's 30 (every third is denied).
    page.get_by_label("Team").select_option("vision")
    page.get_by_label("Outcome").select_option("denied")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_load_state()
    assert page.locator("#decisions tbody tr").count() == 10
    assert set(page.locator("#decisions tbody tr td:nth-child(3)").all_inner_texts()) == {"vision"}


@pytest.mark.parametrize("viewport", [WIDE, PHONE], ids=["1280", "390"])
def test_team_page_fits_and_reads_right_at_each_width(
    page: Any,
    live_server: LiveServer,
    live_portal: Portal,
    artifacts: Path,
    viewport: dict[str, int],
) -> None:
    """Issue 21 (4): no card or table spills or hides columns behind a scroll, the first and
    last bars are inside the plot, quota figures are rounded for people and a slice price
    says what a slice is."""
    team = live_portal.team_a
    QuotaRule.objects.filter(team=team, name="gpus").update(in_use=Decimal("3.999996"))
    waster = selectors.top_wasters(
        team=team, since=live_portal.now - timedelta(days=30), until=live_portal.now
    )[0]
    UsageHour.objects.filter(team=team, claim_name=waster.claim_name).update(
        claim_name=LONG_CLAIM, username=LONG_OWNER
    )
    mig = UsageHour.objects.filter(team=team).exclude(profile="").first()
    assert mig is not None and mig.allocation.device is not None
    share = Fraction(mig.allocation.device.gpu_share)
    RateCard.objects.create(
        product_name=mig.product_name,
        profile=mig.profile,
        per_gpu_hour=Decimal("0.2500"),
        currency="USD",
        valid_from=live_portal.now.date() - timedelta(days=400),
    )
    page.set_viewport_size(viewport)
    log_in(page, live_server, "lead_a")
    page.goto(f"{live_server.url}/teams/vision/?days=30")
    page.evaluate("document.querySelectorAll('details').forEach(d => { d.open = true; })")

    assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
    assert page.evaluate(OVERFLOWING) == []
    assert page.evaluate(BARS_OUTSIDE) == []
    assert len(_chart(page, "usage-chart")["labels"]) == 30

    gpus = page.get_by_role("rowheader", name="gpus", exact=True)
    in_use = page.locator("#quota tbody tr", has=gpus).locator("td[data-label='In use']")
    assert in_use.inner_text() == "4"
    # Every column of the quota is on screen, not behind a scroll.
    for cell in page.locator("#quota tbody tr").first.locator("th, td").all():
        box = cell.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"]
    assert page.locator("#wasters", has_text=LONG_CLAIM).is_visible()
    note = page.locator("#idle .slice-note")
    assert note.count() == 1 and note.is_visible()
    found = re.search(r"1 slice = (\d+)/(\d+) GPU", note.inner_text())
    assert found is not None
    assert abs(Fraction(int(found[1]), int(found[2])) - share) < Fraction(1, 10**6)
    _shot(page, artifacts, f"team-{viewport['width']}")


@pytest.mark.parametrize("viewport", [WIDE, PHONE], ids=["1280", "390"])
def test_refusals_are_the_portals_own_pages(
    page: Any,
    live_server: LiveServer,
    live_portal: Portal,
    artifacts: Path,
    settings: LazySettings,
    viewport: dict[str, int],
) -> None:
    """With DEBUG on (as on a developer's machine) another team's page is still the portal's
    404, and the fleet its 403: the portal's header and a way back, no debug page."""
    settings.DEBUG = True
    page.set_viewport_size(viewport)
    log_in(page, live_server, "lead_a")
    for url, status, heading, name in (
        ("/teams/nlp/", 404, "Page not found", "not-found"),
        ("/fleet/", 403, "Not allowed", "forbidden"),
    ):
        response = page.goto(f"{live_server.url}{url}")
        assert response is not None and response.status == status
        assert page.get_by_role("heading", level=1).inner_text() == heading
        assert page.locator(".site-header .nav").is_visible()
        assert page.get_by_role("link", name="Back to your teams").is_visible()
        assert "Django" not in page.content()
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
        _shot(page, artifacts, f"{name}-{viewport['width']}")


def test_operator_sees_sync_warnings_and_a_partly_used_a100_node(
    page: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    """Issue 18: the fleet page's "Sync warnings" card lists what the sync cannot trust, and
    an A100 node with one 1g slice held reads partly used, 6/7 free, 1g.5gb placeable."""
    cluster = live_portal.cluster
    node = NodeFactory.create(cluster=cluster, name="a100-solo")
    a100 = DeviceFactory.build(node=node, product_name="NVIDIA A100-SXM4-40GB", uuid="GPU-solo")
    slices = MigDeviceFactory.create_batch(
        7, parent=a100, profile="1g.5gb", gpu_share=Decimal("0.142857")
    )
    AllocationFactory.create(device=slices[0])
    dangling = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "gpu-node-9-example"},
        "spec": {
            "driver": "gpu.example.com",
            "pool": {"name": "gpu-node-9", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "gpu-node-9",
            "devices": [
                {
                    "name": "gpu-0-half",
                    "consumesCounters": [
                        {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "40Gi"}}}
                    ],
                }
            ],
        },
    }
    apply_watch_event(cluster=cluster, event_type="ADDED", obj=dangling, at=live_portal.now)

    log_in(page, live_server, "operator")
    page.goto(f"{live_server.url}/fleet/")

    warnings = page.get_by_role("region", name="Sync warnings")
    assert warnings.is_visible()
    [shown] = page.locator("#sync-warnings li").all_inner_texts()
    assert re.fullmatch(
        "pool gpu.example.com/gpu-node-9 generation 1: counter set 'gpu-0-counters', consumed "
        r"by device gpu-0-half, is published by no slice; since \d{4}-\d\d-\d\d \d\d:\d\d UTC "
        r"\(\d+ s\)",
        shown,
    ), shown
    row = page.locator("#nodes tbody tr", has_text="a100-solo")
    cells = row.locator("th, td").all_inner_texts()
    assert cells[5:] == ["0.86 GPUs", "1g.5gb: 6", "1g.5gb", "partly used, 1 partly held"]
    gpu = page.locator("#partial-gpus tbody tr", has=page.locator("code", has_text="GPU-solo"))
    assert gpu.locator("td").all_inner_texts()[2:] == [
        "1/7",
        "6/7 GPU",
        "1g.5gb: 1",
        "1g.5gb: 6",
        "1g.5gb",
    ]
    assert page.evaluate(OVERFLOWING) == []
    _shot(page, artifacts, "fleet-sync-warnings")


def test_the_api_docs_load_nothing_from_outside_and_every_page_has_its_icon(
    page: Any, live_server: LiveServer, live_portal: Portal
) -> None:
    """Issue 35, finding 9: Redoc's bundle asked Redocly's CDN for its logo, and
    `/favicon.ico` was a 404 on every page. Every request the browser makes is watched: any
    to another host is recorded (and refused, as offline)."""
    here = live_server.url.split("//", 1)[1]
    outside: list[str] = []

    def watch(route: Any) -> None:
        url = route.request.url
        if url.split("//", 1)[-1].split("/", 1)[0] == here or url.startswith(("data:", "blob:")):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    page.route("**/*", watch)
    log_in(page, live_server, "lead_a")
    page.goto(f"{live_server.url}/api/docs/")
    page.get_by_role("heading", name=re.compile("Tally")).first.wait_for()
    page.get_by_text("API docs by Redocly").wait_for()  # the footer whose logo it was
    page.wait_for_load_state("networkidle")
    assert outside == []

    # What the browser asks for on a page with no icon link (the admin's, the API's).
    icon = page.request.get(f"{live_server.url}/favicon.ico")
    assert icon.status == 200
    assert icon.headers["content-type"] in ("image/x-icon", "image/vnd.microsoft.icon")
    assert icon.body()[:4] == b"\x00\x00\x01\x00"  # an ICO file
    page.goto(f"{live_server.url}/teams/vision/")
    linked = page.locator("link[rel=icon]").get_attribute("href")
    assert linked is not None and page.request.get(f"{live_server.url}{linked}").ok
