"""Samples of MIG devices NVIDIA's DRA driver creates when a claim is prepared (dynamic MIG).

The driver publishes each placement a MIG profile can take as a partition device without a
UUID (tests/fixtures/dra/vendors/nvidia-dynamic-mig.yaml); the MIG device made for a claim has
a new UUID no ResourceSlice carries. The agent sends, with a MIG device's sample, its parent
GPU and the placement NVML reads, and the ingest stores the sample under the partition device
at that placement on the sending node (`metering.mig_samples`), through `/ingest/samples`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path
from typing import Any

import pynvml
import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from agent.exporters import DCGM, ExporterSource
from agent.nvml import NvmlSource
from inventory import services
from inventory.dumps import iter_objects
from inventory.models import Allocation, Cluster, Device
from metering import rollup
from metering.hours import epoch_ms
from metering.ingest import adopt_unknown_samples
from metering.models import DirtyHour, MigInstance, Sample, UnknownDeviceSample, UsageHour
from metering.services import issue_agent_token
from tests.agent.nvml_fake import GIB, FakeDevice, install
from tests.factories import MigDeviceFactory
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

T0 = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)
FIXTURE = DRA / "vendors" / "nvidia-dynamic-mig.yaml"
H100 = "GPU-5e1f0c2a-7b3d-4c8e-9f10-2a3b4c5d6e7f"  # on h100-dyn-1, whole GPU published too
A100 = "GPU-8c2d4e6f-0a1b-4c3d-8e5f-7a9b1c3d5e7f"  # on a100-dyn-1, only its partitions
MIG_A = "MIG-1d2e3f40-5a6b-5c7d-8e9f-0a1b2c3d4e5f"
MIG_B = "MIG-6f5e4d3c-2b1a-5f0e-9d8c-7b6a5f4e3d2c"


def load(name: str = "fx", at: datetime | None = None) -> Cluster:
    cluster = services.get_cluster(name)
    report = services.import_snapshot(
        cluster=cluster,
        objects=list(iter_objects(FIXTURE)),
        at=at or T0 - timedelta(days=1),
        kinds=["ResourceSlice"],
    )
    assert report.errors == []
    return cluster


@pytest.fixture
def cluster() -> Cluster:
    return load()


def partition(cluster: Cluster, node: str, name: str) -> Device:
    return Device.objects.get(cluster=cluster, node__name=node, name=name)


def mig_sample(
    uuid: str, parent: str, start: int, size: int, at: datetime = T0, **fields: Any
) -> dict[str, Any]:
    return {
        "uuid": uuid,
        "ts": at.isoformat(),
        "gpu_util": 40.0,
        "parent_uuid": parent,
        "gpu_instance_id": 2,
        "mig_placement": {"start": start, "size": size},
        **fields,
    }


def post(token: str, node: str, samples: list[Any]) -> dict[str, Any]:
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": node, "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()
    return answer


def stored() -> list[tuple[str, int]]:
    return sorted(Sample.objects.values_list("device_uuid", "ts_ms"))


def set_aside() -> list[tuple[str, int, str]]:
    return sorted(UnknownDeviceSample.objects.values_list("device_uuid", "ts_ms", "node"))


def test_a_dynamic_mig_devices_samples_go_to_the_partition_at_their_placement(
    cluster: Cluster,
) -> None:
    h100_token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    a100_token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    three_g = partition(cluster, "h100-dyn-1", "gpu-0-mig-3g40gb-9-4")
    one_g = partition(cluster, "a100-dyn-1", "gpu-0-mig-1g10gb-19-6")

    answer = post(
        h100_token,
        "h100-dyn-1",
        [
            mig_sample(MIG_A, H100, 4, 4, mig_profile="3g.40gb", mig_profile_id=9),
            mig_sample(MIG_A, H100, 4, 4, T0 + timedelta(minutes=1), mig_profile="3g.40gb"),
        ],
    )
    assert (answer["accepted"], answer["rejected"], answer["unknown_devices"]) == (2, [], [])
    # The A100 publishes no whole GPU (MIG mode on Ampere): the parent is matched by the
    # partitions' parentUUID alone.
    answer = post(a100_token, "a100-dyn-1", [mig_sample(MIG_B, A100, 6, 1)])
    assert (answer["accepted"], answer["unknown_devices"]) == (1, [])

    assert stored() == [
        *sorted(
            [
                (three_g.meter_id, epoch_ms(T0)),
                (three_g.meter_id, epoch_ms(T0) + 60_000),
                (one_g.meter_id, epoch_ms(T0)),
            ]
        )
    ]
    assert set_aside() == []


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        # Memory slices 0-3 are both 3g.40gb at 0 and 4g.40gb at 0: the profile tells them apart.
        ({"mig_profile": "3g.40gb"}, "gpu-0-mig-3g40gb-9-0"),
        ({"mig_profile": "4g.40gb"}, "gpu-0-mig-4g40gb-5-0"),
        # So does the GI profile id, which the driver names its partitions by.
        ({"mig_profile_id": 5}, "gpu-0-mig-4g40gb-5-0"),
        ({"mig_profile": "3g.40gb", "mig_profile_id": 9}, "gpu-0-mig-3g40gb-9-0"),
        # Neither: two partitions fit, none is guessed.
        ({}, None),
        # A profile and a profile id that contradict each other fit none.
        ({"mig_profile": "3g.40gb", "mig_profile_id": 5}, None),
    ],
)
def test_partitions_on_the_same_memory_slices_are_told_apart_or_none_is_guessed(
    cluster: Cluster, fields: dict[str, Any], expected: str | None
) -> None:
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    answer = post(token, "h100-dyn-1", [mig_sample(MIG_A, H100, 0, 4, **fields)])
    assert answer["accepted"] == 1
    if expected is None:
        assert answer["unknown_devices"] == [MIG_A]
        assert stored() == []
        assert set_aside() == [(MIG_A, epoch_ms(T0), "h100-dyn-1")]
    else:
        assert answer["unknown_devices"] == []
        assert stored() == [(partition(cluster, "h100-dyn-1", expected).meter_id, epoch_ms(T0))]


@pytest.mark.parametrize(
    "sample",
    [
        mig_sample(MIG_A, H100, 1, 2, mig_profile="2g.20gb"),  # not a placement 2g.20gb takes
        mig_sample(MIG_A, H100, 4, 4, mig_profile="3g.20gb"),  # not a profile of this GPU
        mig_sample(MIG_A, "GPU-00000000-1111-2222-3333-444444444444", 4, 4),  # no such GPU
        mig_sample(MIG_A, A100, 6, 1),  # the A100 is on another node
    ],
)
def test_a_placement_no_partition_of_the_node_fits_is_set_aside_and_never_adopted(
    cluster: Cluster, sample: dict[str, Any]
) -> None:
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    answer = post(token, "h100-dyn-1", [sample])
    assert (answer["accepted"], answer["unknown_devices"]) == (1, [MIG_A])
    assert stored() == []
    assert adopt_unknown_samples(now=timezone.now()) == 0
    assert set_aside() == [(MIG_A, epoch_ms(T0), "h100-dyn-1")]


def test_tokens_place_samples_only_on_partitions_they_may_send_for(cluster: Cluster) -> None:
    # A node's token (and only the node it belongs to can be the batch's node): naming the
    # GPU of another node stores nothing there.
    a100_token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    answer = post(a100_token, "a100-dyn-1", [mig_sample(MIG_A, H100, 4, 4, mig_profile="3g.40gb")])
    assert answer["unknown_devices"] == [MIG_A]
    # Another cluster's token, for a node of the same name there: nothing of this cluster.
    elsewhere = load("other", at=T0 + timedelta(days=1))  # its own copy of the slices
    Device.objects.filter(cluster=elsewhere).update(gone_at=T0)
    foreign = issue_agent_token(cluster=elsewhere, node="h100-dyn-1", actor="ops")
    later = T0 + timedelta(minutes=1)
    answer = post(
        foreign, "h100-dyn-1", [mig_sample(MIG_A, H100, 4, 4, later, mig_profile="3g.40gb")]
    )
    assert answer["unknown_devices"] == [MIG_A]
    assert stored() == []
    # A cluster-wide token of this cluster, for the partition's node: stored there.
    everywhere = issue_agent_token(cluster=cluster, node="*", actor="ops")
    latest = T0 + timedelta(minutes=2)
    answer = post(
        everywhere, "h100-dyn-1", [mig_sample(MIG_A, H100, 4, 4, latest, mig_profile="3g.40gb")]
    )
    three_g = partition(cluster, "h100-dyn-1", "gpu-0-mig-3g40gb-9-4")
    assert stored() == [(three_g.meter_id, epoch_ms(latest))]
    assert adopt_unknown_samples(now=timezone.now()) == 0


def test_a_mig_uuid_the_inventory_knows_is_stored_under_it_placement_or_not(
    cluster: Cluster,
) -> None:
    whole = partition(cluster, "h100-dyn-1", "gpu-0")
    static = MigDeviceFactory.create(parent=whole, name="gpu-0-static", profile="3g.40gb")
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    answer = post(token, "h100-dyn-1", [mig_sample(static.uuid, H100, 4, 4, mig_profile="3g.40gb")])
    assert (answer["accepted"], answer["unknown_devices"]) == (1, [])
    assert stored() == [(static.uuid, epoch_ms(T0))]


def test_a_partition_gone_or_published_with_a_uuid_is_not_matched(cluster: Cluster) -> None:
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    Device.objects.filter(name="gpu-0-mig-1g10gb-19-6", cluster=cluster).update(gone_at=T0)
    Device.objects.filter(name="gpu-0-mig-1g10gb-19-5", cluster=cluster).update(
        uuid="MIG-00000000-0000-5000-8000-000000000005"
    )
    answer = post(
        token,
        "a100-dyn-1",
        [mig_sample(MIG_A, A100, 6, 1), mig_sample(MIG_B, A100, 5, 1)],
    )
    assert answer["unknown_devices"] == [MIG_A, MIG_B]
    assert stored() == []


def test_a_dynamic_mig_mean_keeps_its_covered_time(cluster: Cluster) -> None:
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    one_g = partition(cluster, "a100-dyn-1", "gpu-0-mig-1g10gb-19-0")
    samples = [mig_sample(MIG_A, A100, 0, 1, covered_seconds=59.997)] * 2  # sent twice
    answer = post(token, "a100-dyn-1", samples)
    assert (answer["accepted"], answer["duplicates"]) == (1, 1)
    assert list(Sample.objects.values_list("device_uuid", "covered_ms")) == [
        (one_g.meter_id, 59_997)
    ]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"mig_placement": [4, 4]}, 'samples[0].mig_placement: must be an object {"start": '),
        ({"mig_placement": {"start": 4}}, "samples[0].mig_placement: start and size must be"),
        ({"mig_placement": {"start": -1, "size": 2}}, "not -1 and 2"),
        ({"mig_placement": {"start": 0, "size": 0}}, "size from 1"),
        ({"mig_placement": {"start": 60, "size": 8}}, "start + size at most 64"),
        ({"mig_placement": {"start": True, "size": 1}}, "not true and 1"),
        ({"parent_uuid": None}, "samples[0].parent_uuid: is needed with mig_placement"),
        ({"parent_uuid": "GPU-\u00e9"}, "samples[0].parent_uuid: "),
        ({"mig_profile": ""}, "samples[0].mig_profile: must be printable ASCII"),
        ({"mig_profile": 7}, "samples[0].mig_profile: must be printable ASCII"),
        (
            {"mig_profile_id": "9"},
            'samples[0].mig_profile_id: must be an integer from 0 to 4095, not "9"',
        ),
        ({"mig_profile_id": 4096}, "samples[0].mig_profile_id: must be an integer"),
    ],
)
def test_a_bad_placement_is_rejected_naming_the_field(
    cluster: Cluster, fields: dict[str, Any], reason: str
) -> None:
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    sample = {**mig_sample(MIG_A, H100, 4, 4), **fields}
    answer = post(token, "h100-dyn-1", [sample])
    assert answer["accepted"] == 0
    [rejection] = answer["rejected"]
    assert reason in rejection["reason"], rejection["reason"]


def test_a_placement_with_a_device_named_by_driver_is_rejected(cluster: Cluster) -> None:
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    sample = {**mig_sample(MIG_A, H100, 4, 4), "driver": "gpu.nvidia.com", "device": "gpu-0"}
    del sample["uuid"]
    [rejection] = post(token, "h100-dyn-1", [sample])["rejected"]
    assert rejection["reason"].startswith("samples[0].mig_placement: goes with a MIG device's")


def test_the_command_places_lines_of_their_node(cluster: Cluster, tmp_path: Path) -> None:
    lines = tmp_path / "samples.jsonl"
    lines.write_text(
        json.dumps({**mig_sample(MIG_A, H100, 4, 4, mig_profile="3g.40gb"), "node": "h100-dyn-1"})
        + "\n"
    )
    out = StringIO()
    call_command("ingest_samples", str(lines), stdout=out)
    assert "1 accepted" in out.getvalue()
    three_g = partition(cluster, "h100-dyn-1", "gpu-0-mig-3g40gb-9-4")
    assert stored() == [(three_g.meter_id, epoch_ms(T0))]


# Sent before the sync learns the partition: set aside with the placement, adopted after.


def sample_ids() -> list[tuple[str, int, int | None, int | None]]:
    return list(
        Sample.objects.order_by("device_uuid", "ts_ms").values_list(
            "device_uuid", "ts_ms", "covered_ms", "gap_ms"
        )
    )


def test_a_sample_sent_before_the_sync_is_adopted_by_the_partition_at_its_placement() -> None:
    cluster = services.get_cluster("fx")
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    first = [
        mig_sample(MIG_B, A100, 6, 1, T0, covered_seconds=60, mig_profile="1g.10gb"),
        mig_sample(MIG_B, A100, 6, 1, T0 + timedelta(minutes=1), mig_profile_id=19),
    ]
    answer = post(token, "a100-dyn-1", first)
    assert (answer["accepted"], answer["unknown_devices"]) == (2, [MIG_B])
    assert UnknownDeviceSample.objects.filter(mig_placement__isnull=False).count() == 2
    # The sync sees the node's slices ten minutes after the samples were taken.
    load(at=T0 + timedelta(minutes=10))
    one_g = partition(cluster, "a100-dyn-1", "gpu-0-mig-1g10gb-19-6")
    # One of them sent again (a retry) before the adoption: stored now, once in all.
    answer = post(
        token, "a100-dyn-1", [first[1], mig_sample(MIG_B, A100, 6, 1, T0 + timedelta(minutes=3))]
    )
    assert (answer["accepted"], answer["unknown_devices"]) == (2, [])
    DirtyHour.objects.all().delete()

    assert adopt_unknown_samples(now=timezone.now()) == 1  # the retry's twin is dropped
    assert adopt_unknown_samples(now=timezone.now()) == 0
    assert set_aside() == []
    # Each sample's gap to its partition's next is worked out again; the mean keeps its time.
    start = epoch_ms(T0)
    assert sample_ids() == [
        (one_g.meter_id, start, 60_000, 60_000),
        (one_g.meter_id, start + 60_000, None, 120_000),
        (one_g.meter_id, start + 180_000, None, None),
    ]
    assert set(DirtyHour.objects.values_list("hour", flat=True)) == {T0}


def test_a_sample_set_aside_is_adopted_only_onto_a_partition_its_token_may_send_for() -> None:
    cluster = services.get_cluster("fx")
    other = services.get_cluster("other")
    a100_node = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    foreign = issue_agent_token(cluster=other, node="h100-dyn-1", actor="ops")
    everywhere = issue_agent_token(cluster=cluster, node="*", actor="ops")
    three_g = mig_sample(MIG_A, H100, 4, 4, mig_profile="3g.40gb")
    # The A100 node's token names the H100's GPU (on h100-dyn-1); another cluster's token
    # sends for a node of the same name; a cluster-wide token for h100-dyn-1.
    post(a100_node, "a100-dyn-1", [three_g])
    post(foreign, "h100-dyn-1", [three_g])
    later = {**three_g, "ts": (T0 + timedelta(minutes=1)).isoformat()}
    post(everywhere, "h100-dyn-1", [later])
    assert len(set_aside()) == 3
    load()

    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert adopt_unknown_samples(now=timezone.now()) == 0
    three_g_partition = partition(cluster, "h100-dyn-1", "gpu-0-mig-3g40gb-9-4")
    assert stored() == [(three_g_partition.meter_id, epoch_ms(T0) + 60_000)]
    assert set_aside() == [(MIG_A, epoch_ms(T0), "a100-dyn-1"), (MIG_A, epoch_ms(T0), "h100-dyn-1")]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),  # 3g.40gb and 4g.40gb both take slices 0-3: none is guessed
        ({"mig_profile": "4g.40gb"}, "gpu-0-mig-4g40gb-5-0"),
    ],
)
def test_a_sample_set_aside_is_adopted_only_where_one_partition_fits(
    fields: dict[str, Any], expected: str | None
) -> None:
    cluster = services.get_cluster("fx")
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    post(token, "h100-dyn-1", [mig_sample(MIG_A, H100, 0, 4, **fields)])
    load()
    assert adopt_unknown_samples(now=timezone.now()) == (expected is not None)
    if expected is None:
        assert (stored(), set_aside()) == ([], [(MIG_A, epoch_ms(T0), "h100-dyn-1")])
    else:
        meter_id = partition(cluster, "h100-dyn-1", expected).meter_id
        assert (stored(), set_aside()) == ([(meter_id, epoch_ms(T0))], [])


def test_an_operators_sample_set_aside_is_adopted_by_the_partition_of_its_node(
    tmp_path: Path,
) -> None:
    lines = tmp_path / "samples.jsonl"
    sample = {**mig_sample(MIG_A, H100, 4, 4, mig_profile="3g.40gb"), "node": "h100-dyn-1"}
    lines.write_text(json.dumps(sample) + "\n")
    call_command("ingest_samples", str(lines), stdout=StringIO())
    assert set_aside() == [(MIG_A, epoch_ms(T0), "h100-dyn-1")]
    cluster = load()
    assert adopt_unknown_samples(now=timezone.now()) == 1
    three_g = partition(cluster, "h100-dyn-1", "gpu-0-mig-3g40gb-9-4")
    assert stored() == [(three_g.meter_id, epoch_ms(T0))]


# The inventory of the sample's time: partitions gone since, or published again.


def renumbered(minor: int, generation: int) -> list[dict[str, Any]]:
    """The fixture's slices after the A100 node's driver restarted: its GPU renumbered (its
    partitions published again under new names, so new meter ids), a new pool generation."""
    objects = []
    for obj in iter_objects(FIXTURE):
        if obj["metadata"]["name"].startswith("a100-dyn-1"):
            obj = json.loads(json.dumps(obj).replace('"gpu-0-', f'"gpu-{minor}-'))
            obj["spec"]["pool"]["generation"] = generation
        objects.append(obj)
    return objects


def test_a_late_sample_goes_to_the_partition_published_at_its_time(cluster: Cluster) -> None:
    old = partition(cluster, "a100-dyn-1", "gpu-0-mig-1g10gb-19-6")
    restart = T0 + timedelta(hours=1)
    report = services.import_snapshot(
        cluster=cluster, objects=renumbered(1, 2), at=restart, kinds=["ResourceSlice"]
    )
    assert report.errors == []
    new = partition(cluster, "a100-dyn-1", "gpu-1-mig-1g10gb-19-6")
    assert (Device.objects.get(pk=old.pk).gone_at, new.first_seen) == (restart, restart)
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    # Buffered by the agent, sent after the restart: before it, at it, after it; and one
    # taken before the sync first saw either, which either could be: set aside.
    instants = [T0 + timedelta(minutes=30), restart, restart + timedelta(minutes=30)]
    before_both = old.first_seen - timedelta(hours=1)
    answer = post(
        token,
        "a100-dyn-1",
        [mig_sample(MIG_B, A100, 6, 1, at) for at in [*instants, before_both]],
    )
    assert (answer["accepted"], answer["unknown_devices"]) == (4, [MIG_B])
    assert stored() == sorted(
        [
            (old.meter_id, epoch_ms(instants[0])),
            (new.meter_id, epoch_ms(instants[1])),
            (new.meter_id, epoch_ms(instants[2])),
        ]
    )
    assert set_aside() == [(MIG_B, epoch_ms(before_both), "a100-dyn-1")]
    assert adopt_unknown_samples(now=timezone.now()) == 0


def test_a_late_sample_of_a_partition_gone_since_is_adopted_too() -> None:
    cluster = services.get_cluster("fx")
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    post(token, "a100-dyn-1", [mig_sample(MIG_B, A100, 6, 1)])
    load(at=T0 - timedelta(minutes=5))
    one_g = partition(cluster, "a100-dyn-1", "gpu-0-mig-1g10gb-19-6")
    # Withdrawn before the adoption ran (the node drained): the sample was taken before.
    Device.objects.filter(cluster=cluster, node__name="a100-dyn-1").update(
        gone_at=T0 + timedelta(minutes=1)
    )
    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert stored() == [(one_g.meter_id, epoch_ms(T0))]
    # One taken after it went has no partition then: set aside, never guessed.
    post(token, "a100-dyn-1", [mig_sample(MIG_B, A100, 6, 1, T0 + timedelta(minutes=1))])
    assert adopt_unknown_samples(now=timezone.now()) == 0
    assert set_aside() == [(MIG_B, epoch_ms(T0) + 60_000, "a100-dyn-1")]


# End to end: the agent (NVML with a fake library, DCGM through its exporter's HTTP text),
# the endpoint, the sync's allocations and the rollup, over a day in which the MIG device of
# one partition is made for one claim, then destroyed and made again for the next.

DAY = (timezone.now() - timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
NOON = DAY + timedelta(hours=12)


def claim(name: str, uid: str, allocated: datetime) -> dict[str, Any]:
    """A claim the scheduler allocated the H100's 3g.40gb partition at slices 4-7 to."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": "research",
            "uid": uid,
            "creationTimestamp": allocated.isoformat(),
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "mig",
                        "exactly": {
                            "deviceClassName": "mig.nvidia.com",
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "selectors": [
                                {
                                    "cel": {
                                        "expression": "device.attributes['gpu.nvidia.com']"
                                        ".profile == '3g.40gb'"
                                    }
                                }
                            ],
                        },
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "allocationTimestamp": allocated.isoformat(),
                "devices": {
                    "results": [
                        {
                            "request": "mig",
                            "driver": "gpu.nvidia.com",
                            "pool": "h100-dyn-1",
                            "device": "gpu-0-mig-3g40gb-9-4",
                        }
                    ]
                },
            }
        },
    }


