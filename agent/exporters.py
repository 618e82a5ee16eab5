"""Vendors' Prometheus exporters as sources: NVIDIA's dcgm-exporter, AMD's device-metrics
exporter, Intel's XPU Manager exporter, Intel Gaudi's metric exporter and the TPU metrics
GKE's TPU device plugin serves, each read from its `/metrics` text on this node.

An `ExporterProfile` says which metrics give utilisation and memory and how a series names
its device; `parse_metrics` turns one scrape (parsed by prometheus_client's text parser)
into `GpuReading`s naming each device the way the inventory knows it. `ExporterSource`
scrapes an exporter every read; `with_mig_instances` gives MIG readings of the DCGM exporter
their MIG device's UUID from NVML's readings.

What each profile relies on (checked against the vendors' code and docs, not guessed):

- **DCGM** (`dcgm-exporter`): a whole GPU's series carry its `UUID`. A MIG device's carry
  its *parent's* `UUID` plus `GPU_I_ID` (GPU instance id) and `GPU_I_PROFILE`; DCGM does not
  know MIG UUIDs. NVIDIA's DRA driver does not publish the GPU instance id either (a MIG
  device's attributes are uuid, parentUUID, profile, type, pciBusID...; its name carries the
  profile and *placement*, not the instance id), so it cannot be derived from the
  inventory. The NVML agent reads it (`nvmlDeviceGetGpuInstanceId`) next to the MIG
  device's own UUID and reports both: `with_mig_instances` matches (parent UUID, GPU
  instance id) to that UUID. A MIG series NVML did not see keeps the key
  `<parent UUID>::gi<N>` (stored by the ingest under the device that GPU instance was then,
  by the spells NVML's samples record, `metering.mig_instances`). Utilisation:
  `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (ratio), else `DCGM_FI_DEV_GPU_UTIL` (%); memory
  `DCGM_FI_DEV_FB_USED` (MiB).
- **AMD** (ROCm device-metrics-exporter): every series carries `gpu_id`, `serial_number`,
  `card_model`, `hostname`, `gpu_partition_id`, `gpu_compute_partition_type` (labels it
  cannot be configured without). AMD's DRA driver (`gpu.amd.com`) publishes no UUID; each
  device, and every partition of a GPU, carries the GPU's PCI address as
  `resource.kubernetes.io/pciBusID`. The exporter has no PCI address label, so the agent
  takes it from the node: the PCI devices bound to `amdgpu` (`/sys/bus/pci/devices`),
  in address order, are the physical GPUs in the order amd-smi (and so the exporter)
  numbers them; partitions of one GPU share its `serial_number`. A series is named by
  `driver` + `pci_bus_id`, and `partition` (`gpu_partition_id`) when the GPU is partitioned
  (compute partition type other than SPX). Utilisation `gpu_gfx_activity` (%), memory
  `gpu_used_vram` (MB, as the exporter's docs say; taken as MiB).
- **Intel** (XPU Manager exporter, `xpum_*`): device series carry `uuid`, `dev_name`,
  `pci_dev`, `pci_bdf`, `dev_file` and, with `NODE_NAME` set, `node`; per-tile series add
  `sub_dev`, card aggregates carry `card` instead. Intel's DRA driver publishes no UUID, so a
  series is named by `driver` (`gpu.intel.com`) + `pci_bus_id` (`pci_bdf`). Utilisation
  `xpum_engine_group_ratio{type="compute"}` (the exporter scales XPU Manager's percentage by
  0.01: a ratio), else `xpum_engine_ratio`; memory `xpum_memory_used_bytes`, per tile, so
  summed over the tiles.
- **Gaudi** (Intel Gaudi Prometheus metric exporter, `habanalabs_*`, port 41611): every card
  series carries `Serial`, `UUID`, `device` (the serial again), `id` (HLML's index), `fit`,
  `spi`, `driver` (the driver's version), `pod_namespace`, `pod_name`; no PCI address
  (HabanaAI/gaudi-metric-exporter, exporter.go `getMetricLabels` and `deviceLabels`, release
  1.24.0-1007). Intel's Gaudi DRA driver (`gaudi.intel.com`) publishes no uuid and no PCI
  attribute, but names each card by its PCI address (`0000-0f-00-0-0x1020`: the address with
  hyphens, then the PCI device id) and gives it the attribute `serial`, HLML's serial number
  (intel-resource-drivers-for-kubernetes, cmd/kubelet-gaudi-plugin/healthcare.go `initHLML`).
  So a series is matched by its `Serial` (`MatchBy.SERIAL`): the agent asks HLML for the PCI
  address of each serial on its node (`hlml_serial_buses`) and names the card by `driver` +
  `pci_bus_id`; the Prometheus source finds the device of that node whose `serial` attribute
  it is. Utilisation `habanalabs_utilization` (%), memory `habanalabs_memory_used_bytes`.
- **TPU** (GKE's TPU device plugin, `/metrics` on port 2112): a chip's series carry
  `accelerator_id` = `<VM instance id>-<chip index>`; Google's TPU DRA driver
  (`tpu.google.com`) names chip N `accelN` (its `uuid` is the host's, the same on every
  chip), so a series is named by `driver` + `device` `accel<index>`. Utilisation
  `duty_cycle_node` (%, every chip, held or not), else `duty_cycle` (%, the chips a
  container holds); memory `memory_used_node`, else `memory_used` (bytes). On a multi-host
  slice the index may be the chip's in the slice, not on the host: such a series names no
  chip the node's inventory has and the ingest refuses it (unmeasured, never misplaced).

How a series names its device is each profile's declared rule (`MatchBy`), which the agent
(`parse_metrics`, `ExporterSource`) and the Prometheus source (`metering.prometheus`) both
dispatch on; neither asks which exporter it is. The ingest resolves `driver` + `pci_bus_id`
(+ `partition`) through the inventory to the device's meter id (`metering.ingest`).
"""

