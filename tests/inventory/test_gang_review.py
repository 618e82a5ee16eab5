"""Adversarial review of reading gangs (issue 20): what the webhook's cached reader serves.

Each test showed a defect found in review (as a strict xfail until it was fixed): a Pod recreated
under its name, and a gang unreadable when its claim was first seen.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from devtools.fake_kube import KINDS, FakeKube
from inventory import gangs, kube_owners, kube_sync, services
from inventory.dumps import iter_objects
from inventory.gangs import gang_of_claim
from inventory.models import ResourceClaim

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gangs"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lws() -> dict[str, Any]:
    return {
        "apiVersion": gangs.LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "serve", "namespace": "ml"},
        "spec": {"leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": {}}}},
    }


def leader(uid: str) -> dict[str, Any]:
    """The leader Pod of group 0: LWS Pods keep their names when a group is recreated."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "serve-0",
            "namespace": "ml",
            "uid": uid,
            "labels": {
                gangs.LWS_NAME_LABEL: "serve",
                gangs.LWS_GROUP_INDEX_LABEL: "0",
                gangs.LWS_WORKER_INDEX_LABEL: "0",
            },
            "annotations": {gangs.LWS_SIZE_ANNOTATION: "2"},
        },
        "spec": {"containers": [{"name": "main", "image": "server:1"}]},
    }


def claim_for(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": f"{pod['metadata']['name']}-gpu-{pod['metadata']['uid']}",
            "namespace": "ml",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": {"devices": {"requests": []}},
    }


def test_a_pod_recreated_under_its_name_is_read_again(fake: FakeKube, api_client: Any) -> None:
    fake.add_custom(lws(), "leaderworkersets")
    old = leader("uid-old")
    fake.add(copy.deepcopy(old))
    reader = kube_owners.GangReader(api_client, ttl_seconds=30, clock=Clock())
    assert gang_of_claim(claim_for(old), reader) is not None

    fake.delete("Pod", "serve-0", "ml")
    new = leader("uid-new")
    fake.add(copy.deepcopy(new))
    # Seconds later (within the TTL) the restarted group's leader gets its claim.
    found = gang_of_claim(claim_for(new), reader)
    assert found is not None and found.key == "LeaderWorkerSet/serve#0"


def test_the_webhook_reads_a_recreated_pod_again_too(fake: FakeKube, api_client: Any) -> None:
    """The webhook wraps the reader (`quota.admission.service._Watched`, which never raises):
    the wrapper must still read past what the reader kept."""
    from quota.admission.service import _Watched

    fake.add_custom(lws(), "leaderworkersets")
    old = leader("uid-old")
    fake.add(copy.deepcopy(old))
    reader = kube_owners.GangReader(api_client, ttl_seconds=30, clock=Clock())
    assert gang_of_claim(claim_for(old), _Watched(reader)) is not None

    fake.delete("Pod", "serve-0", "ml")
    new = leader("uid-new")
    fake.add(copy.deepcopy(new))
    watched = _Watched(reader)
    found = gang_of_claim(claim_for(new), watched)
    assert found is not None and found.key == "LeaderWorkerSet/serve#0"
    assert watched.failures == []


def served(objects: list[dict[str, Any]], fake: FakeKube, *, kinds: tuple[str, ...]) -> None:
    for obj in objects:
        plural = gangs.GANG_KINDS.get((obj["apiVersion"].rpartition("/")[0], obj["kind"]))
        if obj["kind"] not in kinds:
            continue
        if plural is not None:
            fake.add_custom(obj, plural)
        else:
            fake.add(obj)


@pytest.mark.django_db
def test_a_gang_unreadable_when_its_claim_was_first_seen_is_read_on_a_later_list(
    fake: FakeKube, api_client: Any
) -> None:
    cluster = services.get_cluster("lab")
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    served(objects, fake, kinds=(*KINDS, "Job"))  # everything but the JobSet
    kube_sync.sync(api_client=api_client, cluster=cluster, kinds=["ResourceClaim"], once=True)
    assert ResourceClaim.objects.exists()
    assert not ResourceClaim.objects.filter(gang__isnull=False).exists()

    served(objects, fake, kinds=("JobSet",))  # readable now
    kube_sync.sync(api_client=api_client, cluster=cluster, kinds=["ResourceClaim"], once=True)
    assert set(ResourceClaim.objects.values_list("gang__key", flat=True)) == {"JobSet/train"}
