"""A claim's gang (issue 20, item 1): from each declared source, read through the real client
from `devtools.fake_kube` (`kube_owners.GangReader`), through the sync, and from dumps
(`GangIndex`).

The objects are the project's fixtures in `tests/fixtures/gangs/`, written from each project's
documentation: the declaring object, Pods as its controller makes them, their claims.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.urls import reverse

from devtools.fake_kube import KINDS, FakeKube
from inventory import gang_sync, gangs, kube, kube_owners, kube_sync, services
from inventory.dumps import iter_objects
from inventory.gangs import GangIndex, GangRef, GangRole, gang_of_claim, gang_of_pod
from inventory.models import Cluster, Gang, ResourceClaim, SyncState
from tests.inventory.test_kube_sync import running_sync, wait_until, wait_watching

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gangs"
AT = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Case:
    file: str
    claim: str  # a claim in the file, and the gang it is in
    gang: GangRef

    @property
    def objects(self) -> list[dict[str, Any]]:
        return list(iter_objects(FIXTURES / self.file))


def role(name: str, pods: int, *templates: str) -> GangRole:
    return GangRole(name=name, pods=pods, claim_templates=templates)


CASES = [
    Case(
        "jobset.yaml",
        "train-workers-0-0-x7k2p-gpus-4m8rt",
        GangRef("jobset", "JobSet/train", 2, (role("workers", 2, "h100x8"),), "workers"),
    ),
    Case(
        "leaderworkerset.yaml",
        "vllm-1-2-gpu-8vq3n",
        GangRef(
            "leaderworkerset",
            "LeaderWorkerSet/vllm#1",
            4,
            (role("leader", 1, "gpu-leader"), role("worker", 3, "h100x8")),
            "worker",
        ),
    ),
    Case(
        "workload-v1alpha1.yaml",
        "training-worker-0-gpu-r7w2k",
        GangRef("workload", "Workload/training/workers#0", 4, (), ""),
    ),
    Case(
        "podgroup-v1alpha2.yaml",
        "train-workers-0-1-gpu-t5n7q",
        GangRef("workload", "PodGroup/train-workers-0", 3, (), ""),
    ),
    Case(
        "kueue-pod-group.yaml",
        "sample-worker-p8d3m-gpu-w4j6h",
        GangRef("kueue", "PodGroup.kueue.x-k8s.io/sample-group", 2, (), ""),
    ),
    Case(
        "volcano.yaml",
        "tf-dist-worker-0-gpu-z2c5x",
        GangRef("volcano", "PodGroup.scheduling.volcano.sh/tf-dist", 3, (), ""),
    ),
    Case(
        "pytorchjob.yaml",
        "bert-worker-1-gpus-b6f9r",
        GangRef(
            "kubeflow",
            "PyTorchJob/bert",
            4,
            (role("master", 1, "h100x8"), role("worker", 3, "h100x8")),
            "worker",
        ),
    ),
    Case(
        "tfjob.yaml",
        "mnist-worker-0-gpu-j3k8w",
        GangRef("kubeflow", "TFJob/mnist", 3, (role("ps", 1), role("worker", 2, "a100")), "worker"),
    ),
]
IDS = [case.file.removesuffix(".yaml") for case in CASES]


def serve(fake: FakeKube, objects: list[dict[str, Any]]) -> None:
    """Put the fixture's objects on the fake API server, as the cluster would hold them."""
    for obj in objects:
        plural = gangs.GANG_KINDS.get((obj["apiVersion"].rpartition("/")[0], obj["kind"]))
        if plural is not None:
            fake.add_custom(obj, plural)
        elif obj["kind"] in KINDS:
            fake.add(obj)


