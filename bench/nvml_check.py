"""Check the NVML source on a real GPU machine: what would the agent send from here?

    .venv/bin/python -m bench.nvml_check [--seconds 60] [--interval 1] [--proc-root /proc]

Runs `agent.nvml.NvmlSource` for `--seconds` at `--interval` and prints one JSON summary
on stdout: the driver version, how long a read took, and per device (GPUs and MIG devices)
its UUID, parent, where its utilisation came from, min/mean/max utilisation, how many reads
had none, memory in use, and every process seen with its pod. Needs no Django and no Tally
server; run it on the node itself (or in a pod with the GPUs and the host's /proc).
Start a GPU workload alongside to see utilisation and the process-to-pod mapping move.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from agent.nvml import NvmlSource
from agent.readings import GpuReading, format_ts


@dataclass
class DeviceSummary:
    """What one device did over the run."""

    first: GpuReading
    utils: list[float] = field(default_factory=list)
    unmeasured: int = 0
    util_sources: set[str] = field(default_factory=set)
    memory: list[int] = field(default_factory=list)
    processes: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, reading: GpuReading) -> None:
        if reading.gpu_util is None:
            self.unmeasured += 1
        else:
            self.utils.append(reading.gpu_util)
        if reading.util_source:
            self.util_sources.add(reading.util_source)
        if reading.mem_used_bytes is not None:
            self.memory.append(reading.mem_used_bytes)
        for process in reading.processes:
            seen = self.processes.setdefault(
                process.pid,
                {
                    "pid": process.pid,
                    "pod_uid": process.pod_uid,
                    "container_id": process.container_id,
                    "reads": 0,
                    "max_mem_used_bytes": None,
                    "gpu_utils": [],
                },
            )
            seen["reads"] += 1
            if process.mem_used_bytes is not None:
                seen["max_mem_used_bytes"] = max(
                    process.mem_used_bytes, seen["max_mem_used_bytes"] or 0
                )
            if process.gpu_util is not None:
                seen["gpu_utils"].append(process.gpu_util)

    def as_json(self) -> dict[str, Any]:
        return {
            "uuid": self.first.uuid,
            "parent_uuid": self.first.parent_uuid,
            "gpu_instance_id": self.first.gpu_instance_id,
            "mig_profile": self.first.mig_profile,
            "reads": len(self.utils) + self.unmeasured,
            "unmeasured_reads": self.unmeasured,
            "util_sources": sorted(self.util_sources),
            "util_percent": _stats(self.utils),
            "mem_used_bytes": _stats([float(m) for m in self.memory]),
            "processes": [
                {
                    **{k: v for k, v in seen.items() if k != "gpu_utils"},
                    "gpu_util_percent": _stats(seen["gpu_utils"]),
                }
                for seen in self.processes.values()
            ],
        }


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "min": min(values),
        "mean": round(sum(values) / len(values), 2),
        "max": max(values),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--proc-root", default="/proc")
    args = parser.parse_args(argv)

    devices: dict[str, DeviceSummary] = {}
    read_ms: list[float] = []
    started = time.monotonic()
    with NvmlSource(proc_root=args.proc_root) as source:
        driver = source.driver_version()
        first_ts = None
        while time.monotonic() - started < args.seconds:
            tick = time.monotonic()
            readings = source.read()
            read_ms.append((time.monotonic() - tick) * 1000)
            for reading in readings:
                first_ts = first_ts or reading.ts
                devices.setdefault(reading.uuid, DeviceSummary(reading)).add(reading)
            time.sleep(max(0.0, args.interval - (time.monotonic() - tick)))

    summary = {
        "driver_version": driver,
        "started": format_ts(first_ts) if first_ts else None,
        "seconds": round(time.monotonic() - started, 1),
        "reads": len(read_ms),
        "read_ms": _stats([round(ms, 2) for ms in read_ms]),
        "devices": len(devices),
        "device_summaries": [d.as_json() for d in devices.values()],
    }
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
