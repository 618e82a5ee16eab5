"""Adversarial review of gang admission, holds and pending demand (issue 20).

The first tests each showed a defect found in review (they were strict xfails until it was
fixed); the next pin down attacks and mishaps that were tried and found handled; the last,
the other paths of the fixes (issue 20, item 2), each with the ledger checked.

Gangs are read through a plain in-memory `GangLookup` (`Cluster` below), which the webhook
uses as it would the API server's reader: what it serves can change between two admissions,
as the cluster does (a JobSet not yet readable, then readable; a JobSet scaled).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.utils import timezone

from inventory import gang_sync, gangs
from inventory import services as inventory_services
from inventory.models import ResourceClaim
from quota import services
from quota.admission import service
from quota.models import (
    GangPolicy,
    GangReservation,
    GangReservationLine,
    QuotaRule,
    Reservation,
    ReservationLine,
)
from quota.pending import pending_claims
from teams.models import Team, TeamNamespace
from tests.api.cast import Cast, cast
from tests.quota.fixtures import AT, claim, gpu_request, make_team, post, review

__all__ = ["cast"]

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

CONTROLLER = "system:serviceaccount:kube-system:resourceclaim-controller"


class Cluster:
    """What the API server serves to the webhook's gang lookup, by (kind, namespace, name)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    def put(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            metadata = obj["metadata"]
            key = (obj["kind"], metadata.get("namespace", "default"), metadata["name"])
            self.objects[key] = copy.deepcopy(obj)

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    served = Cluster()
    service.use_gang_lookup(served)
    yield served
    service.use_gang_lookup(None)


def jobset_object(name: str, workers: int, namespace: str = "ml") -> dict[str, Any]:
    return {
        "apiVersion": gangs.JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": workers,
                    "template": {"spec": {"parallelism": 1, "completions": 1}},
                }
            ]
        },
    }


def pod(name: str, namespace: str = "ml", **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", **metadata},
        "spec": {"containers": [{"name": "main", "image": "trainer:1"}]},
    }


def jobset_pod(jobset: str, index: int, namespace: str = "ml") -> dict[str, Any]:
    """Worker `index` of JobSet `jobset`, made (as in a cluster) by the JobSet's Job."""
    return pod(
        f"{jobset}-workers-{index}",
        namespace,
        labels={
            gangs.JOBSET_NAME_LABEL: jobset,
            gangs.JOBSET_REPLICATED_JOB_LABEL: "workers",
        },
        ownerReferences=[
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": f"{jobset}-workers-{index}",
                "uid": f"uid-job-{jobset}-{index}",
                "controller": True,
            }
        ],
    )


def pod_claim(name: str, owner: dict[str, Any], gpus: int, namespace: str = "ml") -> dict:
    """The claim the resource-claim controller makes from a template for Pod `owner`."""
    body = claim(name, [gpu_request(gpus)], namespace=namespace)
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": True,
        }
    ]
    return body


def admit(body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    response = post(Client(), review(copy.deepcopy(body), username=CONTROLLER, **kwargs))
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()["response"]
    return answer


def in_use() -> Decimal:
    return QuotaRule.objects.get().in_use.normalize()


def held_for_gangs() -> Decimal:
    total = GangReservationLine.objects.exclude(gang_reservation__state="released").aggregate(
        total=Sum("amount")
    )["total"]
    return (total or Decimal(0)).normalize()


def assert_ledger_true() -> None:
    """Each rule's usage is the sum of its live reservation and gang hold lines, and a recount
    from scratch finds no drift."""
    for rule in QuotaRule.objects.all():
        lines = ReservationLine.objects.filter(rule=rule).exclude(reservation__state="released")
        holds = GangReservationLine.objects.filter(rule=rule).exclude(
            gang_reservation__state="released"
        )
        total = sum(
            (q.aggregate(total=Sum("amount"))["total"] or Decimal(0) for q in (lines, holds)),
            Decimal(0),
        )
        assert rule.in_use == total, rule.name
    usage = services.reconcile_usage(at=timezone.now(), fix=False)
    assert [entry.describe() for entry in usage if entry.drifted] == []


def seen(body: dict[str, Any]) -> None:
    """The sync sees the claim (pending: not allocated yet)."""
    body = copy.deepcopy(body)
    body["metadata"]["uid"] = f"uid-claim-{body['metadata']['name']}"
    report = inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME),
        event_type="ADDED",
        obj=body,
        at=timezone.now(),
    )
    assert report.errors == []


