"""The person behind every GPU-hour (issue 19, item 1): the workload webhook writes who made a
workload on it and on its pod templates, and a claim made from a template finds that person
through its owners, read with the real kubernetes client from `devtools.fake_kube`.

Reviews are sent as the API server sends them, through the real URL; the patch each answer
carries is applied with `jsonpatch` to the object sent, as the API server applies it, so a
patch that does not apply to the object as sent fails the test.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
from django.test import Client
from prometheus_client import REGISTRY

from devtools.fake_kube import FakeKube
from inventory import kube, kube_owners, owners
from quota import workloads
from quota.admission import service

PATH = "/admission/workloads/mutate"
CREATED_BY = "tally.dev/created-by"
NAMESPACE = "team-a"
REPLICASET_CONTROLLER = "system:serviceaccount:kube-system:replicaset-controller"
CLAIM_CONTROLLER = "system:serviceaccount:kube-system:resource-claim-controller"
JOBSET_CONTROLLER = "system:serviceaccount:jobset-system:jobset-controller-manager"
REPO = Path(__file__).resolve().parents[2]

Obj = dict[str, Any]


# -- reviews, as the API server sends them ---------------------------------------------------


def pod_template(**annotations: str) -> Obj:
    metadata: Obj = {"labels": {"app": "train"}}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {"metadata": metadata, "spec": {"containers": [{"name": "c", "image": "i"}]}}


def workload(api_version: str, kind: str, name: str, spec: Obj | None, **annotations: str) -> Obj:
    metadata: Obj = {"name": name, "namespace": NAMESPACE}
    if annotations:
        metadata["annotations"] = {key.replace("_", "/"): v for key, v in annotations.items()}
    obj: Obj = {"apiVersion": api_version, "kind": kind, "metadata": metadata}
    if spec is not None:
        obj["spec"] = spec
    return obj


def review(
    obj: Any,
    *,
    username: str | None = "alice",
    operation: str = "CREATE",
    old: Obj | None = None,
    sub_resource: str | None = None,
) -> Obj:
    api_version = obj.get("apiVersion", "v1") if isinstance(obj, dict) else "v1"
    group, _, version = api_version.rpartition("/")
    kind = obj.get("kind", "Pod") if isinstance(obj, dict) else "Pod"
    metadata = obj.get("metadata") if isinstance(obj, dict) else None
    request: Obj = {
        "uid": str(uuid.uuid4()),
        "kind": {"group": group, "version": version, "kind": kind},
        "resource": {"group": group, "version": version, "resource": kind.lower() + "s"},
        "namespace": NAMESPACE,
        "name": metadata.get("name", "") if isinstance(metadata, dict) else "",
        "operation": operation,
        "userInfo": {"username": username, "groups": ["system:authenticated"]},
        "object": obj,
        "oldObject": old,
        "dryRun": False,
    }
    if username is None:
        del request["userInfo"]
    if sub_resource:
        request["subResource"] = sub_resource
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def send(client: Client, body: Any) -> Obj:
    data = body if isinstance(body, bytes) else json.dumps(body)
    response = client.post(PATH, data=data, content_type="application/json")
    assert response.status_code == 200, response.content
    sent_uid = body["request"]["uid"] if isinstance(body, dict) else None
    answer: Obj = response.json()["response"]
    assert answer["allowed"] is True
    if sent_uid is not None:
        assert answer["uid"] == sent_uid
    return answer


def admitted(client: Client, obj: Obj, **kwargs: Any) -> tuple[Obj, list[str]]:
    """The object as the API server stores it after the webhook, and the warnings."""
    answer = send(client, review(obj, **kwargs))
    stored = obj
    if "patch" in answer:
        assert answer["patchType"] == "JSONPatch"
        operations = json.loads(base64.b64decode(answer["patch"]))
        stored = jsonpatch.apply_patch(obj, operations)
    return stored, answer.get("warnings", [])


def creator_at(obj: Obj, *path: str | int) -> Any:
    node: Any = obj
    for part in path:
        node = node[part]
    return (node.get("metadata") or {}).get("annotations", {}).get(CREATED_BY)


def decisions(result: str) -> float:
    value = REGISTRY.get_sample_value(
        "tally_webhook_decisions_total", {"webhook": "workloads", "result": result, "rule": ""}
    )
    return value or 0.0


# -- each kind: the workload and every pod template in it -----------------------------------


def test_a_pod_gets_its_creator(client: Client) -> None:
    pod = workload("v1", "Pod", "notebook", {"containers": [{"name": "c", "image": "i"}]})
    before = decisions("annotated")
    stored, warnings = admitted(client, pod)
    assert stored["metadata"]["annotations"] == {CREATED_BY: "alice"}
    assert warnings == []
    assert decisions("annotated") == before + 1


def test_a_pod_with_other_annotations_keeps_them(client: Client) -> None:
    pod = workload("v1", "Pod", "notebook", {}, team_note="x")
    stored, _ = admitted(client, pod)
    assert stored["metadata"]["annotations"] == {"team/note": "x", CREATED_BY: "alice"}


def test_a_deployment_and_its_pod_template(client: Client) -> None:
    template = pod_template()
    del template["metadata"]  # a template without metadata gets one
    deployment = workload("apps/v1", "Deployment", "serve", {"replicas": 2, "template": template})
    stored, _ = admitted(client, deployment)
    assert creator_at(stored) == "alice"
    assert stored["spec"]["template"]["metadata"] == {"annotations": {CREATED_BY: "alice"}}
    assert stored["spec"]["replicas"] == 2


def test_a_job_and_its_pod_template(client: Client) -> None:
    job = workload("batch/v1", "Job", "train", {"template": pod_template(other="1")})
    stored, _ = admitted(client, job)
    assert creator_at(stored) == "alice"
    assert stored["spec"]["template"]["metadata"]["annotations"] == {
        "other": "1",
        CREATED_BY: "alice",
    }


def test_a_cron_job_its_job_template_and_pod_template(client: Client) -> None:
    cron = workload(
        "batch/v1",
        "CronJob",
        "nightly",
        {"schedule": "0 1 * * *", "jobTemplate": {"spec": {"template": pod_template()}}},
    )
    stored, _ = admitted(client, cron)
    assert creator_at(stored) == "alice"
    assert creator_at(stored, "spec", "jobTemplate") == "alice"
    assert creator_at(stored, "spec", "jobTemplate", "spec", "template") == "alice"


def test_a_job_set_every_replicated_job_and_its_pod_template(client: Client) -> None:
    replicated = [
        {"name": name, "replicas": 1, "template": {"spec": {"template": pod_template()}}}
        for name in ("driver", "workers")
    ]
    jobset = workload("jobset.x-k8s.io/v1alpha2", "JobSet", "llm", {"replicatedJobs": replicated})
    stored, _ = admitted(client, jobset)
    assert creator_at(stored) == "alice"
    for index in range(2):
        job_template = stored["spec"]["replicatedJobs"][index]["template"]
        assert creator_at(job_template) == "alice"
        assert creator_at(job_template, "spec", "template") == "alice"


def test_a_pytorch_job_every_replica_template(client: Client) -> None:
    specs = {
        "Master": {"replicas": 1, "template": pod_template()},
        "Worker": {"replicas": 4, "template": pod_template()},
    }
    job = workload("kubeflow.org/v1", "PyTorchJob", "ft", {"pytorchReplicaSpecs": specs})
    stored, _ = admitted(client, job)
    assert creator_at(stored) == "alice"
    for role in ("Master", "Worker"):
        assert creator_at(stored, "spec", "pytorchReplicaSpecs", role, "template") == "alice"


def test_a_ray_job_its_cluster_templates_and_submitter(client: Client) -> None:
    cluster = {
        "headGroupSpec": {"template": pod_template()},
        "workerGroupSpecs": [{"groupName": "gpu", "template": pod_template()}],
    }
    ray_job = workload(
        "ray.io/v1",
        "RayJob",
        "eval",
        {"rayClusterSpec": cluster, "submitterPodTemplate": pod_template()},
    )
    stored, _ = admitted(client, ray_job)
    spec = stored["spec"]
    assert creator_at(spec, "rayClusterSpec", "headGroupSpec", "template") == "alice"
    assert creator_at(spec, "rayClusterSpec", "workerGroupSpecs", 0, "template") == "alice"
    assert creator_at(spec, "submitterPodTemplate") == "alice"


def test_a_leader_worker_set_both_templates(client: Client) -> None:
    lws = workload(
        "leaderworkerset.x-k8s.io/v1",
        "LeaderWorkerSet",
        "serve",
        {"leaderWorkerTemplate": {"leaderTemplate": pod_template(), "workerTemplate": {}}},
    )
    stored, _ = admitted(client, lws)
    template = stored["spec"]["leaderWorkerTemplate"]
    assert creator_at(template, "leaderTemplate") == "alice"
    assert creator_at(template, "workerTemplate") == "alice"


def test_a_train_job_passes_it_to_what_it_makes(client: Client) -> None:
    train = workload("trainer.kubeflow.org/v1alpha1", "TrainJob", "ft", {"runtimeRef": {}})
    stored, _ = admitted(client, train)
    assert creator_at(stored) == "alice"
    assert stored["spec"]["annotations"] == {CREATED_BY: "alice"}


def test_a_workload_without_the_templates_its_kind_may_have_gets_only_its_own(
    client: Client,
) -> None:
    jobset = workload("jobset.x-k8s.io/v1alpha2", "JobSet", "odd", {"replicatedJobs": []})
    stored, _ = admitted(client, jobset)
    assert creator_at(stored) == "alice"
    assert stored["spec"] == {"replicatedJobs": []}
    no_spec = workload("apps/v1", "Deployment", "bare", None)
    stored, _ = admitted(client, no_spec)
    assert creator_at(stored) == "alice"
    assert "spec" not in stored


# -- kept, replaced, and who may copy ------------------------------------------------------


def test_the_requesters_own_name_is_kept_without_a_patch(client: Client) -> None:
    job = workload("batch/v1", "Job", "t", {"template": pod_template(**{CREATED_BY: "alice"})})
    job["metadata"]["annotations"] = {CREATED_BY: "alice"}
    answer = send(client, review(job))
    assert "patch" not in answer and "warnings" not in answer


def test_someone_elses_name_is_replaced_by_the_requester_with_a_warning(
    client: Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A test before this one may have configured logging anew (gunicorn, celery), disabling
    # the loggers that existed then; this one is about what the webhook logs.
    monkeypatch.setattr(logging.getLogger("quota.workload_views"), "disabled", False)
    caplog.set_level(logging.INFO, logger="quota.workload_views")
    job = workload("batch/v1", "Job", "t", {"template": pod_template(**{CREATED_BY: "carol"})})
    job["metadata"]["annotations"] = {CREATED_BY: "bob"}
    before = decisions("replaced")
    stored, warnings = admitted(client, job, username="mallory")
    assert creator_at(stored) == "mallory"
    assert creator_at(stored, "spec", "template") == "mallory"
    assert warnings == [
        f"{CREATED_BY} names the user who creates the object: set to 'mallory', not 'bob'",
        f"{CREATED_BY} names the user who creates the object: set to 'mallory', not 'carol'",
    ]
    assert decisions("replaced") == before + 1
    assert "by mallory: the creator it named was replaced" in caplog.text


def test_a_creator_that_is_no_string_is_replaced(client: Client) -> None:
    pod = workload("v1", "Pod", "p", {})
    pod["metadata"]["annotations"] = {CREATED_BY: {"nested": True}}
    stored, warnings = admitted(client, pod)
    assert creator_at(stored) == "alice"
    assert len(warnings) == 1


def owned_by(obj: Obj, api_version: str, kind: str, name: str) -> Obj:
    """`obj` with the controller reference its controller writes on what it makes for `kind`."""
    obj["metadata"]["ownerReferences"] = [
        {
            "apiVersion": api_version,
            "kind": kind,
            "name": name,
            "uid": f"uid-{kind.lower()}-{name}",
            "controller": True,
        }
    ]
    return obj


def test_a_controller_keeps_the_creator_and_is_never_one(client: Client) -> None:
    # The ReplicaSet controller makes a Pod from a template the webhook annotated.
    made = workload("v1", "Pod", "serve-abc", {}, **{CREATED_BY: "alice"})
    owned_by(made, "apps/v1", "ReplicaSet", "serve")
    answer = send(client, review(made, username=REPLICASET_CONTROLLER))
    assert "patch" not in answer and "warnings" not in answer
    # A Pod of a workload made before Tally: nobody is recorded, the labels will say.
    old_style = owned_by(workload("v1", "Pod", "legacy-abc", {}), "apps/v1", "ReplicaSet", "l")
    answer = send(client, review(old_style, username=REPLICASET_CONTROLLER))
    assert "patch" not in answer


def test_a_controller_copies_its_objects_creator_into_its_templates(client: Client) -> None:
    """A JobSet made by an operator for a TrainJob carries the TrainJob's creator."""
    replicated = [{"name": "node", "template": {"spec": {"template": pod_template()}}}]
    jobset = workload("jobset.x-k8s.io/v1alpha2", "JobSet", "ft", {"replicatedJobs": replicated})
    jobset["metadata"]["annotations"] = {CREATED_BY: "alice"}
    owned_by(jobset, "trainer.kubeflow.org/v1alpha1", "TrainJob", "ft")
    stored, warnings = admitted(client, jobset, username=JOBSET_CONTROLLER)
    assert creator_at(stored, "spec", "replicatedJobs", 0, "template") == "alice"
    assert creator_at(stored, "spec", "replicatedJobs", 0, "template", "spec", "template") == (
        "alice"
    )
    assert warnings == []


