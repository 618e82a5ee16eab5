"""The team page's firing alerts and its snooze buttons: who sees them, who may press them, and
what a forged or malformed request gets (a message or a refusal, never a 500, nothing changed).
The last test presses the buttons in a real headless Chromium."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from pytest_django.live_server_helper import LiveServer

from teams.models import Alert, AlertKind, AlertState, AuditEntry
from tests.api.cast import Cast, cast
from tests.frontend.browsing import WIDE
from tests.frontend.conftest import watched_page
from tests.frontend.seed import PASSWORD

__all__ = ["cast"]


def _alert(cast: Cast, *, key: str = "c/alpha/uid-1", state: str = AlertState.FIRING) -> Alert:
    now = timezone.now()
    return Alert.objects.create(
        kind=AlertKind.IDLE_CLAIM,
        key=key,
        team=cast.alpha,
        subject=f"Idle claim alpha/{key.rsplit('/', 1)[-1]}",
        description="Under 5% of what it holds for 4 hours.",
        state=state,
        first_seen=now - timedelta(hours=5),
        last_seen=now,
        resolved_at=now if state == AlertState.RESOLVED else None,
    )


def _client(cast: Cast, who: str) -> Client:
    client = Client()
    client.force_login(getattr(cast, who))
    return client


def _snooze(client: Client, team: str, alert: Alert, hours: str) -> Any:
    url = reverse("alert-snooze", args=[team, alert.pk])
    return client.post(url, {"hours": hours}, follow=True)


@pytest.mark.django_db
def test_leads_and_operators_get_buttons_finance_only_reads(cast: Cast) -> None:
    firing = _alert(cast)
    resolved = _alert(cast, key="c/alpha/uid-2", state=AlertState.RESOLVED)
    team_page = reverse("team", args=["alpha"])
    for who, buttons in (("lead_a", True), ("operator", True), ("finance", False)):
        page = _client(cast, who).get(team_page).content.decode()
        assert firing.subject in page
        assert resolved.subject not in page
        snooze_url = reverse("alert-snooze", args=["alpha", firing.pk])
        assert (snooze_url in page) is buttons, who


@pytest.mark.django_db
def test_a_team_without_firing_alerts_shows_no_section(cast: Cast) -> None:
    _alert(cast, state=AlertState.RESOLVED)
    page = _client(cast, "lead_a").get(reverse("team", args=["alpha"])).content.decode()
    assert 'id="alerts-heading"' not in page


@pytest.mark.django_db
def test_a_lead_snoozes_and_lifts_it_audited(cast: Cast) -> None:
    alert = _alert(cast)
    client = _client(cast, "lead_a")
    before = timezone.now()
    response = _snooze(client, "alpha", alert, "24")
    assert response.status_code == 200
    assert response.redirect_chain[-1][0].endswith(
        reverse("team", args=["alpha"]) + "#alerts-heading"
    )
    alert.refresh_from_db()
    assert alert.snoozed_until is not None and alert.snoozed_by == cast.lead_a.username
    assert (
        before + timedelta(hours=24) <= alert.snoozed_until <= timezone.now() + timedelta(hours=24)
    )
    page = response.content.decode()
    assert "Snoozed “Idle claim alpha/uid-1” until" in page
    assert "Lift the snooze" in page
    assert AuditEntry.objects.filter(
        actor=cast.lead_a.username, object_type="alert", action="update"
    ).exists()

    response = _snooze(client, "alpha", alert, "0")
    alert.refresh_from_db()
    assert alert.snoozed_until is None and alert.snoozed_by == ""
    assert "Lifted the snooze" in response.content.decode()


@pytest.mark.django_db
@pytest.mark.parametrize("hours", ["", "5", "-1", "1e3", "٣", "9" * 5000, "24 ", "0x18"])
def test_hours_not_offered_are_refused_with_a_message(cast: Cast, hours: str) -> None:
    alert = _alert(cast)
    response = _snooze(_client(cast, "lead_a"), "alpha", alert, hours)
    assert response.status_code == 200
    assert "hours: must be 0 (lift) or one of 4, 24, 168" in response.content.decode()
    alert.refresh_from_db()
    assert alert.snoozed_until is None


@pytest.mark.django_db
def test_who_may_not_snooze_is_refused_and_nothing_changes(cast: Cast) -> None:
    alert = _alert(cast)
    url = reverse("alert-snooze", args=["alpha", alert.pk])
    # Finance reads the team but may not silence it.
    assert _client(cast, "finance").post(url, {"hours": "24"}).status_code == 403
    # Another team's lead: the team is not theirs to see (404), nor is the alert under theirs.
    assert _client(cast, "lead_b").post(url, {"hours": "24"}).status_code == 404
    other = reverse("alert-snooze", args=["beta", alert.pk])
    assert _client(cast, "lead_b").post(other, {"hours": "24"}).status_code == 404
    # A member without a role, and nobody at all.
    assert _client(cast, "member_a").post(url, {"hours": "24"}).status_code == 403
    assert Client().post(url, {"hours": "24"}).status_code == 302  # to the login page
    # Reading the URL does nothing.
    assert _client(cast, "lead_a").get(url).status_code == 405
    alert.refresh_from_db()
    assert alert.snoozed_until is None


@pytest.mark.django_db
def test_a_snooze_needs_the_csrf_token(cast: Cast) -> None:
    alert = _alert(cast)
    client = Client(enforce_csrf_checks=True)
    client.force_login(cast.lead_a)
    response = client.post(reverse("alert-snooze", args=["alpha", alert.pk]), {"hours": "24"})
    assert response.status_code == 403
    alert.refresh_from_db()
    assert alert.snoozed_until is None


@pytest.fixture
def wide(chromium: Any) -> Iterator[Any]:
    context = chromium.new_context(viewport=WIDE)
    context.set_default_timeout(15_000)
    with watched_page(context) as page:
        yield page


@pytest.mark.browser
def test_a_lead_presses_snooze_in_the_browser(
    wide: Any, live_server: LiveServer, transactional_db: None, cast: Cast
) -> None:
    cast.lead_a.set_password(PASSWORD)
    cast.lead_a.save()
    alert = _alert(cast)
    wide.goto(f"{live_server.url}/login/")
    wide.get_by_label("Username").fill(cast.lead_a.username)
    wide.get_by_label("Password").fill(PASSWORD)
    wide.get_by_role("button", name="Log in").click()
    wide.wait_for_load_state()
    wide.goto(f"{live_server.url}/teams/alpha/")
    item = wide.locator(f'li.alert[data-alert="{alert.pk}"]')
    item.get_by_label("Snooze for").select_option(label="a week")
    item.get_by_role("button", name="Snooze").click()
    wide.wait_for_load_state()
    assert "Snoozed “Idle claim alpha/uid-1” until" in wide.locator(".messages").inner_text()
    alert.refresh_from_db()
    assert alert.snoozed_until is not None
    assert alert.snoozed_until - timezone.now() > timedelta(days=6, hours=23)
    wide.locator(f'li.alert[data-alert="{alert.pk}"]').get_by_role(
        "button", name="Lift the snooze"
    ).click()
    wide.wait_for_load_state()
    alert.refresh_from_db()
    assert alert.snoozed_until is None
