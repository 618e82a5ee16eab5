"""Gang-aware admission (issue 20, item 2): a gang is admitted whole or not at all.

The gangs are read as the webhook reads them in a cluster: the real kubernetes client over the
fake API server (`inventory.kube_owners.GangReader`), serving JobSets and their Pods. After every
step the ledger is checked: each rule's usage is what the live reservations and gang holds
hold, and a recount from scratch finds no drift.
"""

from __future__ import annotations

import copy
import functools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from devtools.fake_kube import KINDS, FakeKube
from inventory import gangs, kube, kube_owners
from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota import services
from quota.admission import service, store
from quota.models import (
    AdmissionDecision,
    GangMode,
    GangPolicy,
    GangReservation,
    GangReservationLine,
    Mode,
    QuotaRule,
    Reservation,
    ReservationLine,
)
from quota.policy import PolicyError, apply_policy, load_policy
from tests.quota.fixtures import AT, claim, gpu_request, make_team, post, review

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fleet")]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gangs" / "jobset.yaml"
WORKER_0 = "train-workers-0-0-x7k2p-gpus-4m8rt"
WORKER_1 = "train-workers-1-0-q9m4z-gpus-p2v6d"
# Claims made from templates are created by the resource-claim controller.
CONTROLLER = "system:serviceaccount:kube-system:resourceclaim-controller"


# --- The cluster: JobSets, their Pods and claims, on the fake API server ---------------------


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(max_lifetime_seconds=120) as server:
        yield server


@pytest.fixture
def reader(fake: FakeKube, tmp_path: Path) -> Iterator[kube_owners.GangReader]:
    """The webhook's gang lookup: the real client over the fake API server."""
    client = kube.api_client(kubeconfig=str(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    lookup = kube_owners.GangReader(client)
    service.use_gang_lookup(lookup)
    yield lookup
    client.close()


def serve(fake: FakeKube, objects: list[dict[str, Any]]) -> None:
    """Put objects on the fake API server, as the cluster holds them."""
    for obj in objects:
        plural = gangs.GANG_READS.get((obj["apiVersion"].rpartition("/")[0], obj["kind"]))
        if plural is not None:
            fake.add_custom(obj, plural)
        elif obj["kind"] in KINDS and obj["kind"] != "ResourceClaim":
            fake.add(obj)


def issue_jobset() -> dict[str, dict[str, Any]]:
    """The issue's JobSet `train` in namespace ml: 2 workers, each a Pod whose claim asks for
    8 GPUs (tests/fixtures/gangs/jobset.yaml), by name."""
    return {obj["metadata"]["name"]: obj for obj in iter_objects(FIXTURE)}


def jobset(name: str, *, workers: int, gpus: int, namespace: str = "ml") -> list[dict[str, Any]]:
    """A JobSet of `workers` one-Pod Jobs, each Pod's claim asking for `gpus` GPUs: the
    JobSet, its Pods and their claims (claims named `<name>-<i>`)."""
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
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
    ]
    for index in range(workers):
        pod = f"{name}-workers-{index}"
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod,
                    "namespace": namespace,
                    "uid": f"uid-{pod}",
                    "labels": {
                        gangs.JOBSET_NAME_LABEL: name,
                        gangs.JOBSET_REPLICATED_JOB_LABEL: "workers",
                    },
                    # Made by the JobSet's Job, as in a cluster.
                    "ownerReferences": [
                        {
                            "apiVersion": "batch/v1",
                            "kind": "Job",
                            "name": pod,
                            "uid": f"uid-job-{pod}",
                            "controller": True,
                        }
                    ],
                },
                "spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]},
            }
        )
        member = claim(f"{name}-{index}", [gpu_request(gpus)], namespace=namespace)
        member["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod,
                "uid": f"uid-{pod}",
                "controller": True,
            }
        ]
        objects.append(member)
    return objects


