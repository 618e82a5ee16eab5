"""`agent.exporters`: vendors' exporters read from recorded `/metrics` text (the project's
own recordings in tests/agent/fixtures/, written in each exporter's shape)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.exporters import (
    AMD,
    DCGM,
    GAUDI,
    INTEL,
    TPU,
    ExporterError,
    ExporterSource,
    amd_bus_ids,
    merge_with_nvml,
    parse_metrics,
    with_mig_instances,
)
from agent.readings import GpuReading, ProcessReading

FIXTURES = Path(__file__).parent / "fixtures"
AT = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
H100 = "GPU-6a7b8c9d-0e1f-2a3b-4c5d-6e7f8a9b0c1d"
A100 = "GPU-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"
MIG_3G = "MIG-2b3c4d5e-6f7a-5b8c-9d0e-1f2a3b4c5d6e"
MIG_1G = "MIG-3c4d5e6f-7a8b-5c9d-8e0f-2a3b4c5d6e7f"
AMD_GPUS = ["0000:11:00.0", "0000:2f:00.0"]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def by_uuid(readings: list[GpuReading]) -> dict[str, GpuReading]:
    return {reading.uuid: reading for reading in readings}


def nvml_mig(uuid: str, instance: int, **fields: Any) -> GpuReading:
    """A MIG device as `agent.nvml` reports it: its own UUID, parent, GPU instance id, and no
    utilisation (NVML measures none on MIG devices)."""
    return GpuReading(
        uuid=uuid,
        ts=AT,
        gpu_util=None,
        mem_used_bytes=2**30,
        parent_uuid=A100,
        gpu_instance_id=instance,
        **fields,
    )


# DCGM


def test_dcgm_whole_gpus_by_uuid_and_mig_series_by_parent_and_instance() -> None:
    readings = by_uuid(parse_metrics(fixture("dcgm-mig.prom"), DCGM, at=AT))
    assert set(readings) == {H100, f"{A100}::gi1", f"{A100}::gi13"}
    h100 = readings[H100]
    # The profiling ratio wins over DEV_GPU_UTIL, shown as a percentage.
    assert (h100.gpu_util, h100.util_source, h100.mem_used_bytes) == (
        42.3,
        "gr_engine_active",
        40960 * 2**20,
    )
    assert (h100.node, h100.parent_uuid, h100.gpu_instance_id) == ("dgx-node-1", None, None)
    small = readings[f"{A100}::gi13"]
    assert (small.gpu_util, small.mem_used_bytes) == (12.5, 512 * 2**20)
    assert (small.parent_uuid, small.gpu_instance_id, small.mig_profile) == (A100, 13, "1g.5gb")


def test_dcgm_mig_series_take_the_mig_uuid_nvml_reported_with_their_instance_id() -> None:
    exported = parse_metrics(fixture("dcgm-mig.prom"), DCGM, at=AT)
    # NVML saw instance 1 only (instance 13 was made after its last read).
    matched = by_uuid(with_mig_instances(exported, [nvml_mig(MIG_3G, 1)]))
    assert set(matched) == {H100, MIG_3G, f"{A100}::gi13"}
    assert matched[MIG_3G].gpu_util == 90.0
    sample = matched[MIG_3G].as_sample()
    assert (sample["uuid"], sample["parent_uuid"], sample["gpu_instance_id"]) == (MIG_3G, A100, 1)
    assert "driver" not in sample


def test_nvml_readings_take_dcgm_utilisation_where_nvml_measured_none() -> None:
    process = ProcessReading(
        pid=41, pod_uid="pod-1", container_id=None, gpu_util=None, mem_used_bytes=2**29
    )
    h100 = GpuReading(
        uuid=H100, ts=AT, gpu_util=61.0, mem_used_bytes=2**34, util_source="utilization_rates"
    )
    nvml = [h100, nvml_mig(MIG_3G, 1, processes=(process,)), nvml_mig(MIG_1G, 13)]
    merged = by_uuid(merge_with_nvml(parse_metrics(fixture("dcgm-mig.prom"), DCGM, at=AT), nvml))
    assert set(merged) == {H100, MIG_3G, MIG_1G}
    # NVML measured the whole GPU itself: its own figure is kept.
    assert (merged[H100].gpu_util, merged[H100].util_source) == (61.0, "utilization_rates")
    # MIG devices: DCGM's utilisation, NVML's memory and processes.
    assert (merged[MIG_3G].gpu_util, merged[MIG_3G].util_source) == (90.0, "gr_engine_active")
    assert merged[MIG_3G].processes == (process,)
    assert merged[MIG_3G].mem_used_bytes == 2**30
    assert merged[MIG_1G].gpu_util == 12.5


def test_a_dynamic_mig_devices_merged_sample_keeps_the_placement_nvml_read() -> None:
    nvml = [nvml_mig(MIG_1G, 13, mig_profile="1g.5gb", mig_placement=(6, 1), mig_profile_id=19)]
    [merged] = [
        reading
        for reading in merge_with_nvml(parse_metrics(fixture("dcgm-mig.prom"), DCGM, at=AT), nvml)
        if reading.uuid == MIG_1G
    ]
    sample = merged.as_sample()
    # DCGM's utilisation, with what the ingest finds the driver's partition by.
    assert sample["gpu_util"] == 12.5
    assert (sample["parent_uuid"], sample["mig_placement"], sample["mig_profile"]) == (
        A100,
        {"start": 6, "size": 1},
        "1g.5gb",
    )
    assert sample["mig_profile_id"] == 19


# AMD


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A node's /sys with two MI300X bound to amdgpu (listed out of order), an NVMe drive
    and a device bound to no driver."""
    devices = tmp_path / "bus" / "pci" / "devices"
    drivers = tmp_path / "bus" / "pci" / "drivers"
    for name in ("amdgpu", "nvme"):
        (drivers / name).mkdir(parents=True)
    listed: list[tuple[str, str | None]] = [
        ("0000:2F:00.0", "amdgpu"),
        ("0000:05:00.0", "nvme"),
        ("0000:11:00.0", "amdgpu"),
        ("0000:00:01.0", None),
    ]
    for bdf, driver in listed:
        (devices / bdf).mkdir(parents=True)
        if driver:
            (devices / bdf / "driver").symlink_to(drivers / driver)
    return tmp_path


