"""Samples that name their device by driver and device name (issue 18), not by UUID.

Devices without a published UUID (Intel GPUs, Gaudi cards, AMD partitions) are metered by
the identity the inventory forms for them (`Device.meter_id`); an agent reading a vendor's
exporter knows the device's name in its ResourceSlice, not that identity. The ingest
resolves (token's cluster, node, driver, device name) to the meter id and stores the sample
under it, exactly as a UUID-named sample of a NVIDIA device is stored under its UUID.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import path
from django.utils import timezone

from agent.exporters import AMD as AMD_PROFILE
from agent.exporters import INTEL as INTEL_PROFILE
from agent.exporters import parse_metrics
from inventory import services
from inventory.dumps import iter_objects
from inventory.models import Cluster, Device, DeviceKind
from metering import views
from metering.hours import epoch_ms
from metering.ingest import adopt_unknown_samples, formed_meter_id, validate_samples
from metering.models import Sample, UnknownDeviceSample
from metering.services import issue_agent_token
from tests.factories import DeviceFactory, NodeFactory, OtherDeviceFactory
from tests.fixtures import DRA

urlpatterns = [path("ingest/samples", views.ingest_samples)]

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

T0 = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)
INTEL = "gpu.intel.com"


def intel_gpu(**fields: Any) -> Device:
    """An Intel GPU as Intel's driver publishes it: no uuid, named by its PCI address."""
    device = DeviceFactory.create(driver=INTEL, uuid="", parent_uuid="", meter_id="", **fields)
    device.physical_gpu_key = f"{device.pool}/{device.name}"
    device.meter_id = formed_meter_id(device.cluster.name, INTEL, device.pool, device.name)
    device.save()
    return device


def node_of(device: Device) -> str:
    assert device.node is not None
    return device.node.name