def test_the_controllers_are_a_setting(client: Client, settings: Any) -> None:
    settings.TALLY_WORKLOAD_CONTROLLERS = ["system:serviceaccount:argo:*"]
    pod = workload("v1", "Pod", "step-1", {}, **{CREATED_BY: "alice"})
    owned_by(pod, "batch/v1", "Job", "step")
    answer = send(client, review(pod, username="system:serviceaccount:argo:workflow-controller"))
    assert "patch" not in answer
    stored, warnings = admitted(client, pod, username=REPLICASET_CONTROLLER)
    assert creator_at(stored) == REPLICASET_CONTROLLER and warnings


# -- updates --------------------------------------------------------------------------------


def test_an_update_cannot_change_a_recorded_creator(client: Client) -> None:
    old = workload(
        "apps/v1", "Deployment", "serve", {"template": pod_template(**{CREATED_BY: "alice"})}
    )
    old["metadata"]["annotations"] = {CREATED_BY: "alice"}
    new = json.loads(json.dumps(old))
    new["spec"]["template"]["metadata"]["annotations"][CREATED_BY] = "bob"
    del new["metadata"]["annotations"]
    stored, warnings = admitted(client, new, operation="UPDATE", old=old, username="mallory")
    assert creator_at(stored) == "alice"
    assert creator_at(stored, "spec", "template") == "alice"
    assert warnings == [f"{CREATED_BY} is recorded by Tally: the value sent was not kept"]


