"""What a batch of samples is made of and what ingest answers: a sample's stored form
(`SampleRow`), a sample left out (`Rejection`, `InvalidSample`) or not stored (`Refusal`),
what one batch stored (`IngestReport`), and the bounds and columns every part shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple, TypedDict

from metering.mig_samples import GpuInstance, MigPlacement

MAX_UUID_LENGTH = 128
MAX_BIGINT = 2**63 - 1
# A GPU has 8 memory slices (A100 to B200); the bound leaves room, and keeps a placement small.
MAX_MEMORY_SLICES = 64
MAX_PROFILE_LENGTH = 64
MAX_PROFILE_ID = 4095
MAX_GPU_INSTANCE_ID = 4095
ADOPT_CHUNK = 10_000
# Per session, emptied at every commit (a truncate: temporary tables are never vacuumed).
BATCH_TABLE = "tally_ingest_batch"
# A sample set aside is one per device, instant, the node that sent it and its cluster (a
# token's: its token's): what a token sends under the identity of a device elsewhere (never
# adopted), or another cluster's, cannot stand in for what that device's own agent sends at
# the same instant.
UNIQUE_SET_ASIDE = "device_uuid, ts_ms, node, cluster_id"
# Columns of `billing_sample` and `billing_unknowndevicesample` alike, in this order.
COLUMNS = "device_uuid, ts_ms, gpu_util, mem_used_bytes, processes, node, received_at"
# The columns of `billing_sample` a `SampleRow` fills, in its order.
ROW_COLUMNS = "device_uuid, ts_ms, gpu_util, mem_used_bytes, processes, covered_ms"


class SampleRow(NamedTuple):
    """One valid sample, as stored: `processes` is JSON text (or None), `covered_ms` a mean's
    covered time in whole milliseconds (None: a single reading). `placement`, which a MIG
    device's sample may give, finds the partition device a MIG UUID the inventory does not
    know was made for (`metering.mig_samples`); it is kept only with a sample set aside.
    `instance`, its GPU instance, is recorded for the device the sample is stored under
    (`MigInstance`)."""

    device_uuid: str
    ts_ms: int
    gpu_util: float | None
    mem_used_bytes: int | None
    processes: str | None
    covered_ms: int | None = None
    placement: MigPlacement | None = None
    instance: GpuInstance | None = None


class Rejection(TypedDict):
    """A sample left out of a batch: its position, why (naming the field), and `label`, why in
    one word of `core.metrics.INGEST_REJECT_REASONS` (for the metric; not sent back)."""

    index: int
    reason: str
    label: str


class Refusal(NamedTuple):
    """A valid sample `ingest` did not store: its position among those given, why, and the
    field the reason is about (`uuid`, or `device` for a sample naming driver and device)."""

    position: int
    label: str
    reason: str
    field: str = "uuid"


@dataclass
class IngestReport:
    """What one `ingest` stored.

    `accepted` counts samples newly stored (known devices and ones set aside alike);
    `duplicates` the ones already stored or sent twice; `refused` the ones not stored (a device
    on another node than the agent token's, an unknown device past the token's limits):
    accepted + duplicates + refused = samples given.
    """

    accepted: int = 0
    duplicates: int = 0
    refused: list[Refusal] = field(default_factory=list)
    unknown_devices: list[str] = field(default_factory=list)
    hours: set[datetime] = field(default_factory=set)
    # Devices named by driver and device that the inventory does not know: the identity
    # their samples are kept aside under -> what was named, and where it was looked for.
    unknown_named: dict[str, str] = field(default_factory=dict)


class InvalidSample(ValueError):
    """One sample is not acceptable; `str()` names the field, e.g. `gpu_util: 140 is not ...`.

    `label` is why in one word (the metric's): the field, `sample` for none, or as given.
    """

    def __init__(self, field_name: str, message: str, *, label: str = "") -> None:
        super().__init__(f"{field_name}: {message}" if field_name else message)
        self.field_name = field_name
        # A field within a field (`mig_placement.start`) counts under the outer one.
        self.label = label or field_name.split(".", 1)[0] or "sample"
