"""Issue 34: the taint plan has a limit, shows itself before acting, carries its reasons, and
follows deviations as they are removed; through the real client against the fake API server."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone

from inventory import kube, taints
from inventory.models import Cluster, VersionBaseline, VersionDeviation
from tests.deploy.fake_api import FakeApi
from tests.deploy.taint_fleet import OLD, rules
from tests.factories import DeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db


def mistype_the_baseline(cluster: Cluster) -> None:
    # 508 for 580: every node but none would be off it.
    VersionBaseline.objects.create(cluster=cluster, driver_version="508.82.7")


def test_every_rule_carries_its_reason(api: FakeApi, cluster: Cluster) -> None:
    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    [name] = report.created
    reason = rules(api)[name]["metadata"]["annotations"]["tally.dev/reason"]
    assert reason == (
        "2 NVIDIA H100 80GB HBM3 on driver 570.172.8, CUDA 12.8.0; baseline (computed): "
        "driver 580.82.7, CUDA 13.0.0; no active deviation"
    )
    assert report.plan == [f"create: {name} ({reason})"]


def test_a_mistyped_baseline_taints_nothing_over_the_limit(api: FakeApi, cluster: Cluster) -> None:
    mistype_the_baseline(cluster)

    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert report.created == [] and api.names("DeviceTaintRule") == []
    assert [line.split(":")[0] for line in report.plan] == ["held"] * 4
    [limit] = report.limits
    assert limit.startswith(
        "NVIDIA H100 80GB HBM3 (gpu.nvidia.com): 4 of 4 nodes would be tainted, more than "
        "TALLY_VERSION_TAINT_MAX_PERCENT=50%"
    )
    assert "--force" in limit

    forced = taints.apply_version_taints(cluster=cluster, force=True, api_client=api.api_client())
    assert len(forced.created) == 4 and len(api.names("DeviceTaintRule")) == 4


def test_the_limit_is_a_configured_share_of_the_models_nodes(cluster: Cluster) -> None:
    VersionBaseline.objects.create(cluster=cluster, driver_version="580.82.07")
    DeviceFactory.create_batch(
        2, node=NodeFactory.create(cluster=cluster, name="node-old-2"), **OLD
    )
    # Two of five nodes off the baseline: 40%, within the default 50%.
    plan = taints.taint_plan(cluster=cluster)
    assert ([t.node for t in plan.targets], plan.held) == (["node-old", "node-old-2"], [])
    with override_settings(TALLY_VERSION_TAINT_MAX_PERCENT=30):
        plan = taints.taint_plan(cluster=cluster)
    assert (plan.targets, [t.node for t in plan.held]) == ([], ["node-old", "node-old-2"])
    # Three of five: 60%, over the default.
    cluster.nodes.get(name="node-c").devices.update(**OLD)
    assert len(taints.taint_plan(cluster=cluster).held) == 3


def test_a_held_pool_keeps_the_rule_it_had(api: FakeApi, cluster: Cluster) -> None:
    [name] = taints.apply_version_taints(cluster=cluster, api_client=api.api_client()).created
    mistype_the_baseline(cluster)

    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    # The limit adds no taint and removes none: node-old's rule stays as it was.
    assert (report.created, report.deleted, report.held) == ([], [], [name])
    assert api.names("DeviceTaintRule") == [name]


def test_a_removed_deviation_removes_its_taint(api: FakeApi, cluster: Cluster) -> None:
    deviation = VersionDeviation.objects.create(
        cluster=cluster,
        node_name="node-old",
        driver_version="570.172.08",  # as nvidia-smi prints it
        reason="validating the 570 branch",
        owner="gpu-platform",
        expires_at=timezone.now() + timedelta(days=7),
    )
    [documented] = taints.apply_version_taints(cluster=cluster, api_client=api.api_client()).created
    assert documented.startswith("tally-deviation-node-old-")
    assert rules(api)[documented]["metadata"]["annotations"]["tally.dev/reason"].startswith(
        f"documented deviation {deviation.pk} (owner gpu-platform, until "
    )

    deviation.delete()
    report = taints.apply_version_taints(cluster=cluster, api_client=api.api_client())

    assert report.deleted == [documented]
    [unvalidated] = report.created
    assert unvalidated.startswith("tally-unvalidated-node-old-")
    assert api.names("DeviceTaintRule") == [unvalidated]


def test_the_command_shows_the_plan_and_fails_over_the_limit(
    api: FakeApi, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube, "api_client", lambda **_: api.api_client())
    out = StringIO()
    call_command("apply_version_taints", "--cluster=prod", "--dry-run", stdout=out)
    printed = out.getvalue()
    assert "Plan (dry run, nothing changed):" in printed
    assert "  create: tally-unvalidated-node-old-" in printed and "570.172.8" in printed
    assert api.names("DeviceTaintRule") == []

    mistype_the_baseline(cluster)
    err = StringIO()
    with pytest.raises(CommandError, match=r"held by the limit.*--force"):
        call_command("apply_version_taints", "--cluster=prod", stdout=StringIO(), stderr=err)
    assert "limit: NVIDIA H100 80GB HBM3 (gpu.nvidia.com): 4 of 4 nodes" in err.getvalue()
    assert api.names("DeviceTaintRule") == []

    call_command("apply_version_taints", "--cluster=prod", "--force", stdout=StringIO())
    assert len(api.names("DeviceTaintRule")) == 4
