"""Acceptance of issue 18 (every accelerator, every way of sharing it), as its users meet it.

An operator syncs a dump of the cluster (`sync_inventory --from-file`) and reads `fleet_report`;
a team's claims go through the admission webhook (an AdmissionReview POSTed to
/admission/resourceclaims); an agent posts samples to /ingest/samples; finance runs
`run_billing` and reads /api/v1/statement-lines/; a team lead reads the team page; whoever adds
a driver follows the README. Each test names the part of the issue it accepts; findings are
numbered in the issue's order (1 AMD, 2 devices without a uuid, 3 TPU, 4 vGPU, 5 KEP-4815
counters, 6 consumable capacity, 7 silent acceptance, 8 fragmentation, 9 version baseline).
What the vendor tests already prove (tests/inventory/test_vendors.py,
tests/quota/test_vendor_claims.py, tests/billing/test_vendor_billing.py and others) is not
repeated here; these tests cover what they do not reach end to end, on fixtures of this
module's own:

- AMD's GPU DRA driver (ROCm/k8s-gpu-dra-driver, docs/driver-attributes.md): devices
  `gpu-<card>-<render>`, `type` amdgpu / amdgpu-partition, `deviceID` the model's PCI id (the
  same on every MI300X), `resource.kubernetes.io/pciBusID` the physical GPU's, shared by its
  partitions; `partitionProfile` such as cpx_nps1; `memory`, `computeUnits`, `simdUnits`.
- Intel's GPU driver (intel-resource-drivers-for-kubernetes, gpu.intel.com): devices named by
  PCI address and PCI id, `model`, `family`, `pciId`, no uuid, no type; `memory` 0 on an
  integrated GPU, `millicores`.
- Intel's Gaudi driver (the same repository, gaudi.intel.com, cmd/kubelet-gaudi-plugin
  GetResources): `model`, `pciRoot`, `serial`, `healthy`, published through the v1beta1 API,
  so a v1beta1 dump carries them under `basic`.
- Google's TPU driver (tpu.google.com; GKE's "Prioritized TPUs with DRA" tutorial): chips
  `accel<n>` with `index`, `tpuGen` (v5p, v6e) and the host's `uuid` on every chip; a claim
  takes all chips of a host (`allocationMode: All`), preferring v6e, else v5p
  (`firstAvailable`).
- NVIDIA's driver inside a VM (a vGPU guest: `type: gpu`, the vGPU type as `productName`), on
  a vGPU host with VGPUSupport (kubernetes-sigs/dra-driver-nvidia-gpu vgpu.go: a
  `vgpu-<minor>-counter-set` with one `framebuffer` counter, slot devices
  `vgpu-gpu-<minor>-<short profile>-<slot>` of `type: vgpu` carrying the parent's `uuid` and
  `productName`, `profile` "NVIDIA L40S-12Q", each consuming its profile's framebuffer), and
  an A100 in static MIG mode.
"""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from billing.models import RateCard
from inventory import profiles
from inventory import services as inventory_services
from inventory.models import Device
from metering.services import issue_agent_token
from quota.admission.shapes import forget_fleet_shapes
from quota.models import QuotaRule, Reservation
from teams.models import Membership, Role, Team
from teams.selectors import FINANCE_GROUP
from tests.quota.fixtures import admit, claim, decide, make_team

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parent.parent
AT = datetime(2026, 11, 2, 8, tzinfo=UTC)
DAY = datetime(2026, 10, 14, tzinfo=UTC)  # a day of October 2026, billed and closed

AMD, INTEL, GAUDI = "gpu.amd.com", "gpu.intel.com", "gaudi.intel.com"
TPU, NVIDIA, MIG = "tpu.google.com", "gpu.nvidia.com", "mig.nvidia.com"
MI300X = "AMD_Instinct_MI300X_OAM"
L40S_UUID = "GPU-7a3e9c51-2b84-4f06-9d1e-5c8a0b3f6e27"
GAUDI_CARDS = ["0000-33-00-0-0x1020", "0000-4d-00-0-0x1020"]
MAX_1550, UHD_770 = "0000-29-00-0-0x0bd5", "0000-00-02-0-0xa780"
CPX = "device.attributes['gpu.amd.com'].type == 'amdgpu-partition'"


# --- DRA objects ---------------------------------------------------------------------------------


def text(value: str) -> dict[str, str]:
    return {"string": value}


def version(value: str) -> dict[str, str]:
    return {"version": value}


def integer(value: int) -> dict[str, int]:
    return {"int": value}


def boolean(value: bool) -> dict[str, bool]:
    return {"bool": value}


def quantity(value: str) -> dict[str, str]:
    return {"value": value}


def resource_slice(
    driver: str,
    node: str,
    devices: list[dict[str, Any]],
    *,
    api_version: str = "resource.k8s.io/v1",
    **spec: Any,
) -> dict[str, Any]:
    """The one slice of `node`'s pool, as `kubectl get resourceslices -o yaml` lists it."""
    return {
        "apiVersion": api_version,
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-7kq2p"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
            **spec,
        },
    }