def test_amd_gpus_are_the_pci_devices_bound_to_amdgpu_in_address_order(sysfs: Path) -> None:
    assert amd_bus_ids(sysfs) == AMD_GPUS
    assert amd_bus_ids(sysfs / "missing") == []


def test_amd_cpx_partitions_are_named_by_pci_address_and_partition_index() -> None:
    readings = parse_metrics(fixture("amd-mi300x-cpx.prom"), AMD, at=AT, amd_bus_ids=AMD_GPUS)
    assert len(readings) == 16
    named = {(r.pci_bus_id, r.partition): r for r in readings}
    assert set(named) == {(bus, part) for bus in AMD_GPUS for part in range(8)}
    third = named[AMD_GPUS[0], 2]
    assert (third.gpu_util, third.mem_used_bytes) == (100.0, 24000 * 2**20)
    assert third.node == "mi300x-node-2"
    assert named[AMD_GPUS[1], 4].gpu_util == 50.0
    assert third.as_sample() | {"ts": None} == {
        "driver": "gpu.amd.com",
        "pci_bus_id": "0000:11:00.0",
        "partition": 2,
        "ts": None,
        "gpu_util": 100.0,
        "mem_used_bytes": 24000 * 2**20,
        "processes": [],
    }


def test_amd_whole_gpus_have_no_partition_and_unknown_gpus_are_skipped() -> None:
    readings = parse_metrics(fixture("amd-mi300x-spx.prom"), AMD, at=AT, amd_bus_ids=AMD_GPUS)
    assert [(r.pci_bus_id, r.partition, r.gpu_util) for r in readings] == [
        ("0000:11:00.0", None, 87.0),
        ("0000:2f:00.0", None, 3.0),
    ]
    assert "partition" not in readings[0].as_sample()
    # The node shows one GPU only: the second cannot be named, so it is left out.
    one_gpu = parse_metrics(fixture("amd-mi300x-spx.prom"), AMD, at=AT, amd_bus_ids=AMD_GPUS[:1])
    assert [r.pci_bus_id for r in one_gpu] == ["0000:11:00.0"]


