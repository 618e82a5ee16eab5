"""Review round 28: defects found in the allocationMode-All/AMD, rollup covered_ms and
per-cluster engines, dynamic MIG samples, idle rule, portal snooze and rounding commits.

Each test states what should hold and is a strict xfail while the defect stands: it fails
for the reason given, and passes (failing the run) once the defect is fixed.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from inventory import services
from inventory.dumps import iter_objects
from inventory.models import Cluster, Device
from metering import rollup
from metering.hours import epoch_ms
from metering.ingest import adopt_unknown_samples, ingest, validate_samples
from metering.models import Sample, UsageHour
from metering.services import issue_agent_token
from tests.factories import AllocationFactory, DeviceFactory, NodeFactory
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

HOUR_START = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)
DYNAMIC_MIG = DRA / "vendors" / "nvidia-dynamic-mig.yaml"
A100 = "GPU-8c2d4e6f-0a1b-4c3d-8e5f-7a9b1c3d5e7f"  # on a100-dyn-1 in the fixture
MIG_UUID = "MIG-1d2e3f40-5a6b-5c7d-8e9f-0a1b2c3d4e5f"


def _post(token: str, node: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": node, "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()
    return answer


def _usage(device: Device) -> tuple[int, int, int]:
    row = UsageHour.objects.get(allocation__device=device)
    return row.allocated_gpu_ms, row.utilised_gpu_ms, row.unmeasured_gpu_ms


# --- Means set aside lose their covered time ---------------------------------------------------


def test_a_mean_bills_the_same_whether_it_came_before_or_after_the_sync() -> None:
    """One minute mean (busy 100% over 60 s), the device's next sample 5 minutes later: the
    mean holds for its 60 s whether its device was known when it came or adopted later."""
    node = NodeFactory.create()
    known = DeviceFactory.create(node=node)
    late_uuid = "GPU-00000000-0000-4000-8000-00000000late"

    def batch(uuid: str) -> list[Any]:
        valid, rejected = validate_samples(
            [
                {"uuid": uuid, "ts": HOUR_START.isoformat(), "gpu_util": 100.0,
                 "covered_seconds": 60},
                {"uuid": uuid, "ts": (HOUR_START + timedelta(minutes=5)).isoformat(),
                 "gpu_util": 0.0, "covered_seconds": 60},
            ]
        )  # fmt: skip
        assert rejected == []
        return valid

    ingest(node=node.name, samples=batch(known.uuid), received_at=timezone.now())
    # The same samples for a device the inventory learns only afterwards (an operator's load,
    # adoptable for any device).
    ingest(node=node.name, samples=batch(late_uuid), received_at=timezone.now())
    late = DeviceFactory.create(node=node, uuid=late_uuid)
    assert adopt_unknown_samples(now=timezone.now()) == 2
    for device in (known, late):
        AllocationFactory.create(
            device=device, start=HOUR_START, end=HOUR_START + timedelta(hours=1)
        )
    rollup.rollup_hours(hours=[HOUR_START])

    assert _usage(known)[1] == 60_000  # the mean held for the 60 s it covered
    assert _usage(late) == _usage(known)  # adopted later: held for its 60 s too


# --- Dynamic MIG samples are matched only against the inventory of the moment they come -------


def _load_dynamic_mig(at: datetime) -> Cluster:
    cluster = services.get_cluster("fx")
    report = services.import_snapshot(
        cluster=cluster, objects=list(iter_objects(DYNAMIC_MIG)), at=at, kinds=["ResourceSlice"]
    )
    assert report.errors == []
    return cluster


def _a100_one_g(cluster: Cluster) -> Device:
    """The A100's 1g.10gb partition at memory slice 6."""
    return Device.objects.get(
        cluster=cluster, node__name="a100-dyn-1", name="gpu-0-mig-1g10gb-19-6"
    )


def _mig_sample(at: datetime) -> dict[str, Any]:
    return {
        "uuid": MIG_UUID,
        "ts": at.isoformat(),
        "gpu_util": 40.0,
        "parent_uuid": A100,
        "gpu_instance_id": 2,
        "mig_placement": {"start": 6, "size": 1},
    }


def test_a_dynamic_mig_sample_sent_before_the_sync_reaches_its_partition() -> None:
    cluster = services.get_cluster("fx")
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    # The agent reports before Tally's sync has seen the node's slices (a new node, the sync
    # behind or its database briefly away).
    answer = _post(token, "a100-dyn-1", [_mig_sample(HOUR_START)])
    assert answer["accepted"] == 1
    _load_dynamic_mig(HOUR_START - timedelta(days=1))
    one_g = _a100_one_g(cluster)
    adopt_unknown_samples(now=timezone.now())
    assert list(Sample.objects.values_list("device_uuid", "ts_ms")) == [
        (one_g.meter_id, epoch_ms(HOUR_START))
    ]


