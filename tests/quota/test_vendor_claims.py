"""Quota accounting of typical claims on each vendor's devices, through the webhook as the API
server calls it: ExactCount, All, firstAvailable and adminAccess on the project's vendor
fixtures (tests/fixtures/dra/vendors: AMD MI300X whole and in CPX partitions, Intel discrete and
integrated GPUs, Gaudi2, TPU v4, vGPU VMs, KEP-4815 partitions, consumable capacity).

What each device counts comes from its driver's profile (`inventory.profiles`, applied by the
sync); amounts and messages are in the unit of the devices a rule covers.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.test import Client
from rest_framework.test import APIClient

from inventory import services as inventory_services
from inventory.dumps import iter_objects
from quota.admission.shapes import forget_fleet_shapes
from quota.models import AdmissionDecision, QuotaRule, Reservation
from teams.selectors import OPERATORS_GROUP
from tests.fixtures import DRA
from tests.quota.fixtures import AT, admit, claim, decide, make_team

pytestmark = pytest.mark.django_db

VENDORS = DRA / "vendors"


@pytest.fixture
def vendor() -> Callable[[str], None]:
    """Imports one vendor fixture file (its name without `.yaml`) as the cluster's fleet."""

    def load(name: str) -> None:
        forget_fleet_shapes()
        report = inventory_services.import_snapshot(
            cluster=inventory_services.get_cluster("default"),
            objects=list(iter_objects(VENDORS / f"{name}.yaml")),
            at=AT,
        )
        assert report.errors == []

    return load


def exactly(
    device_class: str, count: int = 1, expression: str = "", name: str = "req", **more: Any
) -> dict[str, Any]:
    """A request (`name`) for `count` devices of `device_class` that `expression` selects."""
    fields: dict[str, Any] = {"deviceClassName": device_class, "count": count, **more}
    if more.get("allocationMode") == "All":
        del fields["count"]
    if expression:
        fields["selectors"] = [{"cel": {"expression": expression}}]
    return {"name": name, "exactly": fields}


def first_available(name: str, *alternatives: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "firstAvailable": [{"name": alt["name"], **alt["exactly"]} for alt in alternatives],
    }


def reserved(name: str, *, weighed: bool = True) -> dict[str, Decimal]:
    """What the live reservation of claim `name` holds, by rule name; `weighed`: by devices it
    could be given (not counted whole for want of a matching one, which would hide a selector
    that matches nothing)."""
    unmatched = AdmissionDecision.objects.filter(
        name=name, warnings__icontains="in the inventory matches it"
    )
    assert not weighed or not unmatched.exists(), unmatched.first()
    reservation = Reservation.objects.get(name=name, state="reserved")
    return {line.rule.name: line.amount for line in reservation.lines.select_related("rule")}


def in_use(rule: str) -> Decimal:
    return QuotaRule.objects.get(name=rule).in_use


def warned(answer: dict[str, Any]) -> str:
    """The answer's warnings, in one line."""
    return " ".join(answer.get("warnings") or [])


def holds_nothing(name: str) -> bool:
    """Whether claim `name` holds nothing on any rule (admitted without a line, or not at all)."""
    return not Reservation.objects.filter(name=name, lines__amount__gt=0).exists()


# --- AMD MI300X: whole GPUs on one node, one GPU in 8 CPX partitions on another ---------------

AMD = "gpu.amd.com"
AMD_WHOLE = "device.attributes['gpu.amd.com'].type == 'amdgpu'"
AMD_CPX = "device.attributes['gpu.amd.com'].type == 'amdgpu-partition'"