# Intel


def test_intel_devices_by_pci_address_with_tiles_summed_and_cards_skipped() -> None:
    readings = {r.pci_bus_id: r for r in parse_metrics(fixture("intel-xpum.prom"), INTEL, at=AT)}
    assert set(readings) == {"0000:29:00.0", "0000:03:00.0"}
    max1550 = readings["0000:29:00.0"]
    # Engine groups are per tile only on a two-tile GPU: the device-level engine ratio.
    assert (max1550.gpu_util, max1550.util_source) == (60.0, "engine")
    assert max1550.mem_used_bytes == 32 * 2**30 + 2**30  # both tiles
    flex = readings["0000:03:00.0"]
    assert (flex.gpu_util, flex.util_source) == (25.3, "engine_group_compute")
    assert (flex.node, flex.driver, flex.uuid) == ("xpu-node-1", "gpu.intel.com", "")
    assert flex.as_sample()["driver"] == "gpu.intel.com"
    assert flex.as_sample()["pci_bus_id"] == "0000:03:00.0"


# Gaudi


# What HLML reports on the node the recording was scraped on: serial number -> PCI address.
GAUDI_HLML = {"AN402031": "0000:0F:00.0", "AN402038": "0000:17:00.0", "AN402045": "0000:1c:00.0"}


def test_gaudi_cards_by_pci_address_from_hlml_by_the_exporters_serial() -> None:
    readings = parse_metrics(fixture("gaudi-hl225.prom"), GAUDI, at=AT, serial_buses=GAUDI_HLML)
    assert [(r.pci_bus_id, r.gpu_util, r.mem_used_bytes) for r in readings] == [
        ("0000:0f:00.0", 87.0, 80 * 2**30),
        ("0000:17:00.0", 12.5, 2**30),
    ]  # the card whose serial HLML does not show names no device
    # Without HLML's view no card is named: unmeasured, never misplaced.
    assert parse_metrics(fixture("gaudi-hl225.prom"), GAUDI, at=AT) == []
    sample = readings[0].as_sample()
    assert (sample["driver"], sample["pci_bus_id"]) == ("gaudi.intel.com", "0000:0f:00.0")
    assert "uuid" not in sample and readings[0].util_source == "habanalabs_utilization"


# TPU


def test_tpu_chips_by_their_index_on_the_host_node_series_first() -> None:
    readings = {r.device: r for r in parse_metrics(fixture("tpu-v4-gke.prom"), TPU, at=AT)}
    # accel2 reports nothing; an accelerator_id without a chip index names no chip.
    assert set(readings) == {"accel0", "accel1", "accel3"}
    # The node's series (every chip) before the container's (chips a container holds).
    assert readings["accel0"].gpu_util == 90.0
    assert readings["accel0"].mem_used_bytes == 20 * 2**30
    assert (readings["accel3"].gpu_util, readings["accel3"].mem_used_bytes) == (0.0, None)
    sample = readings["accel1"].as_sample()
    assert (sample["driver"], sample["device"]) == ("tpu.google.com", "accel1")
    assert "uuid" not in sample and "pci_bus_id" not in sample


def test_text_the_parser_refuses_is_an_exporter_error() -> None:
    with pytest.raises(ExporterError, match="intel exporter text"):
        parse_metrics('xpum_engine_ratio{pci_bdf="0000:29:00.0" 0.5\n', INTEL, at=AT)


