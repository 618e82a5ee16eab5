"""Fleet counts of other vendors' drivers, from the project's fixtures in dra/vendors/.

Each driver is read through its profile (`inventory.profiles`): which devices are
accelerators, what unit they count, how a partition's share and a device's identity are formed.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from django.test import override_settings

from inventory import checks, profiles, selectors, services
from inventory.dumps import iter_objects
from inventory.models import Device, DriverProfile
from tests.factories import AllocationFactory
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db
AT = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
VENDORS = DRA / "vendors"
FIXTURES = (
    "amd-mi300x.yaml",
    "intel-gpu.yaml",
    "intel-arc.yaml",
    "gaudi2.yaml",
    "tpu.yaml",
    "tpu-multi-host.yaml",
    "vgpu.yaml",
    "vgpu-host.yaml",
    "partitionable-counters.yaml",
    "consumable-capacity.yaml",
)


def load(*names: str, at: datetime = AT) -> services.SyncReport:
    objects = [obj for name in names for obj in iter_objects(VENDORS / name)]
    report = services.import_snapshot(
        cluster=services.get_cluster("fx"), objects=objects, at=at, kinds=["ResourceSlice"]
    )
    assert report.errors == []
    return report


def accelerators(driver: str, pool: str | None = None) -> list[Device]:
    rows = Device.objects.filter(gone_at__isnull=True, driver=driver).exclude(kind="other")
    if pool is not None:
        rows = rows.filter(pool=pool)
    return list(rows.order_by("name"))


def physical_units(devices: list[Device]) -> int:
    return len({device.physical_gpu_key for device in devices})


def test_amd_whole_gpus_count_and_cpx_partitions_are_eighths_of_one_gpu() -> None:
    load("amd-mi300x.yaml")
    whole = accelerators("gpu.amd.com", "mi300x-node-1")
    assert len(whole) == 8 and {d.kind for d in whole} == {"gpu"}
    assert {(d.unit, d.gpu_share) for d in whole} == {("gpu", Decimal(1))}
    # deviceID is the model's PCI id, the same on all eight: the key comes from pciBusID.
    assert physical_units(whole) == 8
    assert whole[0].physical_gpu_key == "gpu.amd.com/mi300x-node-1/0000:05:00.0"
    assert (whole[0].product_name, whole[0].driver_version) == (
        "AMD_Instinct_MI300X_OAM",
        "6.10.5",
    )
    assert whole[0].memory_bytes == 192 * 2**30
    parts = accelerators("gpu.amd.com", "mi300x-node-2")
    assert len(parts) == 8 and {d.kind for d in parts} == {"partition"}
    assert {d.gpu_share for d in parts} == {Decimal("0.125")}
    assert {d.physical_gpu_key for d in parts} == {"gpu.amd.com/mi300x-node-2/0000:05:00.0"}
    assert parts[0].profile == "cpx_nps1"
    # Two CPX partitions are a quarter of one MI300X, not two GPUs.
    assert parts[0].gpu_share + parts[1].gpu_share == Decimal("0.25")
    assert sum(d.gpu_share for d in whole + parts) == 9


def test_amd_dual_partition_profile_is_a_half_whatever_is_published() -> None:
    objects = list(iter_objects(VENDORS / "amd-mi300x.yaml"))
    node2 = objects[2]
    devices = node2["spec"]["devices"][:1]  # only one of the two DPX partitions is free
    devices[0]["attributes"]["partitionProfile"] = {"string": "dpx_nps2"}
    node2["spec"]["devices"] = devices
    services.import_snapshot(cluster=services.get_cluster("fx"), objects=[node2], at=AT)
    (part,) = accelerators("gpu.amd.com", "mi300x-node-2")
    assert (part.kind, part.gpu_share) == ("partition", Decimal("0.5"))


def test_cpx_partitions_are_eighths_of_an_mi300x_even_when_some_are_not_published() -> None:
    objects = list(iter_objects(VENDORS / "amd-mi300x.yaml"))
    node2 = objects[2]
    node2["spec"]["devices"] = node2["spec"]["devices"][:3]
    services.import_snapshot(cluster=services.get_cluster("fx"), objects=[node2], at=AT)
    assert {d.gpu_share for d in accelerators("gpu.amd.com")} == {Decimal("0.125")}
    assert profiles.partition_profile_count("cpx_nps4", "Unknown_Accelerator") is None


def test_intel_integrated_gpu_is_not_an_accelerator_and_the_discrete_one_is() -> None:
    load("intel-gpu.yaml")
    (discrete,) = accelerators("gpu.intel.com")
    assert (discrete.name, discrete.kind, discrete.unit) == ("0000-03-00-0-0x56c0", "gpu", "gpu")
    assert (discrete.product_name, discrete.architecture) == ("Flex 170", "Data Center Flex")
    assert discrete.gpu_share == 1 and discrete.memory_bytes == 16 * 2**30
    integrated = Device.objects.get(name="0000-00-02-0-0xa7a0")
    assert (integrated.kind, integrated.gpu_share, integrated.meter_id) == ("other", 0, "")
    # No uuid: the meter identity is formed from where the device is published.
    assert discrete.uuid == ""
    assert discrete.meter_id == profiles.meter_id(
        "fx", "gpu.intel.com", "intel-node-1", "0000-03-00-0-0x56c0"
    )
    assert discrete.meter_id.startswith("dra-") and len(discrete.meter_id) == 36


def test_intel_gpus_whose_driver_names_no_model_are_named_by_pci_id_and_warned_about() -> None:
    load("intel-arc.yaml")
    arc, unlisted = accelerators("gpu.intel.com")
    # "Unknown" would price every unnamed model alike: a known id is named, another spelled.
    assert arc.product_name == "Arc A770"
    assert unlisted.product_name == "Intel GPU 0x56ff"  # no pciId: the id ending its name
    (warning,) = [w for w in checks.sync_warnings() if w["check"] == checks.UNNAMED_MODEL]
    assert warning["devices"] == ["0000-04-00-0-0x56ff"]
    assert warning["message"].startswith(
        "pool gpu.intel.com/arc-node-1: device 0000-04-00-0-0x56ff published no model name; "
        "counted and billed as model 'Intel GPU 0x56ff'"
    )
    assert "models named by PCI id: 1" in checks.summarise([warning])
    # A model the driver names is kept as published.
    assert profiles.fallback_model("gpu.intel.com", "Flex 170", ["0x56a0"]) == "Flex 170"
    assert profiles.fallback_model("gaudi.intel.com", "", ["0x1020"]) == ""


@override_settings(TALLY_GPU_DRIVERS=frozenset())
def test_gaudi_cards_count_without_being_listed_as_gpu_drivers() -> None:
    load("gaudi2.yaml")
    cards = accelerators("gaudi.intel.com")
    assert len(cards) == 8 and physical_units(cards) == 8
    assert {(d.kind, d.unit, d.gpu_share, d.product_name) for d in cards} == {
        ("gpu", "gaudi", Decimal(1), "Gaudi2")
    }
    assert len({d.meter_id for d in cards}) == 8
    assert cards[0].shape is not None and cards[0].shape.unit == "gaudi"


def test_tpu_chips_that_publish_one_host_uuid_stay_four_chips() -> None:
    load("tpu.yaml")
    chips = accelerators("tpu.google.com")
    assert [d.name for d in chips] == ["accel0", "accel1", "accel2", "accel3"]
    assert {d.uuid for d in chips} == {"tpu-7e0f43a2-51c9-4d8b-a6f1-0c2b9d3e8a15"}
    assert physical_units(chips) == 4
    assert len({d.meter_id for d in chips}) == 4
    assert all(d.meter_id.startswith("dra-") for d in chips)
    assert {(d.kind, d.unit, d.gpu_share, d.product_name) for d in chips} == {
        ("gpu", "tpu", Decimal(1), "v4")
    }


def test_a_multi_host_tpu_slice_counts_the_chips_of_every_node_it_spans() -> None:
    load("tpu-multi-host.yaml")
    slices = {d.name: d for d in accelerators("tpu.google.com")}
    assert {name: d.gpu_share for name, d in slices.items()} == {
        "tpu-4x4-1": Decimal(16),
        "tpu-2x4-1": Decimal(8),
        "tpu-2x4-2": Decimal(8),
        **{f"tpu-2x2-{n}": Decimal(4) for n in range(1, 5)},
    }
    assert {(d.kind, d.unit, d.product_name) for d in slices.values()} == {("gpu", "tpu", "v5p")}
    # Overlapping slices of one counter set: one physical key, never 7 units side by side;
    # the fleet counts the 16 chips the set holds, 8 of them held by a 2x4 slice.
    assert physical_units(list(slices.values())) == 1
    AllocationFactory.create(device=slices["tpu-2x4-2"], end=None)
    (row,) = selectors.capacity_by_model()
    assert (row["unit"], row["product_name"], row["gpus"], row["allocated"], row["free"]) == (
        "tpu",
        "v5p",
        16,
        8,
        8,
    )
    assert row["equivalents"] == 16
    # A profile may say which counters count units; none named: the largest fraction, 1.
    DriverProfile.objects.create(
        driver="tpu.google.com", spec={"unit_counters": []}, source="admin"
    )
    load("tpu-multi-host.yaml", at=AT + timedelta(hours=1))
    assert {d.gpu_share for d in accelerators("tpu.google.com")} == {Decimal(1)}


def test_tpu_chips_stay_apart_even_where_a_profile_calls_uuid_an_identity() -> None:
    DriverProfile.objects.create(
        driver="tpu.google.com", spec={"identity_attributes": ["uuid"]}, source="admin"
    )
    load("tpu.yaml")
    chips = accelerators("tpu.google.com")
    assert physical_units(chips) == 4 and len({d.meter_id for d in chips}) == 4


def test_vgpu_profiles_count_their_fraction_of_the_physical_gpu() -> None:
    load("vgpu.yaml")
    (small,) = accelerators("gpu.nvidia.com", "vgpu-vm-1")
    # A guest sees the vGPU type as its product name: the model is the type's board, the
    # type its profile, as a MIG device's (rate cards and quotas name the GPU, not the type).
    assert (small.product_name, small.profile, small.kind, small.gpu_share) == (
        "NVIDIA A100",
        "A100-4C",
        "partition",
        Decimal("0.1"),
    )
    tens = accelerators("gpu.nvidia.com", "vgpu-vm-2")
    assert {(d.product_name, d.profile, d.gpu_share) for d in tens} == {
        ("NVIDIA A100", "A100-10C", Decimal("0.25"))
    }
    # The guest sees its vGPU's own UUID, and samples name it by that.
    assert {d.meter_id for d in tens} == {d.uuid for d in tens}
    assert physical_units(tens) == 2
    assert small.gpu_share + sum(d.gpu_share for d in tens) == Decimal("0.6")


def test_a_guests_vgpu_is_named_by_its_types_board_and_never_its_physical_product() -> None:
    """docs/reference/drivers.md, "What a guest cannot tell": the guest names only the type, so
    the model is the board the type names; a type whose board Tally's table lacks counts a
    whole GPU (overcharged, never undercharged); a card passed through whole keeps its name."""
    objects = list(iter_objects(VENDORS / "vgpu.yaml"))
    (vm,) = [o for o in objects if o["metadata"]["name"].startswith("vgpu-vm-1")]
    guest = vm["spec"]["devices"][0]["attributes"]
    # A name of NVIDIA's type shape whose board is not in VGPU_BOARD_MEMORY_GB.
    assert "Z900" not in profiles.VGPU_BOARD_MEMORY_GB
    guest["productName"] = {"string": "NVIDIA Z900-8C"}
    passthrough = copy.deepcopy(vm)
    passthrough["metadata"]["name"] = "vgpu-vm-9-gpu.nvidia.com-p4ss7"
    passthrough["spec"]["nodeName"] = passthrough["spec"]["pool"]["name"] = "vgpu-vm-9"
    whole = passthrough["spec"]["devices"][0]["attributes"]
    whole["productName"] = {"string": "NVIDIA A100-PCIE-40GB"}
    whole["uuid"] = {"string": "GPU-0c9e8d7f-3b7d-11ef-8f00-1a2b3c4d5e6f"}
    report = services.import_snapshot(
        cluster=services.get_cluster("fx"),
        objects=[*objects, passthrough],
        at=AT,
        kinds=["ResourceSlice"],
    )
    assert report.errors == []
    (unknown,) = accelerators("gpu.nvidia.com", "vgpu-vm-1")
    assert (unknown.product_name, unknown.profile, unknown.gpu_share) == (
        "NVIDIA Z900",
        "Z900-8C",
        Decimal(1),
    )
    (card,) = accelerators("gpu.nvidia.com", "vgpu-vm-9")
    assert (card.product_name, card.profile, card.kind, card.gpu_share) == (
        "NVIDIA A100-PCIE-40GB",
        "",
        "gpu",
        Decimal(1),
    )
    # The known types keep their board, never a physical product's name.
    assert {d.product_name for d in accelerators("gpu.nvidia.com", "vgpu-vm-2")} == {"NVIDIA A100"}
    # Counted whole, never in silence: the sync warns, naming the type, the board and why.
    (warning,) = [w for w in checks.sync_warnings() if w["check"] == checks.UNKNOWN_VGPU_BOARD]
    assert (warning["pool"], warning["devices"]) == ("vgpu-vm-1", [unknown.name])
    assert "vGPU type Z900-8C" in warning["message"]
    assert "board Z900's framebuffer" in warning["message"]
    assert "as a whole GPU" in warning["message"]


def test_vgpu_slots_published_on_the_host_are_shares_of_their_physical_gpu() -> None:
    load("vgpu-host.yaml")
    devices = {d.name: d for d in accelerators("gpu.nvidia.com")}
    gpu = devices.pop("gpu-0")
    assert (gpu.kind, gpu.gpu_share, gpu.meter_id) == ("gpu", 1, gpu.uuid)
    assert {
        name: (d.kind, d.product_name, d.profile, d.gpu_share, d.physical_gpu_key)
        for name, d in devices.items()
    } == {
        "vgpu-gpu-0-12q-0": ("partition", "NVIDIA L40S", "L40S-12Q", Decimal("0.25"), gpu.uuid),
        "vgpu-gpu-0-12q-1": ("partition", "NVIDIA L40S", "L40S-12Q", Decimal("0.25"), gpu.uuid),
        "vgpu-gpu-0-24q-0": ("partition", "NVIDIA L40S", "L40S-24Q", Decimal("0.5"), gpu.uuid),
    }
    # The slots carry their GPU's uuid; the GPU meters by it, each slot by a formed identity.
    assert all(d.meter_id.startswith("dra-") for d in devices.values())


def test_partition_share_is_the_scarcest_counter_not_the_first() -> None:
    load("partitionable-counters.yaml")
    devices = {d.name: d for d in accelerators("gpu.partitions.example.com")}
    assert len(devices) == 7
    # A quarter takes 1/8 of the copy engines (listed first), 1/4 of the multiprocessors and
    # 1/5 of the HBM: it blocks a quarter of the GPU.
    quarter = devices["gpu-0-quarter-0"]
    assert (quarter.kind, quarter.gpu_share) == ("partition", Decimal("0.25"))
    assert devices["gpu-0-half-1"].gpu_share == Decimal("0.5")
    assert (devices["gpu-0"].kind, devices["gpu-0"].gpu_share) == ("gpu", Decimal(1))
    assert {d.physical_gpu_key for d in devices.values()} == {
        "gpu.partitions.example.com/part-node-1/gpu-0-counters"
    }
    assert len({d.meter_id for d in devices.values()}) == 7


def test_position_counters_weigh_together_as_the_share_of_positions_taken() -> None:
    """A MIG-style layout publishes a counter of 1 per memory slice: a device taking one
    slice of eight takes an eighth, not the whole of that slice's counter."""
    positions = {f"memory-slice-{index}": {"value": "1"} for index in range(8)}
    slices = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "mig-node-counters"},
            "spec": {
                "driver": "gpu.slices.example.com",
                "pool": {"name": "mig-node", "generation": 1, "resourceSliceCount": 1},
                "nodeName": "mig-node",
                "sharedCounters": [
                    {
                        "name": "gpu-0",
                        "counters": {"multiprocessors": {"value": "132"}, **positions},
                    }
                ],
                "devices": [
                    {
                        "name": f"gpu-0-{name}",
                        "consumesCounters": [
                            {
                                "counterSet": "gpu-0",
                                "counters": {
                                    "multiprocessors": {"value": str(sms)},
                                    **{f"memory-slice-{i}": {"value": "1"} for i in taken},
                                },
                            }
                        ],
                    }
                    for name, sms, taken in (
                        ("1g", 16, [0]),
                        ("2g", 32, [2, 3]),
                        ("4g", 64, [4, 5, 6, 7]),
                        ("whole", 132, range(8)),
                    )
                ],
            },
        }
    ]
    services.import_snapshot(
        cluster=services.get_cluster("fx"), objects=slices, at=AT, kinds=["ResourceSlice"]
    )
    shares = {d.name: d.gpu_share for d in accelerators("gpu.slices.example.com")}
    assert shares == {
        "gpu-0-1g": Decimal("0.125"),  # 1 of 8 slices (16/132 SMs is less)
        "gpu-0-2g": Decimal("0.25"),
        "gpu-0-4g": Decimal("0.5"),
        "gpu-0-whole": Decimal(1),
    }