from __future__ import annotations

import enum
import logging
import re
import ssl
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent.readings import GpuReading

log = logging.getLogger(__name__)

MIB = 1024 * 1024
AMD_DRIVER = "gpu.amd.com"
INTEL_DRIVER = "gpu.intel.com"
GAUDI_DRIVER = "gaudi.intel.com"
TPU_DRIVER = "tpu.google.com"
_BDF = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


class MatchBy(enum.Enum):
    """How a series is matched to a device: a profile's declared rule, the one thing the agent
    and the Prometheus source dispatch on (the labels each role reads are the profile's
    `labels`).

    - `UUID`: the device's published UUID (`uuid`); a MIG device by its parent's and its GPU
      instance id (`gpu_instance`), matched to the MIG device through NVML's readings (agent)
      or the GPU instances' spells (source).
    - `PCI_ORDER`: the exporter numbers a node's GPUs (`gpu_id`, partitions under one
      `serial`) in PCI address order: the node's devices of `kernel_driver` (agent: sysfs;
      source: the inventory's PCI attributes of the profile's `driver`), `partition` when
      partitioned.
    - `PCI_BUS`: the series carries the PCI address (`pci_bus_id`).
    - `SERIAL`: the series carries the card's serial number (`serial`): the agent maps it to
      the PCI address on its node (`ScrapeContext.serial_buses`), the source to the device of
      that node whose `serial` attribute it is.
    - `DEVICE_NAME`: the series names the device's name in its ResourceSlice (`chip`).
    """

    UUID = "uuid"
    PCI_ORDER = "pci_order"
    PCI_BUS = "pci_bus"
    SERIAL = "serial"
    DEVICE_NAME = "device_name"


class ExporterError(Exception):
    """The exporter could not be read, or answered with something that is not its text."""