def test_an_update_that_leaves_the_creator_out_gets_it_back_quietly(client: Client) -> None:
    """A server-side apply of the manifest as written drops what the webhook added."""
    old = workload("batch/v1", "Job", "t", {"template": pod_template(**{CREATED_BY: "alice"})})
    old["metadata"]["annotations"] = {CREATED_BY: "alice"}
    new = workload("batch/v1", "Job", "t", {"template": pod_template()})
    stored, warnings = admitted(client, new, operation="UPDATE", old=old, username="alice")
    assert creator_at(stored) == creator_at(stored, "spec", "template") == "alice"
    assert warnings == []


def test_an_update_that_leaves_the_creator_alone_is_untouched(client: Client) -> None:
    old = workload(
        "apps/v1", "Deployment", "serve", {"template": pod_template(**{CREATED_BY: "alice"})}
    )
    new = json.loads(json.dumps(old))
    new["spec"]["replicas"] = 5
    answer = send(client, review(new, operation="UPDATE", old=old, username="bob"))
    assert "patch" not in answer and "warnings" not in answer
    # Made before Tally: an update adds nothing (a new template annotation would roll it out).
    legacy = workload("apps/v1", "Deployment", "legacy", {"template": pod_template()})
    answer = send(client, review(legacy, operation="UPDATE", old=legacy, username="bob"))
    assert "patch" not in answer