def device_class(name: str, expression: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {
            "selectors": [{"cel": {"expression": expression or f"device.driver == '{name}'"}}]
        },
    }


def nvidia_class(name: str, device_type: str) -> dict[str, Any]:
    expression = (
        f"device.driver == 'gpu.nvidia.com' && "
        f"device.attributes['gpu.nvidia.com'].type == '{device_type}'"
    )
    return device_class(name, expression)


def amd_gpu(card: int, bus: str, *, partitions: int = 1) -> dict[str, Any]:
    """An MI300X whole (SPX) or one of its `partitions` CPX partitions, on PCI `bus`."""
    return {
        "name": f"gpu-{card}-{127 + card}",
        "attributes": {
            "type": text("amdgpu" if partitions == 1 else "amdgpu-partition"),
            "deviceID": text("0x74a1"),
            "productName": text(MI300X),
            "driverVersion": version("6.12.12"),
            "partitionProfile": text("spx_nps1" if partitions == 1 else "cpx_nps1"),
            "numaNode": integer(0),
            "resource.kubernetes.io/pciBusID": text(bus),
            "resource.kubernetes.io/pcieRoot": text(f"pci0000:{bus[5:7]}"),
        },
        "capacity": {
            "memory": quantity(f"{192 // partitions}Gi"),
            "computeUnits": quantity(str(304 // partitions)),
            "simdUnits": quantity(str(1216 // partitions)),
        },
    }


def amd_node() -> dict[str, Any]:
    """Two MI300X whole and one in CPX mode: eight partitions sharing its pciBusID."""
    cpx = [amd_gpu(3 + index, "0000:38:00.0", partitions=8) for index in range(8)]
    return resource_slice(
        AMD, "mi300x-a", [amd_gpu(1, "0000:0c:00.0"), amd_gpu(2, "0000:22:00.0"), *cpx]
    )


def intel_gpu(bus: str, pci_id: str, model: str, family: str, memory_mib: int) -> dict[str, Any]:
    return {
        "name": f"{bus.replace(':', '-').replace('.', '-')}-{pci_id}",
        "attributes": {
            "model": text(model),
            "family": text(family),
            "driver": text("xe" if memory_mib else "i915"),
            "sriov": boolean(bool(memory_mib)),
            "pciId": text(pci_id),
            "pciAddress": text(bus),
            "health": text("Healthy"),
            "pciRoot": text(bus[5:7]),
            "resource.kubernetes.io/pciBusID": text(bus),
            "resource.kubernetes.io/pcieRoot": text(f"pci0000:{bus[5:7]}"),
        },
        "capacity": {"memory": quantity(f"{memory_mib}Mi"), "millicores": quantity("1000")},
    }


def intel_node() -> dict[str, Any]:
    """A Data Center GPU Max 1550 and the host's integrated UHD Graphics 770 (no memory)."""
    return resource_slice(
        INTEL,
        "xpu-a",
        [
            intel_gpu("0000:29:00.0", "0x0bd5", "Max 1550", "Data Center Max", 131072),
            intel_gpu("0000:00:02.0", "0xa780", "Raptor Lake-S", "UHD Graphics", 0),
        ],
    )


def gaudi_node() -> dict[str, Any]:
    """Two Gaudi2 cards, listed through the v1beta1 API the Gaudi driver publishes with."""
    cards = [
        {
            "name": name,
            "basic": {
                "attributes": {
                    "model": text("Gaudi2"),
                    "pciRoot": text("0e"),
                    "serial": text(serial),
                    "healthy": boolean(True),
                }
            },
        }
        for name, serial in zip(GAUDI_CARDS, ("AN41S3017", "AN41S3102"), strict=True)
    ]
    return resource_slice(GAUDI, "gaudi-a", cards, api_version="resource.k8s.io/v1beta1")


def tpu_node(node: str, generation: str, host_uuid: str) -> dict[str, Any]:
    """A 4-chip TPU host (ct5p-hightpu-4t, ct6e-standard-4t): every chip has the host's uuid."""
    chips = [
        {
            "name": f"accel{index}",
            "attributes": {
                "index": integer(index),
                "tpuGen": text(generation),
                "uuid": text(host_uuid),
            },
        }
        for index in range(4)
    ]
    return resource_slice(TPU, node, chips)


def vgpu_guest() -> dict[str, Any]:
    """A VM given one A100-10C vGPU: the guest's driver sees a GPU named after the vGPU type."""
    return resource_slice(
        NVIDIA,
        "vgpu-vm-a",
        [
            {
                "name": "gpu-0",
                "attributes": {
                    "type": text("gpu"),
                    "uuid": text("GPU-2f6c1a9e-7d3b-11f0-8a5e-3b9d4c1e7f20"),
                    "productName": text("NVIDIA A100-10C"),
                    "architecture": text("Ampere"),
                    "driverVersion": version("550.90.7"),
                    "cudaDriverVersion": version("12.4.0"),
                },
                "capacity": {"memory": quantity("10Gi")},
            }
        ],
    )


def mig_node() -> dict[str, Any]:
    """An A100-SXM4-40GB in static MIG mode: seven 1g.5gb devices and no device for the GPU."""
    return resource_slice(
        NVIDIA,
        "a100-mig-a",
        [
            {
                "name": f"gpu-0-mig-1g5gb-19-{slot}",
                "attributes": {
                    "type": text("mig"),
                    "uuid": text(f"MIG-5c8e1f2a-{slot:04d}-4b7d-9e3a-6f1c2d4e8a0b"),
                    "parentUUID": text("GPU-0d4b8c2e-5a71-4f3e-9b6d-1c2e3f4a5b6c"),
                    "profile": text("1g.5gb"),
                    "productName": text("NVIDIA A100-SXM4-40GB"),
                    "architecture": text("Ampere"),
                    "driverVersion": version("580.95.5"),
                    "cudaDriverVersion": version("13.0.0"),
                    "resource.kubernetes.io/pciBusID": text("0000:07:00.0"),
                },
                "capacity": {
                    "multiprocessors": quantity("14"),
                    "memory": quantity("4864Mi"),
                    f"memorySlice{slot}": quantity("1"),
                },
            }
            for slot in range(7)
        ],
    )


def vgpu_slot(
    short: str, profile_id: int, framebuffer: str, slot: int, parent: dict[str, Any]
) -> dict[str, Any]:
    """Slot `slot` of vGPU profile "NVIDIA L40S-<short>", with its parent GPU's attributes."""
    attributes: dict[str, Any] = {
        "type": text("vgpu"),
        "profile": text(f"NVIDIA L40S-{short.upper()}"),
        "shortProfileName": text(short),
        "slot": integer(slot),
        **parent,
        "vgpuFramework": text("mdev"),
        "profileID": integer(profile_id),
    }
    return {
        "name": f"vgpu-gpu-0-{short}-{slot}",
        "attributes": attributes,
        "consumesCounters": [
            {"counterSet": "vgpu-0-counter-set", "counters": {"framebuffer": quantity(framebuffer)}}
        ],
    }


def vgpu_host() -> dict[str, Any]:
    """An L40S (48 GiB) on a vGPU host: the whole GPU and the slots of two vGPU profiles, all
    consuming its framebuffer counter and all carrying its uuid."""
    parent: dict[str, Any] = {
        "productName": text("NVIDIA L40S"),
        "uuid": text(L40S_UUID),
        "resource.kubernetes.io/pciBusID": text("0000:4b:00.0"),
    }
    whole = {
        "name": "gpu-0",
        "attributes": {
            "type": text("gpu"),
            **parent,
            "architecture": text("Ada Lovelace"),
            "driverVersion": version("580.95.5"),
            "cudaDriverVersion": version("13.0.0"),
        },
        "capacity": {"memory": quantity("48Gi")},
        "consumesCounters": [
            {"counterSet": "vgpu-0-counter-set", "counters": {"framebuffer": quantity("48Gi")}}
        ],
    }
    slots = [
        vgpu_slot(short, profile_id, framebuffer, slot, parent)
        for short, profile_id, framebuffer, instances in (
            ("12q", 1177, "12Gi", 4),
            ("24q", 1179, "24Gi", 2),
        )
        for slot in range(instances)
    ]
    counters = [{"name": "vgpu-0-counter-set", "counters": {"framebuffer": quantity("48Gi")}}]
    return resource_slice(NVIDIA, "l40s-host-a", [whole, *slots], sharedCounters=counters)


def fleet() -> list[dict[str, Any]]:
    """Every node above, with the drivers' DeviceClasses."""
    return [
        *(device_class(driver) for driver in (AMD, INTEL, GAUDI, TPU)),
        nvidia_class(NVIDIA, "gpu"),
        nvidia_class(MIG, "mig"),
        nvidia_class("vgpu.nvidia.com", "vgpu"),
        amd_node(),
        intel_node(),
        gaudi_node(),
        tpu_node("tpu-v5p-a", "v5p", "tpu-3b1e9f27-0c4d-4a8e-b6f2-7d9a1c5e3f08"),
        tpu_node("tpu-v6e-a", "v6e", "tpu-8c2d4f61-9e3a-4b7c-a1d5-2f6e8b0c4d93"),
        vgpu_guest(),
        mig_node(),
        vgpu_host(),
    ]


def allocated(
    name: str, driver: str, pool: str, devices: list[str], request: dict[str, Any]
) -> dict[str, Any]:
    """A claim of namespace `research` the scheduler has allocated `devices` of `pool`."""
    results = [
        {"request": "accel", "driver": driver, "pool": pool, "device": device} for device in devices
    ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "research", "uid": f"uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "accel", "exactly": request}]}},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def exactly(device_class_name: str, count: int = 1, expression: str = "") -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": device_class_name, "count": count}
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return fields


def every(device_class_name: str, expression: str = "") -> dict[str, Any]:
    fields: dict[str, Any] = {"deviceClassName": device_class_name, "allocationMode": "All"}
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return fields


# A claim of another namespace still waiting for a device. A dump in which no ResourceClaim is
# left says nothing about claims (the sync applies only the kinds a dump contains), so the dump
# taken after the claims went keeps this one, as a real cluster would have some.
WAITING = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "waiting", "namespace": "elsewhere", "uid": "uid-waiting"},
    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly(NVIDIA)}]}},
}


