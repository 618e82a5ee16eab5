"""Utilisation samples from the node agents: tokens, validation, and storage with dedup.

The hot path (`validate_samples` then `ingest`) handles plain tuples, never model instances:
a batch is COPYed (binary) straight into `billing_sample`, under a savepoint; a batch that
meets a stored sample, or repeats one, takes the general way instead: a temporary table and
one `INSERT ... SELECT ... ON CONFLICT DO NOTHING`. Either way a device and instant
are stored once however often (and however concurrently) they are sent, and each sample's gap
to its device's next one is kept right (`refresh_gaps`), under the device's lock.

A sample names its device one way: by `uuid`, or by `driver` and `device` (or `pci_bus_id`),
resolved through the inventory. One giving both is rejected (`uuid: give uuid, or driver and
device, not both`) rather than one silently winning: they could name two devices, and which
one the sender meant cannot be told. Refusals name the device as the sender named it, never
the identity the inventory forms from a driver and device name.

A node's agent token sends for its node's devices only. A sample of a device the inventory
does not know yet is set aside with the node that sent it and its token, and adopted later
only where the token could have sent it had the device been known (`adopt_unknown_samples`):
naming a device of another node before the sync learns it plants nothing there. A MIG
device NVIDIA's driver made when a claim was prepared (dynamic MIG) has a UUID no
ResourceSlice carries: its sample, giving its parent GPU and placement (`mig_placement`), is
stored under the partition device published at that placement on the sending node when it
was taken (`metering.mig_samples`), at once or, the partition not synced yet, once adopted.
A MIG sample also gives its GPU instance id (`gpu_instance_id`, with `parent_uuid`): the
device each GPU instance's samples were stored under, and when, is recorded as spells
(`metering.mig_instances`), by which the Prometheus source matches DCGM's MIG series: from an
agent's batch, an operator's backfill and samples set aside once adopted alike (a sample set
aside keeps its GPU instance), under the node the inventory puts the device on. By the same
spells and the same rule, an agent's DCGM samples of MIG devices it could not tell, named
`<parent UUID>::gi<N>`, are stored under the device that GPU instance was at their instant,
set aside while no spell says, and moved where the spells change, so that what is stored does
not depend on the order DCGM's and NVML's batches come in (`placement.place_keyed`). A
token's are placed by its own cluster's spells only. Writers that take both lock the GPU
instances before the devices.

A mean's `covered_seconds` is stored as `covered_ms`, rounded to the millisecond from the
decimal the agent sent, so the rollup holds the mean for the time its readings covered; a
sample set aside keeps it, and its placement, so that it is adopted as it would have been
stored.

The package's modules, in the order a batch meets them: `tokens` (who sends), `schema` (the
payload declared with pydantic: a batch's samples checked in one call, the messages its
refusals give), `validation` (each sample checked into its stored form, `rows`), `named`
(devices named by driver and device, resolved against the inventory), `batch` (`ingest`: a
batch stored), `store` (COPY, the general way, samples set aside), `gaps` (each sample's gap to
its device's next), `placement` (MIG GPU instances and DCGM's samples named by them) and
`adoption` (samples set aside, stored once their device is known). What callers use is imported
here.
"""

from __future__ import annotations

from metering.ingest.adoption import adopt_unknown_samples
from metering.ingest.batch import ingest
from metering.ingest.gaps import fill_gaps, latest_per_hour, refresh_gaps, touched_hours
from metering.ingest.named import (
    NAMED,
    NODE_NAME,
    PCI_ATTRIBUTES,
    PCI_KEY,
    formed_meter_id,
    named_device,
    pci_address,
    resolve_named,
)
from metering.ingest.rows import IngestReport, InvalidSample, Refusal, Rejection, SampleRow
from metering.ingest.schema import json_type
from metering.ingest.store import inventory_nodes
from metering.ingest.tokens import authenticate, token_sha256
from metering.ingest.validation import Window, check_sample, sample_window, validate_samples

__all__ = [
    "NAMED",
    "NODE_NAME",
    "PCI_ATTRIBUTES",
    "PCI_KEY",
    "IngestReport",
    "InvalidSample",
    "Refusal",
    "Rejection",
    "SampleRow",
    "Window",
    "adopt_unknown_samples",
    "authenticate",
    "check_sample",
    "fill_gaps",
    "formed_meter_id",
    "ingest",
    "inventory_nodes",
    "json_type",
    "latest_per_hour",
    "named_device",
    "pci_address",
    "refresh_gaps",
    "resolve_named",
    "sample_window",
    "token_sha256",
    "touched_hours",
    "validate_samples",
]