def named(device: Device, at: datetime, **fields: Any) -> dict[str, Any]:
    return {
        "driver": device.driver,
        "device": device.name,
        "ts": at.isoformat(),
        "gpu_util": 40.0,
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


def stored() -> list[tuple[str, int, str]]:
    return sorted(Sample.objects.values_list("device_uuid", "ts_ms", "node"))


def test_a_device_named_by_driver_and_device_is_stored_under_its_meter_id() -> None:
    xpu = intel_gpu(name="0000-03-00-0-0x56c0")
    node = node_of(xpu)
    token = issue_agent_token(cluster=xpu.cluster, node=node, actor="ops")
    answer = post(token, node, [named(xpu, T0)])
    assert answer == {"accepted": 1, "duplicates": 0, "rejected": [], "unknown_devices": []}
    assert xpu.meter_id.startswith("dra-") and xpu.meter_id != xpu.name
    assert stored() == [(xpu.meter_id, epoch_ms(T0), node)]


def test_a_batch_mixes_uuids_and_names_and_one_device_named_both_ways_is_stored_once() -> None:
    gpu = DeviceFactory.create()  # NVIDIA: meter id == uuid
    node = node_of(gpu)
    xpu = intel_gpu(node=gpu.node, name="card1")
    token = issue_agent_token(cluster=gpu.cluster, node=node, actor="ops")
    answer = post(
        token,
        node,
        [
            {"uuid": gpu.uuid, "ts": T0.isoformat(), "gpu_util": 10.0},
            named(xpu, T0),
            # The NVIDIA GPU by name at the same instant: the same device, a duplicate.
            named(gpu, T0),
            named(gpu, T0 + timedelta(minutes=1), pool=gpu.pool),
        ],
    )
    assert (answer["accepted"], answer["duplicates"], answer["rejected"]) == (3, 1, [])
    assert stored() == sorted(
        [
            (gpu.uuid, epoch_ms(T0), node),
            (gpu.uuid, epoch_ms(T0 + timedelta(minutes=1)), node),
            (xpu.meter_id, epoch_ms(T0), node),
        ]
    )
    # The uuid-named sample came first and is the one kept.
    assert Sample.objects.get(device_uuid=gpu.uuid, ts_ms=epoch_ms(T0)).gpu_util == 10.0


def test_a_node_other_than_the_tokens_is_refused_naming_the_field() -> None:
    xpu = intel_gpu(name="card0")
    other = NodeFactory.create(cluster=xpu.cluster)
    intel_gpu(node=other, name="card0")
    token = issue_agent_token(cluster=xpu.cluster, node=node_of(xpu), actor="ops")
    answer = post(token, node_of(xpu), [named(xpu, T0), named(xpu, T0, node=other.name)])
    assert answer["accepted"] == 1
    assert answer["rejected"] == [
        {
            "index": 1,
            "reason": f"samples[1].device: {INTEL} device 'card0' on node {other.name!r}: node "
            f"{other.name!r} is not this token's node {node_of(xpu)!r}",
        }
    ]
    assert stored() == [(xpu.meter_id, epoch_ms(T0), node_of(xpu))]


def test_a_cluster_wide_token_resolves_on_any_node_of_its_cluster_only() -> None:
    here = intel_gpu(name="card0")
    there = intel_gpu(name="card0")  # another cluster (a node of its own)
    assert here.cluster_id != there.cluster_id
    token = issue_agent_token(cluster=here.cluster, node="*", actor="ops")
    answer = post(
        token,
        node_of(here),
        [named(here, T0), named(there, T0, node=node_of(there))],
    )
    assert answer["accepted"] == 1
    assert answer["rejected"] == [
        {
            "index": 1,
            "reason": f"samples[1].device: {INTEL} device 'card0' on node {node_of(there)!r}: "
            f"node {node_of(there)!r} is in another cluster than this token's ({here.cluster})",
        }
    ]
    assert answer["unknown_devices"] == []
    assert stored() == [(here.meter_id, epoch_ms(T0), node_of(here))]


def test_an_unknown_named_device_is_kept_aside_under_its_formed_identity_then_adopted() -> None:
    xpu = intel_gpu(name="card0")
    node = node_of(xpu)
    token = issue_agent_token(cluster=xpu.cluster, node=node, actor="ops")
    newcomer = {"driver": INTEL, "device": "card9", "ts": T0.isoformat(), "gpu_util": 5.0}
    answer = post(token, node, [newcomer])
    formed = formed_meter_id(xpu.cluster.name, INTEL, node, "card9")  # pool: the node's name
    assert answer["accepted"] == 1
    assert answer["unknown_devices"] == [formed]
    assert "card9" in answer["unknown_named"][formed]
    assert "kept aside" in answer["unknown_named"][formed]
    assert list(UnknownDeviceSample.objects.values_list("device_uuid", flat=True)) == [formed]
    assert stored() == []

    intel_gpu(node=xpu.node, name="card9")  # the sync learns it
    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert stored() == [(formed, epoch_ms(T0), node)]


def test_a_device_tally_does_not_meter_and_an_ambiguous_name_are_refused() -> None:
    gpu = DeviceFactory.create()
    node = node_of(gpu)
    channel = OtherDeviceFactory.create(node=gpu.node, name="channel-0")
    assert channel.kind == DeviceKind.OTHER and channel.meter_id == ""
    # The same name in a second pool of the node.
    DeviceFactory.create(node=gpu.node, name=gpu.name, pool="second")
    token = issue_agent_token(cluster=gpu.cluster, node=node, actor="ops")
    answer = post(token, node, [named(channel, T0), named(gpu, T0)])
    assert answer["accepted"] == 0
    reasons = [rejection["reason"] for rejection in answer["rejected"]]
    assert reasons[0].startswith("samples[0].device: compute-domain.nvidia.com device ")
    assert "is not an accelerator Tally meters" in reasons[0]
    assert reasons[1].startswith(f"samples[1].device: gpu.nvidia.com device {gpu.name!r}")
    pools = ", ".join(sorted([repr(gpu.pool), "'second'"]))
    assert f"names 2 devices (pools {pools}); give its pool" in reasons[1]


# A node's token names a device of another node (issue 18's review): by driver, pool and
# device, the identity it forms is that device's.


def set_aside() -> list[tuple[str, int, str, float | None]]:
    return sorted(
        UnknownDeviceSample.objects.values_list("device_uuid", "ts_ms", "node", "gpu_util")
    )


def test_a_device_of_another_node_named_before_the_sync_knows_it_is_never_adopted() -> None:
    mine = intel_gpu(name="card0")
    node_a = node_of(mine)
    node_b = NodeFactory.create(cluster=mine.cluster)
    theirs = formed_meter_id(mine.cluster.name, INTEL, node_b.name, "card0")  # B's card0, to be
    token_a = issue_agent_token(cluster=mine.cluster, node=node_a, actor="ops")
    token_b = issue_agent_token(cluster=mine.cluster, node=node_b.name, actor="ops")
    # A names B's card0 by its pool (B's name), with no node: looked for on A, not found, and
    # set aside under the identity B's card0 will have; then B's own agent sends the same
    # instant, which is set aside too, not taken for a duplicate.
    planted = post(token_a, node_a, [named(mine, T0, pool=node_b.name, gpu_util=99.0)])
    assert (planted["accepted"], planted["unknown_devices"]) == (1, [theirs])
    own = post(token_b, node_b.name, [named(mine, T0, gpu_util=7.0)])
    assert (own["accepted"], own["duplicates"], own["unknown_devices"]) == (1, 0, [theirs])

    card0_b = intel_gpu(node=node_b, name="card0")  # the sync learns B's card0
    assert card0_b.meter_id == theirs
    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert stored() == [(theirs, epoch_ms(T0), node_b.name)]
    assert Sample.objects.get(device_uuid=theirs).gpu_util == 7.0  # B's own, not A's 99
    # A's stays aside, to expire; looked at again, it is still not adopted.
    assert set_aside() == [(theirs, epoch_ms(T0), node_a, 99.0)]
    assert adopt_unknown_samples(now=timezone.now()) == 0
    assert stored() == [(theirs, epoch_ms(T0), node_b.name)]


def test_a_known_device_of_another_node_named_by_pool_is_refused_as_sent() -> None:
    mine = intel_gpu(name="card0")
    node_a = node_of(mine)
    node_b = NodeFactory.create(cluster=mine.cluster)
    card0_b = intel_gpu(node=node_b, name="card0")
    token_a = issue_agent_token(cluster=mine.cluster, node=node_a, actor="ops")
    answer = post(token_a, node_a, [named(mine, T0, pool=node_b.name), named(mine, T0)])
    assert answer["accepted"] == 1
    # Named as sent (driver, pool, device), never by the identity formed from them.
    assert answer["rejected"] == [
        {
            "index": 0,
            "reason": f"samples[0].device: {INTEL} device 'card0' (pool {node_b.name!r}) is on "
            f"node {node_b.name!r}, not on this token's node {node_a!r}",
        }
    ]
    assert card0_b.meter_id not in json.dumps(answer)
    assert stored() == [(mine.meter_id, epoch_ms(T0), node_a)]
    assert set_aside() == []


def test_a_cluster_wide_tokens_samples_are_adopted_in_its_cluster_only() -> None:
    here = intel_gpu(name="card0")
    elsewhere = NodeFactory.create()  # another cluster
    token = issue_agent_token(cluster=here.cluster, node="*", actor="ops")
    newcomers = {"GPU-here-later": here.node, "GPU-elsewhere-later": elsewhere}
    answer = post(
        token,
        "dcgm",
        [{"uuid": uuid, "ts": T0.isoformat(), "gpu_util": 3.0} for uuid in newcomers],
    )
    assert answer["accepted"] == 2
    for uuid, node in newcomers.items():
        DeviceFactory.create(uuid=uuid, node=node)
    # Any node of the token's cluster (the rule `ingest` applies to known devices), but not
    # a device of another cluster.
    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert stored() == [("GPU-here-later", epoch_ms(T0), "dcgm")]
    assert [row[0] for row in set_aside()] == ["GPU-elsewhere-later"]


@override_settings(TALLY_INGEST_MAX_UNKNOWN_DEVICES=1)
def test_past_the_unknown_device_limit_the_device_is_named_as_sent() -> None:
    mine = intel_gpu(name="card0")
    node = node_of(mine)
    token = issue_agent_token(cluster=mine.cluster, node=node, actor="ops")
    answer = post(
        token,
        node,
        [
            {"uuid": "GPU-new-1", "ts": T0.isoformat()},
            {"driver": INTEL, "device": "card8", "pool": "pool-x", "ts": T0.isoformat()},
            {"driver": INTEL, "device": "card9", "ts": T0.isoformat()},
        ],
    )
    assert answer["accepted"] == 1
    reasons = [rejection["reason"] for rejection in answer["rejected"]]
    assert reasons == [
        f"samples[1].device: {INTEL} device 'card8' (pool 'pool-x') is not in the inventory, "
        "and this token already has samples of 1 unknown devices set aside "
        "(TALLY_INGEST_MAX_UNKNOWN_DEVICES)",
        f"samples[2].device: {INTEL} device 'card9' is not in the inventory, and this token "
        "already has samples of 1 unknown devices set aside (TALLY_INGEST_MAX_UNKNOWN_DEVICES)",
    ]
    assert "dra-" not in json.dumps(answer["rejected"])


@pytest.mark.parametrize(
    "identity",
    [
        {"driver": INTEL, "device": "card0"},
        {"device": "card0"},
        {"driver": INTEL, "pci_bus_id": "0000:03:00.0"},
    ],
)
def test_a_sample_naming_its_device_both_ways_is_rejected(identity: dict[str, Any]) -> None:
    mine = intel_gpu(name="card0")
    node = node_of(mine)
    token = issue_agent_token(cluster=mine.cluster, node=node, actor="ops")
    gpu = DeviceFactory.create(node=mine.node)  # the uuid names another device
    answer = post(
        token,
        node,
        [
            {"uuid": gpu.uuid, "ts": T0.isoformat(), **identity},
            # Identity fields left empty (null) name nothing: the uuid alone names the device.
            {"uuid": gpu.uuid, "ts": T0.isoformat(), "driver": None, "device": None},
        ],
    )
    assert answer["rejected"] == [
        {
            "index": 0,
            "reason": "samples[0].uuid: give uuid, or driver and device, not both: they could "
            "name two devices",
        }
    ]
    assert stored() == [(gpu.uuid, epoch_ms(T0), node)]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"driver": INTEL}, "samples[0].device: must be a non-empty string"),
        ({"device": "card0"}, "samples[0].driver: must be a non-empty string"),
        ({"driver": INTEL, "device": 7}, "samples[0].device: must be a non-empty string"),
        ({"driver": INTEL, "device": "card\n0"}, 'samples[0].device: "card\\n0" is not'),
        ({"driver": INTEL, "device": "c", "pool": ""}, "samples[0].pool: must be a non-empty"),
        ({"driver": INTEL, "device": "c", "node": "Node_1"}, 'samples[0].node: "Node_1" is not'),
        ({}, "samples[0].uuid: must be a non-empty string (or give driver and device)"),
    ],
)
def test_bad_identities_name_the_field(fields: dict[str, Any], reason: str) -> None:
    valid, rejected = validate_samples([{"ts": T0.isoformat(), **fields}])
    assert valid == []
    assert rejected[0]["reason"].startswith(reason), rejected[0]["reason"]