def test_a_creator_first_written_by_an_update_names_who_wrote_it(client: Client) -> None:
    legacy = workload("apps/v1", "Deployment", "legacy", {"template": pod_template()})
    new = json.loads(json.dumps(legacy))
    new["metadata"]["annotations"] = {CREATED_BY: "bob"}
    stored, _ = admitted(client, new, operation="UPDATE", old=legacy, username="mallory")
    assert creator_at(stored) == "mallory"
    new["metadata"]["annotations"] = {CREATED_BY: "mallory"}
    answer = send(client, review(new, operation="UPDATE", old=legacy, username="mallory"))
    assert "patch" not in answer


# -- what is left alone -----------------------------------------------------------------------


def test_kinds_not_configured_subresources_and_deletes_are_untouched(
    client: Client, settings: Any
) -> None:
    pod = workload("v1", "Pod", "p", {})
    settings.TALLY_WORKLOAD_KINDS = ["apps/Deployment"]
    assert "patch" not in send(client, review(pod))
    settings.TALLY_WORKLOAD_KINDS = ["Pod"]
    assert "patch" in send(client, review(pod))
    assert "patch" not in send(client, review(pod, sub_resource="status"))
    assert "patch" not in send(client, review(pod, operation="DELETE"))
    service = workload("v1", "Service", "s", {})
    assert "patch" not in send(client, review(service))


def test_a_configured_kind_with_no_known_templates_has_its_spec_template_annotated(
    client: Client, settings: Any
) -> None:
    settings.TALLY_WORKLOAD_KINDS = ["example.com/Trainer"]
    trainer = workload("example.com/v1", "Trainer", "t", {"template": pod_template()})
    stored, _ = admitted(client, trainer)
    assert creator_at(stored) == creator_at(stored, "spec", "template") == "alice"


# -- malformed input: allowed, with a warning, never a 500 --------------------------------


@pytest.mark.parametrize(
    ("obj", "username", "problem"),
    [
        ("a string", "alice", "request.object is not an object"),
        ({"kind": "Pod", "metadata": ["x"]}, "alice", "request.object.metadata is not a mapping"),
        (
            {"kind": "Pod", "metadata": {"annotations": "x"}},
            "alice",
            "request.object.metadata.annotations is not a mapping",
        ),
        (
            {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {},
                "spec": {"template": {"metadata": {"annotations": ["x"]}}},
            },
            "alice",
            "request.object.spec.template.metadata.annotations is not a mapping",
        ),
        (
            {
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "metadata": {},
                "spec": {"replicatedJobs": [{"template": {"metadata": 7}}]},
            },
            "alice",
            "request.object.spec.replicatedJobs[0].template.metadata is not a mapping",
        ),
        ({"kind": "Pod", "metadata": {}}, None, "request.userInfo.username is missing"),
        ({"kind": "Pod", "metadata": {}}, "", "request.userInfo.username is missing"),
    ],
    ids=["object", "metadata", "annotations", "template", "replicated-job", "no-user", "empty"],
)
def test_a_malformed_object_is_admitted_with_a_warning(
    client: Client, obj: Any, username: str | None, problem: str
) -> None:
    answer = send(client, review(obj, username=username))
    assert "patch" not in answer
    assert answer["warnings"] == [f"Tally did not record who created this object: {problem}"]


def test_a_template_of_the_wrong_type_is_no_template(client: Client) -> None:
    deployment = workload("apps/v1", "Deployment", "d", {"template": "nonsense"})
    stored, warnings = admitted(client, deployment)
    assert creator_at(stored) == "alice" and stored["spec"]["template"] == "nonsense"
    assert warnings == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"}', "request"),
        (b'{"request": ' * 100 + b"{}" + b"}" * 100, "nested deeper than"),
    ],
)
def test_a_body_that_is_no_admission_review_gets_400_with_the_reason(
    client: Client, body: bytes, reason: str
) -> None:
    response = client.post(PATH, data=body, content_type="application/json")
    assert response.status_code == 400
    assert reason in response.content.decode()


def test_a_failure_of_its_own_is_an_admission_with_a_warning(
    client: Client, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.TALLY_WORKLOAD_KINDS = None  # a setting broken past its check at start
    before = decisions("error")
    answer = send(client, review(workload("v1", "Pod", "p", {})))
    assert "patch" not in answer
    assert answer["warnings"] == [
        "Tally did not record who created this object (an error; see its logs)"
    ]
    assert decisions("error") == before + 1
    assert "could not record the workload's creator" in caplog.text


def test_only_post_is_served(client: Client) -> None:
    assert client.get(PATH).status_code == 405


def test_the_longest_names_and_usernames_fit(client: Client) -> None:
    # A service account's username: a namespace (63) and a name (253).
    username = f"system:serviceaccount:{'n' * 63}:{'s' * 253}"
    claimed = "x" * 400
    pod = workload("v1", "Pod", "p" * 253, {}, **{CREATED_BY: claimed})
    pod["metadata"]["namespace"] = "n" * 63
    stored, warnings = admitted(client, pod, username=username)
    assert creator_at(stored) == username
    (warning,) = warnings
    assert len(warning) == 256 and warning.endswith("...")


def test_a_bad_kind_setting_fails_at_start_naming_it() -> None:
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "TALLY_WORKLOAD_KINDS": "Pod,apps/deployments",
    }
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "TALLY_WORKLOAD_KINDS: 'apps/deployments' is not a kind" in result.stderr


# -- the owner chain: a claim made from a template finds the person -------------------------


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with FakeKube(max_lifetime_seconds=60) as server:
        yield server


@pytest.fixture
def api_client(fake: FakeKube, tmp_path: Path) -> Iterator[Any]:
    client = kube.api_client(kubeconfig=str(fake.write_kubeconfig(tmp_path / "kubeconfig")))
    yield client
    client.close()


