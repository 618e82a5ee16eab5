"""Every endpoint tried by each of the cast: the wrong one gets 401, 403 or 404, the right one
200 with only the rows of its teams."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from billing.models import Statement
from quota.models import AdmissionDecision
from tests.api.cast import Seeded
from tests.factories import ResourceClaimFactory

pytestmark = pytest.mark.django_db

# Lists of team data: the column that names the team.
TEAM_LISTS = {
    "/api/v1/teams/": "slug",
    "/api/v1/quotas/": "team",
    "/api/v1/statements/": "team",
    "/api/v1/statement-lines/": "team",
    "/api/v1/adjustments/": "team",
    "/api/v1/usage/": "team",
    "/api/v1/usage/claims/": "team",
    "/api/v1/usage/jobs/": "team",
    "/api/v1/usage/users/": "team",
}
SHARED_LISTS = ["/api/v1/rate-cards/", "/api/v1/periods/"]
FLEET = [
    "/api/v1/inventory/summary/",
    "/api/v1/inventory/capacity/",
    "/api/v1/inventory/deviations/",
]
DECISIONS = "/api/v1/decisions/"
# Session/role, the teams the lead may see, count, page, the people of the page's claims.
MAX_DECISION_LIST_QUERIES = 6
EVERY_GET = [*TEAM_LISTS, *SHARED_LISTS, *FLEET, DECISIONS]


def teams_in(response_json: dict, column: str) -> set[str]:
    return {row[column] for row in response_json["results"]}


@pytest.mark.parametrize("url", EVERY_GET)
def test_anonymous_must_authenticate(seeded: Seeded, url: str) -> None:
    response = seeded.cast.client(None).get(url)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"


@pytest.mark.parametrize("url", EVERY_GET)
def test_member_without_role_sees_nothing(seeded: Seeded, url: str) -> None:
    assert seeded.cast.client("member_a").get(url).status_code == 403


@pytest.mark.parametrize(("url", "column"), TEAM_LISTS.items())
@pytest.mark.parametrize(("who", "expected"), [("lead_a", {"alpha"}), ("lead_b", {"beta"})])
def test_lead_sees_only_own_teams(
    seeded: Seeded, url: str, column: str, who: str, expected: set[str]
) -> None:
    response = seeded.cast.client(who).get(url)
    assert response.status_code == 200, response.content
    if url == "/api/v1/adjustments/":
        expected = expected & {"beta"}  # only beta has an adjustment
    assert teams_in(response.json(), column) == expected


@pytest.mark.parametrize(("url", "column"), TEAM_LISTS.items())
@pytest.mark.parametrize("who", ["finance", "operator"])
def test_finance_and_operators_see_every_team(
    seeded: Seeded, url: str, column: str, who: str
) -> None:
    response = seeded.cast.client(who).get(url)
    assert response.status_code == 200, response.content
    expected = {"beta"} if url == "/api/v1/adjustments/" else {"alpha", "beta"}
    assert teams_in(response.json(), column) == expected


@pytest.mark.parametrize("url", SHARED_LISTS)
@pytest.mark.parametrize("who", ["lead_a", "finance", "operator"])
def test_rate_cards_and_periods_are_read_by_every_role(seeded: Seeded, url: str, who: str) -> None:
    response = seeded.cast.client(who).get(url)
    assert response.status_code == 200
    assert response.json()["count"] >= 1


@pytest.mark.parametrize("url", FLEET)
def test_fleet_is_for_finance_and_operators(seeded: Seeded, url: str) -> None:
    for who in ("lead_a", "lead_b"):
        assert seeded.cast.client(who).get(url).status_code == 403
    for who in ("finance", "operator"):
        assert seeded.cast.client(who).get(url).status_code == 200


def test_fleet_summary(seeded: Seeded) -> None:
    report = seeded.cast.client("operator").get("/api/v1/inventory/summary/").json()
    assert report["gpus_by_model"] == {"NVIDIA H100 80GB HBM3": 2}
    assert report["fragmentation"]["nodes_full"] == 2
    assert (
        seeded.cast.client("operator")
        .get("/api/v1/inventory/summary/", {"cluster": "nope"})
        .status_code
        == 404
    )


def test_decisions_operators_and_finance_all_leads_their_teams(seeded: Seeded) -> None:
    operator = seeded.cast.client("operator").get(DECISIONS).json()
    assert {row["team"] for row in operator["results"]} == {"alpha", "beta", None}
    lead = seeded.cast.client("lead_b").get(DECISIONS).json()
    assert [(row["team"], row["allowed"]) for row in lead["results"]] == [("beta", False)]
    # Issue 35: finance reads every decision too (it was a 403).
    finance = seeded.cast.client("finance").get(DECISIONS).json()
    assert finance["results"] == operator["results"]
    # A lead naming their own team gets it; another team is not found, as if there were none.
    own = seeded.cast.client("lead_b").get(DECISIONS, {"team": "beta"}).json()
    assert own["results"] == lead["results"]
    other = seeded.cast.client("lead_b").get(DECISIONS, {"team": "alpha"})
    assert other.status_code == 404
    assert other.json() == {"detail": "No team 'alpha' that you may see."}
    assert seeded.cast.client("finance").get(DECISIONS, {"team": "alpha"}).status_code == 200


def test_other_teams_objects_are_not_found(seeded: Seeded) -> None:
    beta_statement = Statement.objects.get(team=seeded.cast.beta)
    lead_a = seeded.cast.client("lead_a")
    assert lead_a.get("/api/v1/teams/beta/").status_code == 404
    assert lead_a.get(f"/api/v1/statements/{beta_statement.pk}/").status_code == 404
    lead_b = seeded.cast.client("lead_b")
    assert lead_b.get("/api/v1/teams/beta/").json()["leads"] == ["lb"]
    detail = lead_b.get(f"/api/v1/statements/{beta_statement.pk}/").json()
    assert {line["kind"] for line in detail["lines"]} == {"usage", "adjustment"}
    member = seeded.cast.client("member_a")
    assert member.get("/api/v1/teams/alpha/").status_code == 403


def test_team_detail(seeded: Seeded) -> None:
    team = seeded.cast.client("lead_a").get("/api/v1/teams/alpha/").json()
    assert team == {
        "slug": "alpha",
        "name": "Alpha",
        "cost_centre": "CC-1",
        "namespaces": ["alpha-ns"],
        "leads": ["la"],
    }


def test_token_authentication(seeded: Seeded) -> None:
    out = io.StringIO()
    call_command("api_token", "create", "la", stdout=out, stderr=io.StringIO())
    token = out.getvalue().strip()
    client = APIClient()
    response = client.get("/api/v1/teams/", HTTP_AUTHORIZATION=f"Token {token}")
    assert response.status_code == 200
    assert teams_in(response.json(), "slug") == {"alpha"}
    wrong = client.get("/api/v1/teams/", HTTP_AUTHORIZATION="Token not-a-token")
    assert wrong.status_code == 401


def test_decisions_name_their_cluster_and_filter_by_it(seeded: Seeded) -> None:
    AdmissionDecision.objects.filter(team=seeded.cast.beta).update(cluster="east")
    AdmissionDecision.objects.filter(team=seeded.cast.alpha).update(cluster="west")
    client = seeded.cast.client("operator")
    rows = client.get(DECISIONS).json()["results"]
    assert {(row["team"], row["cluster"]) for row in rows} == {
        ("alpha", "west"),
        ("beta", "east"),
        (None, ""),
    }
    east = client.get(DECISIONS, {"cluster": "east"}).json()["results"]
    assert {row["team"] for row in east} == {"beta"}
    lead_a = seeded.cast.client("lead_a").get(DECISIONS, {"cluster": "east"}).json()
    assert lead_a["results"] == []  # beta's cluster holds none of alpha's


def test_decisions_say_which_webhook_decided(seeded: Seeded) -> None:
    AdmissionDecision.objects.filter(team=seeded.cast.beta).update(webhook="mutate")
    rows = seeded.cast.client("operator").get(DECISIONS).json()["results"]
    assert {(row["team"], row["webhook"]) for row in rows} == {
        ("alpha", "validate"),
        ("beta", "mutate"),
        (None, "validate"),
    }


def test_decisions_name_the_person_to_their_teams_lead_only(
    seeded: Seeded, django_assert_max_num_queries: Any
) -> None:
    """A template claim's decision names the resource-claim controller; the lead reads who
    made the workload (as the sync recorded it on the claim), and only their own teams'."""
    controller = "system:serviceaccount:kube-system:resource-claim-controller"
    decision = AdmissionDecision.objects.create(
        at=timezone.now(),
        uid="uid-template",
        namespace="alpha-ns",
        name="pod-0-gpu-abcde",
        username=controller,
        team=seeded.cast.alpha,
        allowed=True,
        warnings=["near the limit"],
    )
    ResourceClaimFactory(namespace="alpha-ns", name="pod-0-gpu-abcde", created_by="la")
    lead_a = seeded.cast.client("lead_a")
    with django_assert_max_num_queries(MAX_DECISION_LIST_QUERIES):
        rows = lead_a.get(DECISIONS).json()["results"]
    assert {row["team"] for row in rows} == {"alpha"}
    template = next(row for row in rows if row["id"] == decision.pk)
    assert (template["username"], template["person"]) == (controller, "la")
    assert {row["person"] for row in rows if row["id"] != decision.pk} == {""}
    warned = lead_a.get(DECISIONS, {"outcome": "warned"}).json()["results"]
    assert [row["id"] for row in warned] == [decision.pk]
    assert lead_a.get(DECISIONS, {"outcome": "nope"}).status_code == 400
    # The wrong lead, asking for the team by name, gets none of it; a member, nothing at all.
    beta_lead = seeded.cast.client("lead_b").get(DECISIONS, {"team": "alpha"})
    assert beta_lead.status_code == 404 and "results" not in beta_lead.json()
    assert seeded.cast.client("member_a").get(DECISIONS).status_code == 403
    assert seeded.cast.client(None).get(DECISIONS).status_code in (401, 403)
