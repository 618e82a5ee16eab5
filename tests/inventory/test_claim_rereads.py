"""When the sync reads a claim's Pod again (issue 22): a claim a read left unsettled (its Pod in
no gang, or gone) waits longer after each read that finds nothing new, up to a bound, so a
large fleet's watch stream does not read a Pod per event; a new Pod starts over at once, and a
gang declared late is still found (issue 20) within the bound `kube_owners.RereadSchedule` states.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from django.db import OperationalError
from django.utils import timezone

from devtools.fake_kube import FakeKube
from inventory import gangs, kube_owners, kube_sync, services
from inventory.dumps import iter_objects
from inventory.models import Cluster, ResourceClaim
from tests.inventory.test_gangs import FIXTURES, Clock, claim_loop, named, serve

CLAIM = "train-workers-0-0-x7k2p-gpus-4m8rt"
POD = "train-workers-0-0-x7k2p"


def claim_obj(uid: str = "claim-1", pod_uid: str = "pod-1") -> dict[str, Any]:
    return {
        "metadata": {
            "uid": uid,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": pod_uid, "controller": True}
            ],
        }
    }


def test_the_wait_doubles_up_to_its_bound_and_starts_over_for_a_new_pod() -> None:
    schedule = kube_owners.RereadSchedule(first_seconds=30, max_seconds=300)
    claim = claim_obj()
    now = 0.0
    assert schedule.due(claim, now)  # never read here
    waits = []
    for _ in range(6):
        schedule.read(claim, now, settled=False)
        wait = next(step for step in range(1, 1000) if schedule.due(claim, now + step))
        assert not schedule.due(claim, now + wait - 1)
        waits.append(wait)
        now += wait
    assert waits == [30, 60, 120, 240, 300, 300]

    recreated = claim_obj(pod_uid="pod-2")  # the same claim, owned by a new Pod
    assert schedule.due(recreated, now + 1)
    schedule.read(recreated, now + 1, settled=False)
    assert not schedule.due(recreated, now + 30)
    assert schedule.due(recreated, now + 31)  # started over at the first wait

    schedule.read(recreated, now + 31, settled=True)  # in a gang: read again at the bound
    assert not schedule.due(recreated, now + 330)
    assert schedule.due(recreated, now + 331)
    # Unsettled after a settled read (its Pod now names a gang not made yet): the first wait.
    schedule.read(recreated, now + 331, settled=False)
    assert not schedule.due(recreated, now + 360)
    assert schedule.due(recreated, now + 361)

    schedule.forget("claim-1")  # deleted
    assert schedule.due(recreated, now + 32)


class Objects:
    """A lookup of the objects given, by API version, kind and name; None for the others."""

    def __init__(self, *objects: dict[str, Any]) -> None:
        self._objects = {
            (obj["apiVersion"], obj["kind"], obj["metadata"]["name"]): obj for obj in objects
        }

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self._objects.get((api_version, kind, name))


def test_a_pod_group_served_in_one_version_of_the_two_asked_settles_the_claim() -> None:
    """A PodGroup is asked for in each API version the scheduler has served (a cluster
    serves one): the version not served is no object missing. One without a gang policy
    settles the claim, in no gang; one not there at all does not."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml", "uid": "pod-1"},
        "spec": {"schedulingGroup": {"podGroupName": "team-a"}},
    }
    basic = {
        "apiVersion": gangs.POD_GROUP_API_VERSIONS[-1],
        "kind": "PodGroup",
        "metadata": {"name": "team-a", "namespace": "ml"},
        "spec": {"schedulingPolicy": {"basic": {}}},
    }
    assert gangs.read_gang_of_claim(claim_obj(), Objects(pod, basic)) == gangs.GangRead(
        gang=None, settled=True
    )
    assert gangs.read_gang_of_claim(claim_obj(), Objects(pod)) == gangs.GangRead(
        gang=None, settled=False
    )
    assert gangs.read_gang_of_claim(claim_obj(), Objects()) == gangs.GangRead(
        gang=None, settled=False
    )