def team(limit: int) -> None:
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": limit}], slug="ml")


# --- Defects (fixed) -------------------------------------------------------------------------


def test_a_member_admitted_before_its_gang_was_readable_still_counts_for_the_gang(
    cluster: Cluster,
) -> None:
    team(16)
    first, second = jobset_pod("train", 0), jobset_pod("train", 1)
    cluster.put(first, second)  # the JobSet not readable yet (not cached / created, 404)
    assert admit(pod_claim("train-0", first, 8))["allowed"]
    assert Reservation.objects.get(name="train-0").gang_key == ""
    assert in_use() == 8

    cluster.put(jobset_object("train", workers=2))
    answer = admit(pod_claim("train-1", second, 8))
    # The gang is 2 x 8 = 16 GPUs, of which worker 0 holds 8 already: it fits the limit of 16.
    # Before the fix worker 1 was denied ("needs 16 GPUs ... uses 8 of 16"), worker 0 kept its 8
    # GPUs: the very partial gang the issue is about.
    assert answer["allowed"], answer["status"]["message"]


def test_no_room_is_held_for_a_member_already_admitted_alone(cluster: Cluster) -> None:
    team(24)
    first, second = jobset_pod("train", 0), jobset_pod("train", 1)
    cluster.put(first, second)
    assert admit(pod_claim("train-0", first, 8))["allowed"]
    cluster.put(jobset_object("train", workers=2))
    assert admit(pod_claim("train-1", second, 8))["allowed"]
    assert_ledger_true()
    # Both workers hold 8 each; nobody else is to come. Before the fix a hold of 8 more was
    # kept for worker 0 (already admitted): 24 in use, and a teammate's 1-GPU notebook denied.
    assert (in_use(), held_for_gangs()) == (16, 0)


def test_a_gang_that_grows_is_not_admitted_member_by_member(cluster: Cluster) -> None:
    team(24)
    pods = [jobset_pod("train", index) for index in range(4)]
    cluster.put(jobset_object("train", workers=2), pods[0], pods[1])
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 0)

    # The JobSet is scaled to 4 workers: 32 GPUs, and the team may hold 24.
    cluster.put(jobset_object("train", workers=4), pods[2], pods[3])
    third = admit(pod_claim("train-2", pods[2], 8))
    fourth = admit(pod_claim("train-3", pods[3], 8))
    assert not fourth["allowed"]  # no room for it: 24 in use
    # Before the fix worker 2 was admitted alone (drawing nothing from the empty hold), so 3
    # of the 4 workers held 24 GPUs waiting for a fourth that could not come.
    assert not third["allowed"], "half of the grown gang was admitted"


def test_an_allocated_admin_access_claim_is_not_pending(cast: Cast) -> None:
    TeamNamespace.objects.create(team=cast.alpha, namespace="alpha")
    body = claim("monitor", [gpu_request(1, adminAccess=True)], namespace="alpha")
    body["metadata"]["uid"] = "uid-monitor"
    body["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "gpu.nvidia.com",
                        "pool": "h100-a",
                        "device": "gpu-0",
                        "adminAccess": True,
                    }
                ]
            }
        }
    }
    report = inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME),
        event_type="ADDED",
        obj=body,
        at=AT,
    )
    assert report.errors == []
    # Allocated: the scheduler has given it its device (to observe).
    assert [c.name for c in pending_claims(user=cast.finance, now=AT + timedelta(days=7))] == []