def sync_dump(tmp_path: Path, objects: list[dict[str, Any]], at: datetime) -> str:
    """`sync_inventory --from-file` of a `kubectl get ... -o yaml` list taken at `at`; its
    report. Fails on any warning or rejected object."""
    path = tmp_path / f"dump-{at:%Y%m%dT%H%M}.yaml"
    items = [*objects, WAITING]
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}))
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "sync_inventory", "--from-file", str(path), "--at", at.isoformat(), stdout=out, stderr=err
    )
    assert err.getvalue() == "" and "Sync warnings: none" in out.getvalue(), err.getvalue()
    return out.getvalue()


def fleet_report_json(*args: str) -> dict[str, Any]:
    out = io.StringIO()
    call_command("fleet_report", "--format", "json", *args, stdout=out)
    report: dict[str, Any] = json.loads(out.getvalue())
    return report


def research() -> Team:
    """The team owning namespace `research` (the quota fixtures' namespaces), no rules."""
    return make_team([])


def rate_card(product: str, price: str, idle_factor: str = "1") -> None:
    RateCard.objects.create(
        product_name=product,
        per_gpu_hour=Decimal(price),
        idle_factor=Decimal(idle_factor),
        currency="USD",
        valid_from=datetime(2026, 1, 1, tzinfo=UTC).date(),
    )