def test_amd_cpx_partitions_count_their_share(client: Client, vendor: Callable) -> None:
    vendor("amd-mi300x")
    make_team([{"name": "amd", "device_class": AMD, "limit": 2}])
    # Two of the 8 CPX partitions of one MI300X are a quarter of it, not 2 GPUs.
    assert decide(client, claim("cpx", [exactly(AMD, 2, AMD_CPX)]))["allowed"]
    assert reserved("cpx") == {"amd": Decimal("0.25")}
    # All partitions of the node: the whole GPU.
    all_cpx = exactly(AMD, expression=AMD_CPX, allocationMode="All")
    assert decide(client, claim("all-cpx", [all_cpx]))["allowed"]
    assert reserved("all-cpx") == {"amd": Decimal("1")}
    denied = decide(client, claim("whole", [exactly(AMD, 1, AMD_WHOLE)]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "amd" (enforce) would be exceeded: 1.25 GPUs in use, '
        "1 GPU requested, limit 2 GPUs"
    )


def test_amd_all_and_first_available_and_admin_access(client: Client, vendor: Callable) -> None:
    vendor("amd-mi300x")
    make_team([{"name": "amd", "device_class": AMD, "limit": 9}])
    # All of the class: the most devices on one node (8), each the most one can count (1).
    assert decide(client, claim("all", [exactly(AMD, allocationMode="All")]))["allowed"]
    assert reserved("all") == {"amd": Decimal("8")}
    # Three whole GPUs do not fit in what is left (1); two CPX partitions (0.25) do.
    fallback = first_available(
        "gpu", exactly(AMD, 3, AMD_WHOLE, name="whole"), exactly(AMD, 2, AMD_CPX, name="cpx")
    )
    answer = admit(client, claim("fallback", [fallback]))
    assert answer["allowed"]
    assert reserved("fallback") == {"amd": Decimal("0.25")}
    assert Reservation.objects.get(name="fallback").chosen == {"gpu": ["cpx"]}
    # Admin access observes devices and holds nothing, past the limit or not.
    watch = exactly(AMD, expression=AMD_WHOLE, allocationMode="All", adminAccess=True)
    assert decide(client, claim("watch", [watch], namespace="admin-access"))["allowed"]
    assert holds_nothing("watch")
    assert in_use("amd") == Decimal("8.25")


# --- Google TPU v4: four chips of one host ------------------------------------------------------

TPU = "tpu.google.com"


def test_tpu_claims_count_chips_and_say_so(client: Client, vendor: Callable) -> None:
    vendor("tpu")
    make_team([{"name": "tpu", "device_class": TPU, "limit": 3}])
    assert decide(client, claim("two", [exactly(TPU, 2)]))["allowed"]
    assert reserved("two") == {"tpu": Decimal("2")}
    denied = decide(client, claim("again", [exactly(TPU, 2)]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "tpu" (enforce) would be exceeded: 2 TPU chips in use, '
        "2 TPU chips requested, limit 3 TPU chips"
    )
    # The host's four chips (the driver's usual claim) do not fit; one chip does, and warns.
    host = first_available(
        "tpu",
        exactly(TPU, allocationMode="All", name="host"),
        exactly(TPU, 1, name="one"),
    )
    answer = admit(client, claim("host-or-one", [host]))
    assert answer["allowed"]
    assert reserved("host-or-one") == {"tpu": Decimal("1")}
    assert 'quota rule "tpu" is at 3 TPU chips of 3 TPU chips with this claim' in warned(answer)
    watch = exactly(TPU, allocationMode="All", adminAccess=True)
    assert decide(client, claim("watch", [watch], namespace="admin-access"))["allowed"]
    assert holds_nothing("watch")
    assert in_use("tpu") == 3


def _tpus(chips: int) -> str:
    return f"device.capacity['tpu.google.com'].tpus == quantity('{chips}')"


def test_a_multi_host_tpu_slice_counts_the_chips_its_counters_consume(
    client: Client, vendor: Callable
) -> None:
    # KEP-4815: a 4x4 slice takes four chips of each of four nodes; not "1 of 8".
    vendor("tpu-multi-host")
    make_team([{"name": "tpu", "device_class": TPU, "limit": 8}])
    denied = decide(client, claim("slice-4x4", [exactly(TPU, 1, _tpus(16))]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "tpu" (enforce) would be exceeded: 0 TPU chips in use, '
        "16 TPU chips requested, limit 8 TPU chips"
    )
    # A 2x4 half is 8 chips: it fits exactly, and then a 2x2 host (4 chips) does not.
    assert decide(client, claim("slice-2x4", [exactly(TPU, 1, _tpus(8))]))["allowed"]
    assert reserved("slice-2x4") == {"tpu": Decimal("8")}
    assert not decide(client, claim("slice-2x2", [exactly(TPU, 1, _tpus(4))]))["allowed"]
    assert in_use("tpu") == 8


# --- Intel Gaudi2: eight cards ------------------------------------------------------------------

GAUDI = "gaudi.intel.com"


def test_gaudi_claims_count_cards(client: Client, vendor: Callable) -> None:
    vendor("gaudi2")
    make_team([{"name": "gaudi", "device_class": GAUDI, "limit": 4}])
    near = decide(client, claim("four", [exactly(GAUDI, 4)]))
    assert near["allowed"]
    assert near["warnings"] == [
        'team "research": quota rule "gaudi" is at 4 Gaudi cards of 4 Gaudi cards with this claim'
    ]
    denied = decide(client, claim("node", [exactly(GAUDI, allocationMode="All")]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "gaudi" (enforce) would be exceeded: 4 Gaudi cards in use, '
        "8 Gaudi cards requested, limit 4 Gaudi cards"
    )
    # With the quota spent, neither alternative fits: denied, naming both.
    choice = first_available(
        "card",
        exactly(GAUDI, 1, "device.attributes['gaudi.intel.com'].pciRoot == '99'", name="root99"),
        exactly(GAUDI, 1, name="any"),
    )
    refused = decide(client, claim("choice", [choice]))
    assert refused["status"]["message"].endswith(
        "4 Gaudi cards in use, 1 Gaudi card requested, limit 4 Gaudi cards "
        "(none of the 2 alternatives of request 'card' fits)"
    )
    assert in_use("gaudi") == 4


# --- NVIDIA vGPU: an A100-4C and two A100-10C, as the guest's driver publishes them -------------

NVIDIA = "gpu.nvidia.com"


def _product(name: str) -> str:
    return f"device.attributes['gpu.nvidia.com'].productName == '{name}'"


def test_vgpu_profiles_count_their_fraction_of_the_card(client: Client, vendor: Callable) -> None:
    vendor("vgpu")
    make_team([{"name": "gpus", "device_class": NVIDIA, "limit": 1}])
    assert decide(client, claim("small", [exactly(NVIDIA, 1, _product("GRID A100-4C"))]))["allowed"]
    assert reserved("small") == {"gpus": Decimal("0.1")}
    assert decide(client, claim("two", [exactly(NVIDIA, 2, _product("NVIDIA A100-10C"))]))[
        "allowed"
    ]
    assert reserved("two") == {"gpus": Decimal("0.5")}
    # Any vGPU: the most one can count (an A100-10C, a quarter).
    assert decide(client, claim("any", [exactly(NVIDIA, 1)]))["allowed"]
    assert reserved("any") == {"gpus": Decimal("0.25")}
    denied = decide(client, claim("more", [exactly(NVIDIA, 1)]))
    assert "0.85 GPUs in use, 0.25 GPUs requested, limit 1 GPU" in denied["status"]["message"]


# --- Intel GPU: a discrete Flex 170 and an integrated Iris Xe (no memory of its own) ----------

INTEL = "gpu.intel.com"


def test_intel_discrete_counts_and_integrated_does_not(client: Client, vendor: Callable) -> None:
    vendor("intel-gpu")
    make_team([{"name": "intel", "device_class": INTEL, "limit": 1}])
    integrated = "device.attributes['gpu.intel.com'].family == 'Iris Xe'"
    assert decide(client, claim("igpu", [exactly(INTEL, 1, integrated)]))["allowed"]
    assert reserved("igpu") == {"intel": Decimal("0")}
    assert decide(client, claim("flex", [exactly(INTEL, 1)]))["allowed"]  # could get the Flex
    assert reserved("flex") == {"intel": Decimal("1")}
    assert not decide(client, claim("flex-2", [exactly(INTEL, 1)]))["allowed"]


# --- firstAvailable across vendors: an Intel GPU, else a Gaudi card ----------------------------


@pytest.fixture
def intel_and_gaudi() -> None:
    """Intel's discrete and integrated GPUs and eight Gaudi2 cards in one cluster, with a team
    allowed one Intel GPU and one Gaudi card."""
    forget_fleet_shapes()
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[
            *iter_objects(VENDORS / "intel-gpu.yaml"),
            *iter_objects(VENDORS / "gaudi2.yaml"),
        ],
        at=AT,
    )
    assert report.errors == []
    make_team(
        [
            {"name": "intel", "device_class": INTEL, "limit": 1},
            {"name": "gaudi", "device_class": GAUDI, "limit": 1},
        ]
    )


GPU_OR_GAUDI = first_available(
    "accel", exactly(INTEL, 1, name="gpu"), exactly(GAUDI, 1, name="gaudi")
)


@pytest.mark.usefixtures("intel_and_gaudi")
def test_first_available_holds_only_the_alternative_the_mutating_webhook_keeps(
    client: Client,
) -> None:
    """Issue 36, finding 2: the gpu-or-gaudi claim held 1 on the Intel rule and 1 on the Gaudi
    rule, and a one-Gaudi claim was denied ("1 Gaudi card in use")."""
    assert admit(client, claim("gpu-or-gaudi", [GPU_OR_GAUDI]))["allowed"]
    assert reserved("gpu-or-gaudi") == {"intel": Decimal("1")}
    assert Reservation.objects.get(name="gpu-or-gaudi").chosen == {"accel": ["gpu"]}
    assert admit(client, claim("one-gaudi", [exactly(GAUDI, 1)]))["allowed"]
    assert (in_use("intel"), in_use("gaudi")) == (1, 1)


@pytest.mark.usefixtures("intel_and_gaudi")
def test_without_the_mutating_webhook_every_alternative_must_fit(client: Client) -> None:
    """Left in the claim, either alternative may be allocated: it holds the most each takes on
    each rule (one of each, never more than the alternative allocated takes there), and is
    denied while one of them is over quota (it was admitted holding only the Gaudi card, and
    could be given the Intel GPU past its rule's limit)."""
    assert decide(client, claim("both", [GPU_OR_GAUDI]))["allowed"]
    assert reserved("both") == {"intel": Decimal("1"), "gaudi": Decimal("1")}
    Reservation.objects.get(name="both").lines.all().delete()
    QuotaRule.objects.update(in_use=0)
    QuotaRule.objects.filter(name="intel").update(in_use=1)  # the team's Intel GPU is taken
    denied = decide(client, claim("either", [GPU_OR_GAUDI]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "intel" (enforce) would be exceeded: 1 GPU in use, '
        "1 GPU requested, limit 1 GPU by alternative 'gpu' of request 'accel', which the "
        "scheduler may give the claim (remove it, or let Tally's mutating webhook remove the "
        "alternatives over quota)"
    )
    assert in_use("gaudi") == 0
    # Through both webhooks the Intel alternative is removed and the Gaudi card held.
    assert admit(client, claim("either", [GPU_OR_GAUDI]))["allowed"]
    assert reserved("either") == {"gaudi": Decimal("1")}


# --- KEP-4815: one accelerator published whole, in halves and in quarters (several counters) --

PARTS = "gpu.partitions.example.com"


def _hbm(size: str) -> str:
    return f"device.capacity['gpu.partitions.example.com'].hbm == quantity('{size}')"


def test_kep_4815_partitions_count_their_largest_counter_fraction(
    client: Client, vendor: Callable
) -> None:
    vendor("partitionable-counters")
    make_team([{"name": "parts", "device_class": PARTS, "limit": 1}])
    # A quarter takes 1/8 of the copy engines, 1/4 of the multiprocessors, 1/5 of the memory.
    assert decide(client, claim("quarter", [exactly(PARTS, 1, _hbm("16Gi"))]))["allowed"]
    assert reserved("quarter") == {"parts": Decimal("0.25")}
    assert decide(client, claim("half", [exactly(PARTS, 1, _hbm("40Gi"))]))["allowed"]
    assert reserved("half") == {"parts": Decimal("0.5")}
    # The whole device no longer fits; a quarter does.
    choice = first_available(
        "part",
        exactly(PARTS, 1, _hbm("80Gi"), name="whole"),
        exactly(PARTS, 1, _hbm("16Gi"), name="quarter"),
    )
    assert admit(client, claim("choice", [choice]))["allowed"]
    assert Reservation.objects.get(name="choice").chosen == {"part": ["quarter"]}
    assert in_use("parts") == 1


# --- KEP-5075: GPUs several claims share by memory (a valid range) or by cores (valid values) --


def test_consumable_capacity_shares(client: Client, vendor: Callable) -> None:
    vendor("consumable-capacity")
    make_team(
        [
            {"name": "gpus", "device_class": NVIDIA, "limit": 4},
            {"name": "memory", "device_class": NVIDIA, "unit": "memory", "limit": 2**40},
        ]
    )
    # Shapes leave out what identifies one device (the PCI address): told apart by capacity.
    ranged = "'multiprocessors' in device.capacity['gpu.nvidia.com']"
    valued = "'cores' in device.capacity['gpu.nvidia.com']"
    # 9Gi under the qualified name is rounded up to the range's step (10Gi of 80Gi); the GPU's
    # `multiprocessors` has no request policy, so a share that does not ask for them consumes
    # them all, as the scheduler fills an empty request: the whole GPU.
    share = exactly(NVIDIA, 1, ranged, capacity={"requests": {"gpu.nvidia.com/memory": "9.5Gi"}})
    assert decide(client, claim("mem", [share]))["allowed"]
    assert reserved("mem") == {"gpus": Decimal("1"), "memory": Decimal(10 * 2**30)}
    # The same with 10 of the 132 multiprocessors asked for: the largest fraction, 10Gi/80Gi.
    both = exactly(
        NVIDIA,
        1,
        ranged,
        capacity={"requests": {"memory": "9.5Gi", "multiprocessors": "10"}},
    )
    assert decide(client, claim("both", [both]))["allowed"]
    assert reserved("both") == {"gpus": Decimal("0.125"), "memory": Decimal(10 * 2**30)}
    # By cores in valid values (30 -> 50 of 100) with its memory asked for too.
    cores = exactly(NVIDIA, 1, valued, capacity={"requests": {"cores": "30", "memory": "20Gi"}})
    assert decide(client, claim("cores", [cores]))["allowed"]
    assert reserved("cores") == {"gpus": Decimal("0.5"), "memory": Decimal(20 * 2**30)}
    # Asking nothing of the cores: the policy's default, 25 of 100.
    default = exactly(NVIDIA, 1, valued, capacity={"requests": {"memory": "8Gi"}})
    assert decide(client, claim("default", [default]))["allowed"]
    assert reserved("default") == {"gpus": Decimal("0.25"), "memory": Decimal(8 * 2**30)}
    # More cores than any valid value: no device can be given; counted whole, and said so.
    too_many = exactly(NVIDIA, 1, valued, capacity={"requests": {"cores": "150"}})
    answer = decide(client, claim("too-many", [too_many]))
    assert answer["allowed"]
    assert "with capacity cores: 150 in the inventory matches it" in warned(answer)
    assert reserved("too-many", weighed=False) == {"gpus": 1, "memory": 0}


# --- The rules API says what each rule counts ---------------------------------------------------


def test_rules_api_says_the_unit_of_each_rule() -> None:
    forget_fleet_shapes()
    every_device = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "any"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}]},
    }
    report = inventory_services.import_snapshot(
        cluster=inventory_services.get_cluster("default"),
        objects=[
            *iter_objects(VENDORS / "tpu.yaml"),
            *iter_objects(VENDORS / "gaudi2.yaml"),
            every_device,
        ],
        at=AT,
    )
    assert report.errors == []
    make_team(
        [
            {"name": "tpu", "device_class": TPU, "limit": 4},
            {"name": "gaudi", "device_class": GAUDI, "limit": 8},
            {"name": "mixed", "device_class": "any", "limit": 12},
            {"name": "unknown", "device_class": "gpu.nvidia.com", "limit": 1},
            {"name": "hbm", "device_class": GAUDI, "unit": "memory", "limit": 2**40},
        ]
    )
    operator = User.objects.create(username="operator")
    operator.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    api = APIClient()
    api.force_authenticate(operator)
    rows = api.get("/api/v1/quotas/", {"ordering": "name"}).json()["results"]
    assert [(row["name"], row["unit"], row["device_unit"], row["unit_label"]) for row in rows] == [
        ("gaudi", "gpus", "gaudi", "Gaudi cards"),
        ("hbm", "memory", "gaudi", "bytes"),
        ("mixed", "gpus", "accelerator", "accelerators"),
        ("tpu", "gpus", "tpu", "TPU chips"),
        ("unknown", "gpus", "gpu", "GPUs"),  # covers no device: GPUs, as before
    ]


