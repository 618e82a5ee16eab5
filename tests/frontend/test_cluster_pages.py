"""The cluster on the portal's pages (issue 35, finding 6): after a second cluster each claim of
the team page appeared twice with nothing to tell them apart, and pending demand showed a wait
with no cluster. With several clusters every list of claims, capacity, pending demand and
decisions names the cluster and `?cluster=` narrows the page; with one, neither is shown."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse

from inventory import services as inventory_services
from inventory import simulate
from inventory.models import Allocation, Cluster
from quota.admission.shapes import forget_fleet_shapes
from quota.models import AdmissionDecision
from tests.factories import ResourceClaimFactory
from tests.frontend.seed import Portal
from tests.frontend.test_queue_pages import add_queue

LAB = "lab"


def _client(portal: Portal, who: str) -> Client:
    client = Client()
    client.force_login(portal.users[who])
    return client


def _second_cluster(portal: Portal) -> Cluster:
    """Cluster `lab`, simulated with the seed's own seed: the same claim names in the same
    namespaces (the team's claims twice), its devices with UUIDs of their own."""
    forget_fleet_shapes()
    lab = inventory_services.get_cluster(LAB)
    report = inventory_services.import_snapshot(
        cluster=lab,
        objects=simulate.generate(
            nodes=4, seed=1, now=portal.now - timedelta(days=35), cluster=LAB
        ),
        at=portal.now - timedelta(days=35),
    )
    assert not report.errors, report.errors
    forget_fleet_shapes()
    return lab


def _pending_in(portal: Portal, cluster: Cluster, name: str, hours: int) -> None:
    ResourceClaimFactory.create(
        cluster=cluster,
        namespace="vision",
        name=name,
        spec={
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 1}}
                ]
            }
        },
        created_at=portal.now - timedelta(hours=hours),
        first_seen=portal.now - timedelta(hours=hours),
    )


def _rows(page: str, table: str) -> list[str]:
    """The rows of the table `table` of `page`, as text without tags."""
    found = re.search(rf'<table[^>]*(id|class)="{table}[" ].*?<tbody>(.*?)</tbody>', page, re.S)
    assert found, f"no table {table}"
    rows = re.findall(r"<tr.*?</tr>", found.group(2), re.S)
    return [" ".join(re.sub(r"<[^>]+>", " ", row).split()) for row in rows]


def _head(page: str, table: str) -> str:
    found = re.search(rf'<table[^>]*(id|class)="{table}[" ].*?<thead>(.*?)</thead>', page, re.S)
    assert found, f"no table {table}"
    return found.group(2)


@pytest.mark.django_db
def test_with_two_clusters_the_team_page_names_each_claims_cluster(portal: Portal) -> None:
    _second_cluster(portal)
    client = _client(portal, "lead_a")
    url = reverse("team", args=["vision"])
    response = client.get(url)
    assert response.status_code == 200
    page = response.content.decode()
    claims = response.context["claims"]
    # The same claim names, held in both clusters: each row says which.
    assert {claim.cluster for claim in claims} == {"default", LAB}
    twice = [c for c in claims if c.claim_name == claims[0].claim_name]
    assert sorted(c.cluster for c in twice) == ["default", LAB]
    assert '<th scope="col">Cluster</th>' in page
    rows = _rows(page, "live-claims")
    assert any(LAB in row for row in rows) and any("default" in row for row in rows)
    # The filter, keeping the page's window.
    assert 'id="cluster-filter"' in page
    narrowed = client.get(url, {"cluster": LAB, "days": "30"})
    assert narrowed.status_code == 200
    assert narrowed.context["days"] == 30
    assert {claim.cluster for claim in narrowed.context["claims"]} == {LAB}
    assert (
        narrowed.context["claims_total"]
        == Allocation.objects.filter(
            end__isnull=True, cluster__name=LAB, claim__namespace__in=["vision", "research"]
        ).count()
    )
    assert '<option value="lab" selected>' in narrowed.content.decode()
    assert 'name="days" value="30"' in narrowed.content.decode()