def finance() -> Client:
    user = User.objects.create(username="finance")
    user.groups.add(Group.objects.get_or_create(name=FINANCE_GROUP)[0])
    client = Client()
    client.force_login(user)
    return client


def statement_lines(period: str) -> dict[str, dict[str, Any]]:
    """The usage lines finance reads for `period`, by product name."""
    response = finance().get("/api/v1/statement-lines/", {"period": period})
    assert response.status_code == 200, response.content
    return {line["product_name"]: line for line in response.json()["results"]}


def reserved(name: str) -> dict[str, Decimal]:
    """What the live reservation of claim `name` holds, by rule."""
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount.normalize() for line in reservation.lines.all()}


# --- fleet counts: AMD, Intel, Gaudi, TPU, vGPU, partitions (findings 1-5, 8) --------------------


def test_the_operators_fleet_report_counts_every_vendor_in_its_own_unit(tmp_path: Path) -> None:
    """AMD devices are GPUs (finding: kind "other", 0 GPUs), CPX partitions an eighth of their
    MI300X; Intel's integrated GPU is no accelerator; Gaudi cards and TPU chips count in their
    own units, a TPU host's shared uuid collapsing nothing; a vGPU counts its fraction; a GPU
    with one slice or partition held is partly used, with what is still free (fragmentation)."""
    held = [
        allocated("cpx-two", AMD, "mi300x-a", ["gpu-3-130", "gpu-4-131"], exactly(AMD, 2, CPX)),
        allocated("mig-one", NVIDIA, "a100-mig-a", ["gpu-0-mig-1g5gb-19-0"], exactly(MIG)),
    ]
    sync_dump(tmp_path, [*fleet(), *held], AT)

    report = fleet_report_json("--cluster", "default")

    capacity = {
        (row["unit_label"], row["product_name"]): (row["gpus"], row["equivalents"], row["free"])
        for row in report["capacity"]
    }
    assert capacity == {
        ("GPUs", MI300X): (3, "3", 2),
        ("GPUs", "Max 1550"): (1, "1", 1),
        ("GPUs", "NVIDIA A100"): (1, "0.25", 1),  # the guest's A100-10C vGPU
        ("GPUs", "NVIDIA A100-SXM4-40GB"): (1, "1", 0),
        ("GPUs", "NVIDIA L40S"): (1, "1", 1),
        ("TPU chips", "v5p"): (4, "4", 4),
        ("TPU chips", "v6e"): (4, "4", 4),
        ("Gaudi cards", "Gaudi2"): (2, "2", 2),
    }
    partial = {
        gpu["product_name"]: (gpu["held_label"], gpu["free_label"], gpu["free_slices"])
        for gpu in report["partial_gpus"]
    }
    assert partial == {
        MI300X: ("25%", "75%", {"cpx_nps1": 6}),
        "NVIDIA A100-SXM4-40GB": ("1/7", "6/7", {"1g.5gb": 6}),
    }
    nodes = {node["node"]: node["state"] for node in report["partly_used_nodes"]}
    assert nodes == {"mi300x-a": "partly used", "a100-mig-a": "partly used"}
    assert report["sync_warnings"] == []
    table = io.StringIO()
    call_command("fleet_report", stdout=table)
    text = table.getvalue()
    for heading in ("Capacity by model: GPUs", "TPU chips", "Gaudi cards"):
        assert heading in text
    # The headings name what the fleet holds, not only GPUs.
    assert text.startswith("Accelerator fleet report: all clusters\nNodes with accelerators: ")