def test_the_command_resolves_named_lines_on_their_node(tmp_path: Path) -> None:
    xpu = intel_gpu(name="card0")
    node = node_of(xpu)
    lines = [
        json.dumps({**named(xpu, T0), "node": node}),
        json.dumps(named(xpu, T0 + timedelta(minutes=1))),  # no node: given by --node below
        json.dumps({**named(xpu, T0), "device": "card7", "node": node}),
    ]
    file = tmp_path / "samples.jsonl"
    file.write_text("\n".join(lines) + "\n")
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError, match="1 lines rejected"):
        call_command("ingest_samples", str(file), "--node", node, stdout=out, stderr=err)
    assert "2 accepted" in out.getvalue()
    assert f"line 3: device: {INTEL} device 'card7' on node {node!r} is not in the inventory" in (
        err.getvalue()
    )
    assert [row[0] for row in stored()] == [xpu.meter_id, xpu.meter_id]

    file.write_text(json.dumps(named(xpu, T0 + timedelta(minutes=2))) + "\n")
    out, err = StringIO(), StringIO()
    with pytest.raises(CommandError):
        call_command("ingest_samples", str(file), stdout=out, stderr=err)
    assert "node: a device named by driver and device needs its node" in err.getvalue()


# By PCI address: AMD's and Intel's exporters know a GPU's PCI address, not its device name.