def named(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(obj for obj in objects if obj["metadata"]["name"] == name)


def index_of(objects: list[dict[str, Any]]) -> GangIndex:
    index = GangIndex()
    for obj in objects:
        index.add(obj)
    return index


def list_claims(api_client: Any, cluster: Cluster) -> None:
    kube_sync.sync(api_client=api_client, cluster=cluster, kinds=["ResourceClaim"], once=True)


def stored_gang(claim: str) -> GangRef | None:
    gang = ResourceClaim.objects.select_related("gang").get(name=claim).gang
    if gang is None:
        return None
    return GangRef(gang.source, gang.key, gang.size, (), "")


def without_roles(ref: GangRef) -> GangRef:
    """What a Gang row keeps of a gang."""
    return GangRef(ref.source, ref.key, ref.size, (), "")


# Each source, through the API server and from a dump ----------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_gang_of_a_claim_through_the_api_server(
    case: Case, fake: FakeKube, api_client: Any
) -> None:
    objects = case.objects
    serve(fake, objects)

    found = gang_of_claim(named(objects, case.claim), kube_owners.GangReader(api_client))

    assert found == case.gang
    assert [r.status for r in fake.reads("Pod")] == [200]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_gang_of_a_claim_from_a_dump(case: Case) -> None:
    objects = case.objects

    assert gang_of_claim(named(objects, case.claim), index_of(objects)) == case.gang