def test_every_accelerator_has_its_own_meter_id_without_a_uuid_of_its_own(tmp_path: Path) -> None:
    """Devices without a uuid (AMD, Intel, Gaudi) and devices sharing one (TPU chips of a host,
    a vGPU host's slots carrying their GPU's) each get a stable identity of their own."""
    sync_dump(tmp_path, fleet(), AT)
    accelerators = Device.objects.filter(gone_at=None).exclude(kind="other").order_by("pk")
    meters = list(accelerators.values_list("meter_id", flat=True))
    assert all(meters) and len(set(meters)) == len(meters) == 36
    assert Device.objects.get(name=UHD_770).kind == "other"
    chip = Device.objects.get(pool="tpu-v5p-a", name="accel2")
    assert chip.meter_id == profiles.meter_id("default", TPU, "tpu-v5p-a", "accel2")
    sync_dump(tmp_path, fleet(), AT + timedelta(hours=1))
    assert list(accelerators.values_list("meter_id", flat=True)) == meters


# --- quota: ExactCount, All, firstAvailable, adminAccess on each vendor (findings 1-6) -----------


def test_typical_claims_count_what_they_can_take_in_the_unit_of_their_devices(
    tmp_path: Path, client: Client
) -> None:
    sync_dump(tmp_path, fleet(), AT)
    forget_fleet_shapes()
    make_team(
        [
            {"name": "tpu", "device_class": TPU, "limit": 4},
            {"name": "intel", "device_class": INTEL, "limit": 1},
            {"name": "gaudi", "device_class": GAUDI, "limit": 2},
            {"name": "amd", "device_class": AMD, "limit": 2},
            {"name": "vgpu", "device_class": "vgpu.nvidia.com", "limit": "0.5"},
            {"name": "gpu", "device_class": NVIDIA, "limit": 2},
        ]
    )

    def request(name: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": name, "exactly": fields}]

    # GKE's prioritized TPU claim: all chips of a v6e host, else of a v5p host.
    v6e, v5p = (f"device.attributes['tpu.google.com'].tpuGen == '{gen}'" for gen in ("v6e", "v5p"))
    prioritized = [
        {
            "name": "tpus",
            "firstAvailable": [
                {"name": "tpu-v6e", **every(TPU, v6e)},
                {"name": "tpu-v5p", **every(TPU, v5p)},
            ],
        }
    ]
    assert decide(client, claim("tpu-first", prioritized))["allowed"]
    assert reserved("tpu-first") == {"tpu": 4}
    denied = decide(client, claim("tpu-second", prioritized))
    assert denied["status"]["message"] == (
        'team "research": quota rule "tpu" (enforce) would be exceeded: 4 TPU chips in use, '
        "4 TPU chips requested, limit 4 TPU chips (none of the 2 alternatives of request "
        "'tpus' fits)"
    )
    # Intel: All of the node is its discrete GPU (the integrated one counts 0).
    assert decide(client, claim("intel-all", request("xpu", every(INTEL))))["allowed"]
    assert reserved("intel-all") == {"intel": 1}
    # Gaudi: All of the node's two cards, then nothing more.
    assert decide(client, claim("gaudi-all", request("hpu", every(GAUDI))))["allowed"]
    assert reserved("gaudi-all") == {"gaudi": 2}
    full = decide(client, claim("gaudi-one", request("hpu", exactly(GAUDI))))
    assert (
        "2 Gaudi cards in use, 1 Gaudi card requested, limit 2 Gaudi cards"
        in (full["status"]["message"])
    )
    # AMD: all CPX partitions of the node are one MI300X; three of them 3/8.
    assert decide(client, claim("cpx-all", request("gpu", every(AMD, CPX))))["allowed"]
    assert decide(client, claim("cpx-three", request("gpu", exactly(AMD, 3, CPX))))["allowed"]
    assert (reserved("cpx-all"), reserved("cpx-three")) == ({"amd": 1}, {"amd": Decimal("0.375")})
    # vGPU host slots by their framebuffer: a 24Q is half the L40S; a 12Q a quarter.
    q24 = "device.attributes['gpu.nvidia.com'].profile == 'NVIDIA L40S-24Q'"
    q12 = "device.attributes['gpu.nvidia.com'].profile == 'NVIDIA L40S-12Q'"
    choice = [
        {
            "name": "vgpu",
            "firstAvailable": [
                {"name": "two-24q", **exactly("vgpu.nvidia.com", 2, q24)},
                {"name": "one-12q", **exactly("vgpu.nvidia.com", 1, q12)},
            ],
        }
    ]
    assert admit(client, claim("vgpu", choice))["allowed"]  # both webhooks: one-12q kept
    assert reserved("vgpu") == {"vgpu": Decimal("0.25")}
    # A vGPU guest: All of the VM is its one A100-10C, a quarter of an A100.
    guest = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-10C'"
    assert decide(client, claim("guest", request("gpu", every(NVIDIA, guest))))["allowed"]
    assert reserved("guest") == {"gpu": Decimal("0.25")}
    # adminAccess observes devices of every vendor and holds nothing.
    for driver in (TPU, INTEL, GAUDI, AMD):
        watch = {**every(driver), "adminAccess": True}
        name = f"watch-{driver.split('.')[0]}"
        answer = decide(client, claim(name, request("watch", watch), namespace="admin-access"))
        assert answer["allowed"], answer
        assert reserved(name) == {}


def test_allocated_claims_hold_their_exact_share_on_the_ledger(tmp_path: Path) -> None:
    """Claims the cluster allocated before the policy came (adopted on the next sync) count the
    devices they hold: two CPX partitions are a quarter (finding: counted 2), a 12Q slot a
    quarter, the integrated GPU nothing."""
    make_team(
        [
            {"name": "amd", "device_class": AMD, "limit": 2},
            {"name": "tpu", "device_class": TPU, "limit": 8},
            {"name": "intel", "device_class": INTEL, "limit": 2},
            {"name": "gaudi", "device_class": GAUDI, "limit": 2},
            {"name": "vgpu", "device_class": "vgpu.nvidia.com", "limit": 2},
        ]
    )
    held = [
        allocated("cpx-two", AMD, "mi300x-a", ["gpu-3-130", "gpu-4-131"], exactly(AMD, 2, CPX)),
        allocated("v5p", TPU, "tpu-v5p-a", [f"accel{n}" for n in range(4)], every(TPU)),
        allocated("igpu", INTEL, "xpu-a", [UHD_770], exactly(INTEL)),
        allocated("card", GAUDI, "gaudi-a", GAUDI_CARDS[:1], exactly(GAUDI)),
        allocated("slot", NVIDIA, "l40s-host-a", ["vgpu-gpu-0-12q-1"], exactly("vgpu.nvidia.com")),
    ]
    sync_dump(tmp_path, [*fleet(), *held], AT)

    in_use = {
        name: amount.normalize() for name, amount in QuotaRule.objects.values_list("name", "in_use")
    }
    assert in_use == {
        "amd": Decimal("0.25"),
        "tpu": 4,
        "intel": 0,
        "gaudi": 1,
        "vgpu": Decimal("0.25"),
    }
    out = io.StringIO()
    call_command("reconcile_quotas", "--check", stdout=out)
    assert "no drift" in out.getvalue()


# --- billing: every allocation billed, in its unit, to the cent (findings 1-4) ------------------


def test_a_days_statement_bills_every_vendors_allocations_to_the_cent(tmp_path: Path) -> None:
    """Claims held for a day and released, billed by `run_billing --close` and read by finance:
    TPU chips in TPU chip-hours per generation (finding: 2 chips billed 0.00), devices without a
    uuid (AMD partitions, an Intel GPU) unmeasured but billed, a vGPU slot its quarter of the
    L40S; the integrated GPU never."""
    research()
    for product, price in (
        ("v5p", "4.20"),
        ("v6e", "2.70"),
        (MI300X, "4.00"),
        ("Max 1550", "1.50"),
        ("Raptor Lake-S", "0.10"),
        ("NVIDIA L40S", "1.80"),
    ):
        rate_card(product, price)
    held = [
        allocated("v6e", TPU, "tpu-v6e-a", [f"accel{n}" for n in range(4)], every(TPU)),
        allocated("v5p", TPU, "tpu-v5p-a", [f"accel{n}" for n in range(4)], every(TPU)),
        allocated("cpx-two", AMD, "mi300x-a", ["gpu-5-132", "gpu-6-133"], exactly(AMD, 2, CPX)),
        allocated("xpu", INTEL, "xpu-a", [MAX_1550, UHD_770], every(INTEL)),
        allocated("slot", NVIDIA, "l40s-host-a", ["vgpu-gpu-0-12q-0"], exactly("vgpu.nvidia.com")),
    ]
    sync_dump(tmp_path, [*fleet(), *held], DAY)
    sync_dump(tmp_path, fleet(), DAY + timedelta(days=1))

    out = io.StringIO()
    call_command("run_billing", "--period", "2026-10", "--close", "--actor", "finance", stdout=out)
    assert "total 733.20 USD" in out.getvalue()

    lines = statement_lines("2026-10")
    assert {
        product: (
            line["hours"],
            line["allocated_gpu_hours"],
            line["unmeasured_gpu_hours"],
            line["amount"],
        )
        for product, line in lines.items()
    } == {
        "v5p": ("TPU chip-hours", "96.000000", "96.000000", "403.20"),
        "v6e": ("TPU chip-hours", "96.000000", "96.000000", "259.20"),
        MI300X: ("GPU-hours", "6.000000", "6.000000", "24.00"),
        "Max 1550": ("GPU-hours", "24.000000", "24.000000", "36.00"),
        "NVIDIA L40S": ("GPU-hours", "6.000000", "6.000000", "10.80"),
    }
    assert lines["v5p"]["unit"] == "TPU chip-hour"
    table = io.StringIO()
    call_command("statement", "--team", "research", "--period", "2026-10", stdout=table)
    assert "4.2000/TPU chip-h" in table.getvalue() and "733.20" in table.getvalue()


def test_samples_naming_a_gaudi_card_by_driver_and_device_bill_its_utilised_hours(
    tmp_path: Path,
) -> None:
    """An agent that knows a card by its name in the ResourceSlice (no uuid) posts its samples;
    the statement shows the card's hours utilised and idle, its neighbour's unmeasured."""
    research()
    rate_card("Gaudi2", "2.00", idle_factor="0.5")
    start = timezone.now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=4)
    if (start + timedelta(hours=2)).month != start.month:  # keep both hours in one period
        start -= timedelta(hours=2)
    held = allocated("cards", GAUDI, "gaudi-a", GAUDI_CARDS, exactly(GAUDI, 2))
    sync_dump(tmp_path, [*fleet(), held], start)
    token = issue_agent_token(
        cluster=inventory_services.get_cluster("default"), node="gaudi-a", actor="ops"
    )
    samples = [
        {
            "driver": GAUDI,
            "device": GAUDI_CARDS[0],
            "ts": (start + timedelta(minutes=minute)).isoformat(),
            "gpu_util": 50.0,
        }
        for minute in range(120)
    ]
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": "gaudi-a", "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    assert (response.json()["accepted"], response.json()["rejected"]) == (120, [])
    sync_dump(tmp_path, fleet(), start + timedelta(hours=2))

    period = f"{start:%Y-%m}"
    call_command("run_billing", "--period", period, stdout=io.StringIO())

    line = statement_lines(period)["Gaudi2"]
    assert line["hours"] == "Gaudi card-hours"
    # 2 cards x 2 h; the sampled one half busy: 1 h utilised, 1 h idle at half price.
    assert (
        line["allocated_gpu_hours"],
        line["utilised_gpu_hours"],
        line["idle_gpu_hours"],
        line["unmeasured_gpu_hours"],
        line["amount"],
    ) == ("4.000000", "1.000000", "1.000000", "2.000000", "7.00")


