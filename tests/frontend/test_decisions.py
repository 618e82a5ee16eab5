"""Why a claim was denied, where each person looks: the team page lists the team's recent
denials and warnings with the person behind each claim, and the operators' decision log
filters by team, outcome and time, and pages with its filters."""

from __future__ import annotations

import re
from datetime import timedelta
from html import unescape
from typing import Any

from django.test import Client
from django.urls import reverse

from quota.models import AdmissionDecision
from tests.factories import ClusterFactory, ResourceClaimFactory
from tests.frontend.seed import DECISIONS, Portal

CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
# The decision log: session, user, role (operator), the team choices, count, page, people.
MAX_DECISION_LOG_QUERIES = 12


def _client(portal: Portal, who: str) -> Client:
    client = Client()
    client.force_login(portal.users[who])
    return client


def _template_claim_warned(portal: Portal) -> AdmissionDecision:
    """A warning on a claim the resource-claim controller made from a Pod's template; the
    sync found its person (the workload webhook's `tally.dev/created-by` on the Pod)."""
    decision = AdmissionDecision.objects.create(
        at=portal.now - timedelta(seconds=30),
        uid="uid-template",
        namespace="vision",
        name="trainer-0-gpu-x7k2p",
        username=CONTROLLER,
        team=portal.team_a,
        allowed=True,
        warnings=['team "vision": quota rule "gpus" is at 15 of 16 GPUs with this claim'],
    )
    # An older claim of the same name was another person's: not this decision's.
    ResourceClaimFactory(
        cluster=portal.cluster,
        namespace="vision",
        name="trainer-0-gpu-x7k2p",
        created_by="someone-before",
        first_seen=portal.now - timedelta(days=3),
    )
    ResourceClaimFactory(
        cluster=portal.cluster,
        namespace="vision",
        name="trainer-0-gpu-x7k2p",
        created_by="maria",
        first_seen=portal.now,
    )
    return decision