class Exporter:
    """dcgm-exporter's `/metrics` on the node: the MIG series of the GPU instance in use."""

    def __init__(self) -> None:
        self.text = ""
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(exporter.text.encode())

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def show(self, *, instance: int, active: float) -> None:
        labels = (
            f'gpu="0",UUID="{H100}",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",'
            f'Hostname="h100-dyn-1",GPU_I_PROFILE="3g.40gb",GPU_I_ID="{instance}"'
        )
        self.text = (
            "# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge\n"
            f"DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{labels}}} {active}\n"
            "# TYPE DCGM_FI_DEV_FB_USED gauge\n"
            f"DCGM_FI_DEV_FB_USED{{{labels}}} 20480\n"
        )


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    served = Exporter()
    yield served
    served.server.shutdown()
    served.server.server_close()


def test_a_day_of_dynamic_mig_allocations_is_measured_end_to_end(
    monkeypatch: pytest.MonkeyPatch, exporter: Exporter
) -> None:
    cluster = load(at=DAY - timedelta(days=1))
    slices = list(iter_objects(FIXTURE))
    first = claim("train-a", "6b0f3c1e-58a2-4d0e-9c61-1f2a3b4c5d6e", DAY)
    second = claim("train-b", "7c1a4d2f-69b3-4e1f-8d72-2a3b4c5d6e7f", NOON)
    for at, claims in ((DAY, [first]), (NOON, [second])):
        report = services.import_snapshot(
            cluster=cluster,
            objects=[*slices, *claims],
            at=at,
            kinds=["ResourceSlice", "ResourceClaim"],
        )
        assert report.errors == []
    allocations = {a.claim.name: a for a in Allocation.objects.select_related("claim")}
    assert (allocations["train-a"].start, allocations["train-a"].end) == (DAY, NOON)
    assert allocations["train-b"].start == NOON

    # The H100 in MIG mode: one MIG device at slices 4-7, made for train-a (GPU instance 1),
    # destroyed at noon and made again for train-b (instance 2, a new UUID).
    gpu = FakeDevice(
        uuid=H100,
        name="NVIDIA H100 80GB HBM3",
        mem_used=21 * GIB,
        mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
        mig_slots=7,
    )
    install(monkeypatch, [gpu])
    now = [DAY]
    nvml = NvmlSource(proc_root="/nonexistent", clock=lambda: now[0])
    source = ExporterSource(exporter.url, DCGM, nvml=nvml, clock=lambda: now[0])
    token = issue_agent_token(cluster=cluster, node="h100-dyn-1", actor="ops")
    try:
        for hour in range(24):
            samples = []
            for minute in range(60):
                now[0] = DAY + timedelta(hours=hour, minutes=minute)
                before_noon = hour < 12
                uuid, instance = (MIG_A, 1) if before_noon else (MIG_B, 2)
                gpu.mig_devices = {
                    0: FakeDevice(
                        uuid=uuid,
                        name="NVIDIA H100 80GB HBM3 MIG 3g.40gb",
                        mem_used=20 * GIB,
                        gpu_instance_id=instance,
                        placement=(4, 4),
                        profile_id=9,
                    )
                }
                exporter.show(instance=instance, active=0.5 if before_noon else 0.25)
                samples += [reading.as_sample() for reading in source.read()]
            answer = post(token, "h100-dyn-1", samples)
            assert (answer["rejected"], answer["unknown_devices"]) == ([], [])
    finally:
        source.close()

    three_g = partition(cluster, "h100-dyn-1", "gpu-0-mig-3g40gb-9-4")
    assert Sample.objects.filter(device_uuid=three_g.meter_id).count() == 24 * 60
    rollup.rollup_hours(hours=[DAY + timedelta(hours=hour) for hour in range(24)])

    for name, util, hours in (("train-a", 50, range(12)), ("train-b", 25, range(12, 24))):
        rows = UsageHour.objects.filter(allocation=allocations[name]).order_by("hour")
        assert [row.hour for row in rows] == [DAY + timedelta(hours=hour) for hour in hours]
        share = allocations[name].gpu_share
        for row in rows:
            assert row.allocated_gpu_ms == round(3_600_000 * share)
            assert row.unmeasured_gpu_ms == 0
            assert abs(row.utilised_gpu_ms - row.allocated_gpu_ms * util / 100) <= 1
    assert UnknownDeviceSample.objects.count() == 0
    # Each GPU instance recorded under the partition its MIG device was made on, for its
    # span: what a DCGM series of the H100 (`UUID`, `GPU_I_ID`) is matched by.
    last_minute = epoch_ms(DAY + timedelta(hours=23, minutes=59))
    assert sorted(
        MigInstance.objects.values_list(
            "parent_uuid", "gpu_instance_id", "meter_id", "first_ms", "last_ms"
        )
    ) == [
        (H100, 1, three_g.meter_id, epoch_ms(DAY), epoch_ms(NOON) - 60_000),
        (H100, 2, three_g.meter_id, epoch_ms(NOON), last_minute),
    ]