def claims_of(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [obj for obj in objects if obj["kind"] == "ResourceClaim"]


# --- The webhook and the ledger -------------------------------------------------------------


def admit(body: dict[str, Any], path: str = "/admission/resourceclaims") -> dict[str, Any]:
    response = post(Client(), review(copy.deepcopy(body), username=CONTROLLER), path)
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()["response"]
    return answer


def allowed(body: dict[str, Any]) -> bool:
    return bool(admit(body)["allowed"])


def in_use() -> Decimal:
    return QuotaRule.objects.get().in_use.normalize()


def held_for_gangs() -> Decimal:
    total = GangReservationLine.objects.exclude(gang_reservation__state="released").aggregate(
        total=Sum("amount")
    )["total"]
    return (total or Decimal(0)).normalize()


def assert_ledger_true() -> None:
    """Each rule's usage is what the live reservations and gang holds hold on it, and a
    recount from scratch finds it so."""
    for rule in QuotaRule.objects.all():
        held = [
            ReservationLine.objects.filter(rule=rule).exclude(reservation__state="released"),
            GangReservationLine.objects.filter(rule=rule).exclude(
                gang_reservation__state="released"
            ),
        ]
        assert rule.in_use == sum(
            (query.aggregate(total=Sum("amount"))["total"] or Decimal(0) for query in held),
            Decimal(0),
        ), rule.name
    usage = services.reconcile_usage(at=timezone.now(), fix=False)
    assert [entry.describe() for entry in usage if entry.drifted] == []


def team_of_16(mode: str | None = None) -> None:
    team = make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 16}], slug="ml")
    if mode is not None:
        GangPolicy.objects.create(team=team, mode=mode)


# --- The issue's case -----------------------------------------------------------------------