def test_review_claims_says_tpu_chips(vendor: Callable, tmp_path: Path) -> None:
    vendor("tpu")
    make_team([{"name": "tpu", "device_class": TPU, "limit": 3}])
    host = claim("whole-host", [exactly(TPU, allocationMode="All")])
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump(host))
    out = StringIO()
    call_command("review_claims", str(tmp_path), stdout=out)
    assert out.getvalue().splitlines()[0] == (
        f"{tmp_path / 'claims.yaml'}: research/whole-host: DENIED | "
        'team "research": quota rule "tpu" (enforce) would be exceeded: 0 TPU chips in use, '
        "4 TPU chips requested, limit 3 TPU chips"
    )


def test_the_webhook_names_a_rules_unit_over_every_cluster_as_the_api_does(
    client: Client,
) -> None:
    """A rule is not of one cluster: one whose class selects GPUs here and TPU chips in another
    cluster counts accelerators, in the webhook's messages as in the rules API, not the local
    fleet's GPUs."""
    forget_fleet_shapes()
    every_device = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "any"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}]},
    }
    for cluster, objects in [
        ("default", list(iter_objects(VENDORS / "gaudi2.yaml"))),
        ("edge", list(iter_objects(VENDORS / "tpu.yaml"))),
    ]:
        report = inventory_services.import_snapshot(
            cluster=inventory_services.get_cluster(cluster), objects=[*objects, every_device], at=AT
        )
        assert report.errors == []
    make_team(
        [
            {"name": "mixed", "device_class": "any", "limit": 3},
            {"name": "cards", "device_class": GAUDI, "limit": 8},
        ]
    )
    denied = decide(client, claim("four", [exactly(GAUDI, 4)]))
    assert denied["status"]["message"] == (
        'team "research": quota rule "mixed" (enforce) would be exceeded: 0 accelerators in use, '
        "4 accelerators requested, limit 3 accelerators"
    )
    admitted = decide(client, claim("three", [exactly(GAUDI, 3)]))
    assert admitted["allowed"]
    assert sorted(admitted["warnings"]) == [
        'team "research": quota rule "mixed" is at 3 accelerators of 3 accelerators with this claim'
    ]
