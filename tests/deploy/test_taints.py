"""The version matrix's action: DeviceTaintRules for outlier nodes, through the real client,
in the API version the fake server's discovery says it serves."""

from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from inventory import kube, taints
from inventory.models import Cluster, Device, VersionDeviation
from tests.deploy.fake_api import FakeApi
from tests.deploy.taint_fleet import OLD, rules
from tests.factories import ClusterFactory, DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db


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
    stale = kube.list_device_taint_rules(
        api_client=api.api_client(), api_version="resource.k8s.io/v1alpha3", label_selector=""
    )
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


# -- the API version, from discovery ---------------------------------------------------------


@pytest.mark.parametrize(
    ("taint_rule_versions", "group_versions", "expected"),
    [
        # Kubernetes 1.33-1.35: only the alpha version has DeviceTaintRules.
        (("v1alpha3",), ("v1", "v1beta2", "v1beta1", "v1alpha3"), "v1alpha3"),
        # 1.36 with v1beta2 enabled: the beta one is preferred to the alpha one.
        (("v1beta2", "v1alpha3"), ("v1", "v1beta2", "v1alpha3"), "v1beta2"),
        # GA: v1, whatever else is served.
        (("v1", "v1beta2", "v1alpha3"), ("v1", "v1beta2", "v1alpha3"), "v1"),
        # v1beta2 served (ResourceSlices) but its DeviceTaintRules gated off: not chosen.
        (("v1alpha3",), ("v1", "v1beta2", "v1alpha3"), "v1alpha3"),
    ],
)
def test_rules_are_written_in_the_version_discovery_names(
    cluster: Cluster,
    taint_rule_versions: tuple[str, ...],
    group_versions: tuple[str, ...],
    expected: str,
) -> None:
    with FakeApi(
        device_taint_rule_versions=taint_rule_versions, served_resource_versions=group_versions
    ) as api:
        report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

        assert report.api_version == f"resource.k8s.io/{expected}"
        assert rules(api)[report.created[0]]["apiVersion"] == f"resource.k8s.io/{expected}"
        writes = [path for method, path in api.requests if method == "POST"]
        assert writes == [f"/apis/resource.k8s.io/{expected}/devicetaintrules"]
        # The next run, in the same version, finds the rule and leaves it.
        again = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
        assert again.unchanged == report.created


def test_no_served_version_is_a_clear_error(cluster: Cluster) -> None:
    with FakeApi(device_taint_rule_versions=(), served_resource_versions=("v1",)) as api:
        with pytest.raises(kube.KubeError, match=r"serves no DeviceTaintRule API.*served: v1"):
            taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
        assert [method for method, _ in api.requests] == ["GET", "GET"]


# -- documented deviations -------------------------------------------------------------------


def test_a_documented_deviation_gets_the_tolerable_taint_until_it_expires(
    api: FakeApi, cluster: Cluster
) -> None:
    expires = timezone.now() + timedelta(days=7)
    VersionDeviation.objects.create(
        cluster=cluster,
        node_name="node-old",
        driver_version=OLD["driver_version"],
        reason="validating the 570 branch for the inference stack",
        owner="gpu-platform",
        expires_at=expires,
    )

    documented = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert len(documented.created) == 1
    name = documented.created[0]
    assert name.startswith("tally-deviation-node-old-")
    assert rules(api)[name]["spec"]["taint"] == {
        "key": "tally.dev/version-deviation",
        "value": "570.172.8",
        "effect": "NoSchedule",
    }

    # A day after it expires the node is an undocumented outlier again.
    with time_machine.travel(expires + timedelta(days=1), tick=False):
        expired = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert expired.deleted == [name]
    assert len(expired.created) == 1 and expired.created[0].startswith(
        "tally-unvalidated-node-old-"
    )
    assert rules(api)[expired.created[0]]["spec"]["taint"]["key"] == "tally.dev/unvalidated-driver"


def test_a_deviation_for_another_pair_documents_nothing(api: FakeApi, cluster: Cluster) -> None:
    VersionDeviation.objects.create(
        cluster=cluster,
        pool="node-old",
        driver_version="575.1.0",
        reason="a different driver",
        owner="gpu-platform",
        expires_at=timezone.now() + timedelta(days=7),
    )
    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())
    assert [name.startswith("tally-unvalidated-node-old-") for name in report.created] == [True]