AMD = "gpu.amd.com"
BUS = "0000:11:00.0"


def amd_device(
    node: Any,
    name: str,
    *,
    kind: str,
    bus: str = BUS,
    address_attribute: str = "resource.kubernetes.io/pciBusID",
) -> Device:
    """A device as AMD's driver publishes it: no uuid, the GPU's PCI address on the GPU and
    on each of its partitions (under `address_attribute`)."""
    device = DeviceFactory.create(
        node=node,
        driver=AMD,
        name=name,
        kind=kind,
        uuid="",
        meter_id="",
        attributes={
            "type": {"string": "amdgpu" if kind == DeviceKind.GPU else "amdgpu-partition"},
            address_attribute: {"string": bus},
        },
    )
    device.meter_id = formed_meter_id(device.cluster.name, AMD, device.pool, name)
    device.save()
    return device


def by_pci(bus: str, at: datetime, **fields: Any) -> dict[str, Any]:
    return {"driver": AMD, "pci_bus_id": bus, "ts": at.isoformat(), "gpu_util": 30.0, **fields}


def test_partitions_named_by_pci_address_and_index_are_stored_under_their_meter_ids() -> None:
    node = NodeFactory.create()
    # A CPX GPU: 8 partitions named by DRM card and render index, cards 3 to 10 (card 10
    # sorts first as text, last by number: partitions are ordered by number).
    parts = [
        amd_device(node, f"gpu-{card}-{128 + card}", kind=DeviceKind.PARTITION)
        for card in (10, 3, 4, 5, 6, 7, 8, 9)
    ]
    whole = amd_device(node, "gpu-1-129", kind=DeviceKind.GPU, bus="0000:2f:00.0")
    token = issue_agent_token(cluster=node.cluster, node=node.name, actor="ops")
    answer = post(
        token,
        node.name,
        [
            by_pci(BUS, T0, partition=0),
            by_pci(BUS, T0, partition=7),
            by_pci("0000:2F:00.0", T0),  # upper-case hex: the same address
            by_pci(BUS, T0, partition=8),
            by_pci(BUS, T0),
            by_pci("0000:99:00.0", T0),
        ],
    )
    assert answer["accepted"] == 3
    reasons = {rejection["index"]: rejection["reason"] for rejection in answer["rejected"]}
    assert reasons[3].startswith(f"samples[3].device: {AMD} device at PCI {BUS} partition 8 on")
    assert "has 8 partitions in the inventory, not a partition 8" in reasons[3]
    assert "8 devices carry that PCI address; give the partition" in reasons[4]
    assert "0000:99:00.0" in reasons[5] and "is not in the inventory" in reasons[5]
    # Partition 0 is the lowest card index (3), partition 7 the highest (10).
    assert sorted(row[0] for row in stored()) == sorted(
        [parts[1].meter_id, parts[0].meter_id, whole.meter_id]
    )


