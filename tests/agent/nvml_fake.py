"""A stand-in for `libnvidia-ml.so.1`, for tests of `agent.nvml` against the real `pynvml`.

`FakeNvmlLib` stands where the NVML shared library would: pynvml looks its C functions up by
name on `pynvml.nvmlLib`, so every pynvml wrapper (the two-call size protocol, structs, error
classes, str/bytes conversion) runs for real and only the driver answers are made up.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

OK = pynvml.NVML_SUCCESS
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
GIB = 1024**3


@dataclass
class FakeDevice:
    """One GPU or MIG device as the driver would describe it; an int field is an error code
    where the driver would fail."""

    uuid: str
    name: str
    mem_used: int
    util: int | None = None  # None: NOT_SUPPORTED (MIG devices)
    util_error: int | None = None
    uuid_error: int | None = None
    mig_mode: int | None = None  # None: NOT_SUPPORTED (GPUs without MIG)
    mig_slots: int = 0
    mig_devices: dict[int, FakeDevice] = field(default_factory=dict)
    gpu_instance_id: int | None = None
    # A MIG device's GPU instance: its placement (start, size in memory slices) and profile
    # id; None: NVML finds no such instance. `instance_error` on a GPU: what NVML answers
    # when asked for any of its GPU instances (NO_PERMISSION without mig/monitor).
    placement: tuple[int, int] | None = None
    profile_id: int | None = None
    instance_error: int | None = None
    processes: list[tuple[int, int]] = field(default_factory=list)  # (pid, used bytes)
    process_samples: list[tuple[int, int, int]] | None = (
        None  # (pid, ts µs, sm %); None: unsupported
    )
    util_samples: list[tuple[int, int]] | None = None  # (ts µs, %); None: unsupported


class FakeNvmlLib:
    """The NVML C functions the source uses, as Python callables with the C signatures."""

    def __init__(self, gpus: list[FakeDevice]) -> None:
        self.gpus = gpus
        self.handles: dict[int, FakeDevice] = {}
        self.init_calls = 0
        self.shutdown_calls = 0

    def _out_handle(self, ref: Any, device: FakeDevice) -> None:
        key = 0x1000 + len(self.handles) * 0x10
        self.handles[key] = device
        ctypes.c_void_p.from_buffer(ref._obj).value = key

    def _device(self, handle: Any) -> FakeDevice:
        return self.handles[ctypes.cast(handle, ctypes.c_void_p).value or 0]

    def nvmlInitWithFlags(self, flags: int) -> int:
        self.init_calls += 1
        return OK

    def nvmlShutdown(self) -> int:
        self.shutdown_calls += 1
        return OK

    def nvmlSystemGetDriverVersion(self, buffer: Any, size: Any) -> int:
        buffer.value = b"580.82.07"
        return OK

    def nvmlDeviceGetCount_v2(self, count: Any) -> int:
        count._obj.value = len(self.gpus)
        return OK

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> int:
        self._out_handle(ref, self.gpus[index.value])
        return OK

    def nvmlDeviceGetUUID(self, handle: Any, buffer: Any, size: Any) -> int:
        device = self._device(handle)
        if device.uuid_error:
            return device.uuid_error
        buffer.value = device.uuid.encode()
        return OK

    def nvmlDeviceGetName(self, handle: Any, buffer: Any, size: Any) -> int:
        buffer.value = self._device(handle).name.encode()
        return OK

    def nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        device = self._device(handle)
        if device.mig_mode is None:
            return NOT_SUPPORTED
        current._obj.value = pending._obj.value = device.mig_mode
        return OK

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, count: Any) -> int:
        count._obj.value = self._device(handle).mig_slots
        return OK

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: Any, ref: Any) -> int:
        mig = self._device(handle).mig_devices.get(index.value)
        if mig is None:
            return NOT_FOUND
        self._out_handle(ref, mig)
        return OK

    def nvmlDeviceGetGpuInstanceId(self, handle: Any, ref: Any) -> int:
        ref._obj.value = self._device(handle).gpu_instance_id
        return OK

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, instance_id: int, ref: Any) -> int:
        parent = self._device(handle)
        if parent.instance_error:
            return parent.instance_error
        for mig in parent.mig_devices.values():
            if mig.gpu_instance_id == instance_id and mig.placement is not None:
                # One compute instance per GPU instance: the MIG device stands for both.
                self._out_handle(ref, mig)
                return OK
        return NOT_FOUND

    def nvmlGpuInstanceGetInfo(self, instance: Any, info: Any) -> int:
        mig = self._device(instance)
        assert mig.placement is not None and mig.profile_id is not None
        info._obj.id = mig.gpu_instance_id
        info._obj.profileId = mig.profile_id
        info._obj.placement.start, info._obj.placement.size = mig.placement
        return OK

    def nvmlDeviceGetUtilizationRates(self, handle: Any, ref: Any) -> int:
        device = self._device(handle)
        if device.util_error:
            return device.util_error
        if device.util is None:
            return NOT_SUPPORTED
        ref._obj.gpu = device.util
        ref._obj.memory = device.util // 2
        return OK

    def nvmlDeviceGetMemoryInfo_v2(self, handle: Any, ref: Any) -> int:
        ref._obj.used = self._device(handle).mem_used
        ref._obj.total = 80 * GIB
        return OK

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, array: Any) -> int:
        processes = self._device(handle).processes
        if array is None:
            count._obj.value = len(processes)
            return INSUFFICIENT_SIZE if processes else OK
        for slot, (pid, used) in enumerate(processes):
            array[slot].pid = pid
            array[slot].usedGpuMemory = used
        count._obj.value = len(processes)
        return OK

    def nvmlDeviceGetProcessUtilization(
        self, handle: Any, array: Any, count: Any, since: Any
    ) -> int:
        samples = self._device(handle).process_samples
        if samples is None:
            return NOT_SUPPORTED
        fresh = [s for s in samples if s[1] > since.value]
        if not fresh:
            return NOT_FOUND
        if array is None:
            count._obj.value = len(fresh)
            return INSUFFICIENT_SIZE
        for slot, (pid, ts, sm) in enumerate(fresh):
            array[slot].pid, array[slot].timeStamp, array[slot].smUtil = pid, ts, sm
        return OK

    def nvmlDeviceGetSamples(
        self, handle: Any, kind: Any, since: Any, value_type: Any, count: Any, array: Any
    ) -> int:
        samples = self._device(handle).util_samples
        if samples is None:
            return NOT_SUPPORTED
        fresh = [s for s in samples if s[0] > since.value]
        if not fresh:
            return NOT_FOUND
        value_type._obj.value = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        count._obj.value = len(fresh)
        if array is not None:
            for slot, (ts, value) in enumerate(fresh):
                array[slot].timeStamp = ts
                array[slot].sampleValue.uiVal = value
        return OK


def install(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeDevice]) -> FakeNvmlLib:
    """Make `gpus` what NVML sees, for the rest of the test."""
    lib = FakeNvmlLib(gpus)
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return lib