def made_by(controller: Obj, obj: Obj) -> Obj:
    """`obj` as `controller`'s controller makes it: owned by it, with a uid."""
    metadata = obj["metadata"]
    metadata["uid"] = f"uid-{obj['kind'].lower()}-{metadata['name']}"
    metadata["ownerReferences"] = [
        {
            "apiVersion": controller["apiVersion"],
            "kind": controller["kind"],
            "name": controller["metadata"]["name"],
            "uid": controller["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return obj


def from_template(kind: str, api_version: str, name: str, template: Obj) -> Obj:
    """What a controller makes from a template: its metadata, with a name and namespace."""
    metadata = json.loads(json.dumps(template.get("metadata") or {}))
    metadata.update(name=name, namespace=NAMESPACE)
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": {}}


def claim_of(pod: Obj, *, annotations: Obj | None = None, labels: Obj | None = None) -> Obj:
    claim = made_by(
        pod,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": f"{pod['metadata']['name']}-gpu", "namespace": NAMESPACE},
        },
    )
    claim["metadata"]["annotations"] = annotations or {}
    claim["metadata"]["labels"] = labels or {}
    return claim


def resolve(api_client: Any, claim: Obj, labels: tuple[str, ...] = ()) -> owners.Resolution:
    return owners.resolve_job(
        namespace=NAMESPACE,
        owner_references=claim["metadata"]["ownerReferences"],
        lookup=kube_owners.OwnerReader(api_client),
        creator_labels=labels,
    )


def test_a_claim_from_a_deployments_template_finds_who_made_the_deployment(
    client: Client, fake: FakeKube, api_client: Any, settings: Any
) -> None:
    """Through the webhook as the API server calls it for each object the controllers make."""
    deployment, _ = admitted(
        client, workload("apps/v1", "Deployment", "serve", {"template": pod_template()})
    )
    deployment["metadata"]["uid"] = "uid-deployment-serve"
    # The Deployment controller makes a ReplicaSet with the Deployment's template...
    replica_set = made_by(
        deployment,
        from_template("ReplicaSet", "apps/v1", "serve-5d8f", {"metadata": {}}),
    )
    replica_set, _ = admitted(client, replica_set, username=REPLICASET_CONTROLLER)
    # ... and the ReplicaSet controller Pods from it, through the webhook too.
    pod = made_by(
        replica_set,
        from_template("Pod", "v1", "serve-5d8f-x2", deployment["spec"]["template"]),
    )
    pod, warnings = admitted(client, pod, username=REPLICASET_CONTROLLER)
    assert creator_at(pod) == "alice" and warnings == []
    fake.add(replica_set)
    fake.add(pod)
    claim = claim_of(pod)  # by the resource-claim controller: it names nobody
    resolution = resolve(api_client, claim)
    assert resolution.job == "Deployment/serve"
    assert resolution.created_by == resolution.annotated_by == "alice"
    charged = owners.claim_creator(
        recorded=CLAIM_CONTROLLER,
        owner_references=claim["metadata"]["ownerReferences"],
        labels=claim["metadata"]["labels"],
        resolution=resolution,
        creator_labels=settings.TALLY_CREATED_BY_LABELS,
        controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
    )
    assert charged == "alice"


def test_the_nearest_owner_with_the_annotation_names_the_creator(
    fake: FakeKube, api_client: Any
) -> None:
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "nightly-29",
            "namespace": NAMESPACE,
            "uid": "uid-job-nightly-29",
            "annotations": {CREATED_BY: "alice"},
        },
    }
    bare_pod = made_by(job, from_template("Pod", "v1", "nightly-29-a", {}))
    fake.add(job)
    fake.add(bare_pod)
    assert resolve(api_client, claim_of(bare_pod)).created_by == "alice"
    annotated_pod = made_by(
        job,
        from_template(
            "Pod", "v1", "nightly-29-b", {"metadata": {"annotations": {CREATED_BY: "bob"}}}
        ),
    )
    fake.add(annotated_pod)
    assert resolve(api_client, claim_of(annotated_pod)).created_by == "bob"


def test_labels_name_the_creator_of_workloads_made_before_tally(
    fake: FakeKube, api_client: Any, settings: Any
) -> None:
    labels = tuple(settings.TALLY_CREATED_BY_LABELS)
    replica_set = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": "old-1",
            "namespace": NAMESPACE,
            "uid": "uid-replicaset-old-1",
            "labels": {"owner": "carol"},
        },
    }
    pod = made_by(
        replica_set,
        from_template("Pod", "v1", "old-1-a", {"metadata": {"labels": {"user": "dave"}}}),
    )
    fake.add(replica_set)
    fake.add(pod)
    # "owner" comes before "user" in the list: the ReplicaSet's label wins over the Pod's.
    resolution = resolve(api_client, claim_of(pod), labels)
    assert (resolution.annotated_by, resolution.labelled_by) == ("", "carol")
    assert resolve(api_client, claim_of(pod), ("user",)).created_by == "dave"
    assert resolve(api_client, claim_of(pod), ()).created_by == ""
    # A template's claim has the template's labels, not its workload's: its owners' count.
    own = claim_of(pod, labels={"owner": "erin"})
    assert (
        owners.claim_creator(
            recorded="",
            owner_references=own["metadata"]["ownerReferences"],
            labels=own["metadata"]["labels"],
            resolution=resolution,
            creator_labels=labels,
            controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
        )
        == "carol"
    )