@dataclass(frozen=True, slots=True)
class DeviceKey:
    """How one series names its device, before readings are made of it."""

    uuid: str = ""
    node: str | None = None
    parent_uuid: str | None = None
    gpu_instance_id: int | None = None
    mig_profile: str | None = None
    driver: str | None = None
    pci_bus_id: str | None = None
    partition: int | None = None
    device: str | None = None  # the device's name in its ResourceSlice

    @property
    def reported_uuid(self) -> str:
        if self.gpu_instance_id is not None and self.parent_uuid:
            return f"{self.parent_uuid}::gi{self.gpu_instance_id}"
        return self.uuid


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric a profile reads: its name, the labels a series must have (`where`), the
    factor to its unit (percent, or bytes), and whether a device's series add up (per-tile
    memory) rather than repeat (their maximum is kept)."""

    name: str
    scale: float = 1.0
    where: Mapping[str, str] = field(default_factory=dict)
    summed: bool = False
    source: str = ""


@dataclass(frozen=True)
class ExporterProfile:
    """What to read from one exporter: utilisation metrics in order of preference, memory
    metrics, and `key(labels, context)`: the device a series is of, or None to skip it.

    The one description of an exporter, read by the node agent (a scrape) and by the
    Prometheus source (`metering.prometheus`, the same series in an engine): `labels` are the
    roles a label plays there (`role` -> the exporter's label) and `skip` the labels whose
    series are not a device's own; `prometheus_metrics()` and `prometheus_labels()` are the
    source's defaults (settings TALLY_PROMETHEUS_<NAME>_METRICS and _LABELS), which an
    operator who relabels may override. `match` is how a series names its device
    (`MatchBy`): what both dispatch on; where it names a device by driver and PCI address or
    device name, `key` reads them from the labels its roles give."""

    name: str
    utilisation: tuple[Metric, ...]
    memory: tuple[Metric, ...]
    key: Callable[[Mapping[str, str], ScrapeContext], DeviceKey | None]
    match: MatchBy
    # The DRA driver publishing the devices, and the kernel driver the node's PCI devices
    # are bound to (`MatchBy.PCI_ORDER`).
    driver: str = ""
    kernel_driver: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    # Roles an operator may give besides `labels`'s (DCGM: `mig_uuid`, a label some relabel).
    more_roles: tuple[str, ...] = ()

    @property
    def roles(self) -> frozenset[str]:
        """The roles a label may play in the Prometheus source's settings."""
        return frozenset({*self.labels, *self.more_roles, "skip"})

    def prometheus_metrics(self) -> str:
        """The utilisation metrics as the Prometheus source's setting spells them:
        `name{label="value"}*scale, ...` (scale to percent, left out where 1)."""
        return ", ".join(_spelled(metric) for metric in self.utilisation)

    def prometheus_labels(self) -> str:
        """The label roles as the Prometheus source's setting spells them: `role=label, ...`
        and `skip=a|b`."""
        parts = [f"{role}={label}" for role, label in self.labels.items()]
        if self.skip:
            parts.append(f"skip={'|'.join(self.skip)}")
        return ", ".join(parts)

    def native(self, labels: Mapping[str, str], roles: Mapping[str, str]) -> dict[str, str]:
        """A series' labels as this exporter writes them, from an engine's series whose labels
        play `roles` (`role` -> the label it has in the engine)."""
        found = {}
        for role, label in roles.items():
            own = self.labels.get(role)
            if own and label in labels:
                found[own] = labels[label]
        return found


def _spelled(metric: Metric) -> str:
    matchers = ", ".join(f'{name}="{value}"' for name, value in metric.where.items())
    scale = f"*{metric.scale:g}" if metric.scale != 1 else ""
    return metric.name + (f"{{{matchers}}}" if matchers else "") + scale


@dataclass
class ScrapeContext:
    """What a profile may need besides the labels: the node's PCI addresses of its GPUs in
    order and the serial number -> physical index map built from the scrape itself
    (`MatchBy.PCI_ORDER`), and the PCI address of each card's serial number on the node
    (`MatchBy.SERIAL`)."""

    amd_bus_ids: list[str] = field(default_factory=list)
    serial_index: dict[str, int] = field(default_factory=dict)
    serial_buses: dict[str, str] = field(default_factory=dict)


# DCGM


def _dcgm_key(labels: Mapping[str, str], context: ScrapeContext) -> DeviceKey | None:
    uuid = labels.get("UUID") or labels.get("uuid")
    if not uuid:
        return None
    instance = labels.get("GPU_I_ID", "")
    node = labels.get("Hostname") or None
    if instance.isdigit():  # whole GPUs have no GPU_I_ID, or an empty one
        return DeviceKey(
            node=node,
            parent_uuid=uuid,
            gpu_instance_id=int(instance),
            mig_profile=labels.get("GPU_I_PROFILE") or None,
        )
    return DeviceKey(uuid=uuid, node=node)


DCGM = ExporterProfile(
    name="dcgm",
    utilisation=(
        Metric("DCGM_FI_PROF_GR_ENGINE_ACTIVE", scale=100.0, source="gr_engine_active"),
        Metric("DCGM_FI_DEV_GPU_UTIL", source="gpu_util"),
    ),
    memory=(Metric("DCGM_FI_DEV_FB_USED", scale=MIB),),
    key=_dcgm_key,
    match=MatchBy.UUID,
    labels={
        "uuid": "UUID",
        "node": "Hostname",
        "gpu_instance": "GPU_I_ID",
        "mig_profile": "GPU_I_PROFILE",
    },
    more_roles=("mig_uuid",),
)


# AMD


def _amd_key(labels: Mapping[str, str], context: ScrapeContext) -> DeviceKey | None:
    serial = labels.get("serial_number") or labels.get("gpu_id")
    if serial is None or serial not in context.serial_index:
        return None
    index = context.serial_index[serial]
    if index >= len(context.amd_bus_ids):
        return None  # a GPU the node's PCI bus does not show: cannot be named
    partition_type = (labels.get("gpu_compute_partition_type") or "spx").lower()
    partition = labels.get("gpu_partition_id", "")
    partitioned = partition_type not in ("spx", "") and partition.isdigit()
    return DeviceKey(
        node=labels.get("hostname") or None,
        driver=AMD_DRIVER,
        pci_bus_id=context.amd_bus_ids[index],
        partition=int(partition) if partitioned else None,
    )


def _amd_serials(series: Iterable[Mapping[str, str]]) -> dict[str, int]:
    """Physical GPU index per serial number: partitions of a GPU share its serial; GPUs are
    numbered by their lowest `gpu_id` (amd-smi's order, which is PCI address order)."""
    lowest: dict[str, int] = {}
    for labels in series:
        serial = labels.get("serial_number") or labels.get("gpu_id")
        gpu_id = labels.get("gpu_id", "")
        if serial and gpu_id.isdigit():
            lowest[serial] = min(int(gpu_id), lowest.get(serial, int(gpu_id)))
    return {serial: index for index, serial in enumerate(sorted(lowest, key=lowest.__getitem__))}


AMD = ExporterProfile(
    name="amd",
    utilisation=(Metric("gpu_gfx_activity", source="gfx_activity"),),
    memory=(Metric("gpu_used_vram", scale=MIB),),
    key=_amd_key,
    match=MatchBy.PCI_ORDER,
    driver=AMD_DRIVER,
    kernel_driver="amdgpu",
    labels={
        "serial": "serial_number",
        "gpu_id": "gpu_id",
        "node": "hostname",
        "partition": "gpu_partition_id",
        "partition_type": "gpu_compute_partition_type",
    },
)


def amd_bus_ids(sys_root: str | Path = "/sys") -> list[str]:
    """PCI addresses of the devices bound to the `amdgpu` driver, in address order: the
    node's physical AMD GPUs (a partition is no PCI device of its own)."""
    return pci_bus_ids(sys_root, AMD.kernel_driver)


def pci_bus_ids(sys_root: str | Path, kernel_driver: str) -> list[str]:
    """PCI addresses of the devices bound to `kernel_driver`, in address order."""
    devices = Path(sys_root) / "bus" / "pci" / "devices"
    found = []
    try:
        entries = sorted(devices.iterdir())
    except OSError:
        return []
    for entry in entries:
        try:
            driver = (entry / "driver").resolve().name
        except OSError:
            continue
        if driver == kernel_driver and _BDF.fullmatch(entry.name):
            found.append(entry.name.lower())
    return found


# Intel


def _intel_key(labels: Mapping[str, str], context: ScrapeContext) -> DeviceKey | None:
    bdf = labels.get("pci_bdf", "")
    if "card" in labels or not _BDF.fullmatch(bdf):
        return None  # a card's aggregate, or no device
    return DeviceKey(node=labels.get("node") or None, driver=INTEL_DRIVER, pci_bus_id=bdf.lower())


INTEL = ExporterProfile(
    name="intel",
    utilisation=(
        Metric(
            "xpum_engine_group_ratio",
            scale=100.0,
            where={"type": "compute"},
            source="engine_group_compute",
        ),
        Metric("xpum_engine_ratio", scale=100.0, source="engine"),
    ),
    memory=(Metric("xpum_memory_used_bytes", summed=True),),
    key=_intel_key,
    match=MatchBy.PCI_BUS,
    driver=INTEL_DRIVER,
    labels={"pci_bus_id": "pci_bdf", "node": "node"},
    skip=("sub_dev", "card"),
)

# Gaudi


def _gaudi_key(labels: Mapping[str, str], context: ScrapeContext) -> DeviceKey | None:
    bus = context.serial_buses.get(labels.get("Serial", ""), "")
    if not _BDF.fullmatch(bus):
        return None  # a card HLML did not show on this node: cannot be named
    return DeviceKey(node=labels.get("node") or None, driver=GAUDI_DRIVER, pci_bus_id=bus.lower())


GAUDI = ExporterProfile(
    name="gaudi",
    utilisation=(Metric("habanalabs_utilization", source="habanalabs_utilization"),),
    memory=(Metric("habanalabs_memory_used_bytes"),),
    key=_gaudi_key,
    match=MatchBy.SERIAL,
    driver=GAUDI_DRIVER,
    labels={"serial": "Serial", "node": "node"},
)


# Where Habana's packages install HLML (habanalabs-firmware-tools, with hl-smi) and where pyhlml
# looks by default; deploy/components/agent-gaudi mounts the host's directory there.
HLML_LIBRARY_DIR = "/usr/lib/habanalabs"
HLML_LIBRARY = "libhlml.so"


def hlml_serial_buses(library_dir: str | Path = HLML_LIBRARY_DIR) -> dict[str, str]:
    """Each Gaudi card's serial number -> its PCI address, as HLML (Habana's management
    library, through `pyhlml`) reports them on this node: what the exporter's `Serial` and the
    DRA driver's `serial` attribute are read from. `library_dir` holds `libhlml.so`
    (`TALLY_HLML_LIBRARY_DIR`). Empty where HLML cannot be read (unmeasured, never
    misplaced), with a warning naming the library it looked for and why it failed."""
    library = Path(library_dir) / HLML_LIBRARY
    if not library.is_file():
        log.warning(
            "HLML's library %s is missing (TALLY_HLML_LIBRARY_DIR=%s): Gaudi cards cannot be "
            "named by serial number and stay unmeasured. Mount the host's directory holding "
            "libhlml.so (Habana's habanalabs-firmware-tools package installs it in %s; see "
            "deploy/components/agent-gaudi)",
            library,
            library_dir,
            HLML_LIBRARY_DIR,
        )
        return {}
    try:
        import pyhlml
    except ImportError:
        log.warning("pyhlml is not installed: Gaudi cards cannot be named by serial number")
        return {}
    try:
        _hlml_init(library)
    except Exception as error:  # the library raises its own error types
        log.warning("HLML (%s) could not be initialised: %s", library, error)
        return {}
    try:
        return serial_buses_of(pyhlml)
    finally:
        pyhlml.hlmlShutdown()


def _hlml_init(library: Path) -> None:
    """`pyhlml.hlmlInit`, with the library at `library`: pyhlml loads only its built-in path
    (`/usr/lib/habanalabs/libhlml.so`), and prints, rather than raises, why a load failed. The
    library is opened here first so that the loader's own message (a missing dependency, a C
    library too old for it) reaches the warning; then pyhlml's loader object is pointed at it,
    as `hlmlInit` would (pyhlml 1.24, pinned in pyproject.toml)."""
    import ctypes

    from pyhlml import main as hlml_main
    from pyhlml.hlml_lib import LibHLML

    try:
        ctypes.CDLL(str(library))
    except OSError as error:
        raise RuntimeError(f"cannot load it: {error}") from error
    hlml_main.ErrorsAsClass()
    loaded = LibHLML(str(library))
    hlml_main._hlmlOBJ = loaded
    result = loaded.get_func_ptr("hlml_init")()
    loaded.inc_ref()
    hlml_main.check_return(result)


def serial_buses_of(hlml: Any) -> dict[str, str]:
    """The serial -> PCI address of each card an initialised HLML (pyhlml's API) lists."""
    found: dict[str, str] = {}
    try:
        for index in range(hlml.hlmlDeviceGetCount()):
            handle = hlml.hlmlDeviceGetHandleByIndex(index)
            serial = _text(hlml.hlmlDeviceGetSerial(handle))
            bus = _text(hlml.hlmlDeviceGetPCIInfo(handle).bus_id).lower()
            if serial and _BDF.fullmatch(bus):
                found[serial] = bus
    except Exception as error:
        log.warning("HLML could not list the Gaudi cards: %s", error)
    return found


def _text(value: bytes | str) -> str:
    return (value.decode(errors="replace") if isinstance(value, bytes) else value).strip("\0 ")


# TPU

_CHIP = re.compile(r".+-([0-9]{1,4})")


def tpu_chip(accelerator_id: str) -> str | None:
    """The DRA device name (`accelN`) of the chip an `accelerator_id` (`<instance>-<index>`)
    names; None for one that is not of that shape."""
    match = _CHIP.fullmatch(accelerator_id)
    return f"accel{int(match.group(1))}" if match else None


def _tpu_key(labels: Mapping[str, str], context: ScrapeContext) -> DeviceKey | None:
    chip = tpu_chip(labels.get("accelerator_id", ""))
    if chip is None:
        return None
    return DeviceKey(node=labels.get("node") or None, driver=TPU_DRIVER, device=chip)


TPU = ExporterProfile(
    name="tpu",
    utilisation=(
        Metric("duty_cycle_node", source="duty_cycle"),
        Metric("duty_cycle", source="duty_cycle"),
    ),
    memory=(Metric("memory_used_node"), Metric("memory_used")),
    key=_tpu_key,
    match=MatchBy.DEVICE_NAME,
    driver=TPU_DRIVER,
    labels={"chip": "accelerator_id", "node": "node"},
)

PROFILES = {profile.name: profile for profile in (DCGM, AMD, INTEL, GAUDI, TPU)}


# Parsing


def _device_level(metric: Metric, labels: Mapping[str, str]) -> bool:
    """Whether a series is what `metric` reads: its `where` labels match, and it is the
    device's own series (not one tile's, for a metric that is not summed over tiles)."""
    if any(labels.get(name) != value for name, value in metric.where.items()):
        return False
    return metric.summed or "sub_dev" not in labels


def parse_metrics(
    text: str,
    profile: ExporterProfile,
    *,
    at: datetime,
    amd_bus_ids: list[str] | None = None,
    serial_buses: Mapping[str, str] | None = None,
) -> list[GpuReading]:
    """Readings at `at` of every device in one scrape of the exporter `profile` reads.

    Raises `ExporterError` for text the Prometheus parser refuses. A device with neither
    utilisation nor memory gives no reading; one with memory only gives `gpu_util` None
    (unmeasured, never idle).
    """
    wanted = {metric.name for metric in (*profile.utilisation, *profile.memory)}
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    samples[sample.name].append((sample.labels, float(sample.value)))
    except (ValueError, TypeError) as error:
        raise ExporterError(f"{profile.name} exporter text: {error}") from error
    context = ScrapeContext(
        amd_bus_ids=list(amd_bus_ids or []), serial_buses=dict(serial_buses or {})
    )
    if profile.match is MatchBy.PCI_ORDER:
        context.serial_index = _amd_serials(
            labels for series in samples.values() for labels, _ in series
        )

    def values(metric: Metric) -> dict[DeviceKey, float]:
        found: dict[DeviceKey, float] = {}
        for labels, value in samples.get(metric.name, []):
            if value != value or not _device_level(metric, labels):  # NaN: not measured
                continue
            key = profile.key(labels, context)
            if key is None:
                continue
            value *= metric.scale
            if metric.summed:
                found[key] = found.get(key, 0.0) + value
            else:
                # Several series of one device (pod labels, two scrape jobs): the most it did.
                found[key] = max(value, found.get(key, value))
        return found

    utils: dict[DeviceKey, tuple[float, str]] = {}
    for metric in reversed(profile.utilisation):  # the preferred metric written last
        for key, value in values(metric).items():
            utils[key] = (_percent(value), metric.source or metric.name)
    memory: dict[DeviceKey, float] = {}
    for metric in reversed(profile.memory):
        memory.update(values(metric))

    readings = []
    for key in sorted(utils.keys() | memory.keys(), key=_sort_key):
        util, source = utils.get(key, (None, None))
        used = memory.get(key)
        readings.append(
            GpuReading(
                uuid=key.reported_uuid,
                ts=at,
                gpu_util=util,
                mem_used_bytes=round(used) if used is not None else None,
                parent_uuid=key.parent_uuid,
                gpu_instance_id=key.gpu_instance_id,
                mig_profile=key.mig_profile,
                util_source=source,
                node=key.node,
                driver=key.driver,
                pci_bus_id=key.pci_bus_id,
                partition=key.partition,
                device=key.device,
            )
        )
    return readings


def _percent(value: float) -> float:
    # Counters sampled over slightly different windows can overshoot; ingest refuses > 100.
    return round(min(100.0, max(0.0, value)), 2)


def _sort_key(key: DeviceKey) -> tuple[str, str, str, int, int]:
    return (
        key.node or "",
        key.uuid or key.parent_uuid or "",
        key.pci_bus_id or key.device or "",
        -1 if key.gpu_instance_id is None else key.gpu_instance_id,
        -1 if key.partition is None else key.partition,
    )


# MIG devices through NVML


def with_mig_instances(
    readings: Iterable[GpuReading], nvml_readings: Iterable[GpuReading]
) -> list[GpuReading]:
    """`readings` (of the DCGM exporter) with each MIG series given its MIG device's UUID,
    as NVML reported it with the same parent UUID and GPU instance id; one NVML did not
    see keeps its `<parent>::gi<N>` key."""
    mig_uuids: dict[tuple[str | None, int | None], str] = {
        (reading.parent_uuid, reading.gpu_instance_id): reading.uuid
        for reading in nvml_readings
        if reading.parent_uuid and reading.gpu_instance_id is not None
    }
    matched = []
    for reading in readings:
        uuid = mig_uuids.get((reading.parent_uuid, reading.gpu_instance_id))
        matched.append(replace(reading, uuid=uuid) if uuid and reading.parent_uuid else reading)
    return matched


# Source


def _now() -> datetime:
    return datetime.now(UTC)


class ExporterSource:
    """Readings of the devices one exporter on this node reports, scraped at every read.

    With `nvml` (a source reporting MIG devices with their GPU instance ids), a DCGM
    exporter's MIG series are named by their MIG device's UUID (`with_mig_instances`), and
    NVML's readings of the devices the exporter does not report are kept.
    """

    def __init__(
        self,
        url: str,
        profile: ExporterProfile,
        *,
        sys_root: str | Path = "/sys",
        nvml: object | None = None,
        serials: Callable[[], Mapping[str, str]] = hlml_serial_buses,
        ca_file: str | None = None,
        timeout_seconds: float = 10.0,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.url = url
        self.profile = profile
        self.sys_root = Path(sys_root)
        self.nvml = nvml
        self.serials = serials
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def close(self) -> None:
        close = getattr(self.nvml, "close", None)
        if close is not None:
            close()

    def scrape(self) -> str:
        try:
            with urllib.request.urlopen(
                self.url, timeout=self.timeout_seconds, context=self._ssl
            ) as response:
                body: bytes = response.read()
        except urllib.error.HTTPError as error:
            raise ExporterError(f"{self.url}: HTTP {error.code}") from error
        except OSError as error:
            raise ExporterError(f"{self.url}: {error}") from error
        try:
            return body.decode()
        except UnicodeDecodeError as error:
            raise ExporterError(f"{self.url}: not UTF-8 text: {error}") from error

    def read(self) -> list[GpuReading]:
        at = self._clock()
        match = self.profile.match
        bus_ids = None
        if match is MatchBy.PCI_ORDER:
            bus_ids = pci_bus_ids(self.sys_root, self.profile.kernel_driver)
        serial_buses = self.serials() if match is MatchBy.SERIAL else None
        readings = parse_metrics(
            self.scrape(), self.profile, at=at, amd_bus_ids=bus_ids, serial_buses=serial_buses
        )
        read_nvml = getattr(self.nvml, "read", None)
        if read_nvml is None:
            return readings
        return merge_with_nvml(readings, read_nvml())


def merge_with_nvml(
    readings: Iterable[GpuReading], nvml_readings: Iterable[GpuReading]
) -> list[GpuReading]:
    """One reading per device from an exporter's readings and NVML's: NVML's (memory,
    processes) with the exporter's utilisation where NVML measured none (MIG devices: NVML
    gives no utilisation there, DCGM's profiling metrics do), and the exporter's of devices
    NVML did not see. MIG series are first matched through `with_mig_instances`."""
    nvml_readings = list(nvml_readings)
    exported = with_mig_instances(readings, nvml_readings)
    by_uuid = {reading.uuid: reading for reading in exported if reading.uuid}
    merged = []
    for reading in nvml_readings:
        other = by_uuid.pop(reading.uuid, None)
        if other is not None and reading.gpu_util is None and other.gpu_util is not None:
            reading = replace(reading, gpu_util=other.gpu_util, util_source=other.util_source)
        merged.append(reading)
    return merged + list(by_uuid.values()) + [reading for reading in exported if not reading.uuid]
