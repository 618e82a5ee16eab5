"""Version baselines per cluster and model, and the register of documented deviations."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
import time_machine
from django.contrib.auth.models import AbstractBaseUser
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inventory import version_policy, versions
from inventory.models import Cluster, Node, VersionBaseline, VersionDeviation
from inventory.selectors import fleet_report, version_matrix
from inventory.taints import taint_targets
from teams.models import AuditEntry
from tests.factories import ClusterFactory, DeviceFactory, MigDeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db

H100 = "NVIDIA H100 80GB HBM3"
VGPU = "GRID A100-4C"
# Pair A: the DGX hosts' driver. Pair B: the vGPU guest driver the VMs run (older, by design).
PAIR_A = ("580.82.7", "13.0.0")
PAIR_B = ("550.90.7", "12.4.0")
OLD_HOST = ("570.172.8", "12.8.0")


def gpus(node: Node, count: int, pair: tuple[str, str], **fields: object) -> None:
    DeviceFactory.create_batch(
        count, node=node, driver_version=pair[0], cuda_driver_version=pair[1], **fields
    )


@pytest.fixture
def mixed_fleet() -> Cluster:
    """Three DGX H100 nodes (8 GPUs each) on pair A, four VMs with one vGPU each on pair B.

    By node count B wins 4 to 3 and 24 of 28 GPUs would be flagged; per model nothing is.
    """
    cluster = ClusterFactory.create(name="prod")
    for index in range(3):
        gpus(NodeFactory.create(cluster=cluster, name=f"dgx-{index}"), 8, PAIR_A)
    for index in range(4):
        vm = NodeFactory.create(cluster=cluster, name=f"vgpu-vm-{index}")
        gpus(vm, 1, PAIR_B, product_name=VGPU, architecture="Ampere", memory_bytes=4 << 30)
    return cluster


def baselines_by_model(matrix: versions.VersionMatrix) -> dict[str, tuple[str, str, str, str]]:
    return {
        model["product_name"]: (
            model["baseline"]["driver_version"],
            model["baseline"]["cuda_driver_version"],
            model["baseline"]["source"],
            model["baseline"]["scope"],
        )
        for model in matrix["models"]
    }


def test_a_mixed_fleet_gets_a_baseline_per_model_and_no_false_outliers(
    mixed_fleet: Cluster,
) -> None:
    matrix = version_matrix(cluster=mixed_fleet)

    assert baselines_by_model(matrix) == {
        VGPU: (*PAIR_B, "computed", ""),
        H100: (*PAIR_A, "computed", ""),
    }
    assert matrix["outlier_nodes"] == []
    assert [
        (m["product_name"], m["gpus"], m["gpus_on_baseline"], len(m["nodes_on_baseline"]))
        for m in matrix["models"]
    ] == [(VGPU, 4, 4, 4), (H100, 24, 24, 3)]
    # The models' baselines differ, so the cluster has no single one.
    assert matrix["baseline"] is None and matrix["baselines"] == {"prod": None}


def test_only_the_real_outlier_is_flagged(mixed_fleet: Cluster) -> None:
    """A fourth DGX node on an older driver, and one MIG-partitioned H100 of dgx-0 on it too."""
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-old"), 8, OLD_HOST)
    stray = DeviceFactory.create(
        node=Node.objects.get(name="dgx-0"),
        driver_version=OLD_HOST[0],
        cuda_driver_version=OLD_HOST[1],
    )
    MigDeviceFactory.create_batch(3, parent=stray)

    matrix = version_matrix(cluster=mixed_fleet)

    assert matrix["outlier_nodes"] == ["dgx-0", "dgx-old"]
    [h100] = [m for m in matrix["models"] if m["product_name"] == H100]
    # Physical GPUs: the MIG devices count with their parent, once.
    assert [(o["node"], o["gpus"], o["deviation"]) for o in h100["outliers"]] == [
        ("dgx-0", 1, None),
        ("dgx-old", 8, None),
    ]
    assert (h100["gpus"], h100["gpus_on_baseline"]) == (33, 24)
    rows = [
        (r["product_name"], r["driver_version"], r["gpus"], r["baseline"]) for r in matrix["rows"]
    ]
    assert rows == [
        (VGPU, PAIR_B[0], 4, True),
        (H100, PAIR_A[0], 24, True),
        (H100, OLD_HOST[0], 9, False),
    ]


def test_set_baselines_win_over_computed_most_specific_first(mixed_fleet: Cluster) -> None:
    a100 = "NVIDIA A100-SXM4-40GB"
    gpus(
        NodeFactory.create(cluster=mixed_fleet, name="a100-0"),
        2,
        PAIR_A,
        product_name=a100,
        architecture="Ampere",
    )
    # Cluster-wide: pair A. Ampere: pair B. The vGPU model itself: the driver only.
    VersionBaseline.objects.create(
        cluster=mixed_fleet, driver_version=PAIR_A[0], cuda_driver_version=PAIR_A[1]
    )
    VersionBaseline.objects.create(
        cluster=mixed_fleet,
        architecture="Ampere",
        driver_version=PAIR_B[0],
        cuda_driver_version=PAIR_B[1],
    )
    VersionBaseline.objects.create(
        cluster=mixed_fleet, product_name=VGPU, driver_version="550.90.7"
    )
    # Another cluster's rows never apply here.
    VersionBaseline.objects.create(
        cluster=ClusterFactory.create(name="lab"), product_name=H100, driver_version="1.0"
    )

    matrix = version_matrix(cluster=mixed_fleet)

    assert baselines_by_model(matrix) == {
        VGPU: ("550.90.7", "", "set", "product"),
        a100: (*PAIR_B, "set", "architecture"),
        H100: (*PAIR_A, "set", "cluster"),
    }
    # The A100 node runs pair A, but its architecture's baseline is pair B.
    assert matrix["outlier_nodes"] == ["a100-0"]


def test_most_common_pairs_ignore_set_baselines_and_tie_to_the_newest() -> None:
    cluster = ClusterFactory.create()
    gpus(NodeFactory.create(cluster=cluster, name="n1"), 1, ("580.9.1", "13.0.0"))
    gpus(NodeFactory.create(cluster=cluster, name="n2"), 1, ("580.126.20", "13.0.0"))
    VersionBaseline.objects.create(cluster=cluster, driver_version="1.0")
    assert versions.most_common_version_pairs(cluster=cluster) == {
        ("gpu.nvidia.com", H100): {"driver_version": "580.126.20", "cuda_driver_version": "13.0.0"}
    }


# -- deviations -------------------------------------------------------------------------------


def test_a_documented_deviation_is_no_outlier_but_tainted_until_it_expires(
    mixed_fleet: Cluster,
) -> None:
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-canary"), 8, OLD_HOST)
    expires = timezone.now() + timedelta(days=14)
    deviation = VersionDeviation.objects.create(
        cluster=mixed_fleet,
        node_name="dgx-canary",
        driver_version=OLD_HOST[0],
        reason="canary for the 570 branch",
        owner="gpu-platform",
        expires_at=expires,
    )

    matrix = version_matrix(cluster=mixed_fleet)

    assert matrix["outlier_nodes"] == []
    assert matrix["documented_nodes"] == ["dgx-canary"]
    [outlier] = [o for m in matrix["models"] for o in m["outliers"]]
    assert outlier["deviation"] is not None and outlier["deviation"]["id"] == deviation.pk
    assert [d["expired"] for d in matrix["deviations"]] == [False]
    [target] = taint_targets(cluster=mixed_fleet)
    assert (target.node, target.documented, target.taint_key) == (
        "dgx-canary",
        True,
        "tally.dev/version-deviation",
    )
    report = fleet_report(cluster=mixed_fleet)
    assert report["documented_nodes"] == ["dgx-canary"]
    assert report["deviations"][0]["expires_at"] == expires.isoformat()

    with time_machine.travel(expires + timedelta(seconds=1), tick=False):
        expired = version_matrix(cluster=mixed_fleet)
        [target] = taint_targets(cluster=mixed_fleet)

    assert expired["outlier_nodes"] == ["dgx-canary"]
    assert expired["documented_nodes"] == []
    assert [d["expired"] for d in expired["deviations"]] == [True]
    assert (target.documented, target.taint_key) == (False, "tally.dev/unvalidated-driver")


def test_a_deviation_covers_only_its_node_pool_and_pair(mixed_fleet: Cluster) -> None:
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-a"), 2, OLD_HOST)
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-b"), 2, OLD_HOST)
    later = timezone.now() + timedelta(days=1)
    common = {"cluster": mixed_fleet, "reason": "r", "owner": "o", "expires_at": later}
    VersionDeviation.objects.create(pool="dgx-a", cuda_driver_version=OLD_HOST[1], **common)
    VersionDeviation.objects.create(node_name="dgx-b", driver_version="575.1.0", **common)

    matrix = version_matrix(cluster=mixed_fleet)

    assert (matrix["documented_nodes"], matrix["outlier_nodes"]) == (["dgx-a"], ["dgx-b"])


# -- admin ------------------------------------------------------------------------------------


@pytest.fixture
def operator(client: Client, django_user_model: type[AbstractBaseUser]) -> Client:
    user = django_user_model.objects.create_superuser(  # type: ignore[attr-defined]
        "operator", "op@example.com", None
    )
    client.force_login(user)
    return client


def test_admin_adds_and_edits_a_deviation_audited(operator: Client, mixed_fleet: Cluster) -> None:
    add = reverse("admin:inventory_versiondeviation_add")
    form = {
        "cluster": mixed_fleet.pk,
        "node_name": "dgx-0",
        "pool": "",
        "driver_version": OLD_HOST[0],
        "cuda_driver_version": "",
        "reason": "validating 570 for the inference stack",
        "owner": "gpu-platform",
        "expires_at_0": "2027-01-31",
        "expires_at_1": "00:00:00",
    }
    assert operator.post(add, form).status_code == 302
    deviation = VersionDeviation.objects.get()
    assert (deviation.source, deviation.owner) == ("admin", "gpu-platform")

    change = reverse("admin:inventory_versiondeviation_change", args=[deviation.pk])
    assert operator.post(change, {**form, "owner": "alice"}).status_code == 302

    entries = list(AuditEntry.objects.order_by("pk"))
    assert [(e.actor, e.action, e.object_type) for e in entries] == [
        ("operator", "create", "version deviation"),
        ("operator", "update", "version deviation"),
    ]
    assert entries[1].before is not None and entries[1].after is not None
    assert (entries[1].before["owner"], entries[1].after["owner"]) == ("gpu-platform", "alice")


def test_admin_refuses_a_deviation_without_node_or_pool(
    operator: Client, mixed_fleet: Cluster
) -> None:
    response = operator.post(
        reverse("admin:inventory_versiondeviation_add"),
        {
            "cluster": mixed_fleet.pk,
            "driver_version": OLD_HOST[0],
            "reason": "r",
            "owner": "o",
            "expires_at_0": "2027-01-31",
            "expires_at_1": "00:00:00",
        },
    )
    assert response.status_code == 200
    assert b"Give the node, the pool or both" in response.content
    assert not VersionDeviation.objects.exists()
    assert not AuditEntry.objects.exists()


def test_admin_sets_a_model_baseline_audited(operator: Client, mixed_fleet: Cluster) -> None:
    response = operator.post(
        reverse("admin:inventory_versionbaseline_add"),
        {
            "cluster": mixed_fleet.pk,
            "product_name": H100,
            "architecture": "",
            "driver_version": OLD_HOST[0],
            "cuda_driver_version": OLD_HOST[1],
            "note": "rolled back after the 580 regression",
        },
    )
    assert response.status_code == 302
    assert AuditEntry.objects.get().object_type == "version baseline"
    assert version_matrix(cluster=mixed_fleet)["outlier_nodes"] == ["dgx-0", "dgx-1", "dgx-2"]
    for url in ("admin:inventory_versionbaseline_changelist", "admin:inventory_cluster_changelist"):
        assert operator.get(reverse(url)).status_code == 200


# -- the policy file's `versions:` section ----------------------------------------------------


SECTION: dict[str, list[dict[str, object]]] = {
    "baselines": [
        {
            "cluster": "prod",
            "productName": H100,
            "driverVersion": "580.82.7",
            "cudaDriverVersion": "13.0.0",
        },
        {"cluster": "prod", "architecture": "Ampere", "driverVersion": "550.90.7"},
    ],
    "deviations": [
        {
            "cluster": "prod",
            "node": "dgx-canary",
            "driverVersion": "570.172.8",
            "reason": "canary",
            "owner": "gpu-platform",
            "expires": date(2027, 1, 31),
        },
    ],
}


def test_policy_section_errors_name_their_path() -> None:
    specs, errors = version_policy.parse_version_policy(
        {
            "baselines": [{"productName": "x", "architecture": "y", "driverVersion": "1"}, 3],
            "deviations": [{"driverVersion": "1", "reason": "", "owner": "o", "expires": "soon"}],
            "extra": 1,
        },
        "versions",
    )
    assert specs == version_policy.VersionPolicy()
    assert errors == [
        "versions: unknown key 'extra'",
        "versions.baselines[0]: give productName or architecture (or neither: the whole "
        "cluster), not both",
        "versions.baselines[1]: must be a mapping, got int",
        "versions.deviations[0]: give node, pool or both",
        "versions.deviations[0].reason: required",
        "versions.deviations[0].expires: required, a date (2027-01-31: expires at its start, "
        "UTC) or a date and time",
    ]


def test_policy_section_applies_audited_and_again_changes_nothing() -> None:
    specs, errors = version_policy.parse_version_policy(SECTION, "versions")
    assert errors == []
    assert specs.deviations[0].expires_at == datetime(2027, 1, 31, tzinfo=UTC)

    first = version_policy.apply_version_policy(specs=specs, actor="policy", prune=False)

    assert [(e.action, e.object_type) for e in first.entries] == [
        ("create", "version baseline"),
        ("create", "version baseline"),
        ("create", "version deviation"),
    ]
    assert set(VersionBaseline.objects.values_list("source", flat=True)) == {"policy"}
    again = version_policy.apply_version_policy(specs=specs, actor="policy", prune=False)
    assert (again.entries, again.notes) == ([], [])


def test_policy_prune_deletes_only_what_the_file_wrote() -> None:
    specs, _ = version_policy.parse_version_policy(SECTION, "versions")
    version_policy.apply_version_policy(specs=specs, actor="policy", prune=False)
    prod = Cluster.objects.get(name="prod")
    VersionBaseline.objects.create(cluster=prod, driver_version="1.0", source="admin")
    fewer, _ = version_policy.parse_version_policy(
        {"baselines": SECTION["baselines"][:1]}, "versions"
    )

    kept = version_policy.apply_version_policy(specs=fewer, actor="policy", prune=False)
    assert kept.entries == [] and len(kept.notes) == 2
    pruned = version_policy.apply_version_policy(specs=fewer, actor="policy", prune=True)

    assert [(e.action, e.object_type) for e in pruned.entries] == [
        ("delete", "version baseline"),
        ("delete", "version deviation"),
    ]
    assert sorted(VersionBaseline.objects.values_list("source", flat=True)) == ["admin", "policy"]


# -- migration 0004 ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_migration_moves_the_cluster_baseline_into_a_cluster_wide_row() -> None:
    before = [("inventory", "0003_driver_profiles_meter_ids")]
    after = [("inventory", "0004_version_baselines")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old_apps = executor.loader.project_state(before).apps
    old_cluster = old_apps.get_model("inventory", "Cluster")
    old_cluster.objects.create(name="pinned", baseline_driver_version="580.82.7")
    old_cluster.objects.create(name="unpinned")

    executor = MigrationExecutor(connection)
    executor.migrate(after)
    # The model as it was then: later migrations add columns (the baseline's driver).
    baseline_then = executor.loader.project_state(after).apps.get_model(
        "inventory", "VersionBaseline"
    )

    assert [
        (
            row.cluster.name,
            row.product_name,
            row.architecture,
            row.driver_version,
            row.cuda_driver_version,
        )
        for row in baseline_then.objects.select_related("cluster")
    ] == [("pinned", "", "", "580.82.7", "")]
    # The rest of the schema is back at the newest migrations for the tests that follow.
    MigrationExecutor(connection).migrate(MigrationExecutor(connection).loader.graph.leaf_nodes())


def test_the_policy_file_sets_baselines_and_deviations_and_the_api_shows_them(
    operator: Client, mixed_fleet: Cluster, tmp_path: Path
) -> None:
    """As an operator would: `apply_policy` with a `versions:` section, then the fleet API."""
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-canary"), 8, OLD_HOST)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "teams: []\n"
        "versions:\n"
        "  deviations:\n"
        "  - {cluster: prod, node: dgx-canary, driverVersion: 570.172.8, reason: canary,\n"
        "     owner: gpu-platform, expires: 2099-01-31}\n"
    )
    out = StringIO()
    call_command("apply_policy", str(policy), stdout=out)
    assert "version deviation" in out.getvalue()
    assert AuditEntry.objects.filter(actor="apply_policy", object_type="version deviation").exists()

    summary = operator.get("/api/v1/inventory/summary/", {"cluster": "prod"}).json()

    assert summary["documented_nodes"] == ["dgx-canary"] and summary["outlier_nodes"] == []
    [deviation] = summary["deviations"]
    assert (deviation["node_name"], deviation["owner"], deviation["expired"]) == (
        "dgx-canary",
        "gpu-platform",
        False,
    )
    h100 = next(m for m in summary["version_models"] if m["product_name"] == H100)
    assert h100["baseline"]["driver_version"] == PAIR_A[0]
    assert [o["deviation"]["reason"] for o in h100["outliers"]] == ["canary"]

    policy.write_text("teams: []\nversions:\n  deviations:\n  - {node: dgx-canary}\n")
    with pytest.raises(CommandError, match=r"versions\.deviations\[0\]\.reason: required"):
        call_command("apply_policy", str(policy), stdout=StringIO())


@pytest.mark.parametrize("expires", ["2027-02-30", "2027-01-01T25:00:00"])
def test_an_expiry_that_is_no_real_time_is_an_error_naming_it(expires: str) -> None:
    deviation = {"node": "n1", "driverVersion": "1", "reason": "r", "owner": "o"}
    _, errors = version_policy.parse_version_policy(
        {"deviations": [{**deviation, "expires": expires}]}, "versions"
    )
    assert [e.split(":")[0] for e in errors] == ["versions.deviations[0].expires"]


def test_an_already_expired_deviation_is_stored_with_a_warning_and_stays_an_outlier(
    mixed_fleet: Cluster, tmp_path: Path
) -> None:
    gpus(NodeFactory.create(cluster=mixed_fleet, name="dgx-canary"), 8, OLD_HOST)
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "teams: []\n"
        "versions:\n"
        "  deviations:\n"
        "  - {cluster: prod, node: dgx-later, driverVersion: 570.172.8, reason: next,\n"
        "     owner: gpu-platform, expires: 2099-01-31}\n"
        "  - {cluster: prod, node: dgx-canary, driverVersion: 570.172.8, reason: canary,\n"
        "     owner: gpu-platform, expires: 2020-01-31}\n"
    )
    out = StringIO()
    call_command("apply_policy", str(policy), stdout=out)

    warnings = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: versions.deviations[1] (cluster prod, dgx-canary) expired at "
        "2020-01-31T00:00:00+00:00: stored as history, its GPUs count as outliers",
        # No node named so: a deviation that documents nothing is named too.
        "warning: versions.deviations[0] (cluster prod, dgx-later) matches no node's GPUs off "
        "their baseline: it documents nothing (check node, pool, versions, expiry)",
    ]
    stored = VersionDeviation.objects.get(node_name="dgx-canary")
    assert stored.expires_at == datetime(2020, 1, 31, tzinfo=UTC)
    matrix = version_matrix(cluster=mixed_fleet)
    assert matrix["outlier_nodes"] == ["dgx-canary"]
    assert [d["expired"] for d in matrix["deviations"] if d["node_name"] == "dgx-canary"] == [True]