def test_a_late_dynamic_mig_sample_of_a_partition_gone_since_is_stored() -> None:
    cluster = _load_dynamic_mig(HOUR_START - timedelta(days=1))
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    one_g = _a100_one_g(cluster)
    # The partition was published when the sample was taken; the agent's buffered batch
    # arrives after the node's slices were withdrawn (drained, driver restarted).
    Device.objects.filter(pk=one_g.pk).update(gone_at=HOUR_START + timedelta(hours=1))
    answer = _post(token, "a100-dyn-1", [_mig_sample(HOUR_START)])
    assert answer["unknown_devices"] == []
    assert list(Sample.objects.values_list("device_uuid", "ts_ms")) == [
        (one_g.meter_id, epoch_ms(HOUR_START))
    ]


# --- allocationMode All: devices published without a node count nothing ----------------------


def test_an_all_request_over_network_attached_devices_counts_them(client: Client) -> None:
    from quota.admission.shapes import forget_fleet_shapes
    from tests.quota.fixtures import claim, decide, make_team, nvidia_gpu

    forget_fleet_shapes()
    shared = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "fabric-gpu.nvidia.com"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "allNodes": True,
            "pool": {"name": "fabric", "generation": 1, "resourceSliceCount": 1},
            "devices": [nvidia_gpu(i, "fabric", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(4)],
        },
    }
    report = services.import_snapshot(
        cluster=services.get_cluster("default"),
        objects=[*iter_objects(DRA / "deviceclasses-nvidia.yaml"), shared],
        at=HOUR_START,
    )
    assert report.errors == []
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    request = {"name": "all", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                          "allocationMode": "All"}}  # fmt: skip
    # The scheduler gives all four (every node reaches the pool): past the limit of 2.
    four = {"name": "four", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 4}}
    assert not decide(client, claim("four", [four]))["allowed"]  # the rule covers them
    answer = decide(client, claim("everything", [request]))
    assert not answer["allowed"], answer


# --- The week report's idle claims merge claims of one name in different clusters -------------


def test_the_week_lists_an_idle_claim_whatever_its_namesakes_in_other_clusters_do() -> None:
    from datetime import UTC

    from billing.idle import idle_claims
    from billing.week import team_week
    from teams.models import IdleAlertPolicy, Team
    from tests.billing.test_idle_alerts import claim_holding
    from tests.factories import ClusterFactory

    start = datetime(2026, 11, 30, 0, 0, tzinfo=UTC)  # a Monday
    hour_ms = 3_600_000
    team = Team.objects.create(slug="alpha", name="Alpha")
    IdleAlertPolicy.objects.create(team=team, below_percent=5, for_hours=3)
    for cluster_name, utilised in (("east", 0), ("west", hour_ms)):
        cluster = ClusterFactory.create(name=cluster_name)
        [allocation] = claim_holding(cluster, team, "notebook", 1, start=start)
        device = allocation.device
        assert device is not None
        UsageHour.objects.bulk_create(
            UsageHour(
                hour=start + timedelta(hours=n),
                allocation=allocation,
                cluster_id=allocation.cluster_id,
                device_uuid=device.meter_id,
                product_name=device.product_name,
                gpu_share=device.gpu_share,
                namespace=allocation.claim.namespace,
                claim_name=allocation.claim.name,
                team=team,
                job=allocation.job,
                username=allocation.username,
                allocated_gpu_ms=hour_ms,
                utilised_gpu_ms=utilised,
                unmeasured_gpu_ms=0,
            )
            for n in range(6)
        )
    now = start + timedelta(hours=6, minutes=10)
    alerted = {claim.cluster for claim in idle_claims(now=now)}
    assert alerted == {"east"}  # the alert: east's notebook idle 6 hours, west's busy
    week = team_week(team=team, start=start, now=now, budget=None)
    assert [claim.longest_hours for claim in week.idle_claims] == [6]


# --- allocationMode All: a selector on an identity attribute matches no shape, counts 0 -------


def test_an_all_request_selecting_by_uuid_counts_the_gpus_it_gets(client: Client) -> None:
    from quota.admission.shapes import forget_fleet_shapes
    from tests.quota.fixtures import claim, decide, make_team, nvidia_gpu, nvidia_slice

    forget_fleet_shapes()
    gpus = [nvidia_gpu(i, "node-1", "NVIDIA H100 80GB HBM3", "80Gi") for i in range(4)]
    report = services.import_snapshot(
        cluster=services.get_cluster("default"),
        objects=[*iter_objects(DRA / "deviceclasses-nvidia.yaml"), nvidia_slice("node-1", gpus)],
        at=HOUR_START,
    )
    assert report.errors == []
    make_team([{"name": "gpus", "device_class": "gpu.nvidia.com", "limit": 2}])
    plain: dict[str, Any] = {"name": "all", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                        "allocationMode": "All"}}  # fmt: skip
    assert not decide(client, claim("plain", [plain]))["allowed"]  # 4 GPUs past the limit
    # The same four GPUs, asked with a selector every one of them satisfies.
    tautology = {"cel": {"expression": "device.attributes['gpu.nvidia.com'].uuid != ''"}}
    sneaky = {"name": "all", "exactly": {**plain["exactly"], "selectors": [tautology]}}
    answer = decide(client, claim("sneaky", [sneaky]))
    assert not answer["allowed"], answer