def test_consumable_capacity_devices_are_whole_shareable_gpus() -> None:
    load("consumable-capacity.yaml")
    gpus = accelerators("gpu.nvidia.com", "share-node-1")
    assert {(d.kind, d.gpu_share) for d in gpus} == {("gpu", Decimal(1))}
    assert [d.meter_id for d in gpus] == [d.uuid for d in gpus]
    shape = gpus[0].shape
    assert shape is not None and shape.allow_multiple_allocations is True
    assert gpus[0].capacity["memory"]["requestPolicy"]["default"] == "8Gi"


def test_every_accelerator_has_a_unique_meter_id_that_survives_a_resync() -> None:
    load(*FIXTURES)
    present = Device.objects.filter(gone_at__isnull=True)
    accel = present.exclude(kind="other")
    meters = list(accel.values_list("meter_id", flat=True))
    assert all(meters) and len(meters) == len(set(meters)) == 54
    assert set(present.filter(kind="other").values_list("meter_id", flat=True)) == {""}
    before = {d.pk: (d.meter_id, d.physical_gpu_key, d.gpu_share) for d in accel}
    load(*FIXTURES, at=AT + timedelta(hours=1))
    after = {
        d.pk: (d.meter_id, d.physical_gpu_key, d.gpu_share)
        for d in Device.objects.filter(gone_at__isnull=True).exclude(kind="other")
    }
    assert after == before