def test_who_is_charged_for_a_claim_in_order(settings: Any) -> None:
    resolution = owners.Resolution(("Pod/p",), complete=True, annotated_by="alice")
    labelled = owners.Resolution(("Pod/p",), complete=True, labelled_by="carol")
    unread = owners.Resolution(("Pod/p",), complete=False)
    of_a_pod = [{"apiVersion": "v1", "kind": "Pod", "name": "p", "controller": True}]

    def charged(recorded: str, resolution: owners.Resolution | None, references: Any = None) -> str:
        return owners.claim_creator(
            recorded=recorded,
            owner_references=of_a_pod if references is None else references,
            labels={"user": "dave"},
            resolution=resolution,
            creator_labels=settings.TALLY_CREATED_BY_LABELS,
            controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
        )

    # A person who made the claim through the claim webhook.
    assert charged("zoe", resolution) == "zoe"
    # A controller is nobody: the owners' annotation, then the owners' labels.
    assert charged(CLAIM_CONTROLLER, resolution) == "alice"
    assert charged(CLAIM_CONTROLLER, labelled) == "carol"
    assert charged("system:kube-controller-manager", labelled) == "carol"
    # A template's claim whose Pod could not be read: its own labels are the template's.
    assert charged(CLAIM_CONTROLLER, unread) == ""
    assert charged("", None) == ""
    # A claim nothing owns, made before Tally: its own labels.
    assert charged("", None, references=[]) == "dave"


def test_a_dumps_owners_carry_the_creator_too() -> None:
    index = owners.OwnerIndex()
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": NAMESPACE,
            "uid": "uid-p",
            "annotations": {CREATED_BY: " alice "},
            "labels": {"user": "dave", "bad": 7},
        },
    }
    assert index.add(pod)
    owner = index.owner(NAMESPACE, {"apiVersion": "v1", "kind": "Pod", "name": "p"})
    assert owner is not None
    assert (owner.created_by, dict(owner.labels)) == ("alice", {"user": "dave"})


def test_every_default_kind_has_its_templates_known() -> None:
    for kind, paths in workloads.TEMPLATE_ANNOTATIONS.items():
        assert all(path.endswith("annotations") for path in paths), kind


def test_the_largest_objects_are_annotated_and_larger_bodies_refused(client: Client) -> None:
    # etcd keeps objects up to 1.5 MiB: such a Pod is annotated like any other.
    pod = workload("v1", "Pod", "big", {}, note="x" * 1_500_000)
    stored, _ = admitted(client, pod)
    assert creator_at(stored) == "alice"
    # An UPDATE of two such objects is past Django's 2.5 MiB: 400, never a 500 (the API
    # server then admits it unchanged: the webhook fails open).
    body = json.dumps(review(pod, operation="UPDATE", old=pod)).encode()
    response = client.post(PATH, data=body, content_type="application/json")
    assert response.status_code == 400


# -- forgery: every object Pods are made from is recorded, and controllers copy only that ------

DAEMONSET_CONTROLLER = "system:serviceaccount:kube-system:daemon-set-controller"
DEPLOYMENT_CONTROLLER = "system:serviceaccount:kube-system:deployment-controller"
STATEFULSET_CONTROLLER = "system:serviceaccount:kube-system:statefulset-controller"
# Kubeflow installs Argo's workflow controller in its own namespace, which the default
# controller patterns trust.
ARGO_IN_KUBEFLOW = "system:serviceaccount:kubeflow:argo"


@pytest.mark.parametrize(
    ("api_version", "kind", "spec", "template_path"),
    [
        ("apps/v1", "ReplicaSet", {"template": pod_template()}, ("spec", "template")),
        ("apps/v1", "DaemonSet", {"template": pod_template()}, ("spec", "template")),
        ("v1", "ReplicationController", {"template": pod_template()}, ("spec", "template")),
        (
            "apps/v1",
            "ControllerRevision",
            None,
            ("data", "spec", "template"),
        ),
    ],
    ids=["replicaset", "daemonset", "replicationcontroller", "controllerrevision"],
)
def test_a_pod_source_made_by_hand_names_who_made_it_whatever_its_template_says(
    client: Client, api_version: str, kind: str, spec: Obj | None, template_path: tuple[str, ...]
) -> None:
    """The controllers make Pods from these as they are: a forged name must not survive."""
    obj = workload(api_version, kind, "forged", json.loads(json.dumps(spec)))
    if kind == "ControllerRevision":
        # As a StatefulSet's revision holds its template: a patch replacing spec.template.
        template = pod_template(**{CREATED_BY: "alice"})
        obj["data"] = {"spec": {"template": {"$patch": "replace", **template}}}
        obj["revision"] = 1
    else:
        obj["spec"]["template"]["metadata"]["annotations"] = {CREATED_BY: "alice"}
    stored, warnings = admitted(client, obj, username="mallory")
    assert creator_at(stored) == "mallory"
    assert creator_at(stored, *template_path) == "mallory"
    assert warnings == [
        f"{CREATED_BY} names the user who creates the object: set to 'mallory', not 'alice'"
    ]
    # Nor can an UPDATE bring the forgery in later, where no creator was recorded.
    legacy = workload(api_version, kind, "legacy", json.loads(json.dumps(spec)))
    if kind == "ControllerRevision":
        legacy["data"] = {"spec": {"template": pod_template()}}
    forged = json.loads(json.dumps(legacy))
    node = forged
    for part in template_path:
        node = node[part]
    node["metadata"]["annotations"] = {CREATED_BY: "alice"}
    stored, _ = admitted(client, forged, operation="UPDATE", old=legacy, username="mallory")
    assert creator_at(stored, *template_path) == "mallory"


