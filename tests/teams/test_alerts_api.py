"""`/api/v1/alerts/`: who sees which alerts, and leads snoozing their team's."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from teams.alerts import RaisedAlert, raise_alert
from teams.models import Alert, AlertKind, Team
from tests.api.cast import Cast, cast

__all__ = ["cast"]

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)


def alert(team: Team | None, key: str, kind: AlertKind = AlertKind.IDLE_CLAIM) -> Alert:
    raised, _ = raise_alert(
        spec=RaisedAlert(kind=kind, key=key, team=team, subject=f"about {key}"), now=NOW
    )
    return raised


@pytest.fixture
def alerts(cast: Cast) -> dict[str, Alert]:
    return {
        "alpha": alert(cast.alpha, "prod/alpha/a-gpu/1"),
        "beta": alert(cast.beta, "prod/beta/b-gpu/2"),
        "fleet": alert(None, "prod/dgx-7", AlertKind.VERSION_OUTLIER),
    }


def keys(response: Any) -> list[str]:
    assert response.status_code == 200, response.content
    return sorted(row["key"] for row in response.json()["results"])


def test_each_role_sees_its_alerts(cast: Cast, alerts: dict[str, Alert]) -> None:
    assert keys(cast.client("lead_a").get("/api/v1/alerts/")) == ["prod/alpha/a-gpu/1"]
    assert keys(cast.client("lead_b").get("/api/v1/alerts/")) == ["prod/beta/b-gpu/2"]
    assert keys(cast.client("finance").get("/api/v1/alerts/")) == [
        "prod/alpha/a-gpu/1",
        "prod/beta/b-gpu/2",
    ]
    assert keys(cast.client("operator").get("/api/v1/alerts/")) == [
        "prod/alpha/a-gpu/1",
        "prod/beta/b-gpu/2",
        "prod/dgx-7",
    ]
    assert cast.client("member_a").get("/api/v1/alerts/").status_code == 403
    assert cast.client(None).get("/api/v1/alerts/").status_code == 401
    assert cast.client("lead_a").get(f"/api/v1/alerts/{alerts['beta'].pk}/").status_code == 404
    assert keys(cast.client("operator").get("/api/v1/alerts/?kind=version_outlier")) == [
        "prod/dgx-7"
    ]
    assert keys(cast.client("operator").get("/api/v1/alerts/?team=beta")) == ["prod/beta/b-gpu/2"]


def test_the_list_costs_the_same_queries_for_many_alerts(
    cast: Cast, alerts: dict[str, Alert], django_assert_max_num_queries: Any
) -> None:
    for index in range(20):
        alert(cast.alpha if index % 2 else cast.beta, f"more/{index}")
    client = cast.client("operator")
    with django_assert_max_num_queries(6):
        response = client.get("/api/v1/alerts/")
    assert response.json()["count"] == 23


def test_a_lead_snoozes_their_teams_alert_and_lifts_it(
    cast: Cast, alerts: dict[str, Alert]
) -> None:
    client = cast.client("lead_a")
    url = f"/api/v1/alerts/{alerts['alpha'].pk}/snooze/"

    response = client.post(url, {"hours": 4}, format="json")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["snoozed_by"] == "la"
    snoozed = Alert.objects.get(pk=alerts["alpha"].pk)
    assert snoozed.snoozed_until is not None
    remaining = snoozed.snoozed_until - datetime.now(UTC)
    assert timedelta(hours=3, minutes=59) < remaining <= timedelta(hours=4)

    assert client.post(url, {"hours": 0}, format="json").json()["snoozed_until"] is None
    assert Alert.objects.get(pk=alerts["alpha"].pk).snoozed_until is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"hours": 169}, "Ensure this value is less than or equal to 168."),
        ({"hours": -1}, "Ensure this value is greater than or equal to 0."),
        ({"hours": "soon"}, "A valid integer is required."),
        ({}, "This field is required."),
    ],
)
def test_a_bad_snooze_is_a_400_naming_the_field(
    cast: Cast, alerts: dict[str, Alert], body: dict[str, Any], message: str
) -> None:
    response = cast.client("lead_a").post(
        f"/api/v1/alerts/{alerts['alpha'].pk}/snooze/", body, format="json"
    )
    assert response.status_code == 400
    assert response.json() == {"hours": [message]}
    assert Alert.objects.get(pk=alerts["alpha"].pk).snoozed_until is None


def test_only_leads_of_the_team_and_operators_snooze(cast: Cast, alerts: dict[str, Alert]) -> None:
    def snooze(who: str, name: str) -> int:
        response = cast.client(who).post(
            f"/api/v1/alerts/{alerts[name].pk}/snooze/", {"hours": 1}, format="json"
        )
        return response.status_code

    assert snooze("lead_a", "beta") == 404  # not theirs to see
    assert snooze("lead_a", "fleet") == 404
    assert snooze("finance", "alpha") == 403  # sees it, may not silence it
    assert snooze("member_a", "alpha") == 403
    assert snooze("operator", "fleet") == 200
    assert snooze("operator", "beta") == 200
    assert list(
        Alert.objects.filter(snoozed_until__isnull=False)
        .order_by("key")
        .values_list("key", "snoozed_by")
    ) == [("prod/beta/b-gpu/2", "ops"), ("prod/dgx-7", "ops")]
