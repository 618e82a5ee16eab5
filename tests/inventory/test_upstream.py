"""The upstream corpus: the drivers' and Kubernetes' own DRA files, loaded, admitted, selected.

The files are read in place from `../shared/upstream/` (see its SOURCES.md for what each
shows), an extra corpus beside the repository that `.ci/run` requires: without it these tests
are skipped, unless TALLY_UPSTREAM_TESTS=required, which makes them fail. Everything else
tests against the project's own fixtures (`tests/fixtures/dra/`).
"""

from __future__ import annotations

import copy
import json
import os
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import Client

from inventory import dra, services
from inventory.dumps import iter_objects
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    Pool,
    ResourceClaim,
    ResourceSlice,
)
from quota.cel import CELError, compile_selector
from quota.management.commands.review_claims import CLAIM_KINDS, OBJECT_FILES
from quota.models import AdmissionDecision, QuotaRule, Reservation
from tests.conftest import REPO
from tests.fixtures import DRA
from tests.quota.fixtures import make_team, post, review
from tests.quota.test_admission import RULES, claim_to_admit
from tests.quota.test_cel import Device as DeviceView
from tests.quota.test_cel import matching, normalized, selector_expressions
from tests.quota.test_review_claims import review_claims

pytestmark = pytest.mark.django_db
UPSTREAM = REPO.parent / "shared" / "upstream"
REFERENCE_ATTRIBUTES = (
    "dra-driver-nvidia-gpu/site/content/docs/reference/resourceslice-attributes.devices.yaml"
)
EXAMPLE_SLICES = "dra-example-driver/README.resourceslice-list.yaml"
AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="session")
def upstream() -> Path:
    """`../shared/upstream`, or a skip (a failure with TALLY_UPSTREAM_TESTS=required)."""
    if not UPSTREAM.is_dir():
        reason = f"{UPSTREAM} is missing: the upstream corpus tests read the drivers' own files"
        if os.environ.get("TALLY_UPSTREAM_TESTS") == "required":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return UPSTREAM


def load(path: Path, cluster: str = "up") -> services.SyncReport:
    return services.import_snapshot(
        cluster=services.get_cluster(cluster), objects=iter_objects(path), at=AT
    )


def physical_gpus(**filters: Any) -> int:
    return (
        Device.objects.filter(gone_at__isnull=True, **filters)
        .exclude(kind="other")
        .values("physical_gpu_key")
        .distinct()
        .count()
    )


def test_example_driver_kubectl_list(upstream: Path) -> None:
    report = load(upstream / "dra-example-driver/README.resourceslice-list.yaml")
    assert report.errors == []
    devices = Device.objects.order_by("name")
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert {d.kind for d in devices} == {"gpu"}
    assert physical_gpus() == 8
    first = devices[0]
    assert first.product_name == "LATEST-GPU-MODEL"  # the example driver's `model`
    assert first.memory_bytes == 80 * 2**30
    assert first.driver_version == "1.0.0"
    assert first.attributes["index"] == {"int": 0}
    assert first.node is not None and first.node.name == "dra-example-driver-cluster-worker"
    stored = ResourceSlice.objects.get()
    raw = next(iter_objects(upstream / "dra-example-driver/README.resourceslice-list.yaml"))
    assert stored.spec == raw["spec"]
    assert stored.uid == raw["metadata"]["uid"]


def test_nvidia_reference_attributes_gpu_mig_and_vfio_count_one_gpu(upstream: Path) -> None:
    entries = yaml.safe_load((upstream / REFERENCE_ATTRIBUTES).read_text())
    gpu, mig, vfio = entries
    # The GPU driver publishes the GPU and its MIG devices; the VFIO device comes from a
    # separate pool when the GPU is bound to vfio-pci. All three are one physical GPU.
    objects = [
        _slice("node-a-gpus", "node-a", [gpu, mig]),
        _slice("node-a-vfio", "node-a-vfio", [vfio], node="node-a"),
    ]
    report = services.import_snapshot(cluster=services.get_cluster("up"), objects=objects, at=AT)
    assert report.errors == []
    assert physical_gpus() == 1
    mig_row = Device.objects.get(kind="mig")
    assert mig_row.profile == "1g.5gb"
    assert mig_row.parent_uuid == "GPU-2fa81118-5a5f-aa66-7660-471eed407181"
    assert mig_row.gpu_share == Decimal("0.142857")  # one of an A100's seven compute slices
    assert mig_row.memory_bytes == 4864 * 2**20
    whole = Device.objects.get(kind="gpu", device_type="gpu")
    assert whole.driver_version == "580.126.20"
    assert whole.cuda_driver_version == "13.0.0"
    assert whole.cuda_compute_capability == "8.0.0"
    assert whole.architecture == "Ampere"
    assert whole.attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:65:00.0"}
    passthrough = Device.objects.get(device_type="vfio")
    assert passthrough.memory_bytes == 40 * 2**30  # `addressableMemory` on VFIO devices
    assert passthrough.physical_gpu_key == whole.physical_gpu_key == mig_row.physical_gpu_key


