from typing import Any

import pytest

from devtools.fake_kube import FakeKube
from inventory.models import Allocation, Cluster, ResourceClaim
from tests.inventory.test_claim_jobs import (
    add_deployment_pods,
    list_claims,
    pod,
    ref_to,
    reference,
    template_claim,
)


@pytest.mark.django_db
def test_wired(fake: FakeKube, api_client: Any, cluster: Cluster) -> None:
    (web,) = add_deployment_pods(fake, "web-5d8f9c", "web-5d8f9c-abcde")
    web["metadata"]["annotations"] = {"tally.dev/created-by": "alice"}
    fake.modify(web)
    fake.add(template_claim(ref_to(web), name="web-gpu"))
    legacy = pod("old-1", owner=reference("ReplicaSet", "web-5d8f9c", "apps/v1"))
    legacy["metadata"]["labels"] = {"user": "dave"}
    fake.add(legacy)
    fake.add(template_claim(ref_to(legacy), name="old-gpu"))
    report = list_claims(api_client, cluster)
    assert not report.errors
    assert dict(ResourceClaim.objects.values_list("name", "created_by")) == {
        "web-gpu": "alice",
        "old-gpu": "dave",
    }
    assert sorted(Allocation.objects.values_list("claim__name", "username")) == [
        ("old-gpu", "dave"),
        ("web-gpu", "alice"),
    ]


@pytest.mark.django_db
def test_adopted_keeps_person(fake: FakeKube, api_client: Any, cluster: Cluster) -> None:
    from teams.models import Team, TeamNamespace

    team = Team.objects.create(slug="team-a", name="A")
    TeamNamespace.objects.create(team=team, namespace="team-a")
    (web,) = add_deployment_pods(fake, "web-5d8f9c", "web-5d8f9c-abcde")
    web["metadata"]["annotations"] = {"tally.dev/created-by": "alice"}
    fake.modify(web)
    fake.add(template_claim(ref_to(web), name="web-gpu"))
    list_claims(api_client, cluster)
    list_claims(api_client, cluster)
    from quota.models import Reservation

    assert Reservation.objects.count() == 1
    assert dict(ResourceClaim.objects.values_list("name", "created_by")) == {"web-gpu": "alice"}
    assert list(Allocation.objects.values_list("username", flat=True)) == ["alice"]
