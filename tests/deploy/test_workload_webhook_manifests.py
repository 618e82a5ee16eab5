"""The workload webhook's configuration (deploy/base/webhooks.yaml, `tally-workloads`), as
rendered by each overlay: valid for Kubernetes 1.34, failing open, reaching its view through
the webhook port that only the API server's certificate may call, and sent exactly the kinds
that `TALLY_WORKLOAD_KINDS` names by default.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from django.conf import settings
from django.http import HttpResponse
from django.test import RequestFactory
from django.urls import resolve

from config.webhook_auth import WebhookCallerMiddleware
from core.logging import ADMISSION_PREFIX
from quota.workloads import TEMPLATE_ANNOTATIONS
from tests.deploy.test_manifests import (
    KUBERNETES_VERSION,
    OVERLAYS,
    SYSTEM_NAMESPACES,
    Obj,
    find,
    listeners,
    network_policy_ports,
    render,
    service_dns_names,
    service_target,
    web_container,
)

# The resource each default kind is served as (what a rule names), by "group/Kind".
RESOURCES = {
    "Pod": ("", "pods"),
    "ReplicationController": ("", "replicationcontrollers"),
    "apps/Deployment": ("apps", "deployments"),
    "apps/StatefulSet": ("apps", "statefulsets"),
    "apps/ReplicaSet": ("apps", "replicasets"),
    "apps/DaemonSet": ("apps", "daemonsets"),
    "apps/ControllerRevision": ("apps", "controllerrevisions"),
    "batch/Job": ("batch", "jobs"),
    "batch/CronJob": ("batch", "cronjobs"),
    "jobset.x-k8s.io/JobSet": ("jobset.x-k8s.io", "jobsets"),
    "leaderworkerset.x-k8s.io/LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    "kubeflow.org/PyTorchJob": ("kubeflow.org", "pytorchjobs"),
    "kubeflow.org/TFJob": ("kubeflow.org", "tfjobs"),
    "kubeflow.org/MPIJob": ("kubeflow.org", "mpijobs"),
    "trainer.kubeflow.org/TrainJob": ("trainer.kubeflow.org", "trainjobs"),
    "ray.io/RayJob": ("ray.io", "rayjobs"),
    "ray.io/RayCluster": ("ray.io", "rayclusters"),
}


@pytest.fixture(params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> tuple[Obj, ...]:
    return render(request.param)


def _webhook(objects: tuple[Obj, ...]) -> tuple[Obj, Obj]:
    configuration = find(objects, "MutatingWebhookConfiguration", "tally-workloads")
    (webhook,) = configuration["webhooks"]
    return configuration, webhook


def test_it_is_valid_for_kubernetes_1_34(objects: tuple[Obj, ...]) -> None:
    configuration, _ = _webhook(objects)
    try:
        kubernetes_validate.validate(configuration, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"tally-workloads: {exc.message} at {exc.path}")


def test_it_fails_open_quickly_and_writes_nothing_else(objects: tuple[Obj, ...]) -> None:
    _, webhook = _webhook(objects)
    assert webhook["failurePolicy"] == "Ignore"
    assert webhook["sideEffects"] == "None"
    assert webhook["reinvocationPolicy"] == "Never"
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["matchPolicy"] == "Equivalent"
    # Small: every Pod's creation may wait on it.
    assert 1 <= webhook["timeoutSeconds"] <= 3


def test_it_is_sent_exactly_the_default_kinds_on_create_and_update(
    objects: tuple[Obj, ...],
) -> None:
    _, webhook = _webhook(objects)
    sent = set()
    for rule in webhook["rules"]:
        assert rule["operations"] == ["CREATE", "UPDATE"]
        assert rule["apiVersions"] == ["*"]
        assert rule["scope"] == "Namespaced"
        # Subresources (pods/status, deployments/scale) are not workloads being made.
        assert not any("/" in resource for resource in rule["resources"])
        sent |= {(group, r) for group in rule["apiGroups"] for r in rule["resources"]}
    assert sent == {RESOURCES[kind] for kind in settings.TALLY_WORKLOAD_KINDS}
    # And the decision knows where each of them keeps its templates.
    assert set(settings.TALLY_WORKLOAD_KINDS) <= set(TEMPLATE_ANNOTATIONS)


def test_it_skips_the_system_namespaces_as_the_quota_webhooks_do(
    objects: tuple[Obj, ...],
) -> None:
    configuration, webhook = _webhook(objects)
    namespace = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    namespace = namespace.split("/")[0]
    quota = find(objects, "MutatingWebhookConfiguration", "tally-quota")["webhooks"][0]
    assert webhook["matchConditions"] == quota["matchConditions"]
    (condition,) = webhook["matchConditions"]
    for skipped in [*SYSTEM_NAMESPACES, namespace]:
        assert f"'{skipped}'" in condition["expression"]
    # A namespace can be left out by a label, and only one saying so.
    (expression,) = webhook["namespaceSelector"]["matchExpressions"]
    assert expression == {"key": "tally.dev/attribution", "operator": "NotIn", "values": ["off"]}
    assert "objectSelector" not in webhook


def test_it_reaches_its_view_on_the_port_only_the_api_server_may_call(
    objects: tuple[Obj, ...],
) -> None:
    configuration, webhook = _webhook(objects)
    namespace, certificate_name = configuration["metadata"]["annotations"][
        "cert-manager.io/inject-ca-from"
    ].split("/")
    certificate = find(objects, "Certificate", certificate_name)
    assert certificate["metadata"]["namespace"] == namespace
    reference = webhook["clientConfig"]["service"]
    service = find(objects, "Service", reference["name"])
    assert service["metadata"]["namespace"] == reference["namespace"] == namespace
    assert resolve(reference["path"]).url_name == "admission-workloads"
    target = service_target(objects, service, reference.get("port", 443))
    assert any(reference["path"].startswith(p) for p in listeners(web_container(objects))[target])
    peers = network_policy_ports(objects)[target]
    assert peers and all("ipBlock" in peer for peer in peers)
    assert service_dns_names(service) <= set(certificate["spec"]["dnsNames"])


def test_the_client_certificate_check_guards_its_path(settings: Any) -> None:
    """`config.webhook_auth` guards every path under /admission/: this one too."""
    path = "/admission/workloads/mutate"
    assert path.startswith(ADMISSION_PREFIX)
    settings.TALLY_WEBHOOK_CLIENT_CA_FILE = "/etc/tally/webhook-ca.crt"
    settings.TALLY_WEBHOOK_CLIENT_NAMES = ["kube-apiserver"]
    guarded = WebhookCallerMiddleware(lambda request: HttpResponse("decided"))
    refused = guarded(RequestFactory().post(path, b"{}", content_type="application/json"))
    assert refused.status_code == 403
    assert b"no client certificate" in refused.content
