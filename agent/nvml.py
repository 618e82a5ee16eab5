"""NVML: the only module that imports `pynvml` (the GPU side of the node agent).

`NvmlSource.read()` returns one `GpuReading` per GPU and per MIG device on this node:
utilisation, memory in use, and the processes on the device with the pod each one runs in
(found through `/proc/<pid>/cgroup`). A failing NVML call costs only the value it was asked
for, and a failing GPU only its own readings: the other GPUs are still read.

Where utilisation comes from, in order (the reading's `util_source` says which one answered):

1. `nvmlDeviceGetUtilizationRates` ("utilization_rates"): whole GPUs.
2. `nvmlDeviceGetSamples(GPU_UTILIZATION_SAMPLES)` ("samples"): the mean of the driver's
   samples since the last read, for devices that keep a sample buffer but no rate.
3. The sum of per-process SM utilisation from `nvmlDeviceGetProcessUtilization` ("processes").
4. None. NVML gives no utilisation at all for MIG devices (all three calls answer
   NOT_SUPPORTED there); DCGM's profiling metrics do (`agent.dcgm`). The agent sends
   `gpu_util: null`, which the billing side counts as unmeasured, never as idle.

For a GPU in MIG mode the parent's reading carries its memory only; its processes are read
from, and attributed to, the MIG devices, so no process is counted twice. A MIG device's
reading also carries where its GPU instance sits on the parent (`nvmlDeviceGetGpuInstanceById`
then `nvmlGpuInstanceGetInfo`: placement start and size in memory slices, GPU instance
profile id): NVIDIA's DRA driver publishes a dynamic MIG partition by that placement, and the
MIG device it creates for a claim has a UUID no ResourceSlice carries. Where NVML refuses
the GPU instance (an agent without the `mig/monitor` nvidia-capability, or root), the reading
carries no placement and a warning says so once per GPU.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pynvml

from agent.readings import GpuReading, ProcessReading

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PROC_ROOT = "/proc"

_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# One cgroup path component naming a pod: cgroupfs `pod<uid>`, systemd
# `kubepods-burstable-pod<uid with underscores>.slice`. Static pods have a 32-hex uid.
_POD_COMPONENT = re.compile(rf"^(?:kubepods(?:-[a-z]+)*-)?pod({_UUID}|[0-9a-f]{{32}})(?:\.slice)?$")
# The container below it: cgroupfs `<id>`, systemd `cri-containerd-<id>.scope`,
# `docker-<id>.scope`, `crio-<id>.scope`.
_CONTAINER_COMPONENT = re.compile(
    r"^(?:(?:cri-containerd|containerd|docker|crio|cri-o)-)?([0-9a-f]{64})(?:\.scope)?$"
)
_MIG_PROFILE = re.compile(r"\bMIG (\S+)$")

_SAMPLE_VALUE_FIELD = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


def parse_cgroup(text: str) -> tuple[str | None, str | None]:
    """(pod UID, container id) from the text of a `/proc/<pid>/cgroup`, None where absent.

    Understands cgroup v1 (one line per hierarchy) and v2 (`0::/path`), the systemd and the
    cgroupfs drivers, and paths relative to the reader's cgroup namespace (`/../..`).
    """
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        pod_uid: str | None = None
        container_id: str | None = None
        for component in parts[2].split("/"):
            pod_match = _POD_COMPONENT.match(component)
            if pod_match:
                pod_uid = pod_match.group(1).replace("_", "-")
                container_id = None
                continue
            container_match = _CONTAINER_COMPONENT.match(component)
            if pod_uid and container_match:
                container_id = container_match.group(1)
        if pod_uid:
            return pod_uid, container_id
    return None, None


def pod_of_pid(
    pid: int, proc_root: str | Path = DEFAULT_PROC_ROOT
) -> tuple[str | None, str | None]:
    """(pod UID, container id) of a host pid; (None, None) for a process outside any pod or
    one that has already gone."""
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except OSError:
        return None, None
    return parse_cgroup(text)


def _now() -> datetime:
    return datetime.now(UTC)


class NvmlSource:
    """Reads every GPU and MIG device of this node through NVML.

    Holds NVML initialised from construction until `close()`, and remembers, per device,
    the driver timestamp of the last sample it consumed, so each read averages only what
    happened since the previous one. `proc_root` is the host's `/proc` (mounted elsewhere
    when the agent does not share the host's pid namespace).
    """

    def __init__(
        self,
        *,
        proc_root: str | Path = DEFAULT_PROC_ROOT,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.proc_root = Path(proc_root)
        self._clock = clock
        self._last_sample_us: dict[tuple[str, str], int] = {}
        self._reported: set[tuple[str, str, int]] = set()
        pynvml.nvmlInit()
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            pynvml.nvmlShutdown()

    def __enter__(self) -> NvmlSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def driver_version(self) -> str | None:
        """The NVIDIA driver's version, for reports; None when NVML will not say."""
        version = self._call("system", "nvmlSystemGetDriverVersion")
        return str(version) if version is not None else None

    def read(self) -> list[GpuReading]:
        """One reading per device, all stamped with the same instant.

        Raises `pynvml.NVMLError` only when the GPUs cannot even be counted.
        """
        ts = self._clock()
        readings: list[GpuReading] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                readings.extend(self._read_gpu(index, ts))
            except Exception:
                # NVML errors are handled per call; this is the unforeseen, kept to one GPU.
                log.exception("reading GPU %d failed", index, extra={"gpu_index": index})
        return readings

    def _read_gpu(self, index: int, ts: datetime) -> list[GpuReading]:
        where = f"gpu-index-{index}"
        handle = self._call(where, "nvmlDeviceGetHandleByIndex", index)
        uuid = self._call(where, "nvmlDeviceGetUUID", handle) if handle is not None else None
        if handle is None or uuid is None:
            return []
        mig_mode = self._call(uuid, "nvmlDeviceGetMigMode", handle, quiet=_NOT_SUPPORTED)
        if not mig_mode or mig_mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return [self._read_device(handle, uuid, ts)]

        readings = [self._read_device(handle, uuid, ts, with_processes=False)]
        slots = self._call(uuid, "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        for slot in range(slots):
            # Empty slots answer NOT_FOUND: MIG devices need not be numbered densely.
            mig_handle = self._call(
                uuid, "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot, quiet=_NOT_FOUND
            )
            if mig_handle is None:
                continue
            mig_uuid = self._call(uuid, "nvmlDeviceGetUUID", mig_handle)
            if mig_uuid is None:
                continue
            name = self._call(mig_uuid, "nvmlDeviceGetName", mig_handle)
            profile = _MIG_PROFILE.search(name) if name else None
            instance_id = self._call(mig_uuid, "nvmlDeviceGetGpuInstanceId", mig_handle)
            instance = self._gpu_instance(handle, uuid, instance_id)
            readings.append(
                self._read_device(
                    mig_handle,
                    mig_uuid,
                    ts,
                    parent_uuid=uuid,
                    gpu_instance_id=instance_id,
                    mig_profile=profile.group(1) if profile else None,
                    mig_placement=(
                        (int(instance.placement.start), int(instance.placement.size))
                        if instance is not None
                        else None
                    ),
                    mig_profile_id=int(instance.profileId) if instance is not None else None,
                )
            )
        return readings

    def _gpu_instance(self, parent: Any, parent_uuid: str, instance_id: int | None) -> Any:
        """`nvmlGpuInstanceInfo_t` of GPU instance `instance_id` of the GPU `parent`: its
        profile id and placement; None when NVML will not say (warned once per GPU)."""
        if instance_id is None:
            return None
        instance = self._call(parent_uuid, "nvmlDeviceGetGpuInstanceById", parent, instance_id)
        if instance is None:
            return None
        return self._call(parent_uuid, "nvmlGpuInstanceGetInfo", instance)

    def _read_device(
        self,
        handle: Any,
        uuid: str,
        ts: datetime,
        *,
        with_processes: bool = True,
        parent_uuid: str | None = None,
        gpu_instance_id: int | None = None,
        mig_profile: str | None = None,
        mig_placement: tuple[int, int] | None = None,
        mig_profile_id: int | None = None,
    ) -> GpuReading:
        processes = self._processes(handle, uuid) if with_processes else ()
        gpu_util, util_source = self._utilization(handle, uuid, processes)
        return GpuReading(
            uuid=uuid,
            ts=ts,
            gpu_util=gpu_util,
            mem_used_bytes=self._memory_used(handle, uuid),
            processes=processes,
            parent_uuid=parent_uuid,
            gpu_instance_id=gpu_instance_id,
            mig_profile=mig_profile,
            mig_placement=mig_placement,
            mig_profile_id=mig_profile_id,
            util_source=util_source,
        )

    def _utilization(
        self, handle: Any, uuid: str, processes: tuple[ProcessReading, ...]
    ) -> tuple[float | None, str | None]:
        rates = self._call(uuid, "nvmlDeviceGetUtilizationRates", handle, quiet=_NOT_SUPPORTED)
        if rates is not None:
            return float(rates.gpu), "utilization_rates"
        since = self._last_sample_us.get(("samples", uuid), 0)
        answer = self._call(
            uuid,
            "nvmlDeviceGetSamples",
            handle,
            pynvml.NVML_GPU_UTILIZATION_SAMPLES,
            since,
            quiet=_NOT_SUPPORTED | _NOT_FOUND,
        )
        if answer:
            value_type, samples = answer
            fresh = [s for s in samples if s.timeStamp > since]
            if fresh:
                self._last_sample_us["samples", uuid] = max(s.timeStamp for s in fresh)
                field = _SAMPLE_VALUE_FIELD.get(value_type, "uiVal")
                values = [float(getattr(s.sampleValue, field)) for s in fresh]
                return round(sum(values) / len(values), 2), "samples"
        process_utils = [p.gpu_util for p in processes if p.gpu_util is not None]
        if process_utils:
            return min(100.0, round(sum(process_utils), 2)), "processes"
        return None, None

    def _memory_used(self, handle: Any, uuid: str) -> int | None:
        # v2 leaves out the memory the driver reserves for itself; v1 counts it as used.
        memory = self._call(
            uuid,
            "nvmlDeviceGetMemoryInfo",
            handle,
            pynvml.nvmlMemory_v2,
            quiet=_NOT_SUPPORTED | _FUNCTION_NOT_FOUND | _INVALID_ARGUMENT,
        )
        if memory is None:
            memory = self._call(uuid, "nvmlDeviceGetMemoryInfo", handle)
        return int(memory.used) if memory is not None else None

    def _processes(self, handle: Any, uuid: str) -> tuple[ProcessReading, ...]:
        # The _v3 struct needs driver >= 510; older drivers only have _v2 (same fields).
        running = self._call(
            uuid, "nvmlDeviceGetComputeRunningProcesses_v3", handle, quiet=_FUNCTION_NOT_FOUND
        )
        if running is None:
            running = self._call(uuid, "nvmlDeviceGetComputeRunningProcesses_v2", handle) or []
        utils = self._process_utils(handle, uuid)
        processes: dict[int, ProcessReading] = {}
        for process in running:
            pid = int(process.pid)
            if pid in processes:
                continue
            pod_uid, container_id = pod_of_pid(pid, self.proc_root)
            used = process.usedGpuMemory
            processes[pid] = ProcessReading(
                pid=pid,
                pod_uid=pod_uid,
                container_id=container_id,
                gpu_util=utils.get(pid),
                mem_used_bytes=int(used) if used is not None else None,
            )
        return tuple(processes.values())

    def _process_utils(self, handle: Any, uuid: str) -> dict[int, float]:
        """Mean SM utilisation per pid over the driver's samples since the previous read."""
        since = self._last_sample_us.get(("processes", uuid), 0)
        # NOT_FOUND: no process ran since `since`. NOT_SUPPORTED: MIG devices, some GPUs.
        samples = self._call(
            uuid,
            "nvmlDeviceGetProcessUtilization",
            handle,
            since,
            quiet=_NOT_FOUND | _NOT_SUPPORTED,
        )
        if not samples:
            return {}
        per_pid: dict[int, list[float]] = {}
        for sample in samples:
            if sample.timeStamp > since:
                per_pid.setdefault(int(sample.pid), []).append(float(sample.smUtil))
        if per_pid:
            newest = max(s.timeStamp for s in samples)
            self._last_sample_us["processes", uuid] = newest
        return {pid: round(sum(v) / len(v), 2) for pid, v in per_pid.items()}

    def _call(self, device: str, name: str, *args: Any, quiet: frozenset[int] = frozenset()) -> Any:
        """`pynvml.<name>(*args)`, or None when NVML answers with an error.

        Errors in `quiet` are expected answers ("not supported here", "nothing found") and
        are logged at debug; others are logged as a warning the first time each device, call
        and error code come together, then at debug, so a broken GPU does not flood the log.
        """
        try:
            return getattr(pynvml, name)(*args)
        except pynvml.NVMLError as error:
            code = int(error.value)
            key = (device, name, code)
            expected = code in quiet or code == pynvml.NVML_SUCCESS
            level = logging.DEBUG if expected or key in self._reported else logging.WARNING
            self._reported.add(key)
            log.log(
                level,
                "NVML %s failed for %s: %s",
                name,
                device,
                error,
                extra={"device": device, "nvml_call": name, "nvml_error": code},
            )
            return None


_NOT_SUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED})
_NOT_FOUND = frozenset({pynvml.NVML_ERROR_NOT_FOUND})
_FUNCTION_NOT_FOUND = frozenset({pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})
_INVALID_ARGUMENT = frozenset({pynvml.NVML_ERROR_INVALID_ARGUMENT})