def test_a_pod_made_by_hand_with_a_jobsets_labels_cannot_draw_its_hold(cluster: Cluster) -> None:
    team(16)
    workers = []
    for index in range(2):
        worker = jobset_pod("train", index)
        # Made by the Job controller for the JobSet's Job, as in a cluster.
        worker["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": f"train-workers-{index}",
                "uid": f"uid-job-{index}",
                "controller": True,
            }
        ]
        workers.append(worker)
    forged = jobset_pod("train", 9)  # the same labels, created by hand: no Job owns it
    forged["metadata"]["name"] = "sneaky"
    cluster.put(jobset_object("train", workers=2), *workers, forged)
    assert admit(pod_claim("train-0", workers[0], 8))["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 8)

    sneaky = admit(pod_claim("sneaky", forged, 8))
    victim = admit(pod_claim("train-1", workers[1], 8))
    # Before the fix the hand-made Pod took the 8 GPUs held for worker 1, which was then denied
    # ("16 GPUs in use"): the JobSet is left half admitted and the hold went to someone else.
    assert (sneaky["allowed"], victim["allowed"]) == (False, True)


def test_a_replaced_members_share_stays_with_its_gang(cluster: Cluster) -> None:
    team(24)
    pods = [jobset_pod("train", index) for index in range(3)]
    replacement = jobset_pod("train", 1)
    replacement["metadata"].update(name="train-workers-1-retry", uid="uid-retry")
    cluster.put(jobset_object("train", workers=3), *pods, replacement)
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    worker1 = pod_claim("train-1", pods[1], 8)
    assert admit(worker1)["allowed"]
    assert (in_use(), held_for_gangs()) == (24, 8)  # 8 still held for worker 2

    # Worker 1's Pod is evicted: its claim goes; the Job makes a replacement Pod.
    seen(worker1)
    gone = copy.deepcopy(worker1)
    gone["metadata"]["uid"] = "uid-claim-train-1"
    inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME),
        event_type="DELETED",
        obj=gone,
        at=timezone.now(),
    )
    assert_ledger_true()
    # A teammate's notebook now takes the 8 GPUs worker 1 held (before the fix: admitted).
    notebook = admit(claim("notebook", [gpu_request(8)], namespace="ml"))
    retry = admit(pod_claim("train-1-retry", replacement, 8))
    last = admit(pod_claim("train-2", pods[2], 8))
    assert_ledger_true()
    # The gang's room was the gang's until it ends: the notebook waits, all three run.
    assert (notebook["allowed"], retry["allowed"], last["allowed"]) == (False, True, True)


# --- Tried and found handled -----------------------------------------------------------------


def test_the_first_members_review_sent_again_reserves_once(cluster: Cluster) -> None:
    team(16)
    pods = [jobset_pod("train", index) for index in range(2)]
    cluster.put(jobset_object("train", workers=2), *pods)
    first = pod_claim("train-0", pods[0], 8)
    uid = "4b1c0a4e-replayed"
    assert admit(first, uid=uid)["allowed"]
    assert admit(first, uid=uid)["allowed"]  # the same review again
    assert admit(first)["allowed"]  # the create retried: a new uid
    assert (in_use(), held_for_gangs(), GangReservation.objects.count()) == (16, 8, 1)
    assert Reservation.objects.count() == 1
    assert_ledger_true()


def test_a_dry_run_of_the_first_member_holds_nothing(cluster: Cluster) -> None:
    team(16)
    pods = [jobset_pod("train", index) for index in range(2)]
    cluster.put(jobset_object("train", workers=2), *pods)
    assert admit(pod_claim("train-0", pods[0], 8), dry_run=True)["allowed"]
    assert (in_use(), GangReservation.objects.count(), Reservation.objects.count()) == (0, 0, 0)