def test_a_replica_set_made_by_hand_with_a_forged_template_charges_its_maker(
    client: Client, fake: FakeKube, api_client: Any, settings: Any
) -> None:
    """The reviewer's attack end to end: a ReplicaSet written with alice in its pod template,
    its Pods made by the ReplicaSet controller (a trusted controller that copies the template),
    its claim from a template: the owner walk finds mallory, who wrote it."""
    forged = workload(
        "apps/v1", "ReplicaSet", "mine", {"template": pod_template(**{CREATED_BY: "alice"})}
    )
    replica_set, _ = admitted(client, forged, username="mallory")
    replica_set["metadata"]["uid"] = "uid-replicaset-mine"
    pod = made_by(
        replica_set,
        from_template("Pod", "v1", "mine-x1", replica_set["spec"]["template"]),
    )
    pod, warnings = admitted(client, pod, username=REPLICASET_CONTROLLER)
    assert creator_at(pod) == "mallory" and warnings == []
    fake.add(replica_set)
    fake.add(pod)
    claim = claim_of(pod, annotations={CREATED_BY: "alice"}, labels={"user": "alice"})
    resolution = resolve(api_client, claim, tuple(settings.TALLY_CREATED_BY_LABELS))
    assert resolution.job == "ReplicaSet/mine"
    charged = owners.claim_creator(
        recorded=CLAIM_CONTROLLER,
        owner_references=claim["metadata"]["ownerReferences"],
        labels=claim["metadata"]["labels"],
        resolution=resolution,
        creator_labels=settings.TALLY_CREATED_BY_LABELS,
        controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
    )
    assert charged == "mallory"


def test_a_controller_drops_a_creator_it_copied_from_a_kind_tally_does_not_record(
    client: Client,
) -> None:
    """Argo makes a Pod from a Workflow anyone could have written: no creator it names is kept,
    in its metadata or its templates, on creation or by a later update."""
    pod = workload("v1", "Pod", "wf-step-1", {}, **{CREATED_BY: "alice"})
    owned_by(pod, "argoproj.io/v1alpha1", "Workflow", "wf")
    before = decisions("replaced")
    stored, warnings = admitted(client, pod, username=ARGO_IN_KUBEFLOW)
    assert creator_at(stored) is None
    assert warnings == [
        f"{CREATED_BY} was not kept: {ARGO_IN_KUBEFLOW} made this object for a kind Tally "
        "does not record (argoproj.io/Workflow), so it cannot vouch for the creator it copied"
    ]
    assert decisions("replaced") == before + 1
    # A Job (the Katib way, for a Trial): its pod template loses it too, so its Pods have none.
    job = workload(
        "batch/v1", "Job", "trial-1", {"template": pod_template(**{CREATED_BY: "alice"})}
    )
    job["metadata"]["annotations"] = {CREATED_BY: "alice", "other": "kept"}
    owned_by(job, "kubeflow.org/v1beta1", "Trial", "trial-1")
    stored, _ = admitted(client, job, username=ARGO_IN_KUBEFLOW)
    assert stored["metadata"]["annotations"] == {"other": "kept"}
    assert creator_at(stored, "spec", "template") is None
    # An update by it adds none; a creator recorded before stays.
    bare = owned_by(workload("v1", "Pod", "p", {}), "argoproj.io/v1alpha1", "Workflow", "wf")
    forged = json.loads(json.dumps(bare))
    forged["metadata"]["annotations"] = {CREATED_BY: "alice"}
    stored, _ = admitted(client, forged, operation="UPDATE", old=bare, username=ARGO_IN_KUBEFLOW)
    assert creator_at(stored) is None
    recorded = json.loads(json.dumps(bare))
    recorded["metadata"]["annotations"] = {CREATED_BY: "bob"}
    stored, _ = admitted(
        client, forged, operation="UPDATE", old=recorded, username=ARGO_IN_KUBEFLOW
    )
    assert creator_at(stored) == "bob"
    answer = send(
        client, review(recorded, operation="UPDATE", old=recorded, username=ARGO_IN_KUBEFLOW)
    )
    assert "patch" not in answer


def test_a_controller_vouches_for_nothing_on_what_no_object_owns(client: Client) -> None:
    pod = workload("v1", "Pod", "loose", {}, **{CREATED_BY: "alice"})
    stored, warnings = admitted(client, pod, username=REPLICASET_CONTROLLER)
    assert creator_at(stored) is None
    assert warnings and "made this object for no owner" in warnings[0]
    # With nothing to drop, nothing is said.
    answer = send(client, review(workload("v1", "Pod", "bare", {}), username=REPLICASET_CONTROLLER))
    assert "patch" not in answer and "warnings" not in answer


def test_what_a_controller_finds_again_by_its_template_is_left_as_made(
    client: Client, fake: FakeKube, api_client: Any
) -> None:
    """The Deployment controller finds its ReplicaSet by comparing pod templates, and the
    StatefulSet controller its revisions by their data: filling their templates would make
    it create another for ever. The creator is found on the ReplicaSet itself."""
    deployment = workload("apps/v1", "Deployment", "serve", {"template": pod_template()})
    deployment["metadata"].update(uid="uid-deployment-serve", annotations={CREATED_BY: "alice"})
    replica_set = made_by(
        deployment,
        from_template("ReplicaSet", "apps/v1", "serve-5d8f", {"metadata": {}}),
    )
    replica_set["metadata"]["annotations"] = {CREATED_BY: "alice"}  # copied from the Deployment
    replica_set["spec"] = {"template": pod_template()}
    answer = send(client, review(replica_set, username=DEPLOYMENT_CONTROLLER))
    assert "patch" not in answer and "warnings" not in answer
    statefulset = workload("apps/v1", "StatefulSet", "db", {"template": pod_template()})
    statefulset["metadata"].update(uid="uid-statefulset-db", annotations={CREATED_BY: "alice"})
    revision = made_by(statefulset, from_template("ControllerRevision", "apps/v1", "db-7f", {}))
    revision["metadata"]["annotations"] = {CREATED_BY: "alice"}
    revision["data"] = {"spec": {"template": pod_template()}}
    answer = send(client, review(revision, username=STATEFULSET_CONTROLLER))
    assert "patch" not in answer
    # The ReplicaSet controller's Pods carry no creator; the walk finds the ReplicaSet's.
    pod = made_by(replica_set, from_template("Pod", "v1", "serve-5d8f-a", pod_template()))
    fake.add(replica_set)
    fake.add(pod)
    assert resolve(api_client, claim_of(pod)).annotated_by == "alice"


