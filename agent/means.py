"""Means over a longer interval than the agent samples: read each second, send a minute's mean.

With `TALLY_AGENT_MEAN_SECONDS` set, the sampler's readings of each device are gathered per
window of that many seconds (on wall-clock multiples of it, like the sampling) and one sample
is sent per device and window: sixty times fewer rows for a minute of readings a second,
with nothing lost to the bill. The sample's `ts` is the window's first reading and
`covered_seconds` the time its readings cover (to the last reading plus one sampling
interval); the rollup holds a sample's utilisation until the device's next sample, so
back-to-back means each weigh exactly the time they cover, and a GPU busy half the minute is
half a minute utilised and half a minute idle, as from the readings one by one.

- `gpu_util`: the mean of the readings that measured it; null when none did (unmeasured time
  stays unmeasured, never idle).
- `mem_used_bytes`: the largest reading (what the window needed); `processes`: the last.

No Django, no database: the agent's standard-library-only rule holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from agent.readings import GpuReading


@dataclass(frozen=True)
class Mean:
    """One device's mean over one window: the sample to send, and the node it is of (None:
    the agent's own; a source that sees several nodes names it)."""

    node: str | None
    sample: dict[str, Any]


@dataclass
class _Window:
    """One device's readings in the window being gathered."""

    window: int  # the window's number: seconds since the epoch // mean seconds
    first: GpuReading
    last: GpuReading
    util_sum: float = 0.0
    util_count: int = 0
    mem_max: int | None = None
    readings: int = 0

    def add(self, reading: GpuReading) -> None:
        self.last = reading
        self.readings += 1
        if reading.gpu_util is not None:
            self.util_sum += reading.gpu_util
            self.util_count += 1
        if reading.mem_used_bytes is not None:
            self.mem_max = max(self.mem_max or 0, reading.mem_used_bytes)


@dataclass
class Averager:
    """Gathers readings into per-device means over windows of `seconds` (a multiple of the
    sampling `interval`). `add` returns the samples of the windows that closed; `flush` those
    still open (at shutdown)."""

    seconds: float
    interval: float
    _open: dict[tuple[Any, ...], _Window] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.seconds > 0 or not self.interval > 0:
            raise ValueError("the mean's window and the sampling interval must be positive")
        steps = self.seconds / self.interval
        if abs(steps - round(steps)) > 1e-9 or round(steps) < 1:
            raise ValueError(
                f"a mean over {self.seconds:g} s is not a whole number of {self.interval:g} s "
                "sampling intervals"
            )

    def add(self, readings: list[GpuReading]) -> list[Mean]:
        """Take one round of readings; the samples of windows they close, oldest first."""
        closed: list[Mean] = []
        for reading in readings:
            key = _device_key(reading)
            window = math.floor(reading.ts.timestamp() / self.seconds + 1e-9)
            gathering = self._open.get(key)
            if gathering is not None and gathering.window != window:
                closed.append(self._sample(gathering))
                gathering = None
            if gathering is None:
                gathering = self._open[key] = _Window(window, reading, reading)
            gathering.add(reading)
        return closed

    def flush(self) -> list[Mean]:
        """The samples of every window still open; none is left open."""
        samples = [self._sample(gathering) for gathering in self._open.values()]
        self._open.clear()
        return samples

    def _sample(self, gathering: _Window) -> Mean:
        window_end = (gathering.window + 1) * self.seconds
        reach = min(gathering.last.ts.timestamp() + self.interval, window_end)
        covered = round(reach - gathering.first.ts.timestamp(), 3)
        util = round(gathering.util_sum / gathering.util_count, 3) if gathering.util_count else None
        mean = replace(
            gathering.last,
            ts=gathering.first.ts,
            gpu_util=util,
            mem_used_bytes=gathering.mem_max,
        )
        return Mean(node=mean.node, sample={**mean.as_sample(), "covered_seconds": covered})


def _device_key(reading: GpuReading) -> tuple[Any, ...]:
    """One device, however the source names it (a MIG device by its UUID, AMD's by its
    driver and PCI address), on one node."""
    return (
        reading.node,
        reading.uuid,
        reading.driver,
        reading.device,
        reading.pci_bus_id,
        reading.partition,
    )
