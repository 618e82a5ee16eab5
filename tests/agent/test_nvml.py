"""`agent.nvml` against the real `pynvml`, with only the NVML shared library replaced.

`FakeNvmlLib` stands where `libnvidia-ml.so.1` would: pynvml looks its C functions up by name
on `pynvml.nvmlLib`, so every pynvml wrapper (the two-call size protocol, structs, error
classes, str/bytes conversion) runs for real and only the driver answers are made up.
"""

from __future__ import annotations

import ctypes
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent import nvml
from agent.readings import GpuReading

OK = pynvml.NVML_SUCCESS
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
INSUFFICIENT_SIZE = pynvml.NVML_ERROR_INSUFFICIENT_SIZE

POD_A = "2f1b6d7e-3c4a-4b5e-9f60-7a8b9c0d1e2f"
POD_B = "8a9b0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d"
POD_C = "0e1f2a3b-4c5d-4e6f-8a7b-9c0d1e2f3a4b"
CONTAINER_A = "a" * 64
CONTAINER_B = "b" * 64
CONTAINER_C = "c" * 64
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


def mig(slot: int, gi: int, profile: str, **kwargs: Any) -> FakeDevice:
    uuid = f"MIG-{slot:08x}-aaaa-bbbb-cccc-{gi:012x}"
    return FakeDevice(
        uuid=uuid,
        name=f"NVIDIA A100-SXM4-40GB MIG {profile}",
        gpu_instance_id=gi,
        **kwargs,
    )


def fleet() -> list[FakeDevice]:
    return [
        FakeDevice(
            uuid="GPU-00000000-0000-0000-0000-000000000000",
            name="NVIDIA H100 80GB HBM3",
            util=37,
            mem_used=10 * GIB,
            processes=[(101, 6 * GIB), (102, 3 * GIB), (103, GIB)],
            process_samples=[(101, 1_000, 30), (101, 2_000, 50), (102, 1_500, 20)],
        ),
        FakeDevice(
            uuid="GPU-11111111-1111-1111-1111-111111111111",
            name="NVIDIA A100-SXM4-40GB",
            mem_used=12 * GIB,
            mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
            mig_slots=7,
            # Slots need not be dense: 1, 2, 4 and 6 are empty.
            mig_devices={
                0: mig(0, 1, "3g.20gb", mem_used=4 * GIB, processes=[(201, 4 * GIB)]),
                3: mig(3, 5, "2g.10gb", mem_used=0),
                5: mig(5, 13, "1g.5gb", mem_used=GIB, processes=[(202, GIB)]),
            },
        ),
        FakeDevice(
            uuid="GPU-22222222-2222-2222-2222-222222222222",
            name="NVIDIA H100 80GB HBM3",
            util_error=pynvml.NVML_ERROR_UNKNOWN,
            mem_used=GIB,
        ),
        FakeDevice(
            uuid="GPU-33333333-3333-3333-3333-333333333333",
            name="NVIDIA H100 80GB HBM3",
            uuid_error=pynvml.NVML_ERROR_GPU_IS_LOST,
            mem_used=0,
        ),
        FakeDevice(
            uuid="GPU-44444444-4444-4444-4444-444444444444",
            name="NVIDIA A10",
            mem_used=2 * GIB,
            util_samples=[(5_000, 10), (6_000, 30)],
        ),
    ]


@pytest.fixture
def fake_lib(monkeypatch: pytest.MonkeyPatch) -> FakeNvmlLib:
    lib = FakeNvmlLib(fleet())
    monkeypatch.setattr(pynvml, "nvmlLib", lib)
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    return lib


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    cgroups = {
        # cgroup v2, systemd driver, relative to the agent's cgroup namespace.
        101: "0::/../../kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{POD_A.replace('-', '_')}.slice/"
        f"cri-containerd-{CONTAINER_A}.scope\n",
        # cgroup v1, cgroupfs driver, Guaranteed QoS (no QoS level in the path).
        102: "12:pids:/kubepods/pod" + POD_B + "/" + CONTAINER_B + "\n"
        "11:memory:/kubepods/pod" + POD_B + "/" + CONTAINER_B + "\n"
        "1:name=systemd:/kubepods/pod" + POD_B + "/" + CONTAINER_B + "\n",
        # 103 has exited: no /proc entry.
        # cgroup v1, systemd driver, BestEffort, docker.
        201: "5:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{POD_C.replace('-', '_')}.slice/docker-{CONTAINER_C}.scope\n",
        # A process on the host, outside Kubernetes.
        202: "0::/system.slice/ollama.service\n",
    }
    for pid, text in cgroups.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(text)
    return tmp_path


