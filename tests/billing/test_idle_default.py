"""Idle alerts on by default (issue 35, finding 2): a team whose policy says nothing of idle
alerts has the default rule (TALLY_IDLE_ALERT_DEFAULT_*); `idleAlert: off` silences it; the
team page says which rule is in force, or that alerts are off and how to turn them on."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.test import Client, override_settings
from django.urls import reverse

from billing.alerts import idle_claim_alerts
from billing.idle import idle_claims, idle_policies
from inventory.models import Allocation, Cluster
from teams.models import IdleAlertPolicy
from tests.api.cast import Cast, cast
from tests.billing.test_idle_alerts import NOW, claim_holding, hours_of
from tests.factories import ClusterFactory

__all__ = ["cast"]

pytestmark = pytest.mark.django_db


@pytest.fixture
def cluster() -> Cluster:
    return ClusterFactory.create(name="prod")


def _idle_four_hours(cluster: Cluster, cast: Cast) -> None:
    """Alpha (no idle-alert policy) holds a claim used 1% in each of the last four hours."""
    [allocation] = claim_holding(cluster, cast.alpha, "forgotten", 1)
    hours_of(allocation, [(0.01, 0)] * 4)


@override_settings(TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT=5, TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=4)
def test_a_team_without_a_policy_is_alerted_by_the_default_rule(
    cluster: Cluster, cast: Cast
) -> None:
    _idle_four_hours(cluster, cast)
    [found] = idle_claims(now=NOW)
    assert (found.team, found.claim_name) == (cast.alpha, "forgotten")
    assert (found.policy.below_percent, found.policy.for_hours) == (5, 4)
    assert found.policy.pk is None  # the default: nothing is written for it
    assert {policy.team.slug for policy in idle_policies()} == {"alpha", "beta"}


@override_settings(TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=4)
def test_idle_alert_off_silences_the_team(cluster: Cluster, cast: Cast) -> None:
    _idle_four_hours(cluster, cast)
    IdleAlertPolicy.objects.create(
        team=cast.alpha, below_percent=Decimal(5), for_hours=4, enabled=False
    )
    assert idle_claims(now=NOW) == []
    assert {policy.team.slug for policy in idle_policies()} == {"beta"}


@override_settings(TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=0)
def test_the_default_can_be_turned_off(cluster: Cluster, cast: Cast) -> None:
    _idle_four_hours(cluster, cast)
    assert idle_claims(now=NOW) == []


def _team_page(cast: Cast) -> str:
    client = Client()
    client.force_login(cast.lead_a)
    html = client.get(reverse("team", args=["alpha"])).content.decode()
    rule = html.split('id="idle-alert-rule">')[1].split("</p>")[0]
    return " ".join(rule.split())


@override_settings(TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT=5, TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=24)
def test_the_team_page_shows_the_rule_in_force(cast: Cast) -> None:
    assert _team_page(cast).startswith(
        "Idle alerts: a claim used under 5% of what it holds in each of the last 24 rolled-up "
        "hours is alerted to its person and the team's leads (Tally's default rule"
    )
    IdleAlertPolicy.objects.create(team=cast.alpha, below_percent=Decimal("2.5"), for_hours=8)
    assert _team_page(cast) == (
        "Idle alerts: a claim used under 2.50% of what it holds in each of the last 8 rolled-up "
        "hours is alerted to its person and the team's leads."
    )


@override_settings(TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=24)
def test_the_team_page_says_alerts_are_off_and_how_to_turn_them_on(cast: Cast) -> None:
    IdleAlertPolicy.objects.create(
        team=cast.alpha, below_percent=Decimal(5), for_hours=24, enabled=False
    )
    text = _team_page(cast)
    assert "Idle alerts are <strong>off</strong> for this team" in text
    assert "<code>idleAlert: {belowPercent: 5, forHours: 24}</code>" in text
    assert "remove its <code>idleAlert: off</code>" in text
    with override_settings(TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=0):
        IdleAlertPolicy.objects.all().delete()
        text = _team_page(cast)
    assert "Idle alerts are <strong>off</strong>" in text and "idleAlert: off" not in text


@override_settings(TALLY_IDLE_ALERT_DEFAULT_BELOW_PERCENT=5, TALLY_IDLE_ALERT_DEFAULT_FOR_HOURS=4)
def test_an_idle_slice_is_alerted_in_figures_people_read(cluster: Cluster, cast: Cast) -> None:
    """Issue 35, finding 9: a seventh of a GPU read "0.142857 GPUs" and its idle hours
    "3.961555 idle GPU-hours"; both are shown to two decimals at most."""
    [allocation] = claim_holding(cluster, cast.alpha, "slice", 1)
    Allocation.objects.filter(pk=allocation.pk).update(gpu_share=Decimal("0.142857"))
    allocation.refresh_from_db()
    hours_of(allocation, [(0.0096113, 0)] * 4)
    [alert] = idle_claim_alerts(now=NOW)
    assert alert.subject == "Idle claim alpha/slice: 0.14 GPUs under 5% for 4 h"
    assert "holds 0.14 GPUs" in alert.description
    assert "3.96 idle GPU-hours" in alert.description
    assert not re.search(r"\d\.\d{3}", alert.subject + alert.description)