# The source, over HTTP


@pytest.fixture
def exporter() -> Iterator[str]:
    body = fixture("intel-xpum.prom").encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_source_scrapes_the_exporter_at_every_read(exporter: str) -> None:
    source = ExporterSource(f"{exporter}/metrics", INTEL, clock=lambda: AT)
    readings = source.read()
    assert [r.pci_bus_id for r in readings] == ["0000:03:00.0", "0000:29:00.0"]
    assert {r.ts for r in readings} == {AT}
    with pytest.raises(ExporterError, match="HTTP 404"):
        ExporterSource(f"{exporter}/nothing", INTEL).read()


def test_the_source_asks_hlml_for_the_serials_of_a_profile_matched_by_serial() -> None:
    """`MatchBy.SERIAL`: each read asks the node (HLML) for its cards' PCI addresses; other
    rules never do."""
    body = fixture("gaudi-hl225.prom").encode()
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    def hlml() -> dict[str, str]:
        asked.append("hlml")
        return GAUDI_HLML

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        readings = ExporterSource(url, GAUDI, serials=hlml, clock=lambda: AT).read()
        assert [r.pci_bus_id for r in readings] == ["0000:0f:00.0", "0000:17:00.0"]
        assert asked == ["hlml"]
        ExporterSource(url, TPU, serials=hlml, clock=lambda: AT).read()
        assert asked == ["hlml"]
    finally:
        server.shutdown()
        server.server_close()


def test_serial_buses_of_reads_each_cards_serial_and_pci_address() -> None:
    """Through pyhlml's API (a stand-in module: the library needs the Habana driver): bytes
    decoded, NUL padding stripped, addresses lower-cased, a card without a PCI address left
    out."""
    import types

    from agent.exporters import serial_buses_of

    cards = [(b"AN402031", b"0000:0F:00.0\x00\x00"), (b"AN402038", b"0000:17:00.0"), (b"X", b"")]
    info = types.SimpleNamespace
    api = types.SimpleNamespace(
        hlmlDeviceGetCount=lambda: len(cards),
        hlmlDeviceGetHandleByIndex=lambda index: index,
        hlmlDeviceGetSerial=lambda handle: cards[handle][0],
        hlmlDeviceGetPCIInfo=lambda handle: info(bus_id=cards[handle][1]),
    )
    assert serial_buses_of(api) == {"AN402031": "0000:0f:00.0", "AN402038": "0000:17:00.0"}


def test_a_missing_hlml_library_is_named_in_the_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node where the library is not where the agent was told (the host directory not
    mounted, or the firmware tools not installed): no cards, and the warning names the file it
    looked for, the variable that set it and where Habana's package puts it."""
    from agent.exporters import hlml_serial_buses

    with caplog.at_level("WARNING", logger="agent.exporters"):
        assert hlml_serial_buses(tmp_path / "habanalabs") == {}
    (message,) = caplog.messages
    assert f"{tmp_path / 'habanalabs' / 'libhlml.so'} is missing" in message
    assert f"TALLY_HLML_LIBRARY_DIR={tmp_path / 'habanalabs'}" in message
    assert "/usr/lib/habanalabs" in message and "deploy/components/agent-gaudi" in message