def test_names_at_their_longest_make_a_gang_that_is_held_and_drawn(cluster: Cluster) -> None:
    team(16)
    name = ("w" * 62 + ".") * 4 + "w"  # a 253-character DNS subdomain
    assert len(name) == 253
    group, replica = "g" * 63, "r" * 63
    workload = {
        "apiVersion": gangs.WORKLOAD_API_VERSION,
        "kind": "Workload",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"podGroups": [{"name": group, "policy": {"gang": {"minCount": 2}}}]},
    }
    pods = []
    for index in range(2):
        member = pod(f"{'p' * 250}-{index}")
        member["spec"]["workloadRef"] = {
            "name": name,
            "podGroup": group,
            "podGroupReplicaKey": replica,
        }
        pods.append(member)
    cluster.put(workload, *pods)
    assert admit(pod_claim("c" * 253, pods[0], 8))["allowed"]
    hold = GangReservation.objects.get()
    assert len(hold.key) <= gangs.GANG_KEY_MAX_LENGTH
    assert hold.size == 2
    assert admit(pod_claim("d" * 253, pods[1], 8))["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 0)
    assert_ledger_true()


def test_a_huge_declared_gang_blocks_nobody(cluster: Cluster) -> None:
    """A Pod that declares a gang of a million (the most trusted) is denied whole and holds
    nothing; one that declares more is no gang: decided alone."""
    team(16)
    greedy = pod(
        "greedy",
        labels={gangs.KUEUE_POD_GROUP_LABEL: "greedy"},
        annotations={gangs.KUEUE_TOTAL_COUNT_ANNOTATION: str(gangs.MAX_GANG_SIZE)},
    )
    absurd = pod(
        "absurd",
        labels={gangs.KUEUE_POD_GROUP_LABEL: "absurd"},
        annotations={gangs.KUEUE_TOTAL_COUNT_ANNOTATION: "1000000000"},
    )
    cluster.put(greedy, absurd)
    denied = admit(pod_claim("greedy-0", greedy, 1))
    assert not denied["allowed"]
    assert "gang PodGroup.kueue.x-k8s.io/greedy (1000000 pods)" in denied["status"]["message"]
    assert (in_use(), GangReservation.objects.count()) == (0, 0)
    assert admit(pod_claim("absurd-0", absurd, 1))["allowed"]
    assert (in_use(), GangReservation.objects.count()) == (1, 0)
    assert admit(claim("notebook", [gpu_request(15)], namespace="ml"))["allowed"]
    assert_ledger_true()


def test_an_expired_hold_is_made_again_for_the_members_still_to_come(cluster: Cluster) -> None:
    """Expiry racing a late member, in order: the hold expires, then the member arrives. It
    is weighed with the gang (less what its admitted members hold), and the ledger stays
    true at each step."""
    team(24)
    pods = [jobset_pod("train", index) for index in range(3)]
    cluster.put(jobset_object("train", workers=3), *pods)
    first = pod_claim("train-0", pods[0], 8)
    assert admit(first)["allowed"]
    assert (in_use(), held_for_gangs()) == (24, 16)
    seen(first)  # the sync sees worker 0's claim: its reservation no longer expires
    later = timezone.now() + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS + 1)
    assert services.expire_reservations(now=later) >= 1
    assert (in_use(), held_for_gangs()) == (8, 0)
    assert_ledger_true()
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]
    assert (in_use(), held_for_gangs()) == (24, 8)
    assert admit(pod_claim("train-2", pods[2], 8))["allowed"]
    assert (in_use(), held_for_gangs()) == (24, 0)
    assert_ledger_true()


def test_a_gang_in_another_namespace_of_the_same_name_draws_nothing(cluster: Cluster) -> None:
    """A forged JobSet label in another namespace names another gang: gangs are per namespace."""
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 16}], slug="ml")
    other = make_team(
        [{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 16}], slug="other"
    )
    assert other.slug == "other"
    pods = [jobset_pod("train", index) for index in range(2)]
    forged = jobset_pod("train", 1, namespace="other")
    cluster.put(jobset_object("train", workers=2), *pods, forged)
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    assert admit(pod_claim("forged", forged, 8, namespace="other"))["allowed"]
    # The forger's Pod reads the JobSet of its own namespace (none: decided alone); the
    # victim's hold is intact.
    victim = GangReservation.objects.get(namespace="ml")
    assert sum(line.amount for line in victim.lines.all()) == 8
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]


# --- The fixes' other paths ------------------------------------------------------------------


def drop(body: dict[str, Any]) -> None:
    """The claim, seen by the sync, goes (its Pod evicted or done)."""
    seen(body)
    gone = copy.deepcopy(body)
    gone["metadata"]["uid"] = f"uid-claim-{body['metadata']['name']}"
    report = inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME),
        event_type="DELETED",
        obj=gone,
        at=timezone.now(),
    )
    assert report.errors == []


def test_a_gang_that_cannot_be_read_decides_the_claim_alone_with_a_warning(
    cluster: Cluster,
) -> None:
    team(16)
    first = jobset_pod("train", 0)
    cluster.put(first)  # the JobSet its label names is not there (yet)
    answer = admit(pod_claim("train-0", first, 8))
    assert answer["allowed"]
    # (Besides the fixture's nodes being too small for 8 GPUs now: counted all the same.)
    assert [w for w in answer["warnings"] if "on any node now" not in w] == [
        "Tally could not read this claim's gang (JobSet ml/train could not be read): the "
        "claim is decided alone"
    ]


