"""Layouts in a real headless Chromium (issue 35, finding 8): at 390 px the fleet page's Status
column and the decision log's Decision and Message columns were off screen (the team pages
switch to cards, these did not); at 1280 px the team page's side-by-side cards wrapped model
names over five lines and broke claim names mid-word. Also the new home pages of finance and
operators at both widths."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from pytest_django.live_server_helper import LiveServer

from billing.models import Period
from frontend import selectors
from metering.models import UsageHour
from tests.frontend.browsing import PHONE, WIDE, log_in, open_page
from tests.frontend.seed import PASSWORD, Portal
from tests.frontend.test_browser import LONG_CLAIM, LONG_OWNER
from tests.frontend.test_cluster_pages import _second_cluster

pytestmark = pytest.mark.browser

# Cells of the page's tables lying (partly) outside the viewport's width, as "table#id: text".
CUT_OFF = """() => [...document.querySelectorAll('main table')]
    .filter(table => table.offsetParent !== null)
    .flatMap(table => [...table.querySelectorAll('th, td')]
        .filter(cell => cell.offsetParent !== null && cell.getClientRects().length)
        // In cards mode the header row is hidden (clipped to 1 px): only the cells count.
        .filter(cell => !(cell.closest('thead')
            && getComputedStyle(cell.closest('thead')).position === 'absolute'))
        .filter(cell => {
            const box = cell.getBoundingClientRect();
            return box.width > 0 && (box.left < -0.5 || box.right > window.innerWidth + 0.5);
        })
        .map(cell => `table#${table.id || table.className}: ${cell.textContent.trim().slice(0, 40)}`
            + ` (${Math.round(cell.getBoundingClientRect().left)}..`
            + `${Math.round(cell.getBoundingClientRect().right)})`))"""
# Whether the table shows its rows as cards (each row a block, each cell named).
IN_CARDS = (
    """(id) => getComputedStyle(document.querySelector(`#${id} tbody tr`)).display === 'block'"""
)
# Name elements whose text is cut (wider than their box).
CLIPPED = """(selector) => [...document.querySelectorAll(selector)]
    .filter(el => el.scrollWidth > el.clientWidth + 1)
    .map(el => el.textContent.trim())"""
# Per element: its text and over how many lines it is laid out.
LINES = """(selector) => [...document.querySelectorAll(selector)].map(el => {
    const range = document.createRange();
    range.selectNodeContents(el);
    const tops = new Set([...range.getClientRects()]
        .filter(rect => rect.width > 0).map(rect => Math.round(rect.top / 4)));
    return [el.textContent.trim(), tops.size];
})"""
# Per element: the characters a line break follows inside its text (none when on one line).
BREAKS_AFTER = """(selector) => [...document.querySelectorAll(selector)].map(el => {
    const text = el.firstChild;
    const after = [];
    let top = null;
    for (let i = 0; text && i < text.length; i++) {
        const range = document.createRange();
        range.setStart(text, i);
        range.setEnd(text, i + 1);
        const rect = range.getClientRects()[0];
        if (!rect) continue;
        if (top !== null && rect.top > top + 2) after.push(text.data[i - 1]);
        top = rect.top;
    }
    return [el.textContent, after];
})"""
# Where a long name may break: after a hyphen, never inside a word.
NAME_BREAKS = {"-"}


def _fits(page: Any, width: int) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    cut_off = page.evaluate(CUT_OFF)
    assert cut_off == [], "\n".join(cut_off)


def test_fleet_and_decision_log_fit_a_phone(
    phone: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    log_in(phone, live_server, "operator")
    phone.goto(f"{live_server.url}/fleet/")
    _fits(phone, PHONE["width"])
    for table in ("version-matrix", "version-baselines", "nodes", "free-blocks"):
        assert phone.evaluate(IN_CARDS, table), table
    status = phone.locator("#version-matrix tbody td[data-label='Status']").first
    assert status.is_visible()
    assert "baseline" in status.inner_text() or "outlier" in status.inner_text()
    phone.screenshot(path=str(artifacts / "fleet-390.png"), full_page=True)

    phone.goto(f"{live_server.url}/fleet/decisions/")
    _fits(phone, PHONE["width"])
    assert phone.evaluate(IN_CARDS, "decisions")
    denied = phone.locator("#decisions tbody tr", has_text="denied").first
    for label in ("Decision", "Message"):
        cell = denied.locator(f"td[data-label='{label}']")
        box = cell.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    assert "quota gpus exceeded" in denied.locator("td[data-label='Message']").inner_text()
    phone.screenshot(path=str(artifacts / "decisions-390.png"), full_page=True)


def test_team_page_names_fit_their_cards_at_1280(
    wide: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    team = live_portal.team_a
    waster = selectors.top_wasters(
        team=team, since=live_portal.now - timedelta(days=30), until=live_portal.now
    )[0]
    UsageHour.objects.filter(team=team, claim_name=waster.claim_name).update(
        claim_name=LONG_CLAIM, username=LONG_OWNER
    )
    log_in(wide, live_server, "lead_a")
    wide.goto(f"{live_server.url}/teams/vision/?days=30")
    _fits(wide, WIDE["width"])
    assert wide.evaluate(CLIPPED, "main .break, main th[scope=row], .model-name") == []
    models = wide.evaluate(LINES, "#idle .model-name")
    assert models and all(lines <= 2 for _, lines in models), models
    names = wide.evaluate(BREAKS_AFTER, "#wasters .claim-name, #live-claims .claim-name")
    assert any(name == LONG_CLAIM for name, _ in names)
    assert all(set(after) <= NAME_BREAKS for _, after in names), names
    wide.screenshot(path=str(artifacts / "team-cards-1280.png"), full_page=True)


@pytest.mark.parametrize("viewport", [WIDE, PHONE], ids=["1280", "390"])
def test_finance_and_operator_homes_fit(
    chromium: Any,
    live_server: LiveServer,
    live_portal: Portal,
    artifacts: Path,
    viewport: dict[str, int],
) -> None:
    finance = User.objects.get(username="finance")
    finance.set_password(PASSWORD)
    finance.save()
    for who, heading in (("finance", "Spend and periods"), ("operator", "Fleet and teams")):
        for page in open_page(chromium, viewport):
            log_in(page, live_server, who)
            assert page.get_by_role("heading", level=1).inner_text() == heading
            _fits(page, viewport["width"])
            if who == "finance":
                assert page.locator("#spend-trend svg.bar").count() >= 2
                assert page.get_by_role("link", name="CSV").is_visible()
            page.screenshot(
                path=str(artifacts / f"home-{who}-{viewport['width']}.png"), full_page=True
            )


def test_finance_closes_a_period_from_its_home_on_a_phone(
    phone: Any, live_server: LiveServer, live_portal: Portal, artifacts: Path
) -> None:
    """The close as finance does it: the home's Close… link, the confirmation page (which fits
    a phone), its button; the period is closed by them and the home says so."""
    period = live_portal.closed_period
    Period.objects.filter(pk=period.pk).update(closed_at=None, closed_by="")
    finance = User.objects.get(username="finance")
    finance.set_password(PASSWORD)
    finance.save()
    log_in(phone, live_server, "finance")
    phone.get_by_role("link", name=f"Close {period.label}…").click()
    phone.wait_for_load_state()
    assert phone.get_by_role("heading", level=1).inner_text() == f"Close {period.label}"
    _fits(phone, PHONE["width"])
    assert phone.locator("#close-statements tbody tr:not(.total-row)").count() == 2
    assert "All teams" in phone.locator("#close-statements tr.total-row").inner_text()
    phone.screenshot(path=str(artifacts / "period-close-390.png"), full_page=True)
    phone.get_by_role("button", name=f"Close {period.label} and freeze its statements").click()
    phone.wait_for_load_state()
    assert (
        f"Closed {period.label}: 2 statements frozen, by finance."
        in phone.locator(".messages").inner_text()
    )
    period.refresh_from_db()
    assert period.is_closed and period.closed_by == "finance"
    row = phone.locator("#period-states tbody tr", has_text=period.label)
    assert "closed" in row.inner_text()


@pytest.mark.parametrize("viewport", [WIDE, PHONE], ids=["1280", "390"])
def test_the_cluster_column_fits_the_team_page(
    chromium: Any,
    live_server: LiveServer,
    live_portal: Portal,
    artifacts: Path,
    viewport: dict[str, int],
) -> None:
    """With two clusters the team page's lists gain a Cluster column and a filter: still
    nothing cut off, at either width."""
    _second_cluster(live_portal)
    for page in open_page(chromium, viewport):
        log_in(page, live_server, "lead_a")
        page.goto(f"{live_server.url}/teams/vision/")
        assert page.locator("#cluster-filter").is_visible()
        assert page.locator("#live-claims tbody td[data-label='Cluster']").count() > 0
        _fits(page, viewport["width"])
        page.get_by_label("Cluster").select_option("lab")
        page.get_by_role("button", name="Show").click()
        page.wait_for_load_state()
        assert page.url.endswith("?cluster=lab")
        cells = page.locator("#live-claims tbody td[data-label='Cluster']").all_inner_texts()
        assert cells and set(cells) == {"lab"}
        _fits(page, viewport["width"])
        page.screenshot(path=str(artifacts / f"team-clusters-{viewport['width']}.png"))