def test_a_gpu_that_publishes_only_amds_pciaddr_is_found_by_its_address() -> None:
    # AMD's auto-partition and vfio devices may carry `pciAddr` without the standard
    # attribute; the inventory ties them to their GPU by it, and so does the ingest.
    node = NodeFactory.create()
    whole = amd_device(node, "gpu-0", kind=DeviceKind.GPU, address_attribute="pciAddr")
    token = issue_agent_token(cluster=node.cluster, node=node.name, actor="ops")
    answer = post(token, node.name, [by_pci(BUS.upper(), T0), by_pci("0000:99:00.0", T0)])
    assert answer["accepted"] == 1, answer
    assert [row[0] for row in stored()] == [whole.meter_id]
    reason = answer["rejected"][0]["reason"]
    assert "publishes resource.kubernetes.io/pciBusID or pciAddr 0000:99:00.0" in reason


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"pci_bus_id": "11:00.0"}, 'samples[0].pci_bus_id: "11:00.0" is not a PCI address'),
        ({"pci_bus_id": BUS, "partition": -1}, "samples[0].partition: must be an integer"),
        ({"pci_bus_id": BUS, "partition": "1"}, "samples[0].partition: must be an integer"),
    ],
)
def test_bad_pci_identities_name_the_field(fields: dict[str, Any], reason: str) -> None:
    _, rejected = validate_samples([{"driver": AMD, "ts": T0.isoformat(), **fields}])
    assert rejected[0]["reason"].startswith(reason), rejected[0]["reason"]