def test_a_gang_that_grows_within_the_limit_tops_its_hold_up_for_the_new_members(
    cluster: Cluster,
) -> None:
    team(32)
    pods = [jobset_pod("train", index) for index in range(4)]
    cluster.put(jobset_object("train", workers=2), pods[0], pods[1])
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]
    hold = GangReservation.objects.get()
    assert (in_use(), held_for_gangs()) == (16, 0)

    cluster.put(jobset_object("train", workers=4), pods[2], pods[3])
    before = timezone.now()
    assert admit(pod_claim("train-2", pods[2], 8))["allowed"]
    # Worker 2's own 8 and the 8 worker 3 will need: the grown gang is whole.
    assert (in_use(), held_for_gangs()) == (32, 8)
    hold.refresh_from_db()
    assert (hold.state, hold.size) == ("reserved", 4)
    assert hold.expires_at is not None
    assert hold.expires_at >= before + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS)
    assert_ledger_true()
    assert not admit(claim("notebook", [gpu_request(1)], namespace="ml"))["allowed"]
    assert admit(pod_claim("train-3", pods[3], 8))["allowed"]
    assert (in_use(), held_for_gangs(), GangReservation.objects.count()) == (32, 0, 1)
    assert_ledger_true()


def test_a_gang_that_grows_under_warn_admits_its_new_members_alone(cluster: Cluster) -> None:
    """A hold kept from when the team enforced gangs: under `warn` a member beyond it is
    decided alone (counted as a claim alone), with a warning when the gang cannot fit."""
    team(24)
    pods = [jobset_pod("train", index) for index in range(4)]
    cluster.put(jobset_object("train", workers=2), pods[0], pods[1])
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]
    GangPolicy.objects.create(team=Team.objects.get(slug="ml"), mode="warn")

    cluster.put(jobset_object("train", workers=4), pods[2], pods[3])
    answer = admit(pod_claim("train-2", pods[2], 8))
    assert answer["allowed"]
    assert any("gangs: warn; the claim is decided alone" in w for w in answer["warnings"])
    assert (in_use(), held_for_gangs()) == (24, 0)
    assert_ledger_true()
    assert not admit(pod_claim("train-3", pods[3], 8))["allowed"]  # no room: 24 of 24


def test_a_member_admitted_alone_joins_its_gang_when_the_sync_reads_it(cluster: Cluster) -> None:
    team(16)
    first = jobset_pod("train", 0)
    cluster.put(first)
    body = pod_claim("train-0", first, 8)
    assert admit(body)["allowed"]
    seen(body)
    sync = inventory_services.get_cluster(settings.TALLY_CLUSTER_NAME)
    ref = gangs.GangRef(source="jobset", key="JobSet/train", size=2, roles=(), role="workers")
    gang = gang_sync.record_gang(cluster=sync, namespace="ml", ref=ref, at=AT)
    claim_row = ResourceClaim.objects.get(name="train-0")
    ResourceClaim.objects.filter(pk=claim_row.pk).update(gang=gang)
    services.sync_reservations(cluster=sync, claim_ids=[claim_row.pk], at=timezone.now())
    assert Reservation.objects.get(name="train-0").gang_key == "JobSet/train"
    assert_ledger_true()