@pytest.mark.django_db
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_sync_stores_the_claims_gang_reading_each_pod_once(
    case: Case, fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    objects = case.objects
    serve(fake, objects)

    list_claims(api_client, cluster)

    assert stored_gang(case.claim) == without_roles(case.gang)
    gang = Gang.objects.get(key=case.gang.key)
    assert (gang.namespace, gang.first_seen is not None, gang.ended_at) == (
        named(objects, case.claim)["metadata"]["namespace"],
        True,
        None,
    )
    # One read of each claim's Pod serves its job and its gang.
    claimed_pods = sorted(
        ref["name"]
        for obj in objects
        if obj["kind"] == "ResourceClaim"
        for ref in obj["metadata"]["ownerReferences"]
    )
    assert sorted(r.read[2] for r in fake.reads("Pod") if r.read) == claimed_pods


@pytest.mark.django_db
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_dump_import_stores_the_claims_gang(case: Case, cluster: Cluster) -> None:
    report = services.import_snapshot(
        cluster=cluster, objects=iter_objects(FIXTURES / case.file), at=AT
    )

    assert report.errors == []
    assert stored_gang(case.claim) == without_roles(case.gang)
    assert Gang.objects.get(key=case.gang.key).last_seen == AT


@pytest.mark.django_db
def test_claims_of_one_gang_share_one_row_and_its_object_is_read_once(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    serve(fake, list(iter_objects(FIXTURES / "jobset.yaml")))

    list_claims(api_client, cluster)

    assert Gang.objects.count() == 1
    assert set(ResourceClaim.objects.values_list("gang__key", flat=True)) == {"JobSet/train"}
    assert [r.status for r in fake.custom_reads("jobsets")] == [200]


@pytest.mark.django_db
def test_the_lws_leader_and_its_worker_are_one_gang(cluster: Cluster) -> None:
    services.import_snapshot(
        cluster=cluster, objects=iter_objects(FIXTURES / "leaderworkerset.yaml"), at=AT
    )

    assert dict(ResourceClaim.objects.values_list("name", "gang__key")) == {
        "vllm-1-gpu-h2k9s": "LeaderWorkerSet/vllm#1",
        "vllm-1-2-gpu-8vq3n": "LeaderWorkerSet/vllm#1",
    }
    objects = list(iter_objects(FIXTURES / "leaderworkerset.yaml"))
    leader = gang_of_claim(named(objects, "vllm-1-gpu-h2k9s"), index_of(objects))
    assert leader is not None and leader.role == "leader"


@pytest.mark.django_db
def test_a_basic_pod_group_is_no_gang(fake: FakeKube, api_client: Any, cluster: Cluster) -> None:
    serve(fake, list(iter_objects(FIXTURES / "workload-v1alpha1.yaml")))

    list_claims(api_client, cluster)

    assert stored_gang("training-driver-gpu-m3x8c") is None
    assert stored_gang("training-worker-0-gpu-r7w2k") is not None


@pytest.mark.django_db(transaction=True)
def test_the_watch_stores_the_gang_of_a_new_claim(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    objects = list(iter_objects(FIXTURES / "pytorchjob.yaml"))
    with running_sync(api_client, cluster, "ResourceClaim"):
        wait_watching(fake, "ResourceClaim")
        serve(fake, objects)
        claimed = ResourceClaim.objects.filter(name="bert-worker-1-gpus-b6f9r", gang__isnull=False)
        wait_until(claimed.exists, "the claim's gang")

    assert stored_gang("bert-worker-1-gpus-b6f9r") == GangRef(
        "kubeflow", "PyTorchJob/bert", 4, (), ""
    )
    assert len(fake.reads("Pod")) == 1


@pytest.mark.django_db
def test_a_gang_ends_when_no_member_claim_is_live_and_opens_again(cluster: Cluster) -> None:
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    services.import_snapshot(cluster=cluster, objects=objects, at=AT)
    later = AT + timedelta(hours=1)
    first_claim = [obj for obj in objects if obj["kind"] != "ResourceClaim"] + [
        named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt")
    ]

    # One member released: the gang still has a live member.
    services.import_snapshot(cluster=cluster, objects=first_claim, at=later)
    assert Gang.objects.get().ended_at is None

    # The other released too, by a watch event: the gang ends then.
    gone = AT + timedelta(hours=2)
    services.apply_watch_event(
        cluster=cluster,
        event_type="DELETED",
        obj=named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt"),
        at=gone,
    )
    assert Gang.objects.get().ended_at == gone

    back = AT + timedelta(hours=3)
    services.import_snapshot(cluster=cluster, objects=objects, at=back)
    gang = Gang.objects.get()
    assert (gang.ended_at, gang.first_seen, gang.last_seen) == (None, AT, back)


@pytest.mark.django_db
def test_record_gang_is_an_upsert(cluster: Cluster) -> None:
    ref = GangRef("jobset", "JobSet/train", 2, (), "")
    first = gang_sync.record_gang(cluster=cluster, namespace="ml", ref=ref, at=AT)
    grown = GangRef("jobset", "JobSet/train", 3, (), "")
    again = gang_sync.record_gang(cluster=cluster, namespace="ml", ref=grown, at=AT)

    assert first.pk == again.pk and again.size == 3 and Gang.objects.count() == 1
    # No claim has joined it yet: it has not started, so it does not end.
    assert gang_sync.end_gangs(cluster=cluster, at=AT) == 0
    assert Gang.objects.get().ended_at is None


# Sources in more detail ------------------------------------------------------------------


def jobset(**replicated_jobs: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "js", "namespace": "ml"},
        "spec": {
            "replicatedJobs": [{"name": name, **spec} for name, spec in replicated_jobs.items()]
        },
    }


def pod(labels: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    made: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p-0", "namespace": "ml", "labels": labels or {}},
        "spec": {},
    }
    for key, value in extra.items():
        made["metadata" if key in ("annotations", "ownerReferences") else "spec"][key] = value
    return made


JOBSET_POD = {
    "jobset.sigs.k8s.io/jobset-name": "js",
    "jobset.sigs.k8s.io/replicatedjob-name": "workers",
}


def jobset_pod(job: str = "js-workers-0", api_version: str = "batch/v1") -> dict[str, Any]:
    """A Pod of JobSet `js` as the Job controller makes it for the JobSet's Job `job`."""
    owner = {"apiVersion": api_version, "kind": "Job", "name": job, "uid": "u", "controller": True}
    return pod(dict(JOBSET_POD), ownerReferences=[owner])


def test_jobset_pods_per_job_are_parallelism_but_no_more_than_completions() -> None:
    index = index_of(
        [
            jobset(
                driver={"replicas": 1, "template": {"spec": {}}},
                workers={
                    "replicas": 2,
                    "template": {"spec": {"parallelism": 4, "completions": 2}},
                },
            )
        ]
    )

    found = gang_of_pod(jobset_pod(), index)

    assert found == GangRef(
        "jobset", "JobSet/js", 5, (role("driver", 1), role("workers", 4)), "workers"
    )


@pytest.mark.parametrize(
    "made",
    [
        pod(JOBSET_POD),
        pod(
            JOBSET_POD,
            ownerReferences=[
                {"apiVersion": "batch/v1", "kind": "Job", "name": "js-workers-0", "uid": "u"}
            ],
        ),
        jobset_pod(api_version="example.com/v1"),
        jobset_pod("js-workers-2"),
        jobset_pod("js-workers-01"),
        jobset_pod("other-workers-0"),
        jobset_pod("js-driver-0"),
    ],
    ids=[
        "made-by-hand",
        "a-job-owns-it-but-is-not-its-controller",
        "not-a-batch-job",
        "a-job-beyond-the-replicas",
        "a-name-the-jobset-never-makes",
        "another-jobsets-job",
        "a-replicated-job-it-does-not-have",
    ],
)
def test_a_pod_no_job_of_the_jobset_made_is_in_no_jobset_gang(made: dict[str, Any]) -> None:
    """The JobSet's labels are written by whoever creates the Pod: they alone do not make it a
    member (and let it draw the gang's hold)."""
    index = index_of([GOOD_JOBSET])
    assert gang_of_pod(jobset_pod("js-workers-1"), index) is not None

    assert gang_of_pod(made, index) is None


def test_a_jobset_pods_role_is_the_replicated_job_of_its_job() -> None:
    one = {"template": {"spec": {"parallelism": 1}}}
    index = index_of([jobset(a={"replicas": 11, **one}, **{"a-1": {"replicas": 1, **one}})])

    # Whatever its label says: the Job is the JobSet controller's word, the label anyone's.
    for job, role in (("js-a-10", "a"), ("js-a-1-0", "a-1"), ("js-a-0", "a")):
        made = jobset_pod(job)
        made["metadata"]["labels"]["jobset.sigs.k8s.io/replicatedjob-name"] = "a-1"
        found = gang_of_pod(made, index)
        assert found is not None and (found.role, found.size) == (role, 12), job
    assert gang_of_pod(jobset_pod("js-a-1-1"), index) is None  # `a-1` has one Job


def test_a_training_job_with_min_available_below_its_replicas_gives_a_size_only() -> None:
    objects = list(iter_objects(FIXTURES / "pytorchjob.yaml"))
    objects[0]["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] = 2

    found = gang_of_claim(named(objects, "bert-worker-1-gpus-b6f9r"), index_of(objects))

    assert found == GangRef("kubeflow", "PyTorchJob/bert", 2, (), "worker")


def test_a_training_job_is_found_by_its_labels_when_the_pod_has_no_owner() -> None:
    objects = list(iter_objects(FIXTURES / "tfjob.yaml"))
    named(objects, "mnist-worker-0")["metadata"].pop("ownerReferences")

    found = gang_of_claim(named(objects, "mnist-worker-0-gpu-j3k8w"), index_of(objects))

    assert found is not None and found.key == "TFJob/mnist" and found.size == 3


def test_a_lws_whose_object_cannot_be_read_gives_its_size_from_the_pod() -> None:
    objects = [
        obj
        for obj in iter_objects(FIXTURES / "leaderworkerset.yaml")
        if obj["kind"] != "LeaderWorkerSet"
    ]

    found = gang_of_claim(named(objects, "vllm-1-2-gpu-8vq3n"), index_of(objects))

    assert found == GangRef("leaderworkerset", "LeaderWorkerSet/vllm#1", 4, (), "worker")


def test_a_namesake_pod_gives_no_gang() -> None:
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    named(objects, "train-workers-0-0-x7k2p")["metadata"]["uid"] = "a-later-pod"

    assert (
        gang_of_claim(named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt"), index_of(objects))
        is None
    )


def test_a_claim_made_by_hand_has_no_gang() -> None:
    claim = {"metadata": {"name": "mine", "namespace": "ml"}}

    assert gangs.claim_pod(claim) is None
    assert gang_of_claim(claim, GangIndex()) is None


# Hostile input ---------------------------------------------------------------------------


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    *parents, last = path.split(".")
    target: Any = changed
    for step in parents:
        target = target[int(step)] if isinstance(target, list) else target[step]
    if isinstance(target, list):
        target[int(last)] = value
    else:
        target[last] = value
    return changed


GOOD_JOBSET = jobset(workers={"replicas": 2, "template": {"spec": {"parallelism": 1}}})


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec", "not an object"),
        ("spec.replicatedJobs", {"workers": {}}),
        ("spec.replicatedJobs.0", ["workers"]),
        ("spec.replicatedJobs.0.replicas", -1),
        ("spec.replicatedJobs.0.replicas", 10**7),
        ("spec.replicatedJobs.0.replicas", True),
        ("spec.replicatedJobs.0.replicas", 2.5),
        ("spec.replicatedJobs.0.replicas", "2"),
        ("spec.replicatedJobs.0.template.spec.parallelism", -4),
        ("spec.replicatedJobs.0.template.spec.parallelism", "many"),
        ("spec.replicatedJobs.0.replicas", 0),
        ("spec.replicatedJobs.0.name", "x" * 64),
        ("spec.replicatedJobs.0.name", {"name": "workers"}),
    ],
)
def test_a_jobset_that_is_no_jobset_gives_no_gang(path: str, value: Any) -> None:
    assert gang_of_pod(jobset_pod(), index_of([GOOD_JOBSET])) is not None
    broken = _set(GOOD_JOBSET, path, value)

    assert gang_of_pod(jobset_pod(), index_of([broken])) is None


def test_more_pods_than_any_cluster_runs_gives_no_gang() -> None:
    huge = jobset(workers={"replicas": 1001, "template": {"spec": {"parallelism": 1000}}})

    assert gang_of_pod(jobset_pod(), index_of([huge])) is None


@pytest.mark.parametrize("count", ["-2", "0", "abc", "", "2.0", "99999999", " 2", "²", None, 2])
def test_a_kueue_count_that_is_no_count_gives_no_gang(count: Any) -> None:
    annotations = {} if count is None else {"kueue.x-k8s.io/pod-group-total-count": count}
    made = pod({"kueue.x-k8s.io/pod-group-name": "g"}, annotations=annotations)
    if isinstance(count, int):  # JSON, not the string an annotation is: refused too
        made["metadata"]["annotations"] = {"kueue.x-k8s.io/pod-group-total-count": count}

    assert gang_of_pod(made, GangIndex()) is None


@pytest.mark.parametrize("min_member", [0, -3, 1.5, "3", None, [3], 10**9])
def test_a_volcano_min_member_that_is_no_count_gives_no_gang(min_member: Any) -> None:
    group = {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": "pg", "namespace": "ml"},
        "spec": {"minMember": min_member},
    }
    made = pod(annotations={"scheduling.k8s.io/group-name": "pg"})

    assert gang_of_pod(made, index_of([group])) is None


@pytest.mark.parametrize(
    "broken",
    [
        "not a pod",
        None,
        {"metadata": "x"},
        {"metadata": {"labels": ["jobset.sigs.k8s.io/jobset-name"]}},
        {"metadata": {"namespace": "ml", "labels": {"jobset.sigs.k8s.io/jobset-name": 7}}},
        {"metadata": {"namespace": "NOT A NAMESPACE", "labels": JOBSET_POD}},
        {"metadata": {"namespace": "ml"}, "spec": {"workloadRef": "training"}},
        {"metadata": {"namespace": "ml"}, "spec": {"workloadRef": {"name": "w", "podGroup": 3}}},
        {"metadata": {"namespace": "ml"}, "spec": {"schedulingGroup": {"podGroupName": None}}},
        {"metadata": {"namespace": "ml", "ownerReferences": "PyTorchJob/bert"}},
        {"metadata": {"namespace": "ml", "ownerReferences": [{"controller": True}]}},
    ],
)
def test_a_pod_that_is_no_pod_gives_no_gang(broken: Any) -> None:
    assert gang_of_pod(broken, index_of([GOOD_JOBSET])) is None


def test_a_claim_that_is_no_claim_gives_no_gang() -> None:
    claims: list[Any] = [
        "not a claim",
        None,
        {"metadata": []},
        {"metadata": {"ownerReferences": {"kind": "Pod"}}},
        {"metadata": {"ownerReferences": [{"kind": "Pod", "name": 5, "controller": True}]}},
        {"metadata": {"ownerReferences": [{"kind": "Pod", "name": "p", "controller": "yes"}]}},
    ]
    for claim in claims:
        assert gangs.claim_pod(claim) is None
        assert gang_of_claim(claim, GangIndex()) is None


def test_names_at_their_longest_make_a_key_that_fits_and_one_longer_is_refused() -> None:
    name = "n" * 253
    workload = {
        "apiVersion": "scheduling.k8s.io/v1alpha1",
        "kind": "Workload",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"podGroups": [{"name": "g" * 63, "policy": {"gang": {"minCount": 2}}}]},
    }
    ref = {"name": name, "podGroup": "g" * 63, "podGroupReplicaKey": "k" * 63}

    found = gang_of_pod(pod(workloadRef=ref), index_of([workload]))
    other = gang_of_pod(
        pod(workloadRef={**ref, "podGroupReplicaKey": "j" * 63}), index_of([workload])
    )

    assert found is not None and other is not None
    assert len(found.key) == gangs.GANG_KEY_MAX_LENGTH and found.key != other.key
    assert gang_of_pod(pod(workloadRef={**ref, "name": "n" * 254}), index_of([workload])) is None


def test_a_loop_in_an_object_is_never_followed() -> None:
    looped = jobset_pod()
    looped["spec"]["workloadRef"] = looped  # YAML anchors can make such an object
    js = copy.deepcopy(GOOD_JOBSET)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"] = js
    js["spec"]["replicatedJobs"].append(js)

    assert gang_of_pod(looped, index_of([js])) is None  # the second "replicated job" is no job
    js["spec"]["replicatedJobs"].pop()
    assert gang_of_pod(looped, index_of([js])) == GangRef(
        "jobset", "JobSet/js", 2, (role("workers", 2),), "workers"
    )


# GangReader: the cache and what it does when reads fail ------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def serve_jobset(fake: FakeKube) -> list[dict[str, Any]]:
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, objects)
    return objects