@pytest.mark.django_db
def test_with_two_clusters_pending_demand_says_where_it_waits(portal: Portal) -> None:
    lab = _second_cluster(portal)
    _pending_in(portal, portal.cluster, "waits-at-home", hours=2)
    _pending_in(portal, lab, "waits-in-the-lab", hours=5)
    client = _client(portal, "lead_a")
    page = client.get(reverse("team", args=["vision"])).content.decode()
    waiting = _rows(page, "pending-claims")
    assert any("waits-in-the-lab" in row and LAB in row for row in waiting)
    assert any("waits-at-home" in row and "default" in row for row in waiting)
    demand = _rows(page, "pending-demand")
    assert any(row.startswith(LAB) for row in demand)
    assert any(row.startswith("default") for row in demand)
    # Narrowed to the lab: the lab's claim only.
    narrowed = client.get(reverse("team", args=["vision"]), {"cluster": LAB})
    assert [claim.name for claim in narrowed.context["pending_claims"]] == ["waits-in-the-lab"]
    assert [cluster for cluster, _ in narrowed.context["pending_demand"]] == [LAB]


@pytest.mark.django_db
def test_with_two_clusters_the_fleet_page_splits_capacity_and_filters(portal: Portal) -> None:
    _second_cluster(portal)
    client = _client(portal, "operator")
    response = client.get(reverse("fleet"))
    assert response.status_code == 200
    capacity = response.context["capacity"]
    assert {row["cluster"] for row in capacity} == {"default", LAB}
    page = response.content.decode()
    rows = _rows(page, "capacity-gpu")
    assert any(row.startswith(LAB) for row in rows) and any(
        row.startswith("default") for row in rows
    )
    narrowed = client.get(reverse("fleet"), {"cluster": LAB})
    assert narrowed.status_code == 200
    assert {row["cluster"] for row in narrowed.context["capacity"]} == {LAB}
    assert not narrowed.context["show_cluster"]  # node names need no cluster prefix then


@pytest.mark.django_db
def test_with_two_clusters_decisions_name_their_cluster(portal: Portal) -> None:
    _second_cluster(portal)
    AdmissionDecision.objects.update(cluster="default")
    lead = _client(portal, "lead_a")
    newest = lead.get(reverse("team", args=["vision"])).context["objections"][0]
    AdmissionDecision.objects.filter(pk=newest.pk).update(cluster=LAB)
    page = lead.get(reverse("team", args=["vision"])).content.decode()
    objections = _rows(page, "objections")
    assert objections[0].split()[2] == LAB
    assert objections[1:] and all(row.split()[2] == "default" for row in objections[1:])
    lab = lead.get(reverse("team", args=["vision"]), {"cluster": LAB})
    assert [d.pk for d in lab.context["objections"]] == [newest.pk]
    log = _client(portal, "operator").get(reverse("decisions")).content.decode()
    assert {row.split()[2] for row in _rows(log, "decisions")} >= {"default", LAB}


@pytest.mark.django_db
def test_an_unknown_cluster_is_a_400_naming_it(portal: Portal) -> None:
    _second_cluster(portal)
    for who, url in (("lead_a", reverse("team", args=["vision"])), ("operator", reverse("fleet"))):
        response = _client(portal, who).get(url, {"cluster": "nowhere"})
        assert response.status_code == 400
        page = response.content.decode()
        assert "no cluster is named &#x27;nowhere&#x27;" in page
        assert "default, lab" in page


@pytest.mark.django_db
def test_with_one_cluster_there_is_no_cluster_column_nor_filter(portal: Portal) -> None:
    add_queue(portal, portal.now)
    lists = {
        ("lead_a", reverse("team", args=["vision"])): (
            "objections",
            "live-claims",
            "pending-demand",
            "pending-claims",
            "stranded-gangs",
        ),
        ("operator", reverse("fleet")): (
            "capacity-gpu",
            "pending-demand",
            "pending-claims",
            "stranded-gangs",
        ),
        ("operator", reverse("decisions")): ("decisions",),
    }
    for (who, url), tables in lists.items():
        response = _client(portal, who).get(url)
        assert response.status_code == 200
        page = response.content.decode()
        for table in tables:
            assert _head(page, table) and "Cluster" not in _head(page, table), (url, table)
        assert 'id="cluster-filter"' not in page and 'id="decisions-cluster"' not in page
    # Naming the one cluster changes nothing; naming another is a 400.
    url = reverse("team", args=["vision"])
    client = _client(portal, "lead_a")
    assert client.get(url, {"cluster": "default"}).status_code == 200
    assert client.get(url, {"cluster": LAB}).status_code == 400