# --- units in the portal (what to build: units in rules, messages, statements and the portal) ---


def test_the_team_page_states_each_quota_rule_in_the_unit_of_its_devices(
    tmp_path: Path, client: Client
) -> None:
    sync_dump(tmp_path, fleet(), AT)
    team = make_team(
        [
            {"name": "chips", "device_class": TPU, "limit": 8},
            {"name": "cards", "device_class": GAUDI, "limit": 2},
        ]
    )
    lead = User.objects.create(username="lead-research")
    Membership.objects.create(team=team, user=lead, role=Role.LEAD)
    client.force_login(lead)

    page = client.get(f"/teams/{team.slug}/").content.decode()

    table = page[page.index('id="quota"') : page.index("</table>", page.index('id="quota"'))]
    rows = {
        name: re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", row)).strip()
        for name, row in re.findall(r'<th scope="row">([^<]+)</th>(.*?)</tr>', table, re.S)
    }
    assert "8 TPU chips" in rows["chips"], rows
    assert "2 Gaudi cards" in rows["cards"], rows


# --- the docs: supported drivers, and another driver described in the policy file --------------


def readme_section() -> str:
    """The "Supported drivers" section of the drivers reference (once the README's)."""
    readme = (REPO / "docs" / "reference" / "drivers.md").read_text()
    start = readme.index("## Supported drivers")
    return readme[start : readme.index("\n## ", start + 1)]


