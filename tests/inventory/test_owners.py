"""Who is charged for a claim when its owners cannot vouch for anyone (`owners.claim_creator`),
through the sync as it runs: the real kubernetes client against `devtools.fake_kube`, and the
ResourceClaims and Allocations it writes to PostgreSQL.

A claim made from a template carries the ResourceClaimTemplate's annotations and labels,
which anyone who may write templates can set: only what the workload webhook wrote on the
claim's owners names a person, and a claim whose Pod cannot be read names nobody.
"""

from __future__ import annotations

from typing import Any

import pytest

from devtools.fake_kube import FakeKube
from inventory.models import Allocation, Cluster, ResourceClaim
from tests.inventory.test_claim_jobs import (
    add_deployment_pods,
    job,
    list_claims,
    pod,
    reference,
    replica_set,
    template_claim,
)

CREATED_BY = "tally.dev/created-by"


def forged(claim: dict[str, Any]) -> dict[str, Any]:
    """`claim` as made from a template whose author wrote alice in, both ways."""
    claim["metadata"]["annotations"][CREATED_BY] = "alice"
    claim["metadata"]["labels"] = {"user": "alice", CREATED_BY: "alice"}
    return claim


def charged() -> dict[str, tuple[str, list[str]]]:
    """Each claim's recorded creator, and the person on each of its allocations."""
    return {
        claim.name: (
            claim.created_by,
            list(Allocation.objects.filter(claim=claim).values_list("username", flat=True)),
        )
        for claim in ResourceClaim.objects.all()
    }


@pytest.mark.django_db
@pytest.mark.parametrize("unreadable", ["gone", "forbidden"])
def test_a_template_claim_whose_pod_cannot_be_read_names_nobody_whatever_the_template_says(
    fake: FakeKube, api_client: Any, cluster: Cluster, unreadable: str
) -> None:
    if unreadable == "forbidden":
        fake.forbidden = {"Pod"}
        fake.add(pod("web-1", owner=reference("ReplicaSet", "web", "apps/v1")))
    fake.add(forged(template_claim(reference("Pod", "web-1", "v1"), name="web-gpu")))

    report = list_claims(api_client, cluster)

    assert report.errors == []
    assert charged() == {"web-gpu": ("", [""])}


@pytest.mark.django_db
def test_the_webhooks_record_on_the_pod_wins_over_the_template(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    (web,) = add_deployment_pods(fake, "web-5d8f9c", "web-5d8f9c-abcde")
    web["metadata"]["annotations"] = {CREATED_BY: "mallory"}
    fake.modify(web)
    fake.add(forged(template_claim(reference("Pod", "web-5d8f9c-abcde", "v1"), name="web-gpu")))

    list_claims(api_client, cluster)

    assert charged() == {"web-gpu": ("mallory", ["mallory"])}


@pytest.mark.django_db
def test_a_pod_read_later_names_its_creator_where_the_template_was_not_believed(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    fake.add(forged(template_claim(reference("Pod", "web-1", "v1"), name="web-gpu")))
    list_claims(api_client, cluster)
    assert ResourceClaim.objects.get().created_by == ""
    # The Pod's ReplicaSet exists: one naming an owner that does not vouches for nobody (below).
    fake.add(replica_set("web"))
    late = pod("web-1", owner=reference("ReplicaSet", "web", "apps/v1"))
    late["metadata"]["annotations"] = {CREATED_BY: "mallory"}
    fake.add(late)

    list_claims(api_client, cluster)

    assert ResourceClaim.objects.get().created_by == "mallory"


@pytest.mark.django_db
def test_a_claim_nothing_owns_is_named_by_its_labels_never_its_annotation(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    """A claim made by hand before Tally (no claim webhook record): the labels are the
    documented fallback; the annotation, which no webhook writes on a claim, is not read."""
    annotated = template_claim(None, name="annotated")
    annotated["metadata"]["annotations"][CREATED_BY] = "alice"
    labelled = template_claim(None, name="labelled")
    labelled["metadata"]["labels"] = {"user": "dave"}
    labelled["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-1"
    fake.add(annotated)
    fake.add(labelled)

    list_claims(api_client, cluster)

    assert charged() == {"annotated": ("", [""]), "labelled": ("dave", ["dave"])}


@pytest.mark.django_db
@pytest.mark.parametrize("job_exists", [True, False])
def test_a_pod_naming_a_job_that_does_not_exist_vouches_for_nobody(
    fake: FakeKube, api_client: Any, cluster: Cluster, job_exists: bool
) -> None:
    """Issue 40: a controller's service account made a Pod "owned" by a Job that never was and
    kept `tally.dev/created-by: victim` on it. The sync reads the Job: one the API server says
    does not exist vouches for nobody, so the claim's hours are charged to no person (its team
    still pays); a Job that exists lets the Pod's annotation stand, as before."""
    if job_exists:
        fake.add(job("train"))
    trainer = pod("train-0", owner=reference("Job", "train", "batch/v1"))
    trainer["metadata"]["annotations"] = {CREATED_BY: "victim"}
    fake.add(trainer)
    fake.add(template_claim(reference("Pod", "train-0", "v1"), name="train-gpu"))

    report = list_claims(api_client, cluster)

    assert report.errors == []
    expected = "victim" if job_exists else ""
    assert charged() == {"train-gpu": (expected, [expected])}