def test_a_jobset_that_cannot_fit_whole_is_denied_whole_and_holds_nothing(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(claim("notebook", [gpu_request(1)], namespace="ml"))["allowed"]
    assert in_use() == 1

    answer = admit(objects[WORKER_0])
    assert not answer["allowed"]
    message = answer["status"]["message"]
    assert message.startswith("gang JobSet/train (2 pods) needs 16 GPUs of class gpu.nvidia.com")
    assert 'team "ml" uses 1 GPU of 16 GPUs on quota rule "gpus" (enforce)' in message
    assert "denied whole, nothing reserved" in message
    # Nothing held: not the worker's 8 GPUs, no gang hold.
    assert in_use() == 1
    assert list(Reservation.objects.values_list("name", flat=True)) == ["notebook"]
    assert not GangReservation.objects.exists()
    assert not admit(objects[WORKER_1])["allowed"]  # the other worker alike
    assert in_use() == 1
    assert_ledger_true()


def test_a_gang_that_fits_holds_for_its_other_member_which_draws_from_the_hold(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()

    assert admit(objects[WORKER_0])["allowed"]
    # The whole gang is counted: 8 on the worker's reservation, 8 held for the other.
    assert in_use() == 16
    assert held_for_gangs() == 8
    hold = GangReservation.objects.get()
    assert (hold.key, hold.source, hold.size, hold.state) == (
        "JobSet/train",
        "jobset",
        2,
        "reserved",
    )
    assert Reservation.objects.get(name=WORKER_0).gang_key == "JobSet/train"
    assert_ledger_true()

    # No one else can take the room the gang holds.
    denied = admit(claim("notebook", [gpu_request(1)], namespace="ml"))
    assert not denied["allowed"] and "16 GPUs in use" in denied["status"]["message"]

    # The mutating webhook, called first, lets the second worker through: its room is held.
    assert admit(objects[WORKER_1], "/admission/resourceclaims/mutate")["allowed"]
    assert admit(objects[WORKER_1])["allowed"]
    assert in_use() == 16  # moved from the hold to the worker: no change in usage
    assert held_for_gangs() == 0
    line = ReservationLine.objects.get(reservation__name=WORKER_1)
    assert line.amount == 8
    assert_ledger_true()

    # A create the API server sends again reserves nothing more.
    assert admit(objects[WORKER_1])["allowed"]
    assert in_use() == 16
    assert_ledger_true()


def test_a_dry_run_weighs_the_gang_and_holds_nothing(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    body = review(copy.deepcopy(objects[WORKER_0]), username=CONTROLLER, dry_run=True)
    assert post(Client(), body).json()["response"]["allowed"]
    QuotaRule.objects.update(limit=15)
    denied = post(Client(), body).json()["response"]
    assert not denied["allowed"] and "gang JobSet/train" in denied["status"]["message"]
    assert (in_use(), held_for_gangs()) == (0, 0)
    assert not Reservation.objects.exists() and not GangReservation.objects.exists()


def test_two_gangs_that_fit_one_after_the_other_are_both_admitted(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    first, second = jobset("a", workers=2, gpus=4), jobset("b", workers=2, gpus=4)
    serve(fake, first + second)
    team_of_16()
    for body in claims_of(first) + claims_of(second):
        assert admit(body)["allowed"]
    assert in_use() == 16
    assert held_for_gangs() == 0
    assert GangReservation.objects.count() == 2
    assert_ledger_true()


# --- Issue 36: a gang's denial says why a model rule weighs "any GPU" ---------------------------

A100_RULE = "device.attributes['gpu.nvidia.com'].productName.contains('A100')"
BINDS = (
    "; the rule binds NVIDIA A100-SXM4-80GB, which request 'gpu' could be given (a selector "
    "that leaves it out of the request leaves the rule out too)"
)


def team_with_an_a100_rule(limit: int) -> None:
    make_team(
        [
            {"name": "a100", "device_class": "gpu.nvidia.com", "selector": A100_RULE,
             "limit": limit},
            {"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 16},
        ],
        slug="ml",
    )  # fmt: skip


def test_a_gangs_denial_names_the_model_its_rule_binds(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """Two workers, each any two NVIDIA GPUs, with room for two A100s: each claim alone fits,
    the gang does not (it could be given four A100s). Its denial says why the A100 rule
    weighs it, as a claim's own denial does."""
    objects = jobset("any", workers=2, gpus=2)
    serve(fake, objects)
    team_with_an_a100_rule(2)
    answer = admit(claims_of(objects)[0])
    assert not answer["allowed"]
    assert answer["status"]["message"] == (
        'gang JobSet/any (2 pods) needs 4 GPUs of class gpu.nvidia.com; team "ml" uses 0 GPUs '
        'of 2 GPUs on quota rule "a100" (enforce)' + BINDS + "; the gang is denied whole, "
        "nothing reserved"
    )
    assert not Reservation.objects.exists() and not GangReservation.objects.exists()


def test_a_gangs_warning_names_the_model_its_rule_binds(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """As the denial, under `gangs: warn` (each claim decided alone), and for a warn rule. The
    API server keeps a warning's first 256 characters; the decision's record keeps it whole."""
    objects = jobset("any", workers=2, gpus=2)
    serve(fake, objects)
    team_with_an_a100_rule(2)
    GangPolicy.objects.create(team=QuotaRule.objects.get(name="a100").team, mode=GangMode.WARN)

    def recorded(claim: dict[str, Any]) -> list[str]:
        assert admit(claim)["allowed"]
        name = claim["metadata"]["name"]
        return list(AdmissionDecision.objects.filter(name=name).latest("id").warnings)

    assert (
        'gang JobSet/any (2 pods) needs 4 GPUs of class gpu.nvidia.com; team "ml" uses 0 GPUs '
        'of 2 GPUs on quota rule "a100" (enforce)' + BINDS + " (gangs: warn; the claim is "
        "decided alone)"
    ) in recorded(claims_of(objects)[0])
    QuotaRule.objects.filter(name="a100").update(mode=Mode.WARN)
    assert any(
        w.startswith("gang JobSet/any (2 pods) needs") and w.endswith(BINDS + " (warn only)")
        for w in recorded(claims_of(objects)[1])
    )


def test_a_gangs_denial_at_reservation_names_the_model_too(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """The gang fitted when weighed; the reservation's lock finds the A100 rule's usage grown
    meanwhile: denied whole, saying the same."""
    objects = jobset("any", workers=2, gpus=2)
    serve(fake, objects)
    team_with_an_a100_rule(4)
    cluster = inventory_services.get_cluster("default")
    body = claims_of(objects)[0]
    state = store.admission_state(cluster=cluster.name, namespace="ml", name="any-0")
    plan = service._plan(cluster=cluster, claim=body, state=state)
    assert plan.denial == "" and plan.gang is not None and plan.gang.whole
    QuotaRule.objects.filter(name="a100").update(in_use=1)  # meanwhile another took one
    decision, recorded = service._reserve(
        cluster=cluster, claim=body, plan=plan, username=CONTROLLER, admission_uid="u", at=AT
    )
    assert not decision.allowed and not recorded
    assert decision.message.endswith(
        'on quota rule "a100" (enforce)' + BINDS + "; the gang is denied whole, nothing reserved"
    )
    assert not Reservation.objects.exists() and not GangReservation.objects.exists()


class WithTemplates:
    """The objects of a dump (`GangIndex`), and the ResourceClaimTemplates beside them: a
    `GangLookup` that can read the templates of a gang's roles."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.index = gangs.GangIndex()
        self.templates: dict[tuple[str, str], dict[str, Any]] = {}
        for obj in objects:
            if obj["kind"] == "ResourceClaimTemplate":
                metadata = obj["metadata"]
                self.templates[(metadata["namespace"], metadata["name"])] = obj
            else:
                self.index.add(obj)

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        if kind == "ResourceClaimTemplate":
            return self.templates.get((namespace, name))
        return self.index.get(namespace, api_version, kind, name)


def test_a_gangs_demand_is_read_from_its_roles_claim_templates() -> None:
    """A JobSet of a driver (one Pod, 1 GPU) and 2 workers (8 GPUs each): 17 GPUs in all,
    not 3 times the worker's 8."""
    objects = copy.deepcopy(list(issue_jobset().values()))
    jobset_object = next(obj for obj in objects if obj["kind"] == "JobSet")
    worker_job = jobset_object["spec"]["replicatedJobs"][0]
    driver_job = copy.deepcopy(worker_job)
    driver_job["name"], driver_job["replicas"] = "driver", 1
    driver_job["template"]["spec"]["template"]["spec"]["resourceClaims"] = [
        {"name": "gpus", "resourceClaimTemplateName": "one-gpu"}
    ]
    jobset_object["spec"]["replicatedJobs"].append(driver_job)
    template = copy.deepcopy(next(o for o in objects if o["kind"] == "ResourceClaimTemplate"))
    template["metadata"]["name"] = "one-gpu"
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 1
    service.use_gang_lookup(WithTemplates([*objects, template]))
    worker = next(o for o in objects if o["metadata"]["name"] == WORKER_0)
    team_of_16()

    answer = admit(worker)
    assert not answer["allowed"]
    assert answer["status"]["message"].startswith("gang JobSet/train (3 pods) needs 17 GPUs")

    QuotaRule.objects.update(limit=17)
    assert admit(worker)["allowed"]
    assert (in_use(), held_for_gangs()) == (17, 9)  # the other worker's 8, the driver's 1
    assert_ledger_true()


def claim_template(name: str, gpus: int, namespace: str = "ml") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [gpu_request(gpus)]}}},
    }


def leader_worker_set(name: str, *, size: int, namespace: str = "ml") -> list[dict[str, Any]]:
    """A LeaderWorkerSet of one group of `size` Pods: the leader's claim from the template
    `one-gpu` (1 GPU), each worker's from `h100x8` (8 GPUs); the LWS, its Pods, their claims
    (named `<pod>-gpus`, leader first) and the two templates."""

    def pod_spec(template: str) -> dict[str, Any]:
        return {
            "containers": [{"name": "server", "image": "server:1"}],
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
        }

    objects: list[dict[str, Any]] = [
        claim_template("one-gpu", 1, namespace),
        claim_template("h100x8", 8, namespace),
        {
            "apiVersion": gangs.LWS_API_VERSION,
            "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": 1,
                "leaderWorkerTemplate": {
                    "size": size,
                    "leaderTemplate": {"spec": pod_spec("one-gpu")},
                    "workerTemplate": {"spec": pod_spec("h100x8")},
                },
            },
        },
    ]
    for index in range(size):
        pod = name + "-0" + ("" if index == 0 else f"-{index}")
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod,
                    "namespace": namespace,
                    "uid": f"uid-{pod}",
                    "labels": {
                        gangs.LWS_NAME_LABEL: name,
                        gangs.LWS_GROUP_INDEX_LABEL: "0",
                        gangs.LWS_WORKER_INDEX_LABEL: str(index),
                    },
                    "annotations": {gangs.LWS_SIZE_ANNOTATION: str(size)},
                },
                "spec": pod_spec("one-gpu" if index == 0 else "h100x8"),
            }
        )
        member = claim(f"{pod}-gpus", [gpu_request(1 if index == 0 else 8)], namespace=namespace)
        member["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod,
                "uid": f"uid-{pod}",
                "controller": True,
            }
        ]
        objects.append(member)
    return objects


