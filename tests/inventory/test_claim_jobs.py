"""A claim's job: its Pod's controller, read through the real client from `devtools.fake_kube`,
or from the Pods, ReplicaSets and Jobs of a dump.

Owner references are written as the API server writes them: the resource-claim controller
makes a claim from a template owned by its Pod, the ReplicaSet and Job controllers own their
Pods, the Deployment and CronJob controllers their ReplicaSets and Jobs.
"""

from __future__ import annotations

import io
import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from devtools.fake_kube import FakeKube
from inventory import kube_sync, owners, services
from inventory.models import Cluster, ResourceClaim
from tests.inventory.test_kube_sync import (
    claim,
    running_sync,
    sync_state,
    wait_until,
    wait_watching,
)

NAMESPACE = "team-a"
AT = datetime(2026, 1, 1, tzinfo=UTC)


def reference(kind: str, name: str, api_version: str) -> dict[str, Any]:
    """The controller reference a built-in controller writes to what it made."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": f"uid-{kind.lower()}-{name}",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owner_object(
    kind: str, name: str, api_version: str, *, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "uid": f"uid-{kind.lower()}-{name}",
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": {}}


def deployment_ref(name: str) -> dict[str, Any]:
    return reference("Deployment", name, "apps/v1")


def replica_set(name: str, *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return owner_object("ReplicaSet", name, "apps/v1", owner=owner)


def job(name: str, *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return owner_object("Job", name, "batch/v1", owner=owner)


def pod(name: str, *, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return owner_object("Pod", name, "v1", owner=owner)


def ref_to(obj: dict[str, Any]) -> dict[str, Any]:
    return reference(obj["kind"], obj["metadata"]["name"], obj["apiVersion"])


def template_claim(owner: dict[str, Any] | None, *, name: str | None = None) -> dict[str, Any]:
    """A claim the resource-claim controller made for `owner` (a Pod) from a template."""
    pod_name = owner["name"] if owner else "none"
    made = claim(name or f"{pod_name}-gpu-7xk2q", node="node-a", device="gpu-0")
    metadata = made["metadata"]
    metadata["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpu"}
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return made


def add_deployment_pods(fake: FakeKube, rs_name: str, *pod_names: str) -> list[dict[str, Any]]:
    """ReplicaSet `rs_name` of Deployment `web`, and its Pods."""
    fake.add(replica_set(rs_name, owner=deployment_ref("web")))
    pods = [pod(name, owner=reference("ReplicaSet", rs_name, "apps/v1")) for name in pod_names]
    for made in pods:
        fake.add(made)
    return pods


def list_claims(api_client: Any, cluster: Cluster) -> services.SyncReport:
    reports = kube_sync.sync(
        api_client=api_client, cluster=cluster, kinds=["ResourceClaim"], once=True
    )
    return reports["ResourceClaim"]


def jobs() -> dict[str, str]:
    return dict(ResourceClaim.objects.values_list("name", "job"))


# Through the API --------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_pod_of_a_replica_set_is_charged_to_the_deployment(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    (web,) = add_deployment_pods(fake, "web-5d8f9c", "web-5d8f9c-abcde")
    fake.add(template_claim(ref_to(web), name="web-gpu"))

    report = list_claims(api_client, cluster)

    assert report.errors == []
    assert jobs() == {"web-gpu": "Deployment/web"}
    assert [r.read for r in fake.reads("Pod")] == [("Pod", NAMESPACE, "web-5d8f9c-abcde")]
    assert [r.read for r in fake.reads("ReplicaSet")] == [("ReplicaSet", NAMESPACE, "web-5d8f9c")]
    assert not [r for r in fake.requests if "deployments" in r.path], "a Deployment is the job"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("job_owner", "expected"),
    [
        (None, "Job/train"),
        (reference("CronJob", "nightly", "batch/v1"), "CronJob/nightly"),
        (reference("JobSet", "bert", "jobset.x-k8s.io/v1alpha2"), "JobSet/bert"),
    ],
    ids=["job", "cron-job", "job-set"],
)
def test_a_pod_of_a_job_is_charged_to_the_job_or_what_made_it(
    fake: FakeKube,
    api_client: Any,
    cluster: Cluster,
    job_owner: dict[str, Any] | None,
    expected: str,
) -> None:
    fake.add(job("train", owner=job_owner))
    worker = pod("train-0-xk2pq", owner=reference("Job", "train", "batch/v1"))
    fake.add(worker)
    fake.add(template_claim(ref_to(worker), name="train-gpu"))

    list_claims(api_client, cluster)

    assert jobs() == {"train-gpu": expected}
    assert len(fake.reads("Job")) == 1


@pytest.mark.django_db
def test_a_gone_pod_leaves_the_job_at_the_pod(
    fake: FakeKube, api_client: Any, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    fake.add(template_claim(reference("Pod", "web-gone", "v1"), name="orphan-gpu"))

    with caplog.at_level(logging.INFO, logger="inventory.kube"):
        report = list_claims(api_client, cluster)

    assert report.errors == [] and report.created["ResourceClaim"] == 1
    assert jobs() == {"orphan-gpu": "Pod/web-gone"}
    assert [r.status for r in fake.reads("Pod")] == [404]
    assert any("web-gone" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)


@pytest.mark.django_db
def test_a_forbidden_kind_leaves_the_job_at_the_owner_known_and_is_asked_once(
    fake: FakeKube, api_client: Any, cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    fake.forbidden = {"ReplicaSet"}
    (first,) = add_deployment_pods(fake, "web-a", "web-a-1")
    (second,) = add_deployment_pods(fake, "web-b", "web-b-1")
    fake.add(template_claim(ref_to(first), name="first"))
    fake.add(template_claim(ref_to(second), name="second"))

    report = list_claims(api_client, cluster)

    assert report.errors == []
    assert jobs() == {"first": "ReplicaSet/web-a", "second": "ReplicaSet/web-b"}
    assert [r.status for r in fake.reads("ReplicaSet")] == [403]
    assert len(fake.reads("Pod")) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("403" in message and "replicasets.apps" in message for message in warnings)


@pytest.mark.django_db
def test_each_owner_is_read_once_however_many_claims_it_has(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    pods = add_deployment_pods(fake, "web-5d8f9c", *(f"web-5d8f9c-{index}" for index in range(3)))
    for index, made in enumerate(pods):
        fake.add(template_claim(ref_to(made), name=f"claim-{index}"))
    # A Pod with two claims (two templates): one read of it.
    fake.add(template_claim(ref_to(pods[0]), name="claim-0-second"))

    list_claims(api_client, cluster)

    assert set(jobs().values()) == {"Deployment/web"} and len(jobs()) == 4
    assert sorted(r.read[2] for r in fake.reads("Pod") if r.read) == [
        f"web-5d8f9c-{index}" for index in range(3)
    ]
    assert len(fake.reads("ReplicaSet")) == 1


@pytest.mark.django_db
def test_a_namesake_pod_made_after_the_owner_was_deleted_is_not_followed(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    namesake = pod("db-0", owner=reference("ReplicaSet", "other", "apps/v1"))
    namesake["metadata"]["uid"] = "uid-of-a-later-pod"
    fake.add(namesake)
    fake.add(template_claim(reference("Pod", "db-0", "v1"), name="db-gpu"))

    list_claims(api_client, cluster)

    assert jobs() == {"db-gpu": "Pod/db-0"}
    assert not fake.reads("ReplicaSet")


@pytest.mark.django_db
def test_claims_not_owned_by_a_pod_replica_set_or_job_read_nothing(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    fake.add(template_claim(reference("PyTorchJob", "bert", "kubeflow.org/v1"), name="bert"))
    fake.add(template_claim(reference("Job", "sim", "example.com/v1"), name="not-batch"))
    fake.add(template_claim(None, name="by-hand"))

    list_claims(api_client, cluster)

    assert jobs() == {"bert": "PyTorchJob/bert", "not-batch": "Job/sim", "by-hand": ""}
    assert not [r for r in fake.requests if r.read is not None]


@pytest.mark.django_db
def test_a_loop_of_owners_ends(fake: FakeKube, api_client: Any, cluster: Cluster) -> None:
    fake.add(replica_set("loop", owner=reference("ReplicaSet", "loop", "apps/v1")))
    looped = pod("loop-1", owner=reference("ReplicaSet", "loop", "apps/v1"))
    fake.add(looped)
    fake.add(template_claim(ref_to(looped), name="loop-gpu"))

    list_claims(api_client, cluster)

    assert jobs() == {"loop-gpu": "ReplicaSet/loop"}
    assert len(fake.reads("ReplicaSet")) == 1


@pytest.mark.django_db
def test_a_later_list_reads_only_what_is_unresolved_and_never_undoes_a_job(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    (web,) = add_deployment_pods(fake, "web-5d8f9c", "web-5d8f9c-abcde")
    fake.add(template_claim(ref_to(web), name="web-gpu"))
    early = template_claim(reference("Pod", "early-0", "v1"), name="early-gpu")
    fake.add(early)  # its Pod not yet there (or not yet visible)
    list_claims(api_client, cluster)
    assert jobs() == {"web-gpu": "Deployment/web", "early-gpu": "Pod/early-0"}

    fake.delete("Pod", "web-5d8f9c-abcde", namespace=NAMESPACE)
    fake.add(pod("early-0", owner=reference("Job", "train", "batch/v1")))
    fake.add(job("train"))
    pod_reads = len(fake.reads("Pod"))
    set_reads = len(fake.reads("ReplicaSet"))
    list_claims(api_client, cluster)

    assert jobs() == {"web-gpu": "Deployment/web", "early-gpu": "Job/train"}
    # early-0's owners are read to find its job; web-gpu's Pod only to look for its gang (a
    # live claim with none: `sync --once` keeps no memory of when it last looked), never to
    # find its job again: its ReplicaSet is not read.
    assert sorted(r.read[2] for r in fake.reads("Pod")[pod_reads:] if r.read) == [
        "early-0",
        "web-5d8f9c-abcde",
    ]
    assert len(fake.reads("ReplicaSet")) == set_reads


@pytest.mark.django_db(transaction=True)
def test_the_watch_charges_a_new_claim_and_keeps_it_once_the_pod_is_gone(
    fake: FakeKube, api_client: Any, cluster: Cluster
) -> None:
    with running_sync(api_client, cluster, "ResourceClaim"):
        wait_watching(fake, "ResourceClaim")
        (web,) = add_deployment_pods(fake, "web-5d8f9c", "web-5d8f9c-abcde")
        made = template_claim(ref_to(web), name="web-gpu")
        fake.add(made)
        wait_until(lambda: jobs().get("web-gpu") == "Deployment/web", "the claim's job")

        # A new watch request (a new reader) sees the Pod go, then the claim updated.
        fake.drop_streams(partial=False)
        wait_until(lambda: len(fake.watches("ResourceClaim")) >= 2, "the watch resumed")
        fake.delete("Pod", "web-5d8f9c-abcde", namespace=NAMESPACE)
        made["metadata"]["labels"] = {"released": "yes"}
        modified = fake.modify(made)
        wait_until(
            lambda: sync_state(cluster, "ResourceClaim").resource_version == modified,
            "the modification applied",
        )

    stored = ResourceClaim.objects.get(name="web-gpu")
    assert (stored.labels, stored.job) == ({"released": "yes"}, "Deployment/web")
    assert len(fake.reads("Pod")) == 1, "a resolved claim's owners are not read again"


# From a dump ------------------------------------------------------------------------------


def write_dump(path: Path, objects: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path


@pytest.mark.django_db
def test_a_dump_with_the_pods_and_their_owners_charges_the_deployment_and_the_job(
    tmp_path: Path,
) -> None:
    web = pod("web-5d8f9c-abcde", owner=reference("ReplicaSet", "web-5d8f9c", "apps/v1"))
    worker = pod("train-0", owner=reference("Job", "train", "batch/v1"))
    # As `kubectl get resourceclaims,pods,replicasets,jobs` prints them: claims first.
    dump = write_dump(
        tmp_path / "dump.yaml",
        [
            template_claim(ref_to(web), name="web-gpu"),
            template_claim(ref_to(worker), name="train-gpu"),
            template_claim(reference("Pod", "not-dumped", "v1"), name="other-gpu"),
            web,
            worker,
            replica_set("web-5d8f9c", owner=deployment_ref("web")),
            job("train", owner=reference("CronJob", "nightly", "batch/v1")),
        ],
    )

    out = io.StringIO()

    call_command("sync_inventory", "--from-file", str(dump), stdout=out)

    assert jobs() == {
        "web-gpu": "Deployment/web",
        "train-gpu": "CronJob/nightly",
        "other-gpu": "Pod/not-dumped",
    }
    assert "ResourceClaim: 3 created, 0 updated" in out.getvalue()


@pytest.mark.django_db
def test_a_later_dump_with_fewer_owners_undoes_no_job(tmp_path: Path) -> None:
    web = pod("web-5d8f9c-abcde", owner=reference("ReplicaSet", "web-5d8f9c", "apps/v1"))
    web_claim = template_claim(ref_to(web), name="web-gpu")
    rs = replica_set("web-5d8f9c", owner=deployment_ref("web"))
    call_command(
        "sync_inventory",
        "--from-file",
        str(write_dump(tmp_path / "with-owners.yaml", [web_claim, web, rs])),
        stdout=io.StringIO(),
    )
    assert jobs() == {"web-gpu": "Deployment/web"}

    # The Pod without its ReplicaSet (gone since), and a claim whose Pod is not dumped.
    later = template_claim(reference("Pod", "db-0", "v1"), name="db-gpu")
    fewer = tmp_path / "fewer.json"
    fewer.write_text(json.dumps({"kind": "List", "items": [web_claim, later, web]}))
    call_command("sync_inventory", "--from-file", str(fewer), stdout=io.StringIO())

    assert jobs() == {"web-gpu": "Deployment/web", "db-gpu": "Pod/db-0"}


@pytest.mark.django_db
def test_a_dump_of_pods_alone_completes_the_jobs_of_known_claims(cluster: Cluster) -> None:
    web = pod("web-5d8f9c-abcde", owner=reference("ReplicaSet", "web-5d8f9c", "apps/v1"))
    services.import_snapshot(
        cluster=cluster, objects=[template_claim(ref_to(web), name="web-gpu")], at=AT
    )
    assert jobs() == {"web-gpu": "Pod/web-5d8f9c-abcde"}

    report = services.import_snapshot(
        cluster=cluster,
        objects=[web, replica_set("web-5d8f9c", owner=deployment_ref("web"))],
        at=AT,
    )

    assert jobs() == {"web-gpu": "Deployment/web"}
    assert report.updated["ResourceClaim"] == 1
    assert ResourceClaim.objects.get().released_at is None, "Pods are no snapshot of claims"


# The pieces -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chain", "complete", "recorded", "expected"),
    [
        (("Pod/p",), False, "", "Pod/p"),
        (("Pod/p",), False, "Deployment/web", "Deployment/web"),
        (("Pod/p", "ReplicaSet/rs"), False, "Pod/p", "ReplicaSet/rs"),
        (("Pod/p", "ReplicaSet/rs"), False, "Deployment/web", "Deployment/web"),
        (("Pod/p",), True, "Deployment/web", "Pod/p"),
    ],
)
def test_a_resolution_replaces_what_was_recorded_only_when_it_gets_further(
    chain: tuple[str, ...], complete: bool, recorded: str, expected: str
) -> None:
    assert owners.Resolution(chain, complete).over(recorded) == expected