def pod_reads(fake: FakeKube) -> int:
    return len([r for r in fake.reads("Pod") if r.read and r.read[2] == POD])


@pytest.mark.django_db
def test_a_gang_declared_minutes_late_is_found_within_the_bound(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    """The JobSet appears 5 minutes after the claim was first read; lists every 15 s find it
    by 5 minutes + min(5 minutes + 30 s, 5 minutes), reading the Pod 5 times, where a read
    every 30 s read it 11 times before the JobSet appeared."""
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, [obj for obj in objects if obj["kind"] != "JobSet"])
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    first_read = clock.now
    late = 300.0
    bound = late + min(late + kube_owners.GANG_REREAD_SECONDS, kube_owners.GANG_REREAD_MAX_SECONDS)
    found_at = None
    while clock.now - first_read <= bound:
        if clock.now - first_read >= late and found_at is None:
            serve(fake, [named(objects, "train")])
        loop.relist()
        in_gang = ResourceClaim.objects.filter(name=CLAIM, gang__key="JobSet/train").exists()
        if in_gang and found_at is None:
            found_at = clock.now - first_read
            reads_until_found = pod_reads(fake)
        clock.now += 15
    assert found_at is not None and late <= found_at <= bound
    # Read at 0, 30, 90, 210 and 450 s: the waits 30, 60, 120, 240 s.
    assert (found_at, reads_until_found) == (450, 5)
    assert pod_reads(fake) == 5  # in a gang since: not read again


@pytest.mark.django_db
def test_a_recreated_pod_is_read_at_once_whatever_the_wait(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, [obj for obj in objects if obj["kind"] != "JobSet"])
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    for wait in (0, 30, 60):  # read three times: the next wait is 120 s
        clock.now += wait
        loop.relist()
    assert pod_reads(fake) == 3
    clock.now += 10
    loop.relist()
    assert pod_reads(fake) == 3  # waiting

    # The Pod recreated under its name, now one of the JobSet's (a new uid), and the claim
    # owned by it: read at once, and its gang found.
    pod = copy.deepcopy(named(objects, POD))
    pod["metadata"]["uid"] = "0f5b7c8e-1a2b-4c3d-8e9f-0000000000aa"
    fake.modify(pod)
    claim = copy.deepcopy(named(objects, CLAIM))
    claim["metadata"]["ownerReferences"][0]["uid"] = pod["metadata"]["uid"]
    fake.modify(claim)
    serve(fake, [named(objects, "train")])
    clock.now += 10
    loop.relist()
    assert pod_reads(fake) == 4
    assert ResourceClaim.objects.filter(name=CLAIM, gang__key="JobSet/train").exists()


@pytest.mark.django_db
def test_a_claim_whose_pod_is_gone_is_not_read_at_every_list(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    """Its job stays at its Pod, so the claim is followed again, but only when due."""
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, [obj for obj in objects if obj["kind"] == "ResourceClaim"])  # no Pods
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    loop.relist()
    assert pod_reads(fake) == 1
    assert ResourceClaim.objects.get(name=CLAIM).job == f"Pod/{POD}"
    for _ in range(2):
        clock.now += 10
        loop.relist()
    assert pod_reads(fake) == 1  # at 10 and 20 s: waiting
    clock.now += 10
    loop.relist()
    assert pod_reads(fake) == 2