def test_an_hlml_library_that_does_not_load_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that the loader refuses (here not a shared object at all; on a node, a library
    built for a newer C library than the image's): the loader's own reason is in the warning,
    not pyhlml's bare "Failed to load libhlml"."""
    from agent.exporters import hlml_serial_buses

    (tmp_path / "libhlml.so").write_text("not a library")
    with caplog.at_level("WARNING", logger="agent.exporters"):
        assert hlml_serial_buses(tmp_path) == {}
    (message,) = caplog.messages
    assert f"HLML ({tmp_path / 'libhlml.so'}) could not be initialised: cannot load it:" in message
    assert "invalid ELF header" in message or "too short" in message


# A stand-in for libhlml.so with the five calls the agent makes, in the C API's shapes
# (docs.habana.ai, HLML C API Reference; pyhlml 1.24's ctypes signatures): two cards.
FAKE_HLML = r"""
#include <string.h>
typedef struct { unsigned int bus; char bus_id[19]; } pci_info;  /* the leading fields */
static const char *serials[] = {"AN402031", "AN402038"};
static const char *buses[] = {"0000:0F:00.0", "0000:17:00.0"};
static int initialised;
int hlml_init(void) { initialised = 1; return 0; }
int hlml_shutdown(void) { initialised = 0; return 0; }
int hlml_device_get_count(unsigned int *count) { *count = 2; return initialised ? 0 : 1; }
int hlml_device_get_handle_by_index(unsigned int index, void **device) {
    *device = (void *)(unsigned long)(index + 1); return index < 2 ? 0 : 2;
}
int hlml_device_get_serial(void *device, char *serial, unsigned int length) {
    strncpy(serial, serials[(unsigned long)device - 1], length); return 0;
}
int hlml_device_get_pci_info(void *device, pci_info *info) {
    strcpy(info->bus_id, buses[(unsigned long)device - 1]); return 0;
}
"""


def test_hlml_is_loaded_from_the_directory_the_agent_is_given(tmp_path: Path) -> None:
    """Through pyhlml itself, with a library that is not at pyhlml's built-in path: the
    agent's `TALLY_HLML_LIBRARY_DIR` is the one read (a C compiler builds the stand-in)."""
    import shutil
    import subprocess

    from agent.exporters import hlml_serial_buses

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libhlml.so")
    library_dir = tmp_path / "opt" / "habanalabs"
    library_dir.mkdir(parents=True)
    (tmp_path / "fake_hlml.c").write_text(FAKE_HLML)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", library_dir / "libhlml.so", tmp_path / "fake_hlml.c"],
        check=True,
    )
    assert hlml_serial_buses(library_dir) == {
        "AN402031": "0000:0f:00.0",
        "AN402038": "0000:17:00.0",
    }


# Configuration


def test_the_agent_reads_an_exporter_when_configured_to(exporter: str) -> None:
    from agent import runner

    env = {
        "TALLY_URL": "http://tally.example",
        "TALLY_AGENT_TOKEN": "t",
        "TALLY_NODE_NAME": "xpu-node-1",
        "TALLY_AGENT_SOURCE": "exporter",
        "TALLY_EXPORTER_URL": f"{exporter}/metrics",
        "TALLY_EXPORTER_PROFILE": "intel",
    }
    source = runner.make_source(runner.Config.from_env(env))
    assert isinstance(source, ExporterSource)
    assert source.profile is INTEL
    assert len(source.read()) == 2
    assert runner.Config.from_env(env).hlml_library_dir == "/usr/lib/habanalabs"
    gaudi = runner.Config.from_env(
        env | {"TALLY_EXPORTER_PROFILE": "gaudi", "TALLY_HLML_LIBRARY_DIR": "/host/habanalabs"}
    )
    assert gaudi.hlml_library_dir == "/host/habanalabs"
    assert isinstance(gaudi_source := runner.make_source(gaudi), ExporterSource)
    assert getattr(gaudi_source.serials, "args", None) == ("/host/habanalabs",)
    for bad, message in (
        ({"TALLY_EXPORTER_URL": ""}, "TALLY_EXPORTER_URL"),
        ({"TALLY_EXPORTER_PROFILE": "habana"}, "TALLY_EXPORTER_PROFILE must be dcgm, amd"),
        ({"TALLY_EXPORTER_WITH_NVML": "yes"}, "TALLY_EXPORTER_WITH_NVML must be true or false"),
        ({"TALLY_EXPORTER_WITH_NVML": "true"}, "goes with TALLY_EXPORTER_PROFILE=dcgm"),
    ):
        with pytest.raises(runner.ConfigError, match=message):
            runner.Config.from_env(env | bad)