def test_the_readme_lists_the_built_in_drivers() -> None:
    section = readme_section()
    listed = re.findall(r"^\| `([a-z0-9.-]+)` \|", section, re.M)
    assert listed == list(profiles.BUILTIN_SPECS)
    assert "policy file's `drivers:` section" in section


def npu(name: str, kind: str, serial: str, counter_set: str, cores: int, slices: range) -> dict:
    """A device of the drivers page's example driver: whole NPUs and slices consuming counters."""
    return {
        "name": name,
        "attributes": {
            "kind": text(kind),
            "serial": text(serial),
            "model": text("NPU-9"),
            "generation": text("gen3"),
            "firmwareVersion": version("2.4.1"),
            "resource.kubernetes.io/pciBusID": text(f"0000:{counter_set[4]}7:00.0"),
        },
        "capacity": {"hbm": quantity(f"{cores}Gi")},
        "consumesCounters": [
            {
                "counterSet": counter_set,
                "counters": {
                    "cores": quantity(str(cores)),
                    **{f"slice{index}": quantity("1") for index in slices},
                },
            }
        ],
    }


def test_the_readmes_driver_example_applies_and_counts_that_drivers_devices(
    tmp_path: Path,
) -> None:
    """The drivers page's `drivers:` example, applied as written with `apply_policy`, makes the
    next sync count that driver's whole devices and slices (a quarter each by the `cores` and
    `slice*` counters) in accelerators; slices carrying their parent's serial keep meter ids
    of their own."""
    section = readme_section()
    example = section[section.index("```yaml") + len("```yaml") :]
    policy = tmp_path / "policy.yaml"
    policy.write_text("teams: []\n" + example[: example.index("```")])
    call_command("apply_policy", str(policy), stdout=io.StringIO())

    devices = [
        npu("npu-0", "npu", "SN-A1", "npu-0-counters", 64, range(4)),
        *(
            npu(
                f"npu-0-slice-{index}",
                "npu-slice",
                "SN-A1",
                "npu-0-counters",
                16,
                range(index, index + 1),
            )
            for index in range(4)
        ),
        npu("npu-1", "npu", "SN-A2", "npu-1-counters", 64, range(4)),
        # No memory of its own (the example's `exclude`): not an accelerator.
        npu("npu-2", "npu", "SN-A3", "npu-2-counters", 0, range(4)),
    ]
    counters = [
        {
            "name": f"npu-{index}-counters",
            "counters": {"cores": quantity("64"), **{f"slice{n}": quantity("1") for n in range(4)}},
        }
        for index in range(3)
    ]
    npu_slice = resource_slice("npu.example.com", "npu-a", devices, sharedCounters=counters)
    sync_dump(tmp_path, [npu_slice], AT)

    found = {
        device.name: (device.kind, device.unit, device.gpu_share.normalize())
        for device in Device.objects.filter(driver="npu.example.com")
    }
    assert found == {
        "npu-0": ("gpu", "accelerator", 1),
        **{f"npu-0-slice-{n}": ("partition", "accelerator", Decimal("0.25")) for n in range(4)},
        "npu-1": ("gpu", "accelerator", 1),
        "npu-2": ("other", "accelerator", 0),
    }
    accelerators = Device.objects.filter(driver="npu.example.com").exclude(name="npu-2")
    meters = set(accelerators.values_list("meter_id", flat=True))
    assert len(meters) == 6
    [row] = fleet_report_json()["capacity"]
    assert (row["unit_label"], row["product_name"], row["gpus"]) == ("accelerators", "NPU-9", 2)


