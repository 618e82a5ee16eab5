"""Bill shock is an alert (issue 33, finding 8): a team's open-period total that jumps by more
than TALLY_BILL_SHOCK_PERCENT within an hour, or a closed period's money that changes, raises
an operator alert naming what ran the refresh and what the syncs and imports brought in."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.contrib.auth.models import User
from django.test import override_settings

from billing import services
from billing.pricing import period_for, refresh_statements
from teams.models import Alert, AlertKind, AlertState, Team
from tests.billing.test_ledger import hold, month, seed_billing
from tests.factories import DeviceFactory

pytestmark = pytest.mark.django_db

DECEMBER, JANUARY = month(2024, 12), month(2025, 1)
NOON = JANUARY + timedelta(days=10, hours=12)


def shocks() -> list[Alert]:
    return list(Alert.objects.filter(kind=AlertKind.BILL_SHOCK, state=AlertState.FIRING))


@pytest.fixture
def operator() -> User:
    return User.objects.create_user(username="ops", email="ops@example.com", is_staff=True)


@pytest.mark.usefixtures("operator")
def test_a_total_that_jumps_within_an_hour_raises_an_operator_alert_naming_the_cause() -> None:
    nlp = Team.objects.create(slug="nlp", name="NLP")
    seed_billing([nlp])
    gpu = DeviceFactory.create()
    hold(gpu, nlp, JANUARY, hours=10)
    period = period_for(JANUARY)
    with time_machine.travel(NOON, tick=False):
        refresh_statements(period=period, cause="test refresh one")
    assert [alert.key for alert in shocks()] == ["closed/nlp/2024-12/USD"]  # late data, below
    # Twenty minutes later, five times the hours (another cluster's import, say): a jump.
    hold(DeviceFactory.create(), nlp, JANUARY + timedelta(hours=10), hours=50)
    with time_machine.travel(NOON + timedelta(minutes=20), tick=False):
        services.bill_period(period_start=JANUARY, now=NOON + timedelta(minutes=20), actor="ann")

    jump = Alert.objects.get(kind=AlertKind.BILL_SHOCK, key="jump/nlp/2025-01/USD")
    assert jump.team == nlp and jump.recipients == ["ops"]
    assert "nlp's 2025-01 total" in jump.subject and "within an hour" in jump.subject
    assert "Recomputed by: a billing run of 2025-01 by ann." in jump.description
    assert "Claims the syncs and imports first saw meanwhile" in jump.description


@override_settings(TALLY_BILL_SHOCK_PERCENT=50)
def test_a_small_change_raises_nothing_and_a_run_that_changes_nothing_neither() -> None:
    vision = Team.objects.create(slug="vision", name="Vision")
    seed_billing([vision])
    Alert.objects.all().delete()
    hold(DeviceFactory.create(), vision, JANUARY, hours=10)
    period = period_for(JANUARY)
    for minutes in (0, 10, 20):
        with time_machine.travel(NOON + timedelta(minutes=minutes), tick=False):
            refresh_statements(period=period, cause="test")
    hold(DeviceFactory.create(), vision, JANUARY + timedelta(hours=10), hours=2)  # +20 %
    with time_machine.travel(NOON + timedelta(minutes=30), tick=False):
        refresh_statements(period=period, cause="test")
    assert [alert.key for alert in shocks()] == ["closed/vision/2024-12/USD"]


def test_late_data_that_changes_a_closed_periods_money_raises_an_alert() -> None:
    nlp = Team.objects.create(slug="nlp", name="NLP")
    seed_billing([nlp])  # December closed; two of its hours arrived after the close
    with time_machine.travel(NOON, tick=False):
        refresh_statements(period=period_for(JANUARY), cause="beat's periodic refresh")
    (alert,) = shocks()
    assert alert.key == "closed/nlp/2024-12/USD"
    assert alert.subject.startswith("Closed period 2024-12 changed for nlp: late-data adjustments")
    assert "billed in 2025-01" in alert.subject
    assert "Recomputed by: beat's periodic refresh." in alert.description
    # Refreshed again with nothing new: the same alert, not a second one.
    with time_machine.travel(NOON + timedelta(minutes=5), tick=False):
        refresh_statements(period=period_for(JANUARY), cause="beat's periodic refresh")
    assert [a.pk for a in shocks()] == [alert.pk]
    assert Alert.objects.filter(kind=AlertKind.BILL_SHOCK).count() == 1


def test_a_shock_not_seen_again_for_an_hour_is_resolved() -> None:
    nlp = Team.objects.create(slug="nlp", name="NLP")
    seed_billing([nlp])
    with time_machine.travel(NOON, tick=False):
        refresh_statements(period=period_for(JANUARY), cause="beat's periodic refresh")
    (alert,) = shocks()
    with time_machine.travel(NOON + timedelta(minutes=30), tick=False):
        refresh_statements(period=period_for(JANUARY), cause="beat's periodic refresh")
    assert shocks() == [alert]
    with time_machine.travel(NOON + timedelta(hours=1, minutes=5), tick=False):
        refresh_statements(period=period_for(JANUARY), cause="beat's periodic refresh")
    assert shocks() == []
    alert.refresh_from_db()
    assert alert.state == AlertState.RESOLVED