def _rows(html: str, table_class: str) -> list[str]:
    table = re.search(rf'<table class="{table_class}[^"]*">(.*?)</table>', html, re.S)
    assert table is not None, f"no {table_class} table"
    rows = re.findall(r"<tr>(.*?)</tr>", table.group(1).split("<tbody>")[1], re.S)
    return [unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", row))).strip() for row in rows]


def test_the_team_page_lists_its_denials_and_warnings_with_the_person(portal: Portal) -> None:
    _template_claim_warned(portal)
    html = _client(portal, "lead_a").get(reverse("team", args=["vision"])).content.decode()
    rows = _rows(html, "objections")
    assert len(rows) == 10  # the 10 most recent of the team's denials and warnings
    first = rows[0]
    assert "vision/ trainer-0-gpu-x7k2p" in first
    assert f"maria via {CONTROLLER}" in first and "warned" in first
    assert 'quota rule "gpus" is at 15 of 16 GPUs' in first
    denials = [row for row in rows if "denied" in row]
    assert denials and all(
        "ana" in row and "quota gpus exceeded: 17 > 16" in row and "vision/" in row
        for row in denials
    )
    # Team A's are odd-numbered; every third is denied: the other team's never appear.
    assert "nlp/" not in html.split('id="objections"')[1].split("</section>")[0]
    denied_a = sum(1 for n in range(DECISIONS) if n % 2 and n % 3 == 0)
    assert f"the 10 most recent of {denied_a + 1}" in html


def test_a_team_with_no_denial_says_so(portal: Portal) -> None:
    AdmissionDecision.objects.filter(team=portal.team_a).update(allowed=True, message="")
    html = _client(portal, "lead_a").get(reverse("team", args=["vision"])).content.decode()
    assert "No claim of the team was denied or warned about in the last 90 days." in html


def test_the_decision_log_filters_by_team_outcome_and_time(
    portal: Portal, django_assert_max_num_queries: Any
) -> None:
    _template_claim_warned(portal)
    client = _client(portal, "operator")
    url = reverse("decisions")
    with django_assert_max_num_queries(MAX_DECISION_LOG_QUERIES):
        page = client.get(url, {"team": "vision", "outcome": "denied"}).context["page"]
    assert page.paginator.count == sum(1 for n in range(DECISIONS) if n % 2 and n % 3 == 0)
    assert {(d.team_id, d.allowed) for d in page} == {(portal.team_a.pk, False)}
    warned = client.get(url, {"outcome": "warned"}).context["page"]
    assert [d.uid for d in warned] == ["uid-template"]
    assert warned[0].person == "maria"
    today = portal.now.date().isoformat()
    tomorrow = (portal.now + timedelta(days=1)).date().isoformat()
    assert client.get(url, {"start": tomorrow}).context["page"].paginator.count == 0
    assert (
        client.get(url, {"start": today, "end": tomorrow}).context["page"].paginator.count
        == AdmissionDecision.objects.filter(at__date=portal.now.date()).count()
    )


def test_the_decision_log_pages_keep_the_filters(portal: Portal) -> None:
    AdmissionDecision.objects.bulk_create(
        AdmissionDecision(
            at=portal.now - timedelta(hours=2, minutes=n),
            uid=f"more-{n}",
            namespace="vision",
            name=f"more-{n}",
            team=portal.team_a,
            allowed=True,
        )
        for n in range(30)
    )
    client = _client(portal, "operator")
    response = client.get(reverse("decisions"), {"team": "vision"})
    assert response.context["page"].paginator.count == DECISIONS // 2 + 30
    older = re.search(r'<a href="\?([^"]*)" rel="next">Older</a>', response.content.decode())
    assert older is not None and older.group(1) == "team=vision&amp;page=2"
    second = client.get(reverse("decisions"), {"team": "vision", "page": "2"}).context["page"]
    assert len(second) == 10 and {d.team_id for d in second} == {portal.team_a.pk}


def test_a_filter_that_does_not_parse_is_said_and_filters_nothing(portal: Portal) -> None:
    client = _client(portal, "operator")
    response = client.get(reverse("decisions"), {"start": "yesterday", "team": "nope"})
    assert response.status_code == 200
    html = response.content.decode()
    assert "&#x27;yesterday&#x27; is not a UTC date" in html and "Select a valid choice." in html
    assert response.context["page"].paginator.count == DECISIONS
    # The API's words for a reversed or empty window (billing.windows).
    backwards = {"start": "2026-02-02", "end": "2026-02-01"}
    reversed_window = client.get(reverse("decisions"), backwards)
    assert "the window is reversed" in reversed_window.content.decode()
    empty = client.get(reverse("decisions"), {"start": "2026-02-02", "end": "2026-02-02"})
    assert "the window is empty" in empty.content.decode()


def test_the_decision_log_is_still_for_operators_only(portal: Portal) -> None:
    for who in ("lead_a", "member_a", "finance"):
        assert _client(portal, who).get(reverse("decisions")).status_code == 403


def test_the_decision_log_filters_by_cluster_once_there_are_two(portal: Portal) -> None:
    client = _client(portal, "operator")
    # One cluster: no cluster column, no filter.
    single = client.get(reverse("decisions"))
    assert "cluster" not in single.context["form"].fields
    assert '<th scope="col">Cluster</th>' not in single.content.decode()
    ClusterFactory(name="zz-east")
    AdmissionDecision.objects.filter(uid="uid-1").update(cluster="zz-east")
    AdmissionDecision.objects.exclude(uid="uid-1").update(cluster=portal.cluster.name)
    page = client.get(reverse("decisions"), {"cluster": "zz-east"})
    assert [d.uid for d in page.context["page"]] == ["uid-1"]
    html = page.content.decode()
    assert '<th scope="col">Cluster</th>' in html
    assert '<td data-label="Cluster">zz-east</td>' in html
    others = client.get(reverse("decisions"), {"cluster": portal.cluster.name})
    assert others.context["page"].paginator.count == DECISIONS - 1
