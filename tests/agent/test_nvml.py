"""`agent.nvml` against the real `pynvml`, with only the NVML shared library replaced
(`tests.agent.nvml_fake`)."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent import nvml
from agent.readings import GpuReading
from tests.agent.nvml_fake import GIB, FakeDevice, FakeNvmlLib, install

POD_A = "2f1b6d7e-3c4a-4b5e-9f60-7a8b9c0d1e2f"
POD_B = "8a9b0c1d-2e3f-4a5b-8c6d-7e8f9a0b1c2d"
POD_C = "0e1f2a3b-4c5d-4e6f-8a7b-9c0d1e2f3a4b"
CONTAINER_A = "a" * 64
CONTAINER_B = "b" * 64
CONTAINER_C = "c" * 64


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
            # Slots need not be dense: 1, 2, 4 and 6 are empty. GPU instances at memory
            # slices 4-7, 0-1 and 2 (profile ids of the A100 40GB: 9, 14, 19).
            mig_devices={
                0: mig(
                    0,
                    1,
                    "3g.20gb",
                    mem_used=4 * GIB,
                    processes=[(201, 4 * GIB)],
                    placement=(4, 4),
                    profile_id=9,
                ),
                3: mig(3, 5, "2g.10gb", mem_used=0, placement=(0, 2), profile_id=14),
                5: mig(
                    5,
                    13,
                    "1g.5gb",
                    mem_used=GIB,
                    processes=[(202, GIB)],
                    placement=(2, 1),
                    profile_id=19,
                ),
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
    return install(monkeypatch, fleet())


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
    # Where each GPU instance sits: what NVIDIA's driver names a dynamic MIG partition by.
    assert [(m.mig_placement, m.mig_profile_id) for m in migs] == [
        ((4, 4), 9),
        ((0, 2), 14),
        ((2, 1), 19),
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


def test_a_mig_devices_sample_says_where_it_sits(fake_lib: FakeNvmlLib, proc_root: Path) -> None:
    sample = read(proc_root)["MIG-00000005-aaaa-bbbb-cccc-00000000000d"].as_sample()
    assert {key: sample[key] for key in sample if key not in ("ts", "processes")} == {
        "uuid": "MIG-00000005-aaaa-bbbb-cccc-00000000000d",
        "parent_uuid": "GPU-11111111-1111-1111-1111-111111111111",
        "gpu_instance_id": 13,
        "mig_placement": {"start": 2, "size": 1},
        "mig_profile": "1g.5gb",
        "mig_profile_id": 19,
        "gpu_util": None,
        "mem_used_bytes": GIB,
    }


def test_a_gpu_instance_nvml_will_not_read_leaves_no_placement_and_warns_once_per_gpu(
    fake_lib: FakeNvmlLib, proc_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake_lib.gpus[1].instance_error = pynvml.NVML_ERROR_NO_PERMISSION
    with (
        caplog.at_level(logging.WARNING, logger="agent.nvml"),
        nvml.NvmlSource(proc_root=proc_root, clock=lambda: AT) as source,
    ):
        first = source.read()
        second = source.read()
    migs = [reading for reading in first + second if reading.parent_uuid]
    assert len(migs) == 6
    assert {(m.mig_placement, m.mig_profile_id) for m in migs} == {(None, None)}
    assert all("mig_placement" not in m.as_sample() for m in migs)
    assert all(m.as_sample()["gpu_instance_id"] == m.gpu_instance_id for m in migs)
    refused = [r for r in caplog.records if "nvmlDeviceGetGpuInstanceById" in r.getMessage()]
    assert [r.__dict__["device"] for r in refused] == ["GPU-11111111-1111-1111-1111-111111111111"]


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
