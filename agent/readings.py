"""What a GPU source reports: one reading per device, the same shape from NVML and from DCGM.

Plain data with no imports beyond the standard library, so the node agent, the DCGM source
and the tests can share it without loading `pynvml` (only `agent.nvml` does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ProcessReading:
    """One process using a device, and the pod it belongs to when it runs in one."""

    pid: int
    pod_uid: str | None
    container_id: str | None
    gpu_util: float | None  # SM utilisation %, None when the source gives none for the pid
    mem_used_bytes: int | None


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One device (a whole GPU or a MIG device) at one instant.

    `gpu_util` is a percentage 0-100, or None when the device could not be measured;
    `util_source` names what it came from (e.g. "utilization_rates", "samples",
    "gr_engine_active"), so an unmeasured device can be told from an idle one in logs.
    """

    uuid: str
    ts: datetime
    gpu_util: float | None
    mem_used_bytes: int | None
    processes: tuple[ProcessReading, ...] = ()
    parent_uuid: str | None = None  # set on MIG devices: the physical GPU
    gpu_instance_id: int | None = None  # MIG GPU instance id on the parent
    mig_profile: str | None = None
    # Where a MIG device's GPU instance sits on its parent: (start, size) in memory slices,
    # and its GPU instance profile id. NVIDIA's DRA driver names a dynamic MIG partition by
    # these, not by the MIG device's UUID, which exists only once a claim is prepared.
    mig_placement: tuple[int, int] | None = None
    mig_profile_id: int | None = None
    util_source: str | None = None
    node: str | None = None  # set by sources that see several nodes (Prometheus)
    # A device without a UUID the inventory knows (AMD, Intel) is named by its DRA driver
    # and either its device name in the ResourceSlice, or its PCI address (the standard
    # `resource.kubernetes.io/pciBusID` attribute) and, for a partition, its index on that
    # GPU; `uuid` is then "".
    driver: str | None = None
    device: str | None = None
    pci_bus_id: str | None = None
    partition: int | None = None

    def identity(self) -> dict[str, Any]:
        """How the sample names its device: `uuid`, or `driver` with `device` or
        `pci_bus_id` (and `partition`)."""
        if self.uuid:
            return {"uuid": self.uuid}
        named: dict[str, Any] = {"driver": self.driver}
        if self.device:
            named["device"] = self.device
        else:
            named["pci_bus_id"] = self.pci_bus_id
            if self.partition is not None:
                named["partition"] = self.partition
        return named

    def as_sample(self) -> dict[str, Any]:
        """The JSON object the agent posts to `/ingest/samples` for this reading. A MIG
        device's sample also says its parent and GPU instance id (NVML knows both): what
        the DCGM exporter labels MIG series by; and, where NVML read them, its placement,
        profile and profile id: what the ingest finds a dynamic MIG partition by."""
        mig: dict[str, Any] = {}
        if self.parent_uuid and self.gpu_instance_id is not None:
            mig = {"parent_uuid": self.parent_uuid, "gpu_instance_id": self.gpu_instance_id}
            if self.mig_placement is not None:
                start, size = self.mig_placement
                mig["mig_placement"] = {"start": start, "size": size}
                if self.mig_profile:
                    mig["mig_profile"] = self.mig_profile
                if self.mig_profile_id is not None:
                    mig["mig_profile_id"] = self.mig_profile_id
        return {
            **self.identity(),
            **mig,
            "ts": format_ts(self.ts),
            "gpu_util": self.gpu_util,
            "mem_used_bytes": self.mem_used_bytes,
            "processes": [
                {
                    "pid": process.pid,
                    "pod_uid": process.pod_uid,
                    "container_id": process.container_id,
                    "gpu_util": process.gpu_util,
                    "mem_used_bytes": process.mem_used_bytes,
                }
                for process in self.processes
            ],
        }


class Source(Protocol):
    """Anything that can be asked for the current readings of the devices it sees."""

    def read(self) -> list[GpuReading]: ...

    def close(self) -> None: ...


def format_ts(ts: datetime) -> str:
    """ISO 8601 in UTC with a `Z`, to the millisecond: `2025-01-31T12:00:00.000Z`."""
    if ts.tzinfo is None:
        raise ValueError("naive datetime: readings carry aware UTC timestamps")
    return ts.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