def test_the_reader_caches_for_its_ttl(fake: FakeKube, api_client: Any) -> None:
    objects = serve_jobset(fake)
    clock = Clock()
    reader = kube_owners.GangReader(api_client, ttl_seconds=30, clock=clock)
    claim = named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt")

    assert gang_of_claim(claim, reader) == gang_of_claim(claim, reader) is not None
    assert (len(fake.reads("Pod")), len(fake.custom_reads("jobsets"))) == (1, 1)

    clock.now += 31
    gang_of_claim(claim, reader)
    assert (len(fake.reads("Pod")), len(fake.custom_reads("jobsets"))) == (2, 2)


def test_the_reader_keeps_at_most_max_entries(fake: FakeKube, api_client: Any) -> None:
    serve_jobset(fake)
    reader = kube_owners.GangReader(api_client, max_entries=2)
    pods = ["train-workers-0-0-x7k2p", "train-workers-1-0-q9m4z", "missing"]

    for name in pods:
        reader.get("ml", "v1", "Pod", name)
    reader.get("ml", "v1", "Pod", pods[0])  # evicted by the third

    assert [r.read[2] for r in fake.reads("Pod") if r.read] == [*pods, pods[0]]


def test_a_forbidden_kind_is_asked_once_per_ttl(fake: FakeKube, api_client: Any) -> None:
    objects = serve_jobset(fake)
    fake.forbidden = {"jobsets.jobset.x-k8s.io"}
    reader = kube_owners.GangReader(api_client)

    for name in ("train-workers-0-0-x7k2p-gpus-4m8rt", "train-workers-1-0-q9m4z-gpus-p2v6d"):
        assert gang_of_claim(named(objects, name), reader) is None

    assert [r.status for r in fake.custom_reads("jobsets")] == [403]


