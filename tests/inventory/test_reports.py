"""Fleet reports: the selectors' counting rules, `manage.py fleet_report` and the admin."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from io import StringIO

import pytest
from django.contrib.admin.sites import site
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    Node,
    Pool,
    ResourceClaim,
    ResourceSlice,
    SyncState,
    VersionBaseline,
)
from inventory.selectors import (
    capacity_by_model,
    fleet_report,
    fragmentation,
    partial_gpus,
    version_matrix,
)
from teams.models import AuditEntry
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
    OtherDeviceFactory,
    PartitionDeviceFactory,
    ResourceClaimFactory,
)

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"
CURRENT = ("580.82.7", "13.0.0")
OLDER = ("570.172.8", "12.8.0")


def gpus_on(
    node: Node, count: int, versions: tuple[str, str] = CURRENT, **fields: object
) -> list[Device]:
    """`count` whole GPUs on `node` with the given driver/CUDA pair."""
    driver, cuda = versions
    return DeviceFactory.create_batch(
        count, node=node, driver_version=driver, cuda_driver_version=cuda, **fields
    )


def capacity_of(product: str, cluster: Cluster | None = None) -> dict[str, object]:
    rows = {row["product_name"]: row for row in capacity_by_model(cluster=cluster)}
    return dict(rows[product])


# -- capacity_by_model ----------------------------------------------------------------------


def test_a_gpu_split_into_mig_devices_counts_once() -> None:
    node = NodeFactory.create()
    # With MIG on, only the MIG devices are published: the whole GPU is not a device.
    parent = DeviceFactory.build(node=node)
    MigDeviceFactory.create_batch(7, parent=parent)

    assert capacity_of(H100) == {
        "product_name": H100,
        "unit": "gpu",
        "unit_label": "GPUs",
        "gpus": 1,
        "allocated": 0,
        "free": 1,
        "mig_devices": 7,
        "equivalents": Decimal(1),
    }


def test_a_whole_gpu_published_beside_its_partitions_counts_once() -> None:
    gpu = DeviceFactory.create()
    PartitionDeviceFactory.create_batch(2, parent=gpu)
    DeviceFactory.create(node=gpu.node)

    assert capacity_of(H100)["gpus"] == 2
    assert capacity_of(H100)["mig_devices"] == 0


def test_gone_and_non_gpu_devices_do_not_count() -> None:
    node = NodeFactory.create()
    gone = DeviceFactory.create(node=node, gone_at=timezone.now())
    MigDeviceFactory.create(parent=gone, gone_at=timezone.now())
    # An open allocation of a gone device must not make anything allocated.
    AllocationFactory.create(device=gone)
    DeviceFactory.create(node=node)
    OtherDeviceFactory.create(node=node)

    assert capacity_by_model() == [
        {
            "product_name": H100,
            "unit": "gpu",
            "unit_label": "GPUs",
            "gpus": 1,
            "allocated": 0,
            "free": 1,
            "mig_devices": 0,
            "equivalents": Decimal(1),
        }
    ]


def test_an_allocated_mig_slice_makes_its_gpu_allocated() -> None:
    gpu = DeviceFactory.create(product_name=A100)
    slices = MigDeviceFactory.create_batch(3, parent=gpu)
    AllocationFactory.create(device=slices[0])
    # An ended allocation holds nothing.
    AllocationFactory.create(
        device=DeviceFactory.create(node=gpu.node, product_name=A100), end=timezone.now()
    )

    assert capacity_of(A100) == {
        "product_name": A100,
        "unit": "gpu",
        "unit_label": "GPUs",
        "gpus": 2,
        "allocated": 1,
        "free": 1,
        "mig_devices": 3,
        "equivalents": Decimal(2),
    }


def test_capacity_is_per_model_and_per_cluster() -> None:
    east, west = ClusterFactory.create(name="east"), ClusterFactory.create(name="west")
    gpus_on(NodeFactory.create(cluster=east), 4)
    gpus_on(NodeFactory.create(cluster=west), 2)
    gpus_on(NodeFactory.create(cluster=west), 8, product_name=A100)

    assert [(row["product_name"], row["gpus"]) for row in capacity_by_model()] == [
        (A100, 8),
        (H100, 6),
    ]
    assert [(row["product_name"], row["gpus"]) for row in capacity_by_model(cluster=east)] == [
        (H100, 4)
    ]


# -- version_matrix -------------------------------------------------------------------------


@pytest.fixture
def mixed_versions() -> Cluster:
    """Three nodes on the current pair, one on the older pair, one with a single stray GPU."""
    cluster = ClusterFactory.create(name="prod")
    for name in ("node-a", "node-b", "node-c"):
        gpus_on(NodeFactory.create(cluster=cluster, name=name), 2)
    gpus_on(NodeFactory.create(cluster=cluster, name="node-old"), 2, OLDER)
    mixed = NodeFactory.create(cluster=cluster, name="node-mixed")
    gpus_on(mixed, 1)
    stray = gpus_on(mixed, 1, OLDER)[0]
    MigDeviceFactory.create_batch(2, parent=stray)
    return cluster


def test_outliers_against_the_most_common_pair(mixed_versions: Cluster) -> None:
    matrix = version_matrix(cluster=mixed_versions)

    assert matrix["baseline"] == {
        "driver_version": "580.82.7",
        "cuda_driver_version": "13.0.0",
        "source": "computed",
        "scope": "",
        "row_id": None,
        "driver": "",
    }
    assert [
        (
            row["driver_version"],
            row["cuda_driver_version"],
            row["nodes"],
            row["gpus"],
            row["baseline"],
        )
        for row in matrix["rows"]
    ] == [
        ("580.82.7", "13.0.0", ["node-a", "node-b", "node-c", "node-mixed"], 7, True),
        ("570.172.8", "12.8.0", ["node-mixed", "node-old"], 3, False),
    ]
    assert matrix["outlier_nodes"] == ["node-mixed", "node-old"]


def set_cluster_baseline(cluster: Cluster, driver: str, cuda: str) -> None:
    VersionBaseline.objects.create(cluster=cluster, driver_version=driver, cuda_driver_version=cuda)


def test_outliers_against_an_operator_baseline(mixed_versions: Cluster) -> None:
    set_cluster_baseline(mixed_versions, *OLDER)

    matrix = version_matrix(cluster=mixed_versions)

    assert matrix["baseline"] == {
        "driver_version": "570.172.8",
        "cuda_driver_version": "12.8.0",
        "source": "set",
        "scope": "cluster",
        "row_id": VersionBaseline.objects.get().pk,
        "driver": "",
    }
    assert matrix["outlier_nodes"] == ["node-a", "node-b", "node-c", "node-mixed"]


def test_an_operator_may_pin_the_driver_only(mixed_versions: Cluster) -> None:
    gpus_on(
        NodeFactory.create(cluster=mixed_versions, name="node-new-cuda"), 1, ("580.82.7", "13.1.0")
    )
    set_cluster_baseline(mixed_versions, "580.82.7", "")

    assert version_matrix(cluster=mixed_versions)["outlier_nodes"] == ["node-mixed", "node-old"]


def test_a_tie_goes_to_the_newest_driver() -> None:
    cluster = ClusterFactory.create()
    gpus_on(NodeFactory.create(cluster=cluster, name="n1"), 1, ("580.9.1", "13.0.0"))
    # Numerically newer though it sorts lower as text.
    gpus_on(NodeFactory.create(cluster=cluster, name="n2"), 1, ("580.126.20", "13.0.0"))

    matrix = version_matrix(cluster=cluster)

    assert matrix["baseline"] is not None
    assert matrix["baseline"]["driver_version"] == "580.126.20"
    assert matrix["outlier_nodes"] == ["n1"]


def test_all_clusters_get_their_own_baseline() -> None:
    east, west = ClusterFactory.create(name="east"), ClusterFactory.create(name="west")
    gpus_on(NodeFactory.create(cluster=east, name="gpu-1"), 1, CURRENT)
    gpus_on(NodeFactory.create(cluster=west, name="gpu-1"), 1, OLDER)
    gpus_on(NodeFactory.create(cluster=west, name="gpu-2"), 1, OLDER)
    gpus_on(NodeFactory.create(cluster=west, name="gpu-3"), 1, CURRENT)
    ClusterFactory.create(name="empty")

    matrix = version_matrix()

    assert matrix["baseline"] is None
    assert {name: b and b["driver_version"] for name, b in matrix["baselines"].items()} == {
        "east": "580.82.7",
        "empty": None,
        "west": "570.172.8",
    }
    # Node names are unique only within a cluster, so they carry it.
    assert matrix["outlier_nodes"] == ["west/gpu-3"]


def test_devices_without_versions_or_node_are_handled() -> None:
    cluster = ClusterFactory.create()
    gpus_on(NodeFactory.create(cluster=cluster, name="n1"), 1)
    # VFIO passthrough publishes no driver version; a multi-node pool device has no node.
    gpus_on(NodeFactory.create(cluster=cluster, name="vfio"), 1, ("", ""))
    DeviceFactory.create(node=None, cluster=cluster, driver_version=OLDER[0])

    matrix = version_matrix(cluster=cluster)

    assert [(row["driver_version"], row["nodes"], row["gpus"]) for row in matrix["rows"]] == [
        ("580.82.7", ["n1"], 1),
        ("570.172.8", [], 1),
    ]
    assert matrix["outlier_nodes"] == []


# -- fragmentation --------------------------------------------------------------------------


@pytest.fixture
def busy_cluster() -> Cluster:
    """a: 8 free; b: 5 of 8 free; c: full; a and b share a clique, d is alone with 6 free."""
    cluster = ClusterFactory.create(name="busy")
    gpus_on(NodeFactory.create(cluster=cluster, name="a", clique="fabric-1.0"), 8)
    b = gpus_on(NodeFactory.create(cluster=cluster, name="b", clique="fabric-1.0"), 8)
    c = gpus_on(NodeFactory.create(cluster=cluster, name="c", clique="fabric-1.1"), 2)
    gpus_on(NodeFactory.create(cluster=cluster, name="d"), 6)
    for gpu in b[:2] + c:
        AllocationFactory.create(device=gpu)
    # A MIG slice of a third GPU on b: allocated once, however many slices are held.
    for mig in MigDeviceFactory.create_batch(2, parent=b[2]):
        AllocationFactory.create(device=mig)
    DeviceFactory.create(node=None, cluster=cluster)  # multi-node pool: no node, no fragmentation
    return cluster


def test_fragmentation_per_node_and_clique(busy_cluster: Cluster) -> None:
    spread = fragmentation(cluster=busy_cluster)

    assert [
        (row["node"], row["gpus"], row["allocated"], row["free"]) for row in spread["nodes"]
    ] == [
        ("a", 8, 0, 8),
        ("b", 8, 3, 5),
        ("c", 2, 2, 0),
        ("d", 6, 0, 6),
    ]
    assert (spread["nodes_free"], spread["nodes_partial"], spread["nodes_full"]) == (2, 1, 1)
    assert spread["largest_free_block"] == 8
    assert spread["largest_free_clique_block"] == 13


def test_cliques_do_not_span_clusters(busy_cluster: Cluster) -> None:
    other = ClusterFactory.create(name="other")
    gpus_on(NodeFactory.create(cluster=other, name="x", clique="fabric-1.0"), 8)

    spread = fragmentation()

    assert spread["largest_free_clique_block"] == 13
    assert [row["node"] for row in spread["nodes"]][-1] == "other/x"


# -- partly used GPUs -----------------------------------------------------------------------

A100_80 = "NVIDIA A100-SXM4-80GB"
THREE_SEVENTHS = Decimal("0.428571")


@pytest.fixture
def mig_cluster() -> Cluster:
    """n1: an A100 split statically into two 3g.40gb slices (one held), another with both
    held, a whole GPU held and a free GPU; n2: a GPU published whole and as two overlapping
    halves (one held), and an A100 published whole and as seven 1g.10gb, all seven held."""
    cluster = ClusterFactory.create(name="mig")
    n1 = NodeFactory.create(cluster=cluster, name="n1")
    # Static MIG: the driver publishes the slices, not the GPU they are cut from.
    a100 = DeviceFactory.build(node=n1, product_name=A100_80, uuid="GPU-a100")
    held_slice, _ = MigDeviceFactory.create_batch(
        2, parent=a100, profile="3g.40gb", gpu_share=THREE_SEVENTHS
    )
    AllocationFactory.create(device=held_slice)
    # Both held: 6/7 of the compute, but no memory left for another slice, so full.
    busy = DeviceFactory.build(node=n1, product_name=A100_80, uuid="GPU-busy")
    for mig in MigDeviceFactory.create_batch(
        2, parent=busy, profile="3g.40gb", gpu_share=THREE_SEVENTHS
    ):
        AllocationFactory.create(device=mig)
    whole, _ = DeviceFactory.create_batch(2, node=n1)
    AllocationFactory.create(device=whole)

    n2 = NodeFactory.create(cluster=cluster, name="n2")
    partitionable = DeviceFactory.create(node=n2, uuid="GPU-halves")
    counters = {"consumesCounters": [{"counterSet": "gpu-0-counters", "counters": {}}]}
    half, _ = PartitionDeviceFactory.create_batch(2, parent=partitionable, extra=counters)
    AllocationFactory.create(device=half)
    # Seven times 0.142857 is 0.999999: wholly held, though the whole GPU's device is not.
    full = DeviceFactory.create(node=n2, product_name=A100_80, uuid="GPU-full")
    for mig in MigDeviceFactory.create_batch(7, parent=full):
        AllocationFactory.create(device=mig)
    return cluster


def test_partly_used_gpus_show_the_share_and_slices_free(mig_cluster: Cluster) -> None:
    rows = partial_gpus(cluster=mig_cluster)

    assert [
        (row["node"], row["physical_gpu_key"], row["product_name"], row["held_label"])
        for row in rows
    ] == [("n1", "GPU-a100", A100_80, "3/7"), ("n2", "GPU-halves", H100, "50%")]
    mig, halves = rows
    assert (mig["held_share"], mig["free_share"]) == (THREE_SEVENTHS, 1 - THREE_SEVENTHS)
    assert mig["held_devices"] == {"3g.40gb": 1}
    assert (mig["free_slices"], mig["overlapping_unheld"]) == ({"3g.40gb": 1}, False)
    # The unheld half and the whole GPU overlap the held half: only the free share is known.
    assert (halves["held_share"], halves["free_share"]) == (Decimal("0.5"), Decimal("0.5"))
    assert (halves["free_slices"], halves["overlapping_unheld"]) == ({}, True)


def test_fragmentation_counts_the_free_share_of_partly_used_gpus(mig_cluster: Cluster) -> None:
    spread = fragmentation(cluster=mig_cluster)

    assert [
        (
            row["node"],
            row["gpus"],
            row["allocated"],
            row["free"],
            row["gpus_partial"],
            row["free_share"],
        )
        for row in spread["nodes"]
    ] == [
        ("n1", 4, 3, 1, 1, 1 + 1 - THREE_SEVENTHS),
        ("n2", 2, 2, 0, 1, Decimal("0.5")),
    ]
    assert spread["gpus_partial"] == 2
    assert spread["partial_free_share"] == 1 - THREE_SEVENTHS + Decimal("0.5")
    # A partly used GPU takes no whole-GPU claim.
    assert spread["largest_free_block"] == 1


def test_partly_used_gpus_in_other_clusters_and_released_slices(mig_cluster: Cluster) -> None:
    other = ClusterFactory.create(name="other")
    # The same fallback key in another cluster, with nothing held: it is not partly used.
    DeviceFactory.create(node=NodeFactory.create(cluster=other, name="n1"), uuid="GPU-a100")
    assert [row["node"] for row in partial_gpus()] == ["mig/n1", "mig/n2"]

    Allocation.objects.filter(device__physical_gpu_key="GPU-a100").update(end=timezone.now())
    assert [row["physical_gpu_key"] for row in partial_gpus()] == ["GPU-halves"]


# -- fleet_report ---------------------------------------------------------------------------


def test_fleet_report(busy_cluster: Cluster, django_assert_max_num_queries) -> None:
    set_cluster_baseline(busy_cluster, *OLDER)
    OtherDeviceFactory.create(node=Node.objects.get(name="d"))

    # Capacity 1, versions 3, fragmentation 3 (4 when partitions consume counters), sync
    # warnings 3 (incomplete pools, devices live in another cluster, GPUs named by PCI id):
    # however many devices.
    # One of them: the free blocks of multi-host sets (KEP-4815 slices spanning nodes).
    with django_assert_max_num_queries(12):
        report = fleet_report(cluster=busy_cluster)

    assert report["nodes"] == 4
    assert report["gpus_by_model"] == {H100: 25}
    assert report["mig_devices"] == 2
    assert report["capacity"] == [
        {
            "product_name": H100,
            "unit": "gpu",
            "unit_label": "GPUs",
            "gpus": 25,
            "allocated": 5,
            "free": 20,
            "mig_devices": 2,
            "equivalents": "25",
        }
    ]
    assert report["driver_matrix"] == [
        {
            "cluster": "busy",
            "product_name": H100,
            "architecture": "Hopper",
            "driver_version": "580.82.7",
            "cuda_driver_version": "13.0.0",
            "nodes": 4,
            "node_names": ["a", "b", "c", "d"],
            "gpus": 25,
            "baseline": False,
            "documented_nodes": [],
            "outlier_nodes": ["a", "b", "c", "d"],
        }
    ]
    assert report["baseline"]["source"] == "set"
    assert report["outlier_nodes"] == ["a", "b", "c", "d"]
    assert report["fragmentation"] == {
        "nodes_free": 2,
        "nodes_partial": 1,
        "nodes_full": 1,
        "largest_free_block": 8,
        "largest_free_clique_block": 13,
        "free_blocks": [
            {
                "unit": "gpu",
                "unit_label": "GPUs",
                "product_name": H100,
                "largest_free_block": 8,
                "largest_free_clique_block": 13,
            }
        ],
        # b's third GPU: two 1g slices held, the whole GPU published beside them unheld.
        "gpus_partial": 1,
        "partial_free_share": "0.714286",
        "partial_free_by_unit": {"gpu": "0.714286"},
    }
    # b: two whole GPUs held, and two 1g slices of a third.
    assert [(row["node"], row["gpus_partial"]) for row in report["partly_used_nodes"]] == [("b", 1)]
    [partial] = report["partial_gpus"]
    assert (partial["node"], partial["held_share"], partial["held_label"]) == (
        "b",
        "0.285714",
        "2/7",
    )
    assert (partial["free_slices"], partial["overlapping_unheld"]) == ({}, True)
    assert json.loads(json.dumps(report)) == report


# -- manage.py fleet_report -----------------------------------------------------------------


def run_report(*args: str) -> str:
    out = StringIO()
    call_command("fleet_report", *args, stdout=out)
    return out.getvalue()


def test_command_json(busy_cluster: Cluster, mixed_versions: Cluster) -> None:
    report = json.loads(run_report("--format", "json", "--cluster", "prod"))

    assert report["cluster"] == "prod"
    assert report["nodes"] == 5
    assert report["gpus_by_model"] == {H100: 10}
    assert report["outlier_nodes"] == ["node-mixed", "node-old"]
    assert report["fragmentation"]["largest_free_block"] == 2

    everything = json.loads(run_report("--format", "json"))
    assert everything["gpus_by_model"] == {H100: 35}
    assert "busy/a" in everything["driver_matrix"][0]["node_names"]


def test_command_lists_gpus_whose_version_is_unknown_apart(mixed_versions: Cluster) -> None:
    # H100s bound to vfio-pci for passthrough publish no version (tests/fixtures/dra).
    gpus_on(NodeFactory.create(cluster=mixed_versions, name="vm-node-1"), 2, ("", ""))
    text = run_report("--cluster", "prod")
    assert "Version unknown, neither on a baseline nor outliers (1)\n  vm-node-1" in text
    assert "Outlier nodes, undocumented (2)\n  node-mixed\n  node-old" in text


def test_command_table(mixed_versions: Cluster) -> None:
    text = run_report("--cluster", "prod")

    cells = {line.split("  ")[0]: re.split(r"\s{2,}", line) for line in text.splitlines()}
    assert cells[H100] == [H100, "10", "10", "0", "10", "2"]
    assert cells["*"] == ["*", "prod", H100, "580.82.7", "13.0.0", "4", "7"]
    assert (
        f"Baseline of prod, {H100}: driver 580.82.7, CUDA 13.0.0 (most GPUs); 7 of 10 GPUs on it"
        in text
    )
    assert "Outlier nodes, undocumented (2)\n  node-mixed\n  node-old" in text
    assert "Version unknown, neither on a baseline nor outliers (0)\n  none" in text
    assert "Documented deviations (0)\n  none" in text
    assert "Fragmentation" in text


def test_command_shows_partly_used_gpus(mig_cluster: Cluster) -> None:
    report = json.loads(run_report("--format", "json"))
    assert report["fragmentation"]["gpus_partial"] == 2
    assert report["fragmentation"]["partial_free_share"] == "1.071429"
    assert [(row["node"], row["free_slices"]) for row in report["partial_gpus"]] == [
        ("mig/n1", {"3g.40gb": 1}),
        ("mig/n2", {}),
    ]

    text = run_report("--cluster", "mig")
    assert "Partly used GPUs (2, 1.071429 GPUs free)" in text
    gpus = text[text.index("Partly used GPUs") :]
    cells = {line.split("  ")[0]: re.split(r"\s{2,}", line) for line in gpus.splitlines()}
    assert cells["n1"] == ["n1", "GPU-a100", A100_80, "3/7", "4/7 GPU", "3g.40gb: 1", "3g.40gb"]
    # The unheld half fits in what the held one leaves; the whole GPU does not.
    assert cells["n2"] == [
        "n2",
        "GPU-halves",
        H100,
        "50%",
        "50% GPU",
        "partitionable, each alone: 50% GPU: 1",
        "50% GPU",
    ]


def test_command_table_on_an_empty_inventory() -> None:
    assert "Outlier nodes, undocumented (0)\n  none" in run_report()


def test_command_rejects_an_unknown_cluster() -> None:
    with pytest.raises(CommandError, match="nowhere"):
        run_report("--cluster", "nowhere")


# -- admin ----------------------------------------------------------------------------------


@pytest.fixture
def operator(client: Client, django_user_model) -> Client:
    user = django_user_model.objects.create_superuser("operator", "op@example.com", None)
    client.force_login(user)
    return client


@pytest.fixture
def full_inventory(busy_cluster: Cluster) -> Cluster:
    """One row of every model besides the devices, nodes and allocations of `busy_cluster`."""
    now = timezone.now()
    DeviceClass.objects.create(
        cluster=busy_cluster,
        name="gpu.nvidia.com",
        api_version="resource.k8s.io/v1",
        selectors=["device.driver == 'gpu.nvidia.com'"],
        first_seen=now,
    )
    ResourceSlice.objects.create(
        cluster=busy_cluster,
        name="a-gpu.nvidia.com-x7k2p",
        api_version="resource.k8s.io/v1",
        driver="gpu.nvidia.com",
        pool="a",
        generation=1,
        resource_slice_count=1,
        node_name="a",
        first_seen=now,
    )
    Pool.objects.create(
        cluster=busy_cluster, driver="gpu.nvidia.com", name="a", slices_expected=1, updated_at=now
    )
    SyncState.objects.create(cluster=busy_cluster, kind="ResourceSlice", resource_version="42")
    ResourceClaimFactory.create(cluster=busy_cluster, released_at=now)
    return busy_cluster


ADMIN_MODELS = [
    Cluster,
    Node,
    DeviceClass,
    ResourceSlice,
    Pool,
    Device,
    ResourceClaim,
    Allocation,
    SyncState,
]


@pytest.mark.parametrize("model", ADMIN_MODELS, ids=lambda model: model.__name__)
def test_admin_changelist_and_change_page(operator: Client, full_inventory: Cluster, model) -> None:
    info = (model._meta.app_label, model._meta.model_name)
    assert operator.get(reverse("admin:{}_{}_changelist".format(*info))).status_code == 200
    obj = model.objects.order_by("pk").first()
    page = operator.get(reverse("admin:{}_{}_change".format(*info), args=[obj.pk]))
    assert page.status_code == 200


@pytest.mark.parametrize(
    "query",
    [
        "kind__exact=mig",
        f"product_name={H100}",
        "driver_version=580.82.7&cuda_driver_version=13.0.0",
        "gone=no",
        "gone=yes",
        "q=GPU-",
        "q=node-a",
    ],
)
def test_admin_device_filters_and_search(
    operator: Client, full_inventory: Cluster, query: str
) -> None:
    response = operator.get(reverse("admin:inventory_device_changelist") + "?" + query)
    # An unknown lookup would redirect to `?e=1` instead.
    assert response.status_code == 200


def test_admin_device_node_filter(operator: Client, full_inventory: Cluster) -> None:
    node = Node.objects.get(name="c")
    response = operator.get(reverse("admin:inventory_device_changelist"), {"node": node.pk})
    assert response.status_code == 200
    assert response.context["cl"].result_count == 2


@pytest.mark.parametrize(
    ("query", "count"), [({"ended": "no"}, 6), ({"ended": "yes"}, 0), ({"q": "team-a"}, 6)]
)
def test_admin_allocation_filters(operator: Client, full_inventory: Cluster, query, count) -> None:
    response = operator.get(reverse("admin:inventory_allocation_changelist"), query)
    assert response.status_code == 200
    assert response.context["cl"].result_count == count


def test_admin_synced_models_are_read_only(operator: Client, full_inventory: Cluster) -> None:
    assert operator.get(reverse("admin:inventory_device_add")).status_code == 403
    device_admin = site._registry[Device]
    request = operator.get(reverse("admin:inventory_device_changelist")).wsgi_request
    assert not device_admin.has_add_permission(request)
    assert not device_admin.has_delete_permission(request)
    device = Device.objects.first()
    assert device is not None
    before = device.product_name
    operator.post(
        reverse("admin:inventory_device_change", args=[device.pk]), {"product_name": "hacked"}
    )
    device.refresh_from_db()
    assert device.product_name == before


def test_admin_cluster_is_not_editable(operator: Client, full_inventory: Cluster) -> None:
    url = reverse("admin:inventory_cluster_change", args=[full_inventory.pk])
    response = operator.post(url, {"name": "renamed"})
    assert response.status_code == 302
    full_inventory.refresh_from_db()
    assert full_inventory.name == "busy"
    assert operator.get(reverse("admin:inventory_cluster_add")).status_code == 403


def test_admin_action_sets_each_models_most_common_baseline(
    operator: Client, full_inventory: Cluster
) -> None:
    empty = ClusterFactory.create(name="empty")
    response = operator.post(
        reverse("admin:inventory_cluster_changelist"),
        {
            "action": "set_baselines_to_most_common",
            "_selected_action": [full_inventory.pk, empty.pk],
        },
        follow=True,
    )
    assert response.status_code == 200
    assert [
        (row.cluster.name, row.product_name, row.driver_version, row.cuda_driver_version)
        for row in VersionBaseline.objects.all()
    ] == [("busy", H100, *CURRENT)]
    assert [str(message) for message in response.context["messages"]] == [
        "empty: no GPU publishes a driver version",
        f"busy: baseline of {H100} (gpu.nvidia.com) set to driver 580.82.7, CUDA 13.0.0",
    ]
    assert AuditEntry.objects.get().object_type == "version baseline"


def test_admin_device_changelist_query_count_is_fixed(
    operator: Client, full_inventory: Cluster, django_assert_max_num_queries
) -> None:
    url = reverse("admin:inventory_device_changelist")
    # Session, user, cluster filter, page count, page rows, three distinct-value filters;
    # the chosen node adds one. More devices or nodes add none.
    with django_assert_max_num_queries(8):
        assert operator.get(url).status_code == 200
    for node in Node.objects.all():
        gpus_on(node, 5)
    with django_assert_max_num_queries(8):
        assert operator.get(url).status_code == 200
    node = Node.objects.get(name="b")
    with django_assert_max_num_queries(9):
        assert operator.get(url, {"node": str(node.pk), "q": "gpu"}).status_code == 200


def test_admin_allocations_show_and_find_who_held_them(
    operator: Client, full_inventory: Cluster
) -> None:
    allocation = Allocation.objects.order_by("pk").first()
    assert allocation is not None
    Allocation.objects.filter(pk=allocation.pk).update(
        job="JobSet/llm-pretrain", username="alice@example.com"
    )
    changelist = reverse("admin:inventory_allocation_changelist")
    page = operator.get(changelist).content.decode()
    assert "JobSet/llm-pretrain" in page and "alice@example.com" in page
    for query in ("llm-pretrain", "alice@"):
        response = operator.get(changelist, {"q": query})
        assert response.context["cl"].result_count == 1


def test_api_summary_shows_partly_used_gpus(operator: Client, mig_cluster: Cluster) -> None:
    response = operator.get("/api/v1/inventory/summary/", {"cluster": "mig"})

    assert response.status_code == 200, response.content
    report = response.json()
    assert report["fragmentation"]["gpus_partial"] == 2
    assert report["fragmentation"]["partial_free_share"] == "1.071429"
    row = report["partial_gpus"][0]
    assert (row["node"], row["held_share"], row["free_share"]) == ("n1", "0.428571", "0.571429")
    assert (row["held_label"], row["free_slices"]) == ("3/7", {"3g.40gb": 1})


# -- units: capacity and free blocks never mix vendors or models ----------------------------


def test_capacity_and_free_blocks_are_per_unit_and_model_from_the_vendor_fixtures() -> None:
    from datetime import UTC, datetime

    from inventory import services
    from inventory.dumps import iter_objects
    from tests.fixtures import DRA

    objects = [
        obj
        for name in ("tpu.yaml", "gaudi2.yaml", "vgpu.yaml", "amd-mi300x.yaml")
        for obj in iter_objects(DRA / "vendors" / name)
    ]
    report = services.import_snapshot(
        cluster=services.get_cluster("fx"),
        objects=objects,
        at=datetime(2026, 12, 1, 8, 0, tzinfo=UTC),
        kinds=["ResourceSlice"],
    )
    assert report.errors == []

    rows = [
        (row["unit_label"], row["product_name"], row["gpus"], row["equivalents"])
        for row in capacity_by_model()
    ]
    assert rows == [
        ("GPUs", "AMD_Instinct_MI300X_OAM", 9, Decimal(9)),  # 8 whole, 1 in eight CPX partitions
        # VMs' vGPUs (an A100-4C, two A100-10C): shares of A100s, under the GPU's model.
        ("GPUs", "NVIDIA A100", 3, Decimal("0.6")),
        ("TPU chips", "v4", 4, Decimal(4)),
        ("Gaudi cards", "Gaudi2", 8, Decimal(8)),
    ]
    blocks = {
        (block["unit_label"], block["product_name"]): block["largest_free_block"]
        for block in fragmentation()["free_blocks"]
    }
    assert blocks[("TPU chips", "v4")] == 4
    assert blocks[("Gaudi cards", "Gaudi2")] == 8
    assert blocks[("GPUs", "AMD_Instinct_MI300X_OAM")] == 8


def test_free_tpu_chips_and_gpus_on_one_node_are_two_blocks() -> None:
    cluster = ClusterFactory.create(name="mixed")
    node = NodeFactory.create(cluster=cluster, name="mixed", clique="c1")
    gpus_on(node, 2)
    DeviceFactory.create_batch(
        4, node=node, driver="tpu.google.com", unit="tpu", product_name="v5p", kind="gpu"
    )
    gpus_on(NodeFactory.create(cluster=cluster, name="other", clique="c1"), 3)

    spread = fragmentation()

    fields = ("unit_label", "product_name", "largest_free_block", "largest_free_clique_block")
    blocks = [tuple(block[name] for name in fields) for block in spread["free_blocks"]]  # type: ignore[literal-required]
    assert blocks == [("GPUs", H100, 3, 5), ("TPU chips", "v5p", 4, 4)]
    assert (spread["largest_free_block"], spread["largest_free_clique_block"]) == (4, 5)
    out = StringIO()
    call_command("fleet_report", stdout=out)
    text = out.getvalue()
    assert "Capacity by model: TPU chips\nMODEL  TPU CHIPS  CAPACITY  ALLOCATED  FREE" in text
    lines = text.split("Free blocks by model")[1].split("\n\n")[0].splitlines()[2:]
    assert [line.split()[-2:] for line in lines] == [["3", "5"], ["4", "4"]]
