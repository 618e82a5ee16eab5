"""A small fleet and a team with rules, for webhook tests."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml
from django.test import Client

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota.admission.shapes import forget_fleet_shapes
from quota.models import QuotaRule
from teams.models import Team, TeamNamespace
from tests.fixtures import DRA

AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
NAMESPACES = [
    "gpu-test1",
    "gpu-test4",
    "gpu-test6",
    "gpu-share-memory",
    "cel-selector",
    "admin-access",
    "prioritized-alternatives",
    "default",
    "research",
]


def nvidia_gpu(index: int, node: str, product: str, memory: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": f"gpu-{index}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-{node}-{index}"},
            "productName": {"string": product},
            "driverVersion": {"version": "580.82.7"},
            "cudaDriverVersion": {"version": "13.0.0"},
        },
        "capacity": {"memory": {"value": memory}},
        **extra,
    }


def mig_device(name: str, parent: str, profile: str, memory: str, sms: int) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "type": {"string": "mig"},
            "uuid": {"string": f"MIG-{name}"},
            "parentUUID": {"string": parent},
            "profile": {"string": profile},
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
        },
        "capacity": {"memory": {"value": memory}, "multiprocessors": {"value": str(sms)}},
    }


def nvidia_slice(node: str, devices: list[dict[str, Any]], driver: str = "gpu.nvidia.com") -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def fleet_objects() -> list[dict[str, Any]]:
    """H100s (shareable), A100s, one A100 split into MIG devices, and the example driver."""
    example = list(iter_objects(DRA / "example-driver-slices.yaml"))
    classes = [
        *iter_objects(DRA / "deviceclasses-nvidia.yaml"),
        *iter_objects(DRA / "deviceclass-example.yaml"),
    ]
    h100 = [
        nvidia_gpu(i, "h100-a", "NVIDIA H100 80GB HBM3", "80Gi", allowMultipleAllocations=True)
        for i in range(4)
    ]
    a100 = [nvidia_gpu(i, "a100-a", "NVIDIA A100-SXM4-80GB", "80Gi") for i in range(2)]
    migs = [
        mig_device("gpu-0-mig-1g5gb-19-0", "GPU-mig-0", "1g.5gb", "4864Mi", 14),
        mig_device("gpu-0-mig-1g5gb-19-1", "GPU-mig-0", "1g.5gb", "4864Mi", 14),
        mig_device("gpu-0-mig-2g10gb-14-2", "GPU-mig-0", "2g.10gb", "9856Mi", 28),
        mig_device("gpu-0-mig-3g20gb-9-4", "GPU-mig-0", "3g.20gb", "19968Mi", 42),
    ]
    return [
        *classes,
        *example,
        nvidia_slice("h100-a", h100),
        nvidia_slice("a100-a", a100),
        nvidia_slice("mig-a", migs),
    ]


@pytest.fixture
def fleet() -> None:
    """The objects of `fleet_objects`, imported."""
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"), objects=fleet_objects(), at=AT
    )
    assert report.errors == []


def make_team(rules: list[dict[str, Any]], slug: str = "research") -> Team:
    team = Team.objects.create(slug=slug, name=slug.title())
    for namespace in NAMESPACES if slug == "research" else [slug]:
        TeamNamespace.objects.create(team=team, namespace=namespace)
    for rule in rules:
        QuotaRule.objects.create(
            team=team,
            **{"mode": "enforce", "unit": "gpus", **rule, "limit": Decimal(str(rule["limit"]))},
        )
    return team


def claim(
    name: str,
    requests: list[dict[str, Any]],
    namespace: str = "research",
    api_version: str = "resource.k8s.io/v1",
) -> dict[str, Any]:
    return {
        "apiVersion": api_version,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": requests}},
    }


def gpu_request(count: int = 1, device_class_name: str = "gpu.nvidia.com", **more: Any) -> dict:
    return {
        "name": "gpu",
        "exactly": {"deviceClassName": device_class_name, "count": count, **more},
    }


def review(
    obj: dict[str, Any] | None,
    *,
    uid: str | None = None,
    dry_run: bool = False,
    username: str = "alice",
    operation: str = "CREATE",
) -> dict[str, Any]:
    metadata = (obj or {}).get("metadata") or {}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "requestKind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "name": metadata.get("name", ""),
            "namespace": metadata.get("namespace", "default"),
            "operation": operation,
            "userInfo": {"username": username, "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": dry_run,
        },
    }


def post(client: Client, body: Any, path: str = "/admission/resourceclaims") -> Any:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = client.post(path, data=data, content_type="application/json")
    return response


def decide(client: Client, obj: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    response = post(client, review(obj, **kwargs))
    assert response.status_code == 200, response.content
    body: dict[str, Any] = response.json()["response"]
    return body


def admit(client: Client, obj: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """The answer to `obj` as the API server gets it with both webhooks: the mutating one's
    (when it denies), else the validating one's for the claim with its patch applied."""
    mutation = post(client, review(obj, **kwargs), "/admission/resourceclaims/mutate")
    assert mutation.status_code == 200, mutation.content
    answer: dict[str, Any] = mutation.json()["response"]
    if not answer["allowed"]:
        return answer
    if "patch" in answer:
        patch = json.loads(base64.b64decode(answer["patch"]))
        obj = jsonpatch.apply_patch(obj, patch)
    return decide(client, obj, **kwargs)


def load_yaml_objects(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