def test_a_kind_not_served_is_no_gang_and_cached(fake: FakeKube, api_client: Any) -> None:
    objects = [o for o in iter_objects(FIXTURES / "jobset.yaml") if o["kind"] != "JobSet"]
    serve(fake, objects)
    reader = kube_owners.GangReader(api_client)

    for name in ("train-workers-0-0-x7k2p-gpus-4m8rt", "train-workers-1-0-q9m4z-gpus-p2v6d"):
        assert gang_of_claim(named(objects, name), reader) is None

    assert [r.status for r in fake.custom_reads("jobsets")] == [404]


def test_an_api_server_in_trouble_is_left_alone_for_a_while(
    fake: FakeKube, api_client: Any
) -> None:
    fake.unavailable = True
    clock = Clock()
    reader = kube_owners.GangReader(api_client, ttl_seconds=30, clock=clock)

    for index in range(6):
        assert reader.get("ml", "v1", "Pod", f"p-{index}") is None
    assert len(fake.requests) == kube_owners.OWNER_READ_FAILURES

    fake.unavailable = False
    clock.now += 31
    assert reader.get("ml", "v1", "Pod", "p-9") is None  # asked again: 404 now
    assert len(fake.requests) == kube_owners.OWNER_READ_FAILURES + 1


def test_a_namesake_pod_is_read_again_each_time_and_gives_no_gang(
    fake: FakeKube, api_client: Any
) -> None:
    objects = serve_jobset(fake)
    reader = kube_owners.GangReader(api_client, ttl_seconds=30, clock=Clock())
    claim = copy.deepcopy(named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt"))
    claim["metadata"]["ownerReferences"][0]["uid"] = "a-pod-gone-before-this-one"

    assert gang_of_claim(claim, reader) is None
    assert gang_of_claim(claim, reader) is None

    # The cached Pod is not the claim's: read again (not from the cache) each time.
    assert [r.status for r in fake.reads("Pod")] == [200, 200, 200]
    assert fake.custom_reads("jobsets") == []


def test_a_forbidden_pod_is_not_read_again_for_a_namesake(fake: FakeKube, api_client: Any) -> None:
    objects = serve_jobset(fake)
    reader = kube_owners.GangReader(api_client, ttl_seconds=30, clock=Clock())
    claim = copy.deepcopy(named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt"))
    claim["metadata"]["ownerReferences"][0]["uid"] = "a-pod-gone-before-this-one"
    assert gang_of_claim(claim, reader) is None
    fake.forbidden = {"Pod"}

    # Pods forbidden since: asked once, then left alone for the ttl, fresh reads too.
    for _ in range(3):
        assert reader.get_fresh("ml", "v1", "Pod", "train-workers-0-0-x7k2p") is None
    assert [r.status for r in fake.reads("Pod")] == [200, 200, 403]


def claim_loop(api_client: Any, cluster: Cluster, clock: Clock) -> kube_sync.KindSync:
    return kube_sync.KindSync(
        api_client=api_client,
        cluster=cluster,
        resource=kube_sync.RESOURCES["ResourceClaim"],
        clock=clock,
    )


@pytest.mark.django_db
def test_a_claim_in_no_gang_is_read_again_on_a_later_list_once_per_ttl(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, [obj for obj in objects if obj["kind"] != "JobSet"])
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    loop.relist()
    assert not ResourceClaim.objects.filter(gang__isnull=False).exists()
    pod_reads = len(fake.reads("Pod"))
    serve(fake, [named(objects, "train")])  # the JobSet, readable now

    clock.now += kube_owners.GANG_CACHE_SECONDS - 1
    loop.relist()
    assert len(fake.reads("Pod")) == pod_reads  # within the reader's ttl: not read again
    assert not ResourceClaim.objects.filter(gang__isnull=False).exists()

    clock.now += 1
    loop.relist()
    assert set(ResourceClaim.objects.values_list("gang__key", flat=True)) == {"JobSet/train"}
    assert len(fake.reads("Pod")) == pod_reads + 2

    # In a gang now: not read again, however much later.
    clock.now += 10 * kube_owners.GANG_CACHE_SECONDS
    loop.relist()
    assert len(fake.reads("Pod")) == pod_reads + 2


@pytest.mark.django_db(transaction=True)
def test_a_watch_event_reads_the_gang_of_a_claim_in_none_once_per_ttl(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    objects = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, [obj for obj in objects if obj["kind"] != "JobSet"])
    list_claims(api_client, cluster)  # stored in no gang; the watch resumes after this list
    assert not ResourceClaim.objects.filter(gang__isnull=False).exists()
    serve(fake, [named(objects, "train")])
    pod_reads = len(fake.reads("Pod"))
    claim = copy.deepcopy(named(objects, "train-workers-0-0-x7k2p-gpus-4m8rt"))

    with running_sync(api_client, cluster, "ResourceClaim"):
        wait_watching(fake, "ResourceClaim")
        claim["metadata"].setdefault("labels", {})["changed"] = "1"
        fake.modify(copy.deepcopy(claim))
        in_gang = ResourceClaim.objects.filter(name=claim["metadata"]["name"], gang__isnull=False)
        wait_until(in_gang.exists, "the claim's gang")
        claim["metadata"]["labels"]["changed"] = "2"
        last = fake.modify(copy.deepcopy(claim))
        state = SyncState.objects.filter(kind="ResourceClaim", resource_version=last)
        wait_until(state.exists, "the second event applied")

    # One read of the modified claim's Pod; the other claim, without an event, is left alone.
    assert [r.read[2] for r in fake.reads("Pod")[pod_reads:] if r.read] == [
        "train-workers-0-0-x7k2p"
    ]
    assert not ResourceClaim.objects.filter(
        name="train-workers-1-0-q9m4z-gpus-p2v6d", gang__isnull=False
    ).exists()


# Admin -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_gang_admin_lists_read_only(admin_client: Any, cluster: Cluster) -> None:
    services.import_snapshot(cluster=cluster, objects=iter_objects(FIXTURES / "jobset.yaml"), at=AT)
    gang = Gang.objects.get()

    listed = admin_client.get(reverse("admin:inventory_gang_changelist"))
    page = admin_client.get(reverse("admin:inventory_gang_change", args=[gang.pk]))

    assert listed.status_code == 200 and "JobSet/train" in listed.content.decode()
    assert page.status_code == 200
    change = admin_client.post(reverse("admin:inventory_gang_change", args=[gang.pk]), {})
    assert change.status_code == 403


def test_a_reader_waits_no_longer_than_its_request_timeout(fake: FakeKube, tmp_path: Path) -> None:
    """The webhook's reader (no retries, `WEBHOOK_READ_TIMEOUT_SECONDS`) gives up on an API
    server slow to answer well inside the webhook's deadline: the claim is then decided alone,
    not the CREATE failed for a webhook timeout."""
    serve_jobset(fake)
    release = threading.Event()

    def stall(request: object) -> None:
        release.wait()  # no answer until the test is over: only the timeout ends the read

    fake.on_request = stall
    client = kube.api_client(kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")), retries=0)
    reader = kube_owners.GangReader(
        client, request_timeout=kube_owners.WEBHOOK_READ_TIMEOUT_SECONDS
    )
    try:
        started = time.monotonic()
        found = reader.get("ml", "v1", "Pod", "train-workers-0-0-x7k2p")
        elapsed = time.monotonic() - started
    finally:
        release.set()
        client.close()
    assert found is None
    # Well short of what else would end the wait: the reader's default timeout, the fake's
    # lifetime. One try: a retry would show as a second request.
    bound = 5.0
    assert bound < kube_owners.OWNER_READ_TIMEOUT_SECONDS[1]
    assert elapsed < bound
    assert len(fake.requests) == 1
    assert sum(kube_owners.WEBHOOK_READ_TIMEOUT_SECONDS) < settings.TALLY_WEBHOOK_DEADLINE_MS / 1000
