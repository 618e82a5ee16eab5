"""DCGM through Prometheus: the second source, for clusters that already run dcgm-exporter.

`PrometheusSource.read()` asks Prometheus' HTTP API (`/api/v1/query`) for what the exporter
scraped and returns the same `GpuReading`s as the NVML source, so one agent Deployment can
stand in for a DaemonSet. Standard library only: it runs inside the agent.

Metrics:

- utilisation: `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (ratio 0-1, shown as a percentage; the only
  one DCGM measures on MIG devices), else `DCGM_FI_DEV_GPU_UTIL` (already 0-100) for a
  device without the first (GPUs without profiling counters);
- memory: `DCGM_FI_DEV_FB_USED` (MiB).

Device identity. The exporter labels a whole GPU with its `UUID`. A MIG device carries the
`UUID` of its *parent* GPU plus `GPU_I_ID` (GPU instance id) and `GPU_I_PROFILE`; DCGM does
not know MIG UUIDs (NVIDIA/dcgm-exporter#171). So a MIG device is reported as
`uuid = "<parent UUID>::gi<GPU_I_ID>"`, with `parent_uuid`, `gpu_instance_id` and
`mig_profile` set. Nothing in the inventory knows that key (NVIDIA's DRA driver does not
publish the GPU instance id): the ingest stores such a sample under the MIG device that GPU
instance was at its instant, as the NVML agents' samples of that GPU say (their spells,
`metering.mig_instances`), and keeps it aside until they do. Without NVML agents on the
nodes, nothing says, and the samples are never billed. The node agent can name the series
itself (`TALLY_AGENT_SOURCE=exporter`, `TALLY_EXPORTER_PROFILE=dcgm`,
`TALLY_EXPORTER_WITH_NVML=true`): NVML reports each MIG device's UUID with its parent and
GPU instance id, and `agent.exporters.with_mig_instances` names the series by it.

The node a reading belongs to comes from the `Hostname` label (the exporter sets it to the
node name when run with `NODE_NAME`); `node_label` names another (e.g. a relabelled `node`).
Readings carry the query instant; DCGM gives no per-process data here, so `processes` is
empty.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from agent.readings import GpuReading

GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
MIB = 1024 * 1024


class PrometheusError(Exception):
    """Prometheus could not be reached or answered with an error."""


@dataclass(frozen=True, slots=True)
class _DeviceKey:
    uuid: str
    gpu_instance_id: int | None
    mig_profile: str | None
    node: str | None

    @property
    def reported_uuid(self) -> str:
        if self.gpu_instance_id is None:
            return self.uuid
        return f"{self.uuid}::gi{self.gpu_instance_id}"


def _now() -> datetime:
    return datetime.now(UTC)


class PrometheusSource:
    """Readings of every GPU the DCGM exporter reports to one Prometheus."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        node_label: str = "Hostname",
        ca_file: str | None = None,
        timeout_seconds: float = 10.0,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.node_label = node_label
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None

    def close(self) -> None:
        """Nothing held between reads; here for the `Source` protocol."""

    def read(self, at: datetime | None = None) -> list[GpuReading]:
        """Readings at `at` (default: now). Raises `PrometheusError` if a query fails."""
        ts = at or self._clock()
        engine_active = self._query(GR_ENGINE_ACTIVE, ts)
        gpu_util = self._query(GPU_UTIL, ts)
        fb_used = self._query(FB_USED, ts)

        utils: dict[_DeviceKey, tuple[float, str]] = {}
        for key, value in gpu_util.items():
            utils[key] = (_percent(value), "gpu_util")
        for key, value in engine_active.items():
            utils[key] = (_percent(value * 100.0), "gr_engine_active")

        readings = []
        for key in sorted(utils.keys() | fb_used.keys(), key=_sort_key):
            util, util_source = utils.get(key, (None, None))
            memory = fb_used.get(key)
            readings.append(
                GpuReading(
                    uuid=key.reported_uuid,
                    ts=ts,
                    gpu_util=util,
                    mem_used_bytes=round(memory * MIB) if memory is not None else None,
                    parent_uuid=key.uuid if key.gpu_instance_id is not None else None,
                    gpu_instance_id=key.gpu_instance_id,
                    mig_profile=key.mig_profile,
                    util_source=util_source,
                    node=key.node,
                )
            )
        return readings

    def _query(self, metric: str, at: datetime) -> dict[_DeviceKey, float]:
        """The instant vector of `metric`, one value per device.

        Several series for one device (two scrape jobs, pod labels added by the exporter)
        collapse to their maximum, which is what one device can have been doing.
        """
        params = urllib.parse.urlencode({"query": metric, "time": f"{at.timestamp():.3f}"})
        request = urllib.request.Request(f"{self.base_url}/api/v1/query?{params}")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(
                request, timeout=self.timeout_seconds, context=self._ssl
            ) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            raise PrometheusError(f"{metric}: HTTP {error.code}: {_error_text(error)}") from error
        except (OSError, ValueError) as error:
            raise PrometheusError(f"{metric}: {error}") from error
        if body.get("status") != "success":
            raise PrometheusError(f"{metric}: {body.get('errorType')}: {body.get('error')}")
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise PrometheusError(f"{metric}: expected a vector, got {data.get('resultType')}")

        values: dict[_DeviceKey, float] = {}
        for series in data.get("result", []):
            key = self._device_key(series.get("metric", {}))
            try:
                value = float(series["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            if key is None or value != value:  # no UUID, or NaN
                continue
            values[key] = max(value, values.get(key, value))
        return values

    def _device_key(self, labels: dict[str, str]) -> _DeviceKey | None:
        uuid = labels.get("UUID") or labels.get("uuid")
        if not uuid:
            return None
        instance = labels.get("GPU_I_ID", "")
        is_mig = instance.isdigit()  # whole GPUs have no GPU_I_ID, or an empty one
        return _DeviceKey(
            uuid=uuid,
            gpu_instance_id=int(instance) if is_mig else None,
            mig_profile=(labels.get("GPU_I_PROFILE") or None) if is_mig else None,
            node=labels.get(self.node_label) or None,
        )


def _percent(value: float) -> float:
    # Counters sampled over slightly different windows can overshoot; ingest refuses > 100.
    return round(min(100.0, max(0.0, value)), 2)


def _sort_key(key: _DeviceKey) -> tuple[str, str, int]:
    return (key.node or "", key.uuid, -1 if key.gpu_instance_id is None else key.gpu_instance_id)


def _error_text(error: urllib.error.HTTPError) -> str:
    try:
        body: Any = json.load(error)
        return f"{body.get('errorType')}: {body.get('error')}"
    except (OSError, ValueError, AttributeError):
        return error.reason if isinstance(error.reason, str) else str(error.reason)
