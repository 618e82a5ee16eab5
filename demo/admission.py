"""A claim the quota webhooks deny, for the demo's decision log: sent through the admission's
own services in this process, as the API server sends a CREATE (the mutating webhook, then the
validating one), so the decision and its message are the real ones.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db.models import Count

from inventory.models import Allocation
from inventory.simulate import API_VERSION, DRIVER, WORKLOADS
from quota.admission import service
from quota.admission.plans import Decision
from quota.models import AdmissionDecision
from teams.models import TeamNamespace

# The resource-claim controller creates the claims of Pods' templates; the demo has no API
# server to read a Pod's creator from at admission, so its denied claim is one a person of
# the namespace created directly (`kubectl create`), named on the decision as they are.
CREATOR = "system:serviceaccount:kube-system:resource-claim-controller"


def requester(namespace: str) -> str:
    """Who sends the demo's claim in `namespace`: the person who made most of its claims in
    the inventory, else the resource-claim controller."""
    made = (
        Allocation.objects.filter(claim__namespace=namespace)
        .exclude(username="")
        .values("username")
        .annotate(claims=Count("claim", distinct=True))
        .order_by("-claims", "username")
        .first()
    )
    return str(made["username"]) if made else CREATOR


def mig_slices(namespace: str) -> dict[str, Any]:
    """One A100 split four ways (3g.40gb, 2g.20gb and two 1g.10gb of one GPU): one GPU."""
    requests = [
        _request(name, "mig.nvidia.com", f"device.attributes['{DRIVER}'].profile == '{profile}'")
        for name, profile in (
            ("large", "3g.40gb"),
            ("medium", "2g.20gb"),
            ("small-0", "1g.10gb"),
            ("small-1", "1g.10gb"),
        )
    ]
    constraint = {"requests": [], "matchAttribute": f"{DRIVER}/parentUUID"}
    return _claim(namespace, "mig-slices", requests, constraints=[constraint])


def eight_h100(namespace: str) -> dict[str, Any]:
    """Eight H100s for one training job."""
    selector = f"device.attributes['{DRIVER}'].productName == 'NVIDIA H100 80GB HBM3'"
    return _claim(namespace, "eight-h100", [_request("gpus", "gpu.nvidia.com", selector, 8)])


# Tried in this order, each on every team, until the quota denies one.
CANDIDATES: tuple[Callable[[str], dict[str, Any]], ...] = (mig_slices, eight_h100)


def deny_a_claim(*, at: datetime) -> AdmissionDecision | None:
    """Send the first candidate claim that a team's quota denies (tried as a dry run first,
    which records nothing) as a real CREATE; the decision recorded, or None when the quota
    allows every candidate (another fleet than the demo's)."""
    service.forget_caches()  # the fleet was imported in this process
    namespaces = TeamNamespace.objects.order_by("team__slug", "namespace")
    for make in CANDIDATES:
        for namespace in namespaces.values_list("namespace", flat=True):
            claim = make(namespace)
            username = requester(namespace)
            if _create(claim, username=username, at=at, dry_run=True).allowed:
                continue
            uid = str(uuid.uuid4())
            decided = _create(claim, username=username, at=at, dry_run=False, uid=uid)
            assert not decided.allowed, decided
            return AdmissionDecision.objects.filter(uid=uid).first()
    return None


def _create(
    claim: dict[str, Any], *, username: str, at: datetime, dry_run: bool, uid: str = ""
) -> Decision:
    """What the webhooks answer to a CREATE of `claim`: the mutating one first; the validating
    one only after it allowed (each records its own decisions unless `dry_run`)."""
    answer = service.fit_alternatives(
        claim=claim, username=username, dry_run=dry_run, admission_uid=uid, at=at
    )
    if not answer.allowed:
        return answer
    return service.review_claim(
        claim=claim, username=username, dry_run=dry_run, admission_uid=uid, at=at
    )


def _request(name: str, device_class: str, selector: str, count: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "exactly": {
            "deviceClassName": device_class,
            "allocationMode": "ExactCount",
            "count": count,
            "selectors": [{"cel": {"expression": selector}}],
        },
    }


def _claim(
    namespace: str,
    name: str,
    requests: list[dict[str, Any]],
    *,
    constraints: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    workload = WORKLOADS.get(namespace, ("job",))[0]
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceClaim",
        "metadata": {
            "name": f"{workload}-{name}",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": workload},
        },
        "spec": {"devices": devices},
    }
