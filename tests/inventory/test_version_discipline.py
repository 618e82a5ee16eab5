"""Issue 34: version discipline that cannot take a fleet down.

Fleets loaded from the project's own fixtures (tests/fixtures/dra/), with the versions the
drivers really publish (NVIDIA `580.95.5` / CUDA `13.0.0`, the vGPU guests' `550.90.7`, AMD
MI300X `6.10.5` and `6.12.12`, Gaudi and VFIO passthrough GPUs none), judged by baselines
written the way operators copy them from nvidia-smi (`580.95.05`, CUDA `13.0`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from inventory import services
from inventory.dumps import iter_objects
from inventory.models import Cluster, VersionBaseline, VersionDeviation
from inventory.taints import taint_targets
from inventory.versions import set_baseline, version_matrix
from tests.factories import DeviceFactory, NodeFactory
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

NVIDIA = ("nvidia-slices.yaml", "vendors/nvidia-dynamic-mig.yaml", "vendors/vgpu.yaml")
OTHER_VENDORS = (
    "vendors/amd-mi300x.yaml",
    "vendors/amd-mi300x-autopartition.yaml",
    "vendors/gaudi2.yaml",
)
# The vGPU guests run the guest driver 550.90.7: the true NVIDIA outliers of a 580 baseline.
VGPU_VMS = ["vgpu-vm-1", "vgpu-vm-2"]
AMD_NODES = ["mi300x-node-1", "mi300x-node-2", "mi300x-node-3"]


def fleet(*fixtures: str) -> Cluster:
    objects = [obj for name in fixtures for obj in iter_objects(DRA / name)]
    cluster = services.get_cluster("fx")
    report = services.import_snapshot(
        cluster=cluster,
        objects=objects,
        at=datetime(2026, 12, 1, tzinfo=UTC),
        kinds=["ResourceSlice"],
    )
    assert report.errors == []
    return cluster


def outliers(cluster: Cluster) -> list[str]:
    return version_matrix(cluster=cluster)["outlier_nodes"]


def write_policy(tmp_path: Path, versions: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text("teams: []\nversions:\n" + versions)
    return str(path)


# -- 1. versions compared as versions ---------------------------------------------------------


@pytest.mark.parametrize(
    ("driver_version", "cuda_driver_version"),
    [("580.95.5", "13.0.0"), ("580.95.05", "13.0"), ("580.95.05", "13")],
)
def test_a_baseline_as_nvidia_smi_prints_it_finds_the_same_outliers_as_the_drivers_spelling(
    driver_version: str, cuda_driver_version: str
) -> None:
    cluster = fleet(*NVIDIA)
    VersionBaseline.objects.create(
        cluster=cluster, driver_version=driver_version, cuda_driver_version=cuda_driver_version
    )

    assert outliers(cluster) == VGPU_VMS
    # The matrix shows versions as the driver spells them.
    assert {row["driver_version"] for row in version_matrix(cluster=cluster)["rows"]} == {
        "580.95.5",
        "550.90.7",
    }
    assert [t.node for t in taint_targets(cluster=cluster)] == VGPU_VMS


def test_a_deviation_written_with_leading_zeros_documents_its_node() -> None:
    cluster = fleet(*NVIDIA)
    VersionBaseline.objects.create(cluster=cluster, driver_version="580.95.05")
    VersionDeviation.objects.create(
        cluster=cluster,
        node_name="vgpu-vm-1",
        driver_version="550.90.07",
        reason="vGPU guest driver, validated with the host's vGPU manager",
        owner="gpu-platform",
        expires_at=timezone.now() + timedelta(days=30),
    )

    matrix = version_matrix(cluster=cluster)

    assert (matrix["outlier_nodes"], matrix["documented_nodes"]) == (["vgpu-vm-2"], ["vgpu-vm-1"])


def test_the_computed_baseline_counts_one_version_however_spelled() -> None:
    cluster = fleet("nvidia-slices.yaml")  # gpu-node-1: two A100s on 580.95.5
    node = NodeFactory.create(cluster=cluster, name="a100-typed")
    DeviceFactory.create_batch(
        3,
        node=node,
        product_name="NVIDIA A100-PCIE-40GB",
        driver_version="580.95.05",
        cuda_driver_version="13.0",
    )
    DeviceFactory.create_batch(
        4,
        node=NodeFactory.create(cluster=cluster, name="a100-new"),
        product_name="NVIDIA A100-PCIE-40GB",
        driver_version="580.126.9",
        cuda_driver_version="13.0.0",
    )

    # 580.95.5 on 2 + 3 GPUs outnumbers 580.126.9 on 4: one version, two spellings.
    assert outliers(cluster) == ["a100-new"]


# -- 2. baselines scoped by driver ------------------------------------------------------------


def test_an_nvidia_baseline_in_a_mixed_fleet_judges_only_nvidia_devices() -> None:
    cluster = fleet(*NVIDIA, *OTHER_VENDORS)
    set_baseline(
        cluster=cluster,
        driver="gpu.nvidia.com",
        driver_version="580.95.05",
        cuda_driver_version="13.0",
        actor="ops",
    )

    matrix = version_matrix(cluster=cluster)

    nvidia = [m for m in matrix["models"] if m["driver"] == "gpu.nvidia.com"]
    assert sorted(o["node"] for m in nvidia for o in m["outliers"]) == VGPU_VMS
    # The AMD model keeps its own (computed) baseline: 6.10.5 on more GPUs than 6.12.12, so
    # its only outlier is the node on 6.12.12, not every AMD node as under NVIDIA's baseline.
    [amd] = [m for m in matrix["models"] if m["driver"] == "gpu.amd.com"]
    assert (amd["baseline"]["source"], amd["baseline"]["driver_version"]) == ("computed", "6.10.5")
    assert [o["node"] for o in amd["outliers"]] == ["mi300x-node-3"]
    assert matrix["outlier_nodes"] == ["mi300x-node-3", *VGPU_VMS]
    assert [t.node for t in taint_targets(cluster=cluster)] == ["mi300x-node-3", *VGPU_VMS]


def test_a_cluster_wide_baseline_naming_no_driver_judges_nothing_among_several() -> None:
    cluster = fleet(*NVIDIA, *OTHER_VENDORS)
    VersionBaseline.objects.create(
        cluster=cluster, driver_version="580.95.5", cuda_driver_version="13.0.0"
    )

    matrix = version_matrix(cluster=cluster)

    # Judged by it, every AMD node (another driver, no CUDA) was an outlier; now only the one
    # off the AMD model's own computed baseline is.
    assert set(AMD_NODES) & set(matrix["outlier_nodes"]) == {"mi300x-node-3"}
    assert all(m["baseline"]["source"] == "computed" for m in matrix["models"])
    [warning] = matrix["ambiguous"]
    assert "names no driver" in warning and "gpu.amd.com, gpu.nvidia.com" in warning


def test_a_deviation_naming_a_driver_documents_only_its_devices() -> None:
    cluster = fleet(*NVIDIA, *OTHER_VENDORS)
    common = {
        "cluster": cluster,
        "node_name": "vgpu-vm-1",
        "reason": "r",
        "owner": "o",
        "expires_at": timezone.now() + timedelta(days=1),
    }
    set_baseline(
        cluster=cluster,
        driver="gpu.nvidia.com",
        driver_version="580.95.5",
        cuda_driver_version="",
        actor="a",
    )
    VersionDeviation.objects.create(driver="gpu.amd.com", driver_version="550.90.7", **common)
    assert outliers(cluster) == ["mi300x-node-3", *VGPU_VMS]
    VersionDeviation.objects.create(driver="gpu.nvidia.com", driver_version="550.90.7", **common)
    assert outliers(cluster) == ["mi300x-node-3", "vgpu-vm-2"]


# -- 3. unknown is not outlier ----------------------------------------------------------------


def test_gpus_that_publish_no_version_are_unknown_never_outliers_nor_tainted() -> None:
    cluster = fleet(*NVIDIA, "vendors/gaudi2.yaml")
    # An L4 node whose driver publishes its driver version but no CUDA version.
    DeviceFactory.create_batch(
        2,
        node=NodeFactory.create(cluster=cluster, name="l4-node-1"),
        product_name="NVIDIA L4",
        driver_version="580.95.5",
        cuda_driver_version="",
    )
    set_baseline(
        cluster=cluster,
        driver="gpu.nvidia.com",
        driver_version="580.95.05",
        cuda_driver_version="13.0",
        actor="ops",
    )

    matrix = version_matrix(cluster=cluster)

    assert matrix["outlier_nodes"] == VGPU_VMS
    # vm-node-1: H100s bound to vfio-pci publish no version at all.
    assert matrix["unknown_nodes"] == ["gaudi-node-1", "l4-node-1", "vm-node-1"]
    missing = {u["node"]: u["missing"] for u in matrix["unknown"]}
    assert missing["l4-node-1"] == "CUDA version"
    assert missing["vm-node-1"] == "driver and CUDA versions"
    assert [t.node for t in taint_targets(cluster=cluster)] == VGPU_VMS


# -- 4. apply_policy shows what a versions section does ----------------------------------------


def test_a_policy_version_that_is_no_version_is_refused_with_its_path(tmp_path: Path) -> None:
    policy = write_policy(
        tmp_path,
        "  baselines:\n  - {driver: gpu.nvidia.com, driverVersion: 580.82.x}\n"
        "  deviations:\n  - {node: n, cudaDriverVersion: thirteen, reason: r, owner: o,"
        " expires: 2099-01-01}\n",
    )
    with pytest.raises(CommandError) as raised:
        call_command("apply_policy", policy, stdout=StringIO())
    assert "versions.baselines[0].driverVersion: '580.82.x' is not a version" in str(raised.value)
    assert "versions.deviations[0].cudaDriverVersion: 'thirteen' is not a version" in str(
        raised.value
    )
    assert not VersionBaseline.objects.exists()


def test_a_policy_names_the_driver_of_a_cluster_wide_baseline_in_a_mixed_fleet(
    tmp_path: Path,
) -> None:
    fleet(*NVIDIA, *OTHER_VENDORS)
    policy = write_policy(
        tmp_path,
        "  baselines:\n  - {cluster: fx, driverVersion: 580.95.05, cudaDriverVersion: '13.0'}\n",
    )
    with pytest.raises(CommandError, match=r"versions\.baselines\[0\]: cluster fx has devices of"):
        call_command("apply_policy", policy, stdout=StringIO())
    assert not VersionBaseline.objects.exists()


def test_apply_policy_says_what_each_baseline_judges_and_what_matches_nothing(
    tmp_path: Path,
) -> None:
    fleet(*NVIDIA, *OTHER_VENDORS)
    policy = write_policy(
        tmp_path,
        "  baselines:\n"
        "  - {cluster: fx, driver: gpu.nvidia.com, driverVersion: 580.95.05,"
        " cudaDriverVersion: '13.0'}\n"
        "  - {cluster: fx, driver: gpu.nvidia.com, productName: NVIDIA B200,"
        " driverVersion: 580.95.05}\n"
        "  deviations:\n"
        "  - {cluster: fx, node: vgpu-vm-1, driverVersion: 550.90.07, reason: guest driver,"
        " owner: gpu-platform, expires: 2099-01-31}\n"
        "  - {cluster: fx, node: dgx-gone, driverVersion: 570.172.08, reason: canary,"
        " owner: gpu-platform, expires: 2099-01-31}\n",
    )
    out = StringIO()
    call_command("apply_policy", policy, stdout=out, force=True)
    lines = out.getvalue().splitlines()

    [judged] = [line for line in lines if line.startswith("versions.baselines[0]")]
    assert "judges 5 node(s)" in judged and "outliers: fx/vgpu-vm-2" in judged
    assert (
        "warning: versions.baselines[1] (cluster fx, gpu.nvidia.com, NVIDIA B200) matches no "
        "node" in "\n".join(lines)
    )
    assert any(
        line.startswith("warning: versions.deviations[1] (cluster fx, dgx-gone) matches no node")
        for line in lines
    )
    assert not any("versions.deviations[0]" in line for line in lines if "warning" in line)


def test_a_policy_that_makes_most_of_a_model_outliers_is_refused_unless_forced(
    tmp_path: Path,
) -> None:
    fleet(*NVIDIA)
    # A typo: 508 for 580. Every node of the A100-PCIE model would be an outlier.
    policy = write_policy(
        tmp_path,
        "  baselines:\n  - {cluster: fx, productName: NVIDIA A100-PCIE-40GB,"
        " driverVersion: 508.95.5}\n",
    )

    with pytest.raises(CommandError) as raised:
        call_command("apply_policy", policy, stdout=StringIO())

    message = str(raised.value)
    assert "1 of 1 nodes of NVIDIA A100-PCIE-40GB (gpu.nvidia.com) in cluster fx" in message
    assert "they run 580.95.5" in message and "--force" in message
    assert not VersionBaseline.objects.exists()

    out = StringIO()
    call_command("apply_policy", policy, "--force", stdout=out)
    assert "forced: versions: 1 of 1 nodes" in out.getvalue()
    assert VersionBaseline.objects.get().driver_version == "508.95.5"


def test_the_admin_refuses_a_version_that_is_no_version(admin_client: object) -> None:
    cluster = fleet(*NVIDIA)
    response = admin_client.post(  # type: ignore[attr-defined]
        "/admin/inventory/versionbaseline/add/",
        {"cluster": cluster.pk, "driver_version": "580.82.x", "cuda_driver_version": "13.0"},
    )
    assert response.status_code == 200
    assert "&#x27;580.82.x&#x27; is not a version" in response.content.decode()
    assert not VersionBaseline.objects.exists()


def test_the_admin_asks_for_the_driver_of_a_cluster_wide_baseline_in_a_mixed_fleet(
    admin_client: object,
) -> None:
    cluster = fleet(*NVIDIA, *OTHER_VENDORS)
    add = "/admin/inventory/versionbaseline/add/"
    fields = {"cluster": cluster.pk, "driver_version": "580.95.05", "cuda_driver_version": "13.0"}
    response = admin_client.post(add, fields)  # type: ignore[attr-defined]
    assert "name the driver a cluster-wide baseline judges" in response.content.decode()
    response = admin_client.post(add, {**fields, "driver": "gpu.nvidia.com"})  # type: ignore[attr-defined]
    assert response.status_code == 302
    assert VersionBaseline.objects.get().driver == "gpu.nvidia.com"


def test_an_unquoted_version_keeps_the_text_as_written(tmp_path: Path) -> None:
    """YAML reads `cudaDriverVersion: 13.10` as the number 13.1: the baseline keeps "13.10", the
    version the operator wrote (13.10 is not 13.1 as a version), and "12.80" stays "12.80"."""
    fleet(*NVIDIA)
    policy = write_policy(
        tmp_path,
        "  baselines:\n"
        "  - {cluster: fx, driver: gpu.nvidia.com, driverVersion: 580.95.05,"
        " cudaDriverVersion: 13.10}\n"
        "  - {cluster: fx, driver: gpu.nvidia.com, productName: NVIDIA L4,"
        " cudaDriverVersion: 12.80}\n",
    )
    call_command("apply_policy", policy, stdout=StringIO(), force=True)
    written = sorted(VersionBaseline.objects.values_list("cuda_driver_version", flat=True))
    assert written == ["12.80", "13.10"]