def test_a_released_member_of_a_gang_that_needed_no_hold_is_held_for_its_replacement(
    cluster: Cluster,
) -> None:
    """Worker 0 was admitted alone and worker 1 with it, so the gang never had a hold: when
    worker 1 goes, a hold is made for its share (with a fresh expiry)."""
    team(16)
    first, second = jobset_pod("train", 0), jobset_pod("train", 1)
    replacement = jobset_pod("train", 1)
    replacement["metadata"].update(name="train-workers-1-retry", uid="uid-retry")
    cluster.put(first, second, replacement)
    assert admit(pod_claim("train-0", first, 8))["allowed"]
    cluster.put(jobset_object("train", workers=2))
    worker1 = pod_claim("train-1", second, 8)
    assert admit(worker1)["allowed"]
    assert GangReservation.objects.count() == 0

    before = timezone.now()
    drop(worker1)
    hold = GangReservation.objects.get()
    assert (hold.key, hold.state, hold.size) == ("JobSet/train", "reserved", 2)
    assert hold.expires_at is not None
    assert hold.expires_at >= before + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS)
    assert (in_use(), held_for_gangs()) == (16, 8)
    assert_ledger_true()
    assert not admit(claim("notebook", [gpu_request(1)], namespace="ml"))["allowed"]
    assert admit(pod_claim("train-1-retry", replacement, 8))["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 0)
    assert_ledger_true()


def test_a_released_members_share_is_freed_once_its_gangs_hold_has_expired(
    cluster: Cluster,
) -> None:
    team(24)
    pods = [jobset_pod("train", index) for index in range(3)]
    cluster.put(jobset_object("train", workers=3), *pods)
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    worker1 = pod_claim("train-1", pods[1], 8)
    assert admit(worker1)["allowed"]
    seen(pod_claim("train-0", pods[0], 8))
    seen(worker1)
    later = timezone.now() + timedelta(seconds=settings.TALLY_GANG_RESERVATION_SECONDS + 1)
    assert services.expire_reservations(now=later) == 1  # worker 2 never came
    assert (in_use(), held_for_gangs()) == (16, 0)
    drop(worker1)
    # The gang's room was given up when its hold expired: worker 1's share is free.
    assert (
        in_use(),
        held_for_gangs(),
        GangReservation.objects.exclude(state="released").count(),
    ) == (8, 0, 0)
    assert_ledger_true()


def test_an_expired_never_seen_member_gives_its_share_back_to_its_gang(cluster: Cluster) -> None:
    """A member whose claim never appeared (a later admission step refused it) expires: its
    share goes back to the gang's hold, for the claim made again."""
    team(16)
    pods = [jobset_pod("train", index) for index in range(2)]
    cluster.put(jobset_object("train", workers=2), *pods)
    first = pod_claim("train-0", pods[0], 8)
    assert admit(first)["allowed"]
    seen(first)
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]  # never seen by the sync
    later = timezone.now() + timedelta(seconds=settings.TALLY_RESERVATION_TTL_SECONDS + 1)
    assert services.expire_reservations(now=later) == 1
    assert (in_use(), held_for_gangs()) == (16, 8)
    assert_ledger_true()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("limit", "admitted"), [(32, 2), (24, 0)], ids=["room", "no-room"])
def test_new_members_of_a_grown_gang_racing_are_admitted_whole_or_not_at_all(
    cluster: Cluster, limit: int, admitted: int
) -> None:
    """Workers 2 and 3 of a JobSet grown from 2 to 4 workers, admitted at once: one tops the
    hold up for the other (which, planned on the hold as it was, plans again and draws), or
    neither fits."""
    team(limit)
    pods = [jobset_pod("train", index) for index in range(4)]
    cluster.put(jobset_object("train", workers=2), *pods)
    assert admit(pod_claim("train-0", pods[0], 8))["allowed"]
    assert admit(pod_claim("train-1", pods[1], 8))["allowed"]
    cluster.put(jobset_object("train", workers=4))

    def admitted_alone(index: int) -> bool:
        try:
            return bool(admit(pod_claim(f"train-{index}", pods[index], 8))["allowed"])
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(admitted_alone, [2, 3]))
    assert sum(results) == admitted
    assert (in_use(), held_for_gangs()) == (16 + 8 * admitted, 0)
    assert GangReservation.objects.count() == 1
    assert_ledger_true()


def test_only_the_gangs_own_members_admitted_alone_are_counted_for_it(cluster: Cluster) -> None:
    """Claims admitted alone for Pods of another gang, of no gang, or gone stay alone."""
    team(32)
    mine, other, loner, gone = (
        jobset_pod("train", 0),
        jobset_pod("eval", 0),
        pod("notebook"),
        jobset_pod("train", 5),
    )
    cluster.put(mine, other, loner)  # no JobSet readable yet; `gone`'s Pod is not there
    for name, owner in (("train-0", mine), ("eval-0", other), ("nb", loner), ("old", gone)):
        assert admit(pod_claim(name, owner, 4))["allowed"]
    cluster.put(jobset_object("train", workers=2), jobset_object("eval", workers=2))
    cluster.put(jobset_pod("train", 1))
    assert admit(pod_claim("train-1", jobset_pod("train", 1), 4))["allowed"]
    keys = dict(Reservation.objects.values_list("name", "gang_key"))
    assert keys == {
        "train-0": "JobSet/train",
        "train-1": "JobSet/train",
        "eval-0": "",
        "nb": "",
        "old": "",
    }
    assert (in_use(), held_for_gangs()) == (20, 0)
    assert_ledger_true()