def plain_job() -> dict[str, Any]:
    """The Job the fixture's Pod names as its controller, made by a CronJob, in no JobSet."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "train-workers-0",
            "namespace": "ml",
            "uid": "9d1e2f3a-0000-4000-8000-000000000010",
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "CronJob",
                    "name": "nightly",
                    "uid": "9d1e2f3a-0000-4000-8000-000000000020",
                    "controller": True,
                }
            ],
        },
    }


@pytest.mark.django_db
def test_a_claim_whose_pod_declares_no_gang_is_read_again_only_at_the_bound(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    """Its gang cannot appear later, as a JobSet made after its Pods can: read at once, then
    at the bound, as a claim in a gang is, where a Pod that names a JobSet not there yet is
    read again 30 s later."""
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    pod = copy.deepcopy(named(objects, POD))
    pod["metadata"]["labels"] = {"app": "plain"}  # made by its Job, in no JobSet
    serve(fake, [pod, plain_job(), *(o for o in objects if o["kind"] not in ("JobSet", "Pod"))])
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    loop.relist()
    first_read = clock.now
    assert pod_reads(fake) == 1
    while clock.now - first_read < kube_owners.GANG_REREAD_MAX_SECONDS - 15:
        clock.now += 15
        loop.relist()
    assert pod_reads(fake) == 1  # never due in 5 minutes of lists every 15 s
    clock.now += 15
    loop.relist()
    assert pod_reads(fake) == 2  # due at the bound
    assert ResourceClaim.objects.get(name=CLAIM).gang is None

    # The Pod as the JobSet's Job made it (its labels), the JobSet not made yet: due 30 s on.
    fake.modify(named(objects, POD))
    clock.now += kube_owners.GANG_REREAD_MAX_SECONDS
    loop.relist()
    assert pod_reads(fake) == 3
    clock.now += kube_owners.GANG_REREAD_SECONDS
    loop.relist()
    assert pod_reads(fake) == 4


# A watch batch the database fails ---------------------------------------------------------

RESOURCE_VERSION = "7"  # the batch's last


def _claim_event(objects: list[dict[str, Any]]) -> services.WatchEvent:
    """The claim's ADDED event as the watch delivers it (a fresh object each delivery)."""
    obj = copy.deepcopy(named(objects, CLAIM))
    obj["kind"] = "ResourceClaim"
    return services.WatchEvent(event_type="ADDED", obj=obj, at=timezone.now())


def _stored_claim() -> tuple[str, str | None]:
    claim = ResourceClaim.objects.select_related("gang").get(name=CLAIM)
    return claim.job, claim.gang.key if claim.gang else None


@pytest.mark.django_db
def test_a_batch_the_database_failed_records_the_claims_job_and_gang_when_applied_again(
    fake: FakeKube, api_client: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database fails while the batch is applied (after its Pods were read); the watch
    resumes from the last stored resourceVersion and the same event comes again, seconds
    later. The claim is to be stored as if it had applied the first time."""
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, objects)

    # What the claim gets when nothing fails, in another cluster.
    other = services.get_cluster("control")
    kube_sync.KindSync(
        api_client=api_client,
        cluster=other,
        resource=kube_sync.RESOURCES["ResourceClaim"],
        clock=Clock(),
    )._apply([_claim_event(objects)], RESOURCE_VERSION)
    expected = _stored_claim()
    ResourceClaim.objects.filter(cluster=other).delete()
    assert expected[1] is not None  # the JobSet's gang

    clock = Clock()
    loop = kube_sync.KindSync(
        api_client=api_client,
        cluster=cluster,
        resource=kube_sync.RESOURCES["ResourceClaim"],
        clock=clock,
    )
    apply = services.apply_watch_events
    calls: list[int] = []

    def failing_once(**kwargs: Any) -> services.SyncReport:
        calls.append(len(kwargs["events"]))
        if len(calls) == 1:
            raise OperationalError("the server closed the connection unexpectedly")
        return apply(**kwargs)

    monkeypatch.setattr(services, "apply_watch_events", failing_once)
    with pytest.raises(OperationalError):
        loop._apply([_claim_event(objects)], RESOURCE_VERSION)
    clock.now += 0.05  # the backoff's pause, then the watch from the stored resourceVersion
    loop._apply([_claim_event(objects)], RESOURCE_VERSION)

    assert _stored_claim() == expected