# --- version baselines per model (finding 9) -----------------------------------------------------


def dgx_node(name: str, driver_version: str, cuda_version: str) -> dict[str, Any]:
    return resource_slice(
        NVIDIA,
        name,
        [
            {
                "name": f"gpu-{index}",
                "attributes": {
                    "type": text("gpu"),
                    "uuid": text(f"GPU-{name}-{index:02d}-5e1f-4a2b-9c3d-7e8f0a1b2c3d"),
                    "productName": text("NVIDIA H100 80GB HBM3"),
                    "architecture": text("Hopper"),
                    "driverVersion": version(driver_version),
                    "cudaDriverVersion": version(cuda_version),
                },
                "capacity": {"memory": quantity("80Gi")},
            }
            for index in range(8)
        ],
    )


def vm_with_a_vgpu(index: int) -> dict[str, Any]:
    vm = vgpu_guest()
    vm["metadata"]["name"] = f"vgpu-vm-{index}-gpu.nvidia.com-r8k2p"
    vm["spec"]["nodeName"] = vm["spec"]["pool"]["name"] = f"vgpu-vm-{index}"
    device = vm["spec"]["devices"][0]
    device["attributes"]["uuid"] = text(f"GPU-2f6c1a9e-7d3b-11f0-8a5e-{index:012d}")
    device["attributes"]["productName"] = text("GRID A100-4C")
    return vm


def test_a_mixed_fleet_of_dgx_nodes_and_vgpu_vms_flags_only_the_real_outlier(
    tmp_path: Path,
) -> None:
    """Three DGX nodes and four single-vGPU VMs on the guest driver, synced: the VMs set no
    baseline for the H100s (finding: they out-voted the DGX nodes, 24 GPUs flagged); a fourth
    DGX node on an older driver is the one outlier."""
    dgx = [dgx_node(f"dgx-{index}", "580.95.5", "13.0.0") for index in range(3)]
    vms = [vm_with_a_vgpu(index) for index in range(4)]
    sync_dump(tmp_path, [*dgx, *vms], AT)
    assert fleet_report_json()["outlier_nodes"] == []

    sync_dump(
        tmp_path, [*dgx, *vms, dgx_node("dgx-3", "570.172.8", "12.8.0")], AT + timedelta(hours=1)
    )

    report = fleet_report_json("--cluster", "default")
    assert report["outlier_nodes"] == ["dgx-3"]
    baselines = {
        model["product_name"]: (
            model["baseline"]["driver_version"],
            model["gpus_on_baseline"],
            model["gpus"],
        )
        for model in report["version_models"]
    }
    assert baselines == {
        "NVIDIA A100": ("550.90.7", 4, 4),  # the VMs' A100-4C vGPUs
        "NVIDIA H100 80GB HBM3": ("580.95.5", 24, 32),
    }