def test_meter_ids_differ_between_clusters_for_devices_without_uuid() -> None:
    assert profiles.meter_id("a", "gpu.amd.com", "n1", "gpu-1-128") != profiles.meter_id(
        "b", "gpu.amd.com", "n1", "gpu-1-128"
    )
    assert profiles.meter_id("a", "d", "p", "x", "GPU-1") == "GPU-1"


def test_a_driver_profile_row_overrides_the_built_in_one() -> None:
    DriverProfile.objects.create(driver="gpu.intel.com", spec={"exclude": []}, source="admin")
    load("intel-gpu.yaml")
    assert len(accelerators("gpu.intel.com")) == 2


def test_a_configured_driver_counts_in_its_own_unit() -> None:
    DriverProfile.objects.create(
        driver="npu.example.com",
        spec={"unit": "accelerator", "model_attributes": ["model"]},
        source="policy",
    )
    objects = list(iter_objects(VENDORS / "gaudi2.yaml"))
    for obj in objects:
        if obj["kind"] == "ResourceSlice":
            obj["spec"]["driver"] = "npu.example.com"
    services.import_snapshot(cluster=services.get_cluster("fx"), objects=objects, at=AT)
    cards = accelerators("npu.example.com")
    assert len(cards) == 8 and {d.unit for d in cards} == {"accelerator"}