# End to end: an exporter's recorded text, through the agent's profiles, into the ingest,
# against the inventory of the vendors' fixtures (tests/fixtures/dra/vendors/).

AGENT_FIXTURES = Path(__file__).parent.parent / "agent" / "fixtures"


def load_vendor(name: str) -> Cluster:
    cluster = services.get_cluster("fx")
    report = services.import_snapshot(
        cluster=cluster,
        objects=list(iter_objects(DRA / "vendors" / name)),
        at=timezone.now() - timedelta(days=3),
        kinds=["ResourceSlice"],
    )
    assert report.errors == []
    return cluster


def test_amd_exporter_partitions_are_billed_to_the_partitions_the_driver_published() -> None:
    cluster = load_vendor("amd-mi300x.yaml")
    node = "mi300x-node-2"  # one MI300X in CPX mode: 8 partitions on PCI 0000:05:00.0
    readings = parse_metrics(
        (AGENT_FIXTURES / "amd-mi300x-cpx.prom").read_text(),
        AMD_PROFILE,
        at=T0,
        amd_bus_ids=["0000:05:00.0"],  # the node shows one GPU: the recording's second is left out
    )
    assert {reading.node for reading in readings} == {node}
    token = issue_agent_token(cluster=cluster, node=node, actor="ops")
    answer = post(token, node, [reading.as_sample() for reading in readings])
    assert (answer["accepted"], answer["rejected"], answer["unknown_devices"]) == (8, [], [])
    partitions = {
        device.name: device.meter_id
        for device in Device.objects.filter(cluster=cluster, node__name=node, driver=AMD)
    }
    utilisation = dict(Sample.objects.values_list("device_uuid", "gpu_util"))
    # Partition k is the driver's k-th by card index: gpu-1-128 is 0, gpu-3-130 is 2.
    assert utilisation[partitions["gpu-1-128"]] == 35.0
    assert utilisation[partitions["gpu-3-130"]] == 100.0
    assert utilisation[partitions["gpu-8-135"]] == 64.0


def test_intel_exporter_gpus_are_billed_by_pci_address_and_unknown_ones_refused() -> None:
    cluster = load_vendor("intel-gpu.yaml")
    readings = parse_metrics((AGENT_FIXTURES / "intel-xpum.prom").read_text(), INTEL_PROFILE, at=T0)
    token = issue_agent_token(cluster=cluster, node="intel-node-1", actor="ops")
    answer = post(token, "intel-node-1", [reading.as_sample() for reading in readings])
    flex = Device.objects.get(cluster=cluster, name="0000-03-00-0-0x56c0")
    assert answer["accepted"] == 1
    assert stored() == [(flex.meter_id, epoch_ms(T0), "intel-node-1")]
    # The recording's Max 1550 is on no node the inventory knows of.
    assert [rejection["index"] for rejection in answer["rejected"]] == [1]
    assert "PCI 0000:29:00.0" in answer["rejected"][0]["reason"]
    assert "is not in the inventory" in answer["rejected"][0]["reason"]