AT = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def read(proc_root: Path) -> dict[str, GpuReading]:
    with nvml.NvmlSource(proc_root=proc_root, clock=lambda: AT) as source:
        return {reading.uuid: reading for reading in source.read()}


def test_whole_gpu_reading_with_processes_mapped_to_pods(
    fake_lib: FakeNvmlLib, proc_root: Path
) -> None:
    gpu = read(proc_root)["GPU-00000000-0000-0000-0000-000000000000"]

    assert (gpu.ts, gpu.gpu_util, gpu.util_source) == (AT, 37.0, "utilization_rates")
    assert gpu.mem_used_bytes == 10 * GIB
    assert gpu.parent_uuid is None
    by_pid = {p.pid: p for p in gpu.processes}
    assert by_pid[101].pod_uid == POD_A
    assert by_pid[101].container_id == CONTAINER_A
    assert by_pid[101].gpu_util == 40.0  # mean of the two samples
    assert by_pid[101].mem_used_bytes == 6 * GIB
    assert (by_pid[102].pod_uid, by_pid[102].container_id, by_pid[102].gpu_util) == (
        POD_B,
        CONTAINER_B,
        20.0,
    )
    assert (by_pid[103].pod_uid, by_pid[103].container_id, by_pid[103].gpu_util) == (
        None,
        None,
        None,
    )


def test_mig_devices_are_read_under_their_parent(fake_lib: FakeNvmlLib, proc_root: Path) -> None:
    readings = read(proc_root)
    parent_uuid = "GPU-11111111-1111-1111-1111-111111111111"
    parent = readings[parent_uuid]
    migs = sorted(
        (r for r in readings.values() if r.parent_uuid == parent_uuid),
        key=lambda r: r.gpu_instance_id or 0,
    )

    assert parent.mem_used_bytes == 12 * GIB
    assert parent.processes == ()  # attributed to the MIG devices, never twice
    assert [(m.gpu_instance_id, m.mig_profile) for m in migs] == [
        (1, "3g.20gb"),
        (5, "2g.10gb"),
        (13, "1g.5gb"),
    ]
    # NVML has no utilisation for MIG devices: unmeasured, not idle.
    assert {(m.gpu_util, m.util_source) for m in migs} == {(None, None)}
    assert [m.mem_used_bytes for m in migs] == [4 * GIB, 0, GIB]
    assert [(p.pid, p.pod_uid, p.container_id) for p in migs[0].processes] == [
        (201, POD_C, CONTAINER_C)
    ]
    assert [(p.pid, p.pod_uid, p.gpu_util) for p in migs[2].processes] == [(202, None, None)]


def test_one_failing_gpu_does_not_lose_the_others(
    fake_lib: FakeNvmlLib, proc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="agent.nvml"):
        readings = read(proc_root)

    broken = readings["GPU-22222222-2222-2222-2222-222222222222"]
    assert (broken.gpu_util, broken.mem_used_bytes) == (None, GIB)
    assert "GPU-33333333-3333-3333-3333-333333333333" not in readings  # no UUID, no reading
    assert len(readings) == 1 + 1 + 3 + 1 + 1  # H100, A100 + 3 MIG, broken H100, A10
    warnings = [r.getMessage() for r in caplog.records]
    assert any("nvmlDeviceGetUtilizationRates" in w and "GPU-2222" in w for w in warnings)
    assert any("nvmlDeviceGetUUID" in w and "gpu-index-3" in w for w in warnings)


def test_repeated_failures_warn_once(
    fake_lib: FakeNvmlLib, proc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="agent.nvml"),
        nvml.NvmlSource(proc_root=proc_root) as source,
    ):
        source.read()
        first = len(caplog.records)
        source.read()
    assert first > 0
    assert len(caplog.records) == first


