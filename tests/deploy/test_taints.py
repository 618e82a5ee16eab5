"""The version matrix's action: DeviceTaintRules for outlier nodes, through the real client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inventory import kube, taints
from inventory.models import Cluster, Device
from tests.deploy.fake_api import FakeApi
from tests.factories import ClusterFactory, DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db

OLD = {"driver_version": "570.172.8", "cuda_driver_version": "12.8.0"}


@pytest.fixture
def api() -> Iterator[FakeApi]:
    with FakeApi() as fake:
        yield fake


@pytest.fixture
def cluster() -> Cluster:
    """Three nodes on the baseline pair, one (node-old) on an older driver."""
    cluster = ClusterFactory.create(name="prod")
    for name in ("node-a", "node-b", "node-c"):
        DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name=name))
    DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name="node-old"), **OLD)
    return cluster


def rules(api: FakeApi) -> dict[str, dict]:
    return {
        name: rule
        for name in api.names("DeviceTaintRule")
        if (rule := api.get("DeviceTaintRule", name)) is not None
    }


def test_an_outlier_node_gets_a_no_schedule_rule(api: FakeApi, cluster: Cluster) -> None:
    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert len(report.created) == 1
    rule = rules(api)[report.created[0]]
    assert rule["metadata"]["name"].startswith("tally-unvalidated-node-old-")
    assert rule["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "tally",
        "tally.dev/node": "node-old",
    }
    assert rule["spec"] == {
        "deviceSelector": {"driver": "gpu.nvidia.com", "pool": "node-old"},
        "taint": {
            "key": "tally.dev/unvalidated-driver",
            "value": "570.172.8",
            "effect": "NoSchedule",
        },
    }
    # A second run changes nothing.
    again = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
    assert (again.created, again.updated, again.deleted) == ([], [], [])
    assert again.unchanged == report.created


def test_dry_run_writes_nothing(api: FakeApi, cluster: Cluster) -> None:
    report = taints.apply_version_taints(cluster=cluster, dry_run=True, api_client=api.api_client())
    assert report.dry_run and len(report.created) == 1
    assert api.names("DeviceTaintRule") == []
    assert {method for method, _ in api.requests} == {"GET"}


def test_a_node_back_in_line_loses_its_rule_and_others_rules_stay(
    api: FakeApi, cluster: Cluster
) -> None:
    foreign = {
        "apiVersion": "resource.k8s.io/v1alpha3",
        "kind": "DeviceTaintRule",
        "metadata": {"name": "maintenance-node-a", "labels": {"team": "infra"}},
        "spec": {
            "deviceSelector": {"pool": "node-a"},
            "taint": {"key": "maintenance", "effect": "NoExecute"},
        },
    }
    api.put_object("DeviceTaintRule", foreign)
    created = taints.apply_version_taints(cluster=cluster, api_client=api.api_client()).created

    # node-old is upgraded to the baseline driver.
    Device.objects.filter(node__name="node-old").update(
        driver_version="580.82.7", cuda_driver_version="13.0.0"
    )
    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert report.deleted == created
    assert api.names("DeviceTaintRule") == ["maintenance-node-a"]


def test_a_changed_version_updates_the_rule(api: FakeApi, cluster: Cluster) -> None:
    taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
    Device.objects.filter(node__name="node-old").update(driver_version="575.1.0")

    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert len(report.updated) == 1
    assert rules(api)[report.updated[0]]["spec"]["taint"]["value"] == "575.1.0"


def test_a_rule_changed_meanwhile_is_left_for_the_next_run(
    api: FakeApi, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
    Device.objects.filter(node__name="node-old").update(driver_version="575.1.0")
    stale = kube.list_device_taint_rules(api_client=api.api_client(), label_selector="")
    # Someone edits the rule between Tally's list and its write: the replace answers 409.
    api.put_object("DeviceTaintRule", stale[0])
    monkeypatch.setattr(kube, "list_device_taint_rules", lambda **_: stale)

    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert report.conflicts == [stale[0]["metadata"]["name"]]
    assert report.updated == []
    assert rules(api)[stale[0]["metadata"]["name"]]["spec"]["taint"]["value"] == "570.172.8"


def test_no_outliers_no_rules(api: FakeApi) -> None:
    cluster = ClusterFactory.create(name="uniform")
    DeviceFactory.create_batch(2, node=NodeFactory.create(cluster=cluster, name="node-a"))
    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
    assert report.created == [] and api.names("DeviceTaintRule") == []