def test_a_gangs_demand_is_the_sum_over_its_roles_templates_read_from_the_api_server(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """A LeaderWorkerSet group of 3: the leader's template asks for 1 GPU, the workers' for 8
    each. The whole gang takes 17 GPUs, read from the two templates on the API server: not
    the leader's 1 times 3 (which would let the leader in and strand its workers), nor a
    worker's 8 times 3."""
    objects = leader_worker_set("serve", size=3)
    serve(fake, objects)
    leader, *workers = claims_of(objects)
    team_of_16()

    answer = admit(leader)
    assert not answer["allowed"]
    assert answer["status"]["message"].startswith(
        "gang LeaderWorkerSet/serve#0 (3 pods) needs 17 GPUs"
    )
    assert (in_use(), held_for_gangs()) == (0, 0)
    # A worker first, alike: the gang's demand does not depend on which member comes first.
    assert admit(workers[0])["status"]["message"].startswith(
        "gang LeaderWorkerSet/serve#0 (3 pods) needs 17 GPUs"
    )

    QuotaRule.objects.update(limit=17)
    assert admit(leader)["allowed"]
    assert (in_use(), held_for_gangs()) == (17, 16)  # the two workers' 8 each, held
    for worker in workers:
        assert admit(worker)["allowed"]
    assert (in_use(), held_for_gangs()) == (17, 0)
    assert_ledger_true()
    # Each template read once, through the reader's cache, however many members asked.
    reads = [r.custom_read for r in fake.custom_reads("resourceclaimtemplates")]
    assert sorted(read[4] for read in reads if read is not None) == ["h100x8", "one-gpu"]
    assert len(reads) == 2


def test_a_template_that_cannot_be_read_falls_back_to_the_claim_times_the_gang(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """Without RBAC on resourceclaimtemplates the gang is weighed as this claim's demand times
    its size: a worker's 8 x 3 = 24 does not fit 17, which the templates' 17 would."""
    objects = leader_worker_set("serve", size=3)
    serve(fake, objects)
    fake.forbidden.add("resourceclaimtemplates.resource.k8s.io")
    _, worker, _ = claims_of(objects)
    team_of_16()
    QuotaRule.objects.update(limit=17)
    answer = admit(worker)
    assert not answer["allowed"]
    assert answer["status"]["message"].startswith(
        "gang LeaderWorkerSet/serve#0 (3 pods) needs 24 GPUs"
    )
    assert (in_use(), held_for_gangs()) == (0, 0)


# --- Racing gangs on PostgreSQL ---------------------------------------------------------------


def race(calls: list[Callable[[], Any]]) -> list[Any]:
    def run(call: Callable[[], Any]) -> Any:
        try:
            return call()
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        return list(pool.map(run, calls))


@pytest.mark.django_db(transaction=True)
def test_racing_gangs_that_each_need_12_of_16_gpus_admit_exactly_one(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    gangs_racing = [jobset(f"g{i}", workers=2, gpus=6) for i in range(5)]
    serve(fake, [obj for objects in gangs_racing for obj in objects])
    team_of_16()
    members = [body for objects in gangs_racing for body in claims_of(objects)]
    results = race([functools.partial(allowed, body) for body in members])

    admitted = {
        body["metadata"]["name"] for body, allowed in zip(members, results, strict=True) if allowed
    }
    # One gang, both its members (the second drew from the hold); no other member at all.
    assert len(admitted) == 2
    (gang,) = {name.rsplit("-", 1)[0] for name in admitted}
    assert admitted == {f"{gang}-0", f"{gang}-1"}
    assert in_use() == 12
    assert held_for_gangs() == 0
    assert list(GangReservation.objects.values_list("key", flat=True)) == [f"JobSet/{gang}"]
    assert_ledger_true()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("limit", [16, 64], ids=["room-for-one-gang", "room-for-four"])
def test_the_members_of_one_gang_racing_make_one_hold(
    fake: FakeKube, reader: kube_owners.GangReader, limit: int
) -> None:
    """With room for several copies of the gang, members that each planned to be the first
    pass every limit: the one hold a gang may have decides, and the others draw from it."""
    objects = jobset("wide", workers=8, gpus=2)
    serve(fake, objects)
    team_of_16()
    QuotaRule.objects.update(limit=limit)
    results = race([functools.partial(allowed, body) for body in claims_of(objects)])
    assert all(results)
    assert in_use() == 16
    assert held_for_gangs() == 0
    assert GangReservation.objects.count() == 1
    assert_ledger_true()


# --- Release and expiry -----------------------------------------------------------------------


def seen(body: dict[str, Any]) -> dict[str, Any]:
    """The claim as the sync sees it: with its uid."""
    return {**body, "metadata": {**body["metadata"], "uid": f"uid-{body['metadata']['name']}"}}


def snapshot(claims: list[dict[str, Any]], at: Any) -> None:
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=claims,
        at=at,
        kinds=["ResourceClaim"],
    )
    assert report.errors == []


def test_the_hold_is_released_when_the_gang_ends(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = jobset("short", workers=3, gpus=4)
    serve(fake, objects)
    team_of_16()
    first, second, _ = claims_of(objects)
    assert admit(first)["allowed"] and admit(second)["allowed"]
    assert (in_use(), held_for_gangs()) == (12, 4)  # the third worker's 4 still held

    snapshot([seen(first), seen(second)], at=AT + timedelta(minutes=1))
    assert (in_use(), held_for_gangs()) == (12, 4)
    snapshot([seen(second)], at=AT + timedelta(minutes=2))  # one worker's claim goes
    # The gang goes on: its hold stays, and keeps the worker's share for its replacement.
    assert (in_use(), held_for_gangs()) == (12, 8)
    assert_ledger_true()

    snapshot([], at=AT + timedelta(minutes=3))  # the last member's claim goes: the gang ended
    assert (in_use(), held_for_gangs()) == (0, 0)
    hold = GangReservation.objects.get()
    assert (hold.state, hold.released_at) == ("released", AT + timedelta(minutes=3))
    assert_ledger_true()


def test_what_a_gang_holds_for_members_that_never_appear_expires(
    fake: FakeKube, reader: kube_owners.GangReader, settings: Any
) -> None:
    settings.TALLY_GANG_RESERVATION_SECONDS = 60
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(objects[WORKER_0])["allowed"]
    snapshot([seen(objects[WORKER_0])], at=timezone.now())  # the worker's claim is seen
    hold = GangReservation.objects.get()
    assert hold.expires_at is not None

    assert services.expire_reservations(now=hold.expires_at - timedelta(seconds=1)) == 0
    assert (in_use(), held_for_gangs()) == (16, 8)
    assert services.expire_reservations(now=hold.expires_at + timedelta(seconds=1)) == 1
    hold.refresh_from_db()
    assert hold.state == "released"
    assert (in_use(), held_for_gangs()) == (8, 0)  # the admitted worker keeps its own
    assert_ledger_true()

    # The late worker is weighed with what its gang's admitted member holds: it fits.
    assert admit(objects[WORKER_1])["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 0)
    assert GangReservation.objects.filter(state="reserved").count() == 0
    assert_ledger_true()


def test_a_hold_its_members_have_drawn_whole_does_not_expire(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(objects[WORKER_0])["allowed"] and admit(objects[WORKER_1])["allowed"]
    snapshot([seen(objects[WORKER_0]), seen(objects[WORKER_1])], at=timezone.now())
    later = timezone.now() + timedelta(days=1)
    assert services.expire_reservations(now=later) == 0
    assert GangReservation.objects.get().state == "reserved"
    assert in_use() == 16
    assert_ledger_true()


# --- Policy: warn and off ---------------------------------------------------------------------


def test_warn_admits_each_claim_alone_with_a_warning_naming_the_gang(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16(GangMode.WARN)
    assert admit(claim("notebook", [gpu_request(1)], namespace="ml"))["allowed"]

    answer = admit(objects[WORKER_0])
    assert answer["allowed"]
    assert any(
        w.startswith("gang JobSet/train (2 pods) needs 16 GPUs") and "gangs: warn" in w
        for w in answer["warnings"]
    ), answer["warnings"]
    assert in_use() == 9  # the worker alone: nothing held for the gang
    assert not GangReservation.objects.exists()
    assert Reservation.objects.get(name=WORKER_0).gang_key == "JobSet/train"
    assert not admit(objects[WORKER_1])["allowed"]  # decided alone: 17 > 16
    assert_ledger_true()


def test_off_decides_claims_alone_and_reads_no_gang(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16(GangMode.OFF)
    assert admit(claim("notebook", [gpu_request(1)], namespace="ml"))["allowed"]
    answer = admit(objects[WORKER_0])
    # No gang warning (the fixture's nodes are too small for its 8 GPUs now: counted all the same).
    assert answer["allowed"]
    assert [w for w in answer.get("warnings", []) if "on any node now" not in w] == []
    assert in_use() == 9
    assert Reservation.objects.get(name=WORKER_0).gang_key == ""
    # No gang looked for: the JobSet is never read. The Pod and its Job are, once, for the
    # person behind the claim (`service.claim_person`, issue 35), which its decision records.
    assert fake.custom_reads("jobsets") == []
    assert (len(fake.reads("Pod")), len(fake.reads("Job"))) == (1, 1)
    assert_ledger_true()


def test_the_policy_file_sets_a_teams_gangs_and_refuses_what_is_no_mode() -> None:
    text = """
teams:
- slug: ml
  name: ML
  namespaces: [ml]
  gangs: warn
"""
    apply_policy(policy=load_policy(text), prune=False, actor="ops")
    assert GangPolicy.objects.get(team__slug="ml").mode == "warn"
    apply_policy(policy=load_policy(text.replace("warn", "off")), prune=False, actor="ops")
    assert GangPolicy.objects.get(team__slug="ml").mode == "off"
    # Undeclared with --prune: back to the default, enforce.
    apply_policy(policy=load_policy(text.replace("  gangs: warn\n", "")), prune=True, actor="ops")
    assert not GangPolicy.objects.exists()

    with pytest.raises(PolicyError) as raised:
        load_policy(text.replace("warn", "sometimes"))
    assert raised.value.errors == ["teams[0].gangs: must be enforce, warn or off, got 'sometimes'"]


POLICY = """
teams:
- slug: ml
  name: Ml
  namespaces: [ml]
  gangs: enforce
  quotas:
  - {name: gpus, deviceClass: gpu.nvidia.com, gpus: 16}
"""
RESEARCH = """
- slug: research
  name: Research
  namespaces: [research]
  quotas:
  - {name: gpus, deviceClass: gpu.nvidia.com, gpus: 12}
"""


def test_turning_a_teams_gangs_off_releases_its_gang_holds_at_once(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(objects[WORKER_0])["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 8)

    report = apply_policy(
        policy=load_policy(POLICY.replace("enforce", "off")), prune=False, actor="ops"
    )
    # Not at the hold's expiry: now, in the transaction that turned the gangs off.
    hold = GangReservation.objects.get()
    assert hold.state == "released" and hold.released_at is not None
    assert (in_use(), held_for_gangs()) == (8, 0)  # the admitted worker keeps its own
    assert any("recounted: 16 → 8" in note for note in report.notes), report.notes
    assert_ledger_true()
    # The other worker is now decided alone, as `off` says: it fits the room freed.
    assert admit(objects[WORKER_1])["allowed"]
    assert in_use() == 16
    assert not GangReservation.objects.filter(state="reserved").exists()
    assert_ledger_true()

    # Applying the same policy again changes nothing; back to enforce, nothing to release.
    apply_policy(policy=load_policy(POLICY.replace("enforce", "off")), prune=False, actor="ops")
    apply_policy(policy=load_policy(POLICY), prune=False, actor="ops")
    assert in_use() == 16
    assert_ledger_true()


def test_turning_gangs_off_in_the_admin_releases_the_holds_at_once(
    fake: FakeKube, reader: kube_owners.GangReader, django_user_model: Any
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16(GangMode.ENFORCE)
    assert admit(objects[WORKER_0])["allowed"]
    assert (in_use(), held_for_gangs()) == (16, 8)
    admin = Client()
    admin.force_login(django_user_model.objects.create_superuser("ops", "ops@example.com", "x"))
    policy = GangPolicy.objects.get()
    url = reverse("admin:quota_gangpolicy_change", args=[policy.pk])

    response = admin.post(url, {"mode": "off"})

    assert response.status_code == 302, response.content.decode()[:2000]
    assert GangPolicy.objects.get().mode == "off"
    assert GangReservation.objects.get().state == "released"
    assert (in_use(), held_for_gangs()) == (8, 0)  # the admitted worker keeps its own
    assert_ledger_true()


def test_the_recount_releases_the_holds_of_a_team_whose_gangs_are_off(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """Gangs turned off by another way than the policy file (the admin): the periodic
    reconcile finds the hold drifted and releases it."""
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(objects[WORKER_0])["allowed"]
    GangPolicy.objects.create(team=QuotaRule.objects.get().team, mode=GangMode.OFF)
    usage = services.reconcile_usage(at=timezone.now(), fix=False)
    assert [(u.stored, u.recounted) for u in usage] == [(16, 8)]
    assert GangReservation.objects.get().state == "reserved"  # a check writes nothing
    services.reconcile_usage(at=timezone.now(), fix=True)
    assert GangReservation.objects.get().state == "released"
    assert (in_use(), held_for_gangs()) == (8, 0)
    assert_ledger_true()


def test_a_hold_stays_when_a_policy_apply_leaves_the_gangs_enforced(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(objects[WORKER_0])["allowed"]
    apply_policy(policy=load_policy(POLICY), prune=False, actor="ops")  # enforce, as before
    assert GangReservation.objects.get().state == "reserved"
    assert (in_use(), held_for_gangs()) == (16, 8)
    assert_ledger_true()


def test_a_gang_hold_is_released_when_its_namespace_moves_to_another_team(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    """The hold was weighed on the old team's rules for a job that is no longer the old
    team's: it is released (not kept charging the old team, not moved onto the new team's
    rules, which never admitted it). The admitted member's reservation moves with its
    namespace, and the next member is weighed as a gang on the new team's rules."""
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    team_of_16()
    assert admit(objects[WORKER_0])["allowed"]
    snapshot([seen(objects[WORKER_0])], at=timezone.now())  # the sync has seen its claim
    assert (in_use(), held_for_gangs()) == (16, 8)

    moved = (POLICY + RESEARCH.lstrip("\n")).replace("namespaces: [ml]", "namespaces: []")
    moved = moved.replace("namespaces: [research]", "namespaces: [research, ml]")
    apply_policy(policy=load_policy(moved), prune=True, actor="ops")
    hold = GangReservation.objects.get()
    assert hold.state == "released" and hold.team.slug == "ml"  # charged to ml until now
    ml, research = (QuotaRule.objects.get(team__slug=slug) for slug in ("ml", "research"))
    assert (ml.in_use, research.in_use) == (0, 8)  # the worker's own 8 moved with ml
    assert Reservation.objects.get(name=WORKER_0).team.slug == "research"
    assert_ledger_true()

    # The other worker: its gang needs 16, the worker admitted holds 8, research has 12.
    answer = admit(objects[WORKER_1])
    assert not answer["allowed"]
    message = answer["status"]["message"]
    assert message.startswith("gang JobSet/train (2 pods) needs 8 GPUs")
    assert 'team "research" uses 8 GPUs of 12 GPUs' in message
    QuotaRule.objects.filter(team__slug="research").update(limit=16)
    assert admit(objects[WORKER_1])["allowed"]
    assert QuotaRule.objects.get(team__slug="research").in_use == 16
    assert_ledger_true()


# --- No gang to read --------------------------------------------------------------------------


def test_a_pod_that_cannot_be_read_leaves_the_claim_decided_alone_with_a_warning(
    fake: FakeKube, reader: kube_owners.GangReader
) -> None:
    objects = issue_jobset()  # not served: the API server has no such Pod
    team_of_16()
    answer = admit(objects[WORKER_0])
    assert answer["allowed"]
    assert any("could not read this claim's gang" in w for w in answer["warnings"])
    assert (in_use(), held_for_gangs()) == (8, 0)
    assert_ledger_true()


def test_an_api_server_slow_to_answer_leaves_the_claim_decided_alone_within_the_deadline(
    fake: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The webhook's own reader (`service.gang_lookup`, as made in a pod) tries once, for at
    most `WEBHOOK_READ_TIMEOUT_SECONDS`: an API server that does not answer in time costs
    the admission about a second, not the API server's 3 s webhook timeout.

    The API server answers nothing until the test is over: only the reader's timeout ends
    the read. The claim is allowed, so the admission reserved within its deadline
    (TALLY_WEBHOOK_DEADLINE_MS, on the webhook's own clock): past it, it reserves nothing and
    denies the claim."""
    objects = issue_jobset()
    serve(fake, list(objects.values()))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    team_of_16()
    release = threading.Event()

    def stall(request: object) -> None:
        release.wait()

    fake.on_request = stall
    try:
        started = time.monotonic()
        answer = admit(objects[WORKER_0])
        elapsed = time.monotonic() - started
    finally:
        release.set()
    # Well short of what else would end the wait: the reader's default timeout, the stall.
    bound = 5.0
    assert bound < kube_owners.OWNER_READ_TIMEOUT_SECONDS[1]
    assert elapsed < bound
    assert answer["allowed"]  # within the deadline
    assert any("could not read this claim's gang" in w for w in answer["warnings"])
    assert len(fake.requests) == 1


def test_without_a_cluster_to_read_gangs_from_claims_are_decided_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    objects = issue_jobset()
    team_of_16()
    assert service.gang_lookup() is None
    answer = admit(objects[WORKER_0])
    # No gang warning (the fixture's nodes are too small for its 8 GPUs now: counted all the same).
    assert answer["allowed"]
    assert [w for w in answer.get("warnings", []) if "on any node now" not in w] == []
    assert in_use() == 8