def test_sample_buffer_fallback_reads_only_new_samples(
    fake_lib: FakeNvmlLib, proc_root: Path
) -> None:
    uuid = "GPU-44444444-4444-4444-4444-444444444444"
    with nvml.NvmlSource(proc_root=proc_root) as source:
        first = {r.uuid: r for r in source.read()}[uuid]
        fake_lib.gpus[4].util_samples = [(5_000, 10), (6_000, 30), (7_000, 90)]
        second = {r.uuid: r for r in source.read()}[uuid]
        third = {r.uuid: r for r in source.read()}[uuid]

    assert (first.gpu_util, first.util_source) == (20.0, "samples")
    assert (second.gpu_util, second.util_source) == (90.0, "samples")
    assert (third.gpu_util, third.util_source) == (None, None)  # nothing new since


def test_process_utilisation_counts_only_new_samples(
    fake_lib: FakeNvmlLib, proc_root: Path
) -> None:
    uuid = "GPU-00000000-0000-0000-0000-000000000000"
    with nvml.NvmlSource(proc_root=proc_root) as source:
        source.read()
        # No sample since the last read: NVML answers NOT_FOUND, which means "idle", not error.
        again = {r.uuid: r for r in source.read()}[uuid]
    assert {p.pid: p.gpu_util for p in again.processes} == {101: None, 102: None, 103: None}


def test_as_sample_is_the_ingest_shape(fake_lib: FakeNvmlLib, proc_root: Path) -> None:
    gpu = read(proc_root)["GPU-00000000-0000-0000-0000-000000000000"]
    sample = gpu.as_sample()
    assert sample["uuid"] == gpu.uuid
    assert sample["ts"] == "2025-03-01T12:00:00.000Z"
    assert sample["gpu_util"] == 37.0
    assert sample["mem_used_bytes"] == 10 * GIB
    assert sample["processes"][0] == {
        "pid": 101,
        "pod_uid": POD_A,
        "container_id": CONTAINER_A,
        "gpu_util": 40.0,
        "mem_used_bytes": 6 * GIB,
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "0::/kubepods.slice/kubepods-pod" + POD_A.replace("-", "_") + ".slice/"
            "crio-" + CONTAINER_A + ".scope",
            (POD_A, CONTAINER_A),
        ),
        (
            "4:devices:/kubepods/besteffort/pod" + POD_B + "/" + CONTAINER_B,
            (POD_B, CONTAINER_B),
        ),
        # Static pods: the uid is a 32-hex hash.
        ("0::/kubepods/burstable/pod" + "d" * 32 + "/" + CONTAINER_C, ("d" * 32, CONTAINER_C)),
        # The pod's own cgroup, no container below it (e.g. the pause process' parent).
        ("0::/kubepods/burstable/pod" + POD_A, (POD_A, None)),
        ("0::/", (None, None)),
        ("0::/user.slice/user-1000.slice/session-3.scope", (None, None)),
        ("garbage", (None, None)),
        ("", (None, None)),
    ],
)
def test_parse_cgroup(text: str, expected: tuple[str | None, str | None]) -> None:
    assert nvml.parse_cgroup(text) == expected


def test_bench_nvml_check_summarises_a_short_run(
    fake_lib: FakeNvmlLib, proc_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import nvml_check

    args = ["--seconds", "0.05", "--interval", "0.01", "--proc-root", str(proc_root)]
    assert nvml_check.main(args) == 0
    summary = json.loads(capsys.readouterr().out)

    assert summary["driver_version"] == "580.82.07"
    assert summary["devices"] == 7
    assert summary["reads"] >= 2
    h100 = summary["device_summaries"][0]
    assert h100["uuid"] == "GPU-00000000-0000-0000-0000-000000000000"
    assert h100["util_percent"] == {"min": 37.0, "mean": 37.0, "max": 37.0}
    assert {p["pid"]: p["pod_uid"] for p in h100["processes"]} == {
        101: POD_A,
        102: POD_B,
        103: None,
    }
    assert (fake_lib.init_calls, fake_lib.shutdown_calls) == (1, 1)