def test_an_unknown_driver_without_gpu_in_its_name_counts_nothing() -> None:
    objects = list(iter_objects(VENDORS / "gaudi2.yaml"))
    for obj in objects:
        if obj["kind"] == "ResourceSlice":
            obj["spec"]["driver"] = "fpga.example.com"
    services.import_snapshot(cluster=services.get_cluster("fx"), objects=objects, at=AT)
    assert accelerators("fpga.example.com") == []


def test_unit_labels() -> None:
    assert [profiles.unit_label(u) for u in profiles.UNITS] == [
        "GPUs",
        "TPU chips",
        "Gaudi cards",
        "accelerators",
    ]
    assert profiles.unit_label("tpu", plural=False) == "TPU chip"
    assert [profiles.hours_label(u) for u in ("gpu", "tpu", "gaudi")] == [
        "GPU-hours",
        "TPU chip-hours",
        "Gaudi card-hours",
    ]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"unit": "gpus"}, "drivers.x.unit: must be one of gpu, tpu, gaudi, accelerator"),
        ({"share": ["memory"]}, "drivers.x.share[0]: 'memory' is not a share rule"),
        ({"whole_types": "gpu"}, "drivers.x.whole_types: must be a list of names"),
        ({"colour": 1}, "drivers.x.colour: is not a profile key"),
        ({"exclude": [{"capacity": "memory"}]}, "drivers.x.exclude[0].equals: is required"),
        (
            {"exclude": [{"capacity": "memory", "equals": "lots"}]},
            "drivers.x.exclude[0].equals: 'lots' is not a quantity",
        ),
        (
            {"whole_types": ["a"], "partition_types": ["a"]},
            "drivers.x.partition_types: type 'a' is also in whole_types",
        ),
    ],
)
def test_bad_specs_are_refused_naming_the_field(spec: dict[str, object], message: str) -> None:
    with pytest.raises(profiles.ProfileError) as caught:
        profiles.validate_spec(spec, "drivers.x")
    assert str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_vgpu_type_names() -> None:
    assert profiles.vgpu_fraction("GRID A100-4C") == Decimal("0.1")
    assert profiles.vgpu_fraction("NVIDIA L40S-12Q") == Decimal("0.25")
    assert profiles.vgpu_fraction("NVIDIA A100-2-10C") == Decimal(2) / 7
    assert profiles.vgpu_fraction("NVIDIA A100-PCIE-40GB") is None
    assert profiles.vgpu_fraction("NVIDIA H100 80GB HBM3") is None


def test_fixture_files_say_what_they_model() -> None:
    for name in FIXTURES:
        text = Path(VENDORS / name).read_text()
        assert text.startswith("# ") and "Facts relied on" in text, name