def test_every_kind_the_built_in_controllers_make_pods_from_is_recorded(settings: Any) -> None:
    """A kind left out could be written by anyone, and the Pods made from it believed; and
    the owners whose annotation the walk reads must all be recorded."""
    pod_sources = {
        "Pod",
        "ReplicationController",
        "apps/ReplicaSet",
        "apps/DaemonSet",
        "apps/StatefulSet",
        "apps/ControllerRevision",
        "apps/Deployment",
        "batch/Job",
        "batch/CronJob",
    }
    assert pod_sources <= set(settings.TALLY_WORKLOAD_KINDS)
    read = {f"{group}/{kind}" if group else kind for group, kind in owners.FOLLOWED_KINDS}
    assert read <= set(settings.TALLY_WORKLOAD_KINDS)


# -- a controller's owner must exist (issue 40, finding 7) ------------------------------------

JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"
KUBEFLOW_EVIL = "system:serviceaccount:kubeflow:evil"


@pytest.fixture
def owners_read(api_client: Any) -> Iterator[None]:
    """The webhooks read the API server (the fake) with the real client, as in a cluster."""
    service.use_gang_lookup(kube_owners.GangReader(api_client, ttl_seconds=0))
    yield
    service.forget_caches()


def _job(name: str, creator: str | None) -> Obj:
    metadata: Obj = {"name": name, "namespace": NAMESPACE, "uid": f"uid-job-{name}"}
    if creator:
        metadata["annotations"] = {CREATED_BY: creator}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata}


def _pod_of(job: Obj, name: str, **annotations: str) -> Obj:
    return made_by(job, from_template("Pod", "v1", name, pod_template(**annotations)))


@pytest.mark.usefixtures("owners_read")
def test_a_controller_cannot_vouch_with_an_owner_that_does_not_exist(
    client: Client, fake: FakeKube
) -> None:
    """`system:serviceaccount:kubeflow:evil` made a Pod with a made-up Job owner and kept
    `tally.dev/created-by: victim`."""
    ghost = _job("ghost", "victim")  # never created
    pod, warnings = admitted(
        client, _pod_of(ghost, "ghost-a", **{CREATED_BY: "victim"}), username=KUBEFLOW_EVIL
    )
    assert creator_at(pod) is None
    assert any("its owner Job team-a/ghost does not exist" in w for w in warnings), warnings
    # A namesake of another uid is no owner either.
    fake.add({**_job("ghost", "victim"), "metadata": {**ghost["metadata"], "uid": "other"}})
    pod, warnings = admitted(
        client, _pod_of(ghost, "ghost-b", **{CREATED_BY: "victim"}), username=KUBEFLOW_EVIL
    )
    assert creator_at(pod) is None and warnings


@pytest.mark.usefixtures("owners_read")
def test_a_controller_carries_the_creator_its_owner_records(client: Client, fake: FakeKube) -> None:
    job = _job("train", "alice")
    fake.add(job)
    pod, warnings = admitted(
        client, _pod_of(job, "train-a", **{CREATED_BY: "alice"}), username=JOB_CONTROLLER
    )
    assert creator_at(pod) == "alice" and warnings == []
    # What the owner does not record is not the controller's to add: the owner's is written.
    pod, warnings = admitted(
        client, _pod_of(job, "train-b", **{CREATED_BY: "victim"}), username=KUBEFLOW_EVIL
    )
    assert creator_at(pod) == "alice"
    assert any("not 'victim'" in w for w in warnings), warnings
    # An owner made before Tally records nobody: neither does what it makes.
    before = _job("old", None)
    fake.add(before)
    pod, _ = admitted(
        client, _pod_of(before, "old-a", **{CREATED_BY: "victim"}), username=JOB_CONTROLLER
    )
    assert creator_at(pod) is None


@pytest.mark.usefixtures("owners_read")
def test_an_owner_that_cannot_be_read_vouches_for_nobody(client: Client, fake: FakeKube) -> None:
    job = _job("train", "alice")
    fake.add(job)
    fake.unavailable = True
    pod, warnings = admitted(
        client, _pod_of(job, "train-a", **{CREATED_BY: "alice"}), username=JOB_CONTROLLER
    )
    assert creator_at(pod) is None
    assert any("could not be read" in w for w in warnings), warnings


@pytest.mark.usefixtures("owners_read")
def test_a_controller_may_not_change_a_recorded_creator_by_an_update(
    client: Client, fake: FakeKube
) -> None:
    job = _job("train", "alice")
    fake.add(job)
    before = _pod_of(job, "train-a", **{CREATED_BY: "alice"})
    before["metadata"]["annotations"] = {CREATED_BY: "alice"}
    after = json.loads(json.dumps(before))
    after["metadata"]["annotations"][CREATED_BY] = "victim"
    pod, warnings = admitted(client, after, username=KUBEFLOW_EVIL, operation="UPDATE", old=before)
    assert creator_at(pod) == "alice" and warnings