def _slice(
    name: str, pool: str, devices: list[dict[str, Any]], *, node: str | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node or pool,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def test_partitionable_split_layout_counts_once_when_both_slices_seen(
    upstream: Path, settings: Any
) -> None:
    settings.TALLY_GPU_DRIVERS = frozenset({"resource-driver.example.com"})
    path = upstream / (
        "enhancements/keps/sig-scheduling/4815-dra-partitionable-devices/"
        "README.counter-slice-example.yaml"
    )
    counter_slice, device_slice = list(iter_objects(path))
    cluster = services.get_cluster("up")
    # The device slice alone is one of two: the pool is incomplete and counts nothing yet.
    services.import_snapshot(cluster=cluster, objects=[device_slice], at=AT)
    assert Device.objects.count() == 0
    pool = Pool.objects.get()
    assert (pool.slices_seen, pool.slices_expected, pool.counted_generation) == (1, 2, None)

    report = load(path)
    assert report.errors == []
    assert Device.objects.count() == 5
    assert physical_gpus() == 1
    assert Device.objects.get(name="gpu-0").kind == "gpu"
    partitions = Device.objects.filter(kind="partition")
    assert partitions.count() == 4
    assert {p.gpu_share for p in partitions} == {Decimal("0.25")}  # 10Gi of a 40Gi counter set
    assert counter_slice["spec"]["sharedCounters"][0]["name"] == "gpu-0-counter-set"


def test_legacy_v1alpha3_imex_channels_are_kept_but_are_not_gpus(upstream: Path) -> None:
    report = load(
        upstream / "k8s-dra-driver-gpu/demo/clusters/kind/scripts/imex-resourceslice.yaml"
    )
    assert report.errors == []
    assert Device.objects.count() == 20
    assert set(Device.objects.values_list("kind", flat=True)) == {"other"}
    assert physical_gpus() == 0
    channel = Device.objects.get(pool__endswith="-1", name="imex-channel-3")
    assert channel.attributes["channel"] == {"int": 3}
    assert channel.node is None  # a multi-node pool selected by node labels
    assert "nodeSelector" in ResourceSlice.objects.filter(pool=channel.pool).get().spec


def test_v1_slice_round_trip_keeps_every_field(upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceSlice.yaml"
    (raw,) = list(iter_objects(path))
    assert load(path).errors == []
    stored = ResourceSlice.objects.get()
    assert stored.spec == raw["spec"]
    # One slice of the three its pool declares: stored, but nothing counted.
    assert Device.objects.count() == 0

    complete = copy.deepcopy(raw)
    complete["spec"]["pool"]["resourceSliceCount"] = 1
    services.import_snapshot(cluster=services.get_cluster("up"), objects=[complete], at=AT)
    device = Device.objects.get()
    raw_device = raw["spec"]["devices"][0]
    assert device.attributes == raw_device["attributes"]
    assert device.capacity == raw_device["capacity"]
    assert device.extra == {
        key: value
        for key, value in raw_device.items()
        if key not in ("name", "attributes", "capacity")
    }
    assert device.node is not None and device.node.name == "nodeNameValue"


def test_v1_claim_round_trip_and_admin_access_is_not_an_allocation(upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceClaim.yaml"
    (raw,) = list(iter_objects(path))
    assert load(path).errors == []
    claim = ResourceClaim.objects.get()
    assert (claim.spec, claim.status) == (raw["spec"], raw["status"])
    assert claim.owner_references == raw["metadata"]["ownerReferences"]
    assert Allocation.objects.count() == 0  # the only result has adminAccess: true

    held = copy.deepcopy(raw)
    held["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = False
    # A cluster known since before the claim's allocation (2005): its start is the claim's own
    # allocationTimestamp, not moved to a first sync after it (issue 33).
    cluster = services.get_cluster("up")
    Cluster.objects.filter(pk=cluster.pk).update(first_synced_at=datetime(2000, 1, 1, tzinfo=UTC))
    cluster.refresh_from_db()
    services.import_snapshot(cluster=cluster, objects=[held], at=AT)
    allocation = Allocation.objects.get()
    assert (allocation.driver, allocation.pool, allocation.device_name) == (
        "driverValue",
        "poolValue",
        "deviceValue",
    )
    assert allocation.share_id == "shareIDValue"
    assert allocation.start == datetime(2005, 1, 1, 1, 1, 1, tzinfo=UTC)  # allocationTimestamp


def test_v1beta1_claim_flat_layout(upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/resource.k8s.io.v1beta1.ResourceClaim.yaml"
    assert load(path).errors == []
    claim = ResourceClaim.objects.get()
    (request,) = dra.parse_claim_requests(claim.spec, claim.api_version)
    assert request.first_available  # v1beta1 keeps firstAvailable beside the flat fields
    assert request.first_available[0].device_class_name == "deviceClassNameValue"
    assert request.first_available[0].capacity_requests == {"requestsKey": "0"}


def test_device_class(upstream: Path) -> None:
    assert (
        load(upstream / "website/content/en/examples/dra/driver-install/deviceclass.yaml").errors
        == []
    )
    device_class = DeviceClass.objects.get()
    assert device_class.name == "gpu.example.com"
    assert device_class.selectors == ["device.driver == 'gpu.example.com'"]


def test_standalone_claim_without_namespace(upstream: Path) -> None:
    assert load(upstream / "dra-driver-nvidia-gpu/tests/bats/specs/rc-shared-gpu.yaml").errors == []
    claim = ResourceClaim.objects.get()
    assert claim.namespace == "default"
    (request,) = dra.parse_claim_requests(claim.spec, claim.api_version)
    assert (request.device_class_name, request.count) == ("gpu.nvidia.com", 1)


def test_malformed_upstream_claim_names_object_and_field(upstream: Path) -> None:
    report = load(upstream / "website/content/en/examples/dra/resourceclaim.yaml")
    assert report.errors == [
        "ResourceClaim example-resource-claim: "
        "spec.devices.requests[0].exactly.selectors[0].cel: is missing"
    ]
    assert ResourceClaim.objects.count() == 0


def test_scheduler_generated_claim_for_an_extended_resource(upstream: Path) -> None:
    """gpu-full.yaml shows, commented out, the claim the scheduler makes for `nvidia.com/gpu`."""
    text = upstream / "dra-driver-nvidia-gpu/demo/specs/extended-resources/gpu-full.yaml"
    lines = text.read_text().splitlines()
    start = lines.index("# apiVersion: resource.k8s.io/v1")
    end = next(i for i in range(start, len(lines)) if lines[i].strip() == "#")
    generated = yaml.safe_load("\n".join(line[2:] for line in lines[start:end]))
    report = services.import_snapshot(
        cluster=services.get_cluster("up"), objects=[generated], at=AT
    )
    assert report.errors == []
    claim = ResourceClaim.objects.get()
    assert claim.annotations == {"resource.kubernetes.io/extended-resource-claim": "true"}
    assert claim.owner_references[0]["kind"] == "Pod"
    allocation = Allocation.objects.get()
    assert (allocation.pool, allocation.device_name, allocation.start) == (
        "worker-node-1",
        "gpu-0",
        AT,
    )
    assert allocation.device is None  # its slice has not been seen


TEMPLATE_FILES = {
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test1.yaml": ["gpu.nvidia.com"],
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test4.yaml": ["mig.nvidia.com"] * 4,
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1beta1/gpu-test4.yaml": ["mig.nvidia.com"] * 4,
    "dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test6.yaml": ["gpu.nvidia.com"],
    "dra-driver-nvidia-gpu/demo/specs/fabric-manager-partitioning/resourceClaimTemplates.yaml": [
        "vfio.gpu.nvidia.com"
    ],
    "dra-driver-nvidia-gpu/tests/bats/specs/gpu-simple-mig.yaml": ["mig.nvidia.com"],
    "dra-driver-nvidia-gpu/demo/specs/consumable-shares/memory-sharing.yaml": ["gpu.nvidia.com"],
    "dra-example-driver/demo/examples/admin-access/admin-access.yaml": ["gpu.example.com"],
    "dra-example-driver/demo/examples/cel-selector/cel-selector.yaml": ["gpu.example.com"],
    "dra-example-driver/demo/examples/prioritized-alternatives/prioritized-alternatives.yaml": [
        "",
        "",
    ],
    "kubernetes/test/e2e/dra/test-driver/deploy/example/pod-inline-multiple.yaml": ["example"],
    "website/content/en/examples/dra/resourceclaimtemplate.yaml": ["example-device-class"],
}


@pytest.mark.parametrize("relative", sorted(TEMPLATE_FILES))
def test_claim_templates_are_skipped_by_the_inventory_but_readable(
    upstream: Path, relative: str
) -> None:
    report = load(upstream / relative)
    assert report.errors == []
    assert report.skipped["ResourceClaimTemplate"] >= 1
    assert ResourceClaim.objects.count() == 0
    classes = []
    for obj in iter_objects(upstream / relative):
        if obj.get("kind") == "ResourceClaimTemplate":
            requests = dra.parse_claim_requests(obj["spec"]["spec"], obj["apiVersion"])
            classes += [request.device_class_name for request in requests]
    assert classes == TEMPLATE_FILES[relative]


def test_every_upstream_dra_file_is_covered(upstream: Path) -> None:
    covered = set(TEMPLATE_FILES) | {
        "dra-example-driver/README.resourceslice-list.yaml",
        "dra-driver-nvidia-gpu/site/content/docs/reference/resourceslice-attributes.devices.yaml",
        "enhancements/keps/sig-scheduling/4815-dra-partitionable-devices/README.counter-slice-example.yaml",
        "k8s-dra-driver-gpu/demo/clusters/kind/scripts/imex-resourceslice.yaml",
        "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceSlice.yaml",
        "kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceClaim.yaml",
        "kubernetes-api/testdata/HEAD/resource.k8s.io.v1beta1.ResourceClaim.yaml",
        "website/content/en/examples/dra/driver-install/deviceclass.yaml",
        "dra-driver-nvidia-gpu/tests/bats/specs/rc-shared-gpu.yaml",
        "website/content/en/examples/dra/resourceclaim.yaml",
        "dra-driver-nvidia-gpu/demo/specs/extended-resources/gpu-full.yaml",
    }
    dra_files = {
        str(path.relative_to(upstream))
        for path in upstream.rglob("*.yaml")
        if any(
            f"kind: {kind}" in path.read_text()
            for kind in ("ResourceSlice", "DeviceClass", "ResourceClaim")
        )
        or "attributes" in path.read_text()
    }
    assert dra_files <= covered, sorted(dra_files - covered)


# --- the webhook's decisions --------------------------------------------------------------

# Every ResourceClaim and ResourceClaimTemplate upstream, with the decision for a team whose
# rules are tests.quota.test_admission.RULES and which holds nothing yet (each sent as a dry
# run, so each stands alone): "" admits, else a part of the denial's message.
UPSTREAM_CLAIMS = {
    ("dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test1.yaml", "single-gpu"): "",
    ("dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test4.yaml", "mig-devices"): "",
    ("dra-driver-nvidia-gpu/demo/specs/quickstart/v1beta1/gpu-test4.yaml", "mig-devices"): "",
    ("dra-driver-nvidia-gpu/demo/specs/quickstart/v1/gpu-test6.yaml", "a100"): "",
    ("dra-driver-nvidia-gpu/demo/specs/consumable-shares/memory-sharing.yaml", "gpu-4gi"): "",
    ("dra-driver-nvidia-gpu/tests/bats/specs/gpu-simple-mig.yaml", "rct-mig1g"): "",
    ("dra-driver-nvidia-gpu/tests/bats/specs/rc-shared-gpu.yaml", "rc-shared-gpu"): "",
    (
        "dra-driver-nvidia-gpu/demo/specs/fabric-manager-partitioning/resourceClaimTemplates.yaml",
        "fm-partition-2gpu",
    ): (
        # No vfio device in the fleet: two whole GPUs on every rule of the NVIDIA driver, the
        # H100 rule first (issue 36, finding 3).
        'quota rule "h100" (enforce) would be exceeded: '
        "0 GPUs in use, 2 GPUs requested, limit 1 GPU"
    ),
    ("dra-example-driver/demo/examples/cel-selector/cel-selector.yaml", "single-gpu-cel"): "",
    ("dra-example-driver/demo/examples/admin-access/admin-access.yaml", "multiple-gpus-admin"): "",
    (
        "dra-example-driver/demo/examples/prioritized-alternatives/prioritized-alternatives.yaml",
        "prioritized-gpu",
    ): "",
    (
        "dra-example-driver/demo/examples/prioritized-alternatives/prioritized-alternatives.yaml",
        "preferred-gpu",
    ): "",
    # A class the inventory does not know: which rules its devices fall under cannot be told,
    # so the team's enforce rules deny it (issue 36, finding 3).
    (
        "kubernetes/test/e2e/dra/test-driver/deploy/example/pod-inline-multiple.yaml",
        "pause-template",
    ): 'matches class "example", which the inventory does not know',
    # A class the inventory does not know: which rules its devices fall under cannot be told,
    # so the team's enforce rules deny it (issue 36, finding 3).
    (
        "website/content/en/examples/dra/resourceclaimtemplate.yaml",
        "example-resource-claim-template",
    ): 'matches class "example-device-class", which the inventory does not know',
    ("website/content/en/examples/dra/resourceclaim.yaml", "example-resource-claim"): (
        "cannot read the claim: spec.devices.requests[0].exactly.selectors[0].cel: is missing"
    ),
    # The API round-trip fixtures: their selector is the placeholder `expressionValue`, which
    # the API server's validation refuses too (an undeclared reference).
    ("kubernetes-api/testdata/HEAD/resource.k8s.io.v1.ResourceClaim.yaml", "nameValue"): (
        "undeclared reference 'expressionValue'"
    ),
    ("kubernetes-api/testdata/HEAD/resource.k8s.io.v1beta1.ResourceClaim.yaml", "nameValue"): (
        "undeclared reference 'expressionValue'"
    ),
}


@pytest.mark.usefixtures("fleet")
@pytest.mark.parametrize(("relative", "name"), sorted(UPSTREAM_CLAIMS))
def test_upstream_claims(client: Client, upstream: Path, relative: str, name: str) -> None:
    make_team(RULES)
    expected_denial = UPSTREAM_CLAIMS[(relative, name)]
    claim = claim_to_admit(upstream / relative, name)
    if claim["metadata"].get("namespace") == "namespaceValue":  # the API round-trip fixtures
        claim["metadata"]["namespace"] = "research"
    response = post(client, review(claim, dry_run=True, uid="uid-1"))
    assert response.status_code == 200
    decision = response.json()["response"]
    assert decision["uid"] == "uid-1"
    assert decision["allowed"] is (not expected_denial), decision
    if expected_denial:
        assert expected_denial in decision["status"]["message"]
        assert decision["status"]["code"] == 403
    assert Reservation.objects.count() == 0  # dry run


def test_every_upstream_claim_is_in_the_list(upstream: Path) -> None:
    """UPSTREAM_CLAIMS cannot go stale: a claim or template added upstream (or renamed, or
    moved) fails here until it is listed with its expected decision."""
    found = {
        (path.relative_to(upstream).as_posix(), obj["metadata"]["name"])
        for path in sorted(upstream.rglob("*"))
        if path.suffix in OBJECT_FILES and path.is_file()
        for obj in iter_objects(path)
        if obj.get("kind") in CLAIM_KINDS
    }
    assert sorted(found - UPSTREAM_CLAIMS.keys()) == [], "upstream claims missing from the list"
    assert sorted(UPSTREAM_CLAIMS.keys() - found) == [], "listed claims no longer upstream"


@pytest.mark.usefixtures("fleet")
def test_review_claims_gives_the_upstream_claims_the_webhooks_decisions(upstream: Path) -> None:
    make_team(RULES)
    lines, summary, errors = review_claims(str(upstream), "--namespace", "research")
    decisions = {
        (Path(line["file"]).relative_to(upstream).as_posix(), line["name"]): line for line in lines
    }
    assert decisions.keys() == UPSTREAM_CLAIMS.keys()
    for key, expected_denial in UPSTREAM_CLAIMS.items():
        line = decisions[key]
        assert line["namespace"] == "research"
        assert line["decision"] == ("DENIED" if expected_denial else "ALLOWED"), line
        assert expected_denial in line["message"]
    template_key = (
        "website/content/en/examples/dra/resourceclaimtemplate.yaml",
        "example-resource-claim-template",
    )
    claim_key = ("website/content/en/examples/dra/resourceclaim.yaml", "example-resource-claim")
    assert decisions[template_key]["template"] and not decisions[claim_key]["template"]
    denied = sum(bool(denial) for denial in UPSTREAM_CLAIMS.values())
    assert summary == (
        f"{len(UPSTREAM_CLAIMS)} claims: {len(UPSTREAM_CLAIMS) - denied} allowed, "
        f"{denied} denied (dry run, nothing reserved)"
    )
    assert errors == ""
    assert not Reservation.objects.exists() and not AdmissionDecision.objects.exists()
    assert not QuotaRule.objects.exclude(in_use=0).exists()


@pytest.mark.usefixtures("fleet")
def test_the_api_round_trip_admission_review_is_answered(client: Client, upstream: Path) -> None:
    path = upstream / "kubernetes-api/testdata/HEAD/admission.k8s.io.v1.AdmissionReview.json"
    fixture = json.loads(path.read_text())
    response = post(client, fixture)
    assert response.status_code == 200
    assert response.json()["response"]["uid"] == fixture["request"]["uid"]


# --- CEL selectors -------------------------------------------------------------------------

API_FIXTURES = "kubernetes-api/testdata"


def _upstream_expressions(upstream: Path, *, api_fixtures: bool) -> set[str]:
    found: set[str] = set()
    for path in sorted(upstream.rglob("*.yaml")):
        if path.relative_to(upstream).as_posix().startswith(API_FIXTURES) != api_fixtures:
            continue
        for document in yaml.safe_load_all(path.read_text()):
            found.update(selector_expressions(document))
    return found


@pytest.fixture
def upstream_devices(upstream: Path) -> dict[str, DeviceView]:
    """The NVIDIA reference entries and variants of them, the example driver's GPUs, and the
    GPUs the website's examples assume."""
    gpu, mig, vfio = yaml.safe_load((upstream / REFERENCE_ATTRIBUTES).read_text())
    nvidia = "gpu.nvidia.com"
    found: dict[str, DeviceView] = {
        "nvidia-gpu": (nvidia, gpu["attributes"], gpu["capacity"]),
        "nvidia-mig-1g.5gb": (nvidia, mig["attributes"], mig["capacity"]),
        "nvidia-vfio": (nvidia, vfio["attributes"], vfio["capacity"]),
    }
    # The same A100 as published by driver releases up to v25.3, which still had `index`.
    for index in (0, 1):
        attributes = {**gpu["attributes"], "index": {"int": index}}
        found[f"nvidia-gpu-index-{index}"] = (nvidia, attributes, gpu["capacity"])
    # A bigger MIG slice of the same GPU: 3g.20gb has 42 SMs and 19968Mi usable memory.
    big = copy.deepcopy(mig)
    big["attributes"]["profile"] = {"string": "3g.20gb"}
    big["capacity"].update({"memory": {"value": "19968Mi"}, "multiprocessors": {"value": "42"}})
    found["nvidia-mig-3g.20gb"] = (nvidia, big["attributes"], big["capacity"])
    (example_slice,) = yaml.safe_load((upstream / EXAMPLE_SLICES).read_text())["items"]
    for entry in example_slice["spec"]["devices"]:
        found[f"example-{entry['name']}"] = (
            example_slice["spec"]["driver"],
            entry["attributes"],
            entry["capacity"],
        )
    # The website's example device class assumes a driver.example.com GPU with 64Gi.
    website = {"type": {"string": "gpu"}}
    found["website-64Gi"] = ("driver.example.com", website, {"memory": {"value": "64Gi"}})
    found["website-65536Mi"] = ("driver.example.com", website, {"memory": {"value": "65536Mi"}})
    found["website-80Gi"] = ("driver.example.com", website, {"memory": {"value": "80Gi"}})
    return found


EXAMPLE_GPUS = {f"example-gpu-{i}" for i in range(8)}
# Expected result per upstream selector (whitespace-normalized); devices not listed: no match.
EXPECTED_MATCHES: dict[str, set[str]] = {
    "device.attributes['gpu.example.com'].model == 'BLEEDING-EDGE-GPU'": set(),
    "device.capacity['gpu.example.com'].memory.compareTo(quantity('1Ti')) >= 0": set(),
    "device.attributes['gpu.example.com'].model == 'LATEST-GPU-MODEL'": EXAMPLE_GPUS,
    "device.capacity['gpu.example.com'].memory.compareTo(quantity('4Gi')) >= 0": EXAMPLE_GPUS,
    "device.attributes['gpu.nvidia.com'].profile == '1g.5gb'": {"nvidia-mig-1g.5gb"},
    "device.attributes['gpu.nvidia.com'].profile == '2g.10gb'": set(),
    "device.attributes['gpu.nvidia.com'].profile == '3g.20gb'": {"nvidia-mig-3g.20gb"},
    (
        "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$') && "
        "(device.attributes['gpu.nvidia.com'].index == 0 || "
        "device.attributes['gpu.nvidia.com'].index == 2 || "
        "device.attributes['gpu.nvidia.com'].index == 4 || "
        "device.attributes['gpu.nvidia.com'].index == 6)"
    ): {"nvidia-gpu-index-0"},
    (
        "device.capacity['gpu.nvidia.com'].multiprocessors.isGreaterThan(quantity(\"10\")) && "
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity(\"10Gi\"))"
    ): {"nvidia-mig-3g.20gb"},
    "device.driver == 'gpu.example.com'": EXAMPLE_GPUS,
    (
        'device.attributes["driver.example.com"].type == "gpu" && '
        'device.capacity["driver.example.com"].memory == quantity("64Gi")'
    ): {"website-64Gi", "website-65536Mi"},
}


def test_every_upstream_selector_has_an_expectation(upstream: Path) -> None:
    found = {normalized(e) for e in _upstream_expressions(upstream, api_fixtures=False)}
    assert found == set(EXPECTED_MATCHES)


def test_upstream_selectors_match_the_expected_devices(
    upstream: Path, upstream_devices: dict[str, DeviceView]
) -> None:
    for expression in _upstream_expressions(upstream, api_fixtures=False):
        expected = EXPECTED_MATCHES[normalized(expression)]
        assert matching(expression, upstream_devices) == expected, expression


def test_the_nvidia_fixtures_publish_what_the_drivers_reference_lists(upstream: Path) -> None:
    """Each attribute and capacity of the project's NVIDIA fixture devices is one the driver's
    reference page lists for that device type, with the same value type."""
    reference = {
        entry["attributes"]["type"]["string"]: entry
        for entry in yaml.safe_load((upstream / REFERENCE_ATTRIBUTES).read_text())
    }
    for resource_slice in iter_objects(DRA / "nvidia-slices.yaml"):
        for device in resource_slice["spec"]["devices"]:
            listed = reference[device["attributes"]["type"]["string"]]
            for name, value in device["attributes"].items():
                assert listed["attributes"].get(name, {}).keys() == value.keys(), (device, name)
            # The driver adds one `memorySliceN` per memory slice a MIG device holds; the page
            # does not list them.
            capacities = {name for name in device["capacity"] if not name.startswith("memorySlice")}
            assert capacities <= listed["capacity"].keys(), device["name"]


def test_api_fixture_placeholder_is_not_a_valid_selector(upstream: Path) -> None:
    (placeholder,) = _upstream_expressions(upstream, api_fixtures=True)
    with pytest.raises(CELError, match="undeclared reference 'expressionValue'"):
        compile_selector(placeholder)
