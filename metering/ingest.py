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
not depend on the order DCGM's and NVML's batches come in (`_place`). A token's are placed by
its own cluster's spells only. Writers that take both lock the GPU instances before the
devices.

A mean's `covered_seconds` is stored as `covered_ms`, rounded to the millisecond from the
decimal the agent sent, so the rollup holds the mean for the time its readings covered; a
sample set aside keeps it, and its placement, so that it is adopted as it would have been
stored.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from operator import itemgetter
from typing import Any, NamedTuple, TypedDict

from django.conf import settings
from django.db import connection, models, transaction
from django.db.backends.utils import CursorWrapper
from django.db.models import Exists, OuterRef, Q
from django.db.models.fields.json import KT
from django.utils import timezone
from psycopg.errors import UniqueViolation

from db.copy import copy_rows, json_rows
from db.locks import advisory_xact_lock, text_key
from inventory import profiles
from inventory.models import Device, DeviceKind
from metering.dirty import mark_dirty
from metering.hours import MS_PER_HOUR, epoch_ms, hour_at, sample_hold_ms
from metering.mig_instances import (
    InstanceKey,
    Point,
    Respelled,
    covering,
    covering_any,
    lock_instances,
    record_instances,
    spells_covering,
    spells_of_any_cluster,
)
from metering.mig_samples import GpuInstance, MigPlacement, partitions_at
from metering.models import AgentToken, DcgmInstance, MigInstance, Sample, UnknownDeviceSample

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
# A NUL escaped in JSON text (an odd run of backslashes before u0000): jsonb refuses it.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


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


# Tokens


def token_sha256(token: str) -> str:
    """How an agent token is stored and looked up: its SHA-256, never the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def authenticate(token: str) -> AgentToken | None:
    """The unrevoked token `token` is, or None.

    The lookup is by the token's SHA-256, so how long it takes says nothing about the token.
    """
    if not token:
        return None
    return (
        AgentToken.objects.select_related("cluster")
        .filter(token_sha256=token_sha256(token), revoked_at__isnull=True)
        .first()
    )


# Validation


JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def json_type(value: object) -> str:
    """What a decoded JSON value is, in JSON's words (an array, null), for messages."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    """A value for an error message, cut short: the message goes back to the sender."""
    # Scalars as written (true, null, 3, "x"); an object or array by its kind only.
    text = (
        json.dumps(value)
        if value is None or isinstance(value, str | int | float)
        else (json_type(value))
    )
    return text if len(text) <= 64 else text[:61] + "..."


class Window(NamedTuple):
    """The sample times accepted, in ms since the epoch, both ends included."""

    earliest_ms: int
    latest_ms: int


def sample_window(now: datetime | None = None) -> Window:
    """The sample times accepted at `now`: back TALLY_INGEST_MAX_AGE_DAYS (late data for an
    open period, or for a closed one as an adjustment), and TALLY_INGEST_MAX_SKEW_SECONDS
    ahead (an agent's clock running fast). A year-1 or year-2999 time is a broken clock, and
    would make hours to roll up, or periods, that were never billed."""
    now_ms = epoch_ms(now or timezone.now())
    return Window(
        now_ms - int(settings.TALLY_INGEST_MAX_AGE_DAYS) * 86_400_000,
        now_ms + int(settings.TALLY_INGEST_MAX_SKEW_SECONDS) * 1000,
    )


def check_sample(sample: object, *, window: Window) -> SampleRow:
    """The stored form of one sample, or `InvalidSample` naming the first bad field.

    Unknown keys are ignored. Every value that reaches the database is checked here, so a
    stored batch never fails on a value (NUL characters, lone surrogates, numbers too large).
    """
    return SampleChecker(window=window).check(sample)


class SampleChecker:
    """`check_sample` for the samples of one batch, which repeat a few device UUIDs and
    instants thousands of times: each distinct UUID and timestamp text is checked once."""

    def __init__(self, *, window: Window) -> None:
        self.window = window
        self._valid_uuids: set[str] = set()
        self._instants: dict[str, int] = {}  # timestamp text -> ms, valid ones only
        self._named_keys: dict[tuple[Any, ...], str] = {}  # identity fields -> key, valid ones
        self._covered_ms: dict[float, int] = {}  # a float covered_seconds -> ms, valid ones
        # (parent_uuid, gpu_instance_id and its type) -> the GPU instance, valid ones
        self._instances: dict[tuple[Any, Any, type], GpuInstance] = {}
        # A DCGM sample's `<parent UUID>::gi<N>` as sent -> (its key as stored, its GPU instance)
        self._keyed: dict[str, tuple[str, GpuInstance]] = {}

    def _named(self, sample: dict[str, Any]) -> str:
        """`_named_key(sample)`, worked out once per distinct identity of the batch."""
        partition = sample.get("partition")
        fields = (
            sample.get("driver"),
            sample.get("device"),
            sample.get("pool"),
            sample.get("node"),
            sample.get("pci_bus_id"),
            partition,
            type(partition),  # 1 and true are equal, and only one is a partition
            "device" in sample,
        )
        try:
            return self._named_keys[fields]
        except KeyError:
            key = self._named_keys[fields] = _named_key(sample)
            return key
        except TypeError:  # an unhashable value (an array): not valid anyway
            return _named_key(sample)

    def check(self, sample: object) -> SampleRow:
        """As `check_sample`."""
        if type(sample) is not dict:
            raise InvalidSample("", f"must be an object, not {_show(sample)}")
        uuid = sample.get("uuid")
        if not (isinstance(uuid, str) and uuid in self._valid_uuids) or (
            "driver" in sample or "device" in sample
        ):
            if uuid is None and ("driver" in sample or "device" in sample):
                uuid = self._named(sample)
            elif sample.get("driver") is not None or sample.get("device") is not None:
                raise InvalidSample(
                    "uuid",
                    "give uuid, or driver and device, not both: they could name two devices",
                )
            else:
                uuid = _checked_uuid(uuid)
                keyed = _keyed_instance(uuid)
                if keyed is not None:
                    self._keyed[uuid] = (instance_key(keyed), keyed)
                self._valid_uuids.add(uuid)
        keyed_as = self._keyed.get(uuid) if self._keyed else None
        ts = sample.get("ts")
        if type(ts) is not str:
            raise InvalidSample("ts", "must be an ISO 8601 string with a timezone")
        ts_ms = self._instants.get(ts)
        if ts_ms is None:
            ts_ms = self._instants[ts] = _checked_ms(ts, window=self.window)
        gpu_util = sample.get("gpu_util")
        if gpu_util is not None:
            if type(gpu_util) is not float and type(gpu_util) is not int:
                raise InvalidSample("gpu_util", f"must be a number or null, not {_show(gpu_util)}")
            if not 0 <= gpu_util <= 100:  # also false for NaN
                raise InvalidSample("gpu_util", f"{_show(gpu_util)} is not between 0 and 100")
            gpu_util = float(gpu_util)
        mem_used_bytes = sample.get("mem_used_bytes")
        if mem_used_bytes is not None and (
            type(mem_used_bytes) is not int or not 0 <= mem_used_bytes <= MAX_BIGINT
        ):
            raise InvalidSample(
                "mem_used_bytes",
                f"must be an integer from 0 to 2^63-1, not {_show(mem_used_bytes)}",
            )
        processes = sample.get("processes")
        processes_json = None
        if processes is not None:
            if type(processes) is not list or not _DICTS_ONLY.issuperset(map(type, processes)):
                raise InvalidSample("processes", "must be a list of objects")
            processes_json = _processes_json(processes)
        covered = sample.get("covered_seconds")
        covered_ms = None
        if covered is not None:
            if type(covered) is float:
                covered_ms = self._covered_ms.get(covered)
                if covered_ms is None:
                    covered_ms = self._covered_ms[covered] = _covered_ms(covered)
            else:
                covered_ms = _covered_ms(covered)
        placement = sample.get("mig_placement")
        if placement is not None:
            if uuid[:1] == NAMED:
                raise InvalidSample(
                    "mig_placement", "goes with a MIG device's uuid, not with driver and device"
                )
            if keyed_as is not None:
                raise InvalidSample(
                    "mig_placement",
                    "goes with a MIG device's own uuid, not with a <parent UUID>::gi<N> one",
                )
            placement = _checked_placement(sample, placement)
        instance = sample.get("gpu_instance_id")
        if keyed_as is not None:
            uuid, instance = keyed_as
            _check_agrees(sample, instance)
        elif instance is not None:
            if uuid[:1] == NAMED:
                raise InvalidSample(
                    "gpu_instance_id", "goes with a MIG device's uuid, not with driver and device"
                )
            key = (sample.get("parent_uuid"), instance, type(instance))
            try:
                instance = self._instances[key]
            except KeyError:
                instance = self._instances[key] = _checked_instance(sample, instance)
            except TypeError:  # an unhashable value (an object): not valid anyway
                instance = _checked_instance(sample, instance)
        return SampleRow(
            uuid, ts_ms, gpu_util, mem_used_bytes, processes_json, covered_ms, placement, instance
        )


_DICTS_ONLY = frozenset([dict])
_MS = Decimal(1)


def _covered_ms(covered: object) -> int:
    """A mean's `covered_seconds` in whole milliseconds: the sample is the mean of readings
    over `[ts, ts + covered_seconds)` (an agent sampling each second sends minute means).

    Rounded half up from the decimal the agent sent (a float's shortest text reads back as
    that decimal), so 4.0005 is 4,001 ms, never 4,000 through binary error. The rollup holds
    a sample's utilisation until the device's next sample, at most TALLY_SAMPLE_HOLD_SECONDS,
    so back-to-back means each weigh their whole interval; a longer one would count in part
    only, and is refused rather than undercounted; one under half a millisecond would hold
    for none, and is refused too."""
    if type(covered) is not int and type(covered) is not float:
        raise InvalidSample("covered_seconds", f"must be a number of seconds, not {_show(covered)}")
    hold = int(settings.TALLY_SAMPLE_HOLD_SECONDS)
    if not 0 < covered <= hold:  # also false for NaN
        raise InvalidSample(
            "covered_seconds",
            f"must be more than 0 and at most {hold} (TALLY_SAMPLE_HOLD_SECONDS, how long a "
            f"sample holds), not {_show(covered)}: send means over a shorter interval",
        )
    if type(covered) is int:
        return covered * 1000
    covered_ms = int(Decimal(repr(covered)).scaleb(3).quantize(_MS, ROUND_HALF_UP))
    if not covered_ms:
        raise InvalidSample(
            "covered_seconds",
            f"{_show(covered)} is under half a millisecond, which is what it is stored in",
        )
    return covered_ms


def _checked_uuid(uuid: object, field_name: str = "uuid") -> str:
    if type(uuid) is not str or not uuid:
        or_named = " (or give driver and device)" if field_name == "uuid" else ""
        raise InvalidSample(field_name, f"must be a non-empty string{or_named}")
    if len(uuid) > MAX_UUID_LENGTH or not (uuid.isascii() and uuid.isprintable()):
        raise InvalidSample(
            field_name,
            f"{_show(uuid)} is not printable ASCII of at most {MAX_UUID_LENGTH} characters",
        )
    return uuid


def _checked_placement(sample: dict[str, Any], placement: object) -> MigPlacement:
    """Where a MIG device sits, as its sample gives it: `mig_placement` (`start` and `size`,
    in memory slices) with `parent_uuid`, and optionally `mig_profile` and `mig_profile_id`
    (its GPU instance profile id), as NVML reads them (`agent.nvml`)."""
    if type(placement) is not dict:
        raise InvalidSample(
            "mig_placement",
            f'must be an object {{"start": ..., "size": ...}}, not {_show(placement)}',
        )
    start, size = placement.get("start"), placement.get("size")
    if (
        type(start) is not int
        or type(size) is not int
        or not 0 <= start < start + size <= MAX_MEMORY_SLICES
    ):
        raise InvalidSample(
            "mig_placement",
            f"start and size must be integers, start from 0 and size from 1, start + size at "
            f"most {MAX_MEMORY_SLICES} (memory slices), not {_show(start)} and {_show(size)}",
        )
    parent = sample.get("parent_uuid")
    if parent is None:
        raise InvalidSample("parent_uuid", "is needed with mig_placement: the MIG device's GPU")
    profile = sample.get("mig_profile")
    if profile is None:
        profile = ""
    elif (
        type(profile) is not str
        or not profile
        or len(profile) > MAX_PROFILE_LENGTH
        or not (profile.isascii() and profile.isprintable())
    ):
        raise InvalidSample(
            "mig_profile",
            f"must be printable ASCII of 1 to {MAX_PROFILE_LENGTH} characters, like 1g.10gb, "
            f"not {_show(profile)}",
        )
    profile_id = sample.get("mig_profile_id")
    if profile_id is not None and (
        type(profile_id) is not int or not 0 <= profile_id <= MAX_PROFILE_ID
    ):
        raise InvalidSample(
            "mig_profile_id",
            f"must be an integer from 0 to {MAX_PROFILE_ID}, not {_show(profile_id)}",
        )
    return MigPlacement(_checked_uuid(parent, "parent_uuid"), start, size, profile, profile_id)


# How the DCGM source names a MIG device it cannot tell (`agent.dcgm`): its GPU's UUID and its
# GPU instance id.
_KEYED = re.compile(r"(?P<parent>.+)::gi(?P<instance>[0-9]+)")


def instance_key(instance: GpuInstance) -> str:
    """The `<parent UUID>::gi<N>` a DCGM sample of a GPU instance is sent, and set aside,
    under."""
    return f"{instance.parent_uuid}::gi{instance.gpu_instance_id}"


def _keyed_instance(uuid: str) -> GpuInstance | None:
    """The GPU instance a DCGM sample's uuid `<parent UUID>::gi<N>` names (None: a device's
    own uuid), or `InvalidSample` for an id out of range."""
    match = _KEYED.fullmatch(uuid)
    if match is None:
        return None
    instance_id = int(match["instance"])
    if instance_id > MAX_GPU_INSTANCE_ID:
        raise InvalidSample(
            "uuid",
            f"{_show(uuid)} names GPU instance {instance_id}; a GPU instance id is at most "
            f"{MAX_GPU_INSTANCE_ID}",
        )
    return GpuInstance(match["parent"], instance_id)


def _check_agrees(sample: dict[str, Any], instance: GpuInstance) -> None:
    """A DCGM sample named `<parent UUID>::gi<N>` may also give `parent_uuid` and
    `gpu_instance_id` (the agent does): they must be the ones its uuid names."""
    parent, instance_id = sample.get("parent_uuid"), sample.get("gpu_instance_id")
    if parent is not None and parent != instance.parent_uuid:
        raise InvalidSample(
            "parent_uuid",
            f"{_show(parent)} is not the GPU its uuid names ({instance.parent_uuid})",
        )
    if instance_id is not None and (
        type(instance_id) is not int or instance_id != instance.gpu_instance_id
    ):
        raise InvalidSample(
            "gpu_instance_id",
            f"{_show(instance_id)} is not the GPU instance its uuid names "
            f"({instance.gpu_instance_id})",
        )


def _checked_instance(sample: dict[str, Any], instance_id: object) -> GpuInstance:
    """A MIG device's GPU instance, as its sample gives it: `gpu_instance_id` with
    `parent_uuid` (`agent.nvml`)."""
    if type(instance_id) is not int or not 0 <= instance_id <= MAX_GPU_INSTANCE_ID:
        raise InvalidSample(
            "gpu_instance_id",
            f"must be an integer from 0 to {MAX_GPU_INSTANCE_ID}, not {_show(instance_id)}",
        )
    parent = sample.get("parent_uuid")
    if parent is None:
        raise InvalidSample("parent_uuid", "is needed with gpu_instance_id: the MIG device's GPU")
    return GpuInstance(_checked_uuid(parent, "parent_uuid"), instance_id)


# A sample that names its device by driver and device name (and node, optionally pool) is
# carried through validation under a key no UUID can be (UUIDs are printable), then resolved
# by `ingest` against the inventory, once per batch.
NAMED = "\x00"
# A Kubernetes node name: a DNS subdomain (RFC 1123), at most 253 characters.
NODE_NAME = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
MAX_NAME_LENGTH = 253
# A device named by its PCI address (the standard `resource.kubernetes.io/pciBusID`
# attribute) rather than its name: the key's device part is PCI_KEY-separated.
PCI_KEY = "\x01"
PCI_BUS_ID = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
PCI_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
# Where a device's PCI address is read from, in order: the standard attribute, else AMD's own
# `pciAddr` (auto-partition and vfio devices that publish only it), as the inventory's AMD
# profile reads a GPU's address (`inventory.profiles`, physical_unit_attributes).
PCI_ATTRIBUTES = (PCI_ATTRIBUTE, "pciAddr", "gpu.amd.com/pciAddr")


# A device named by its PCI address, with hyphens (`0000-0f-00-0`, optionally followed by
# `-<PCI device id>`): how Intel's Gaudi DRA driver names its cards, which publish no PCI
# attribute. PostgreSQL's regex for the query; the same in Python for the value.
PCI_NAME_SQL = r"^[0-9a-fA-F]{4}-[0-9a-fA-F]{2}-[0-9a-fA-F]{2}-[0-7](-|$)"
PCI_NAME = re.compile(r"([0-9a-fA-F]{4})-([0-9a-fA-F]{2})-([0-9a-fA-F]{2})-([0-7])(?:-.*)?")


def pci_address(attributes: dict[str, Any], name: str = "") -> str | None:
    """The PCI address a stored device's attributes publish, else (given its `name`) the one
    its name spells (Gaudi cards), lower-case; None without one."""
    for attribute in PCI_ATTRIBUTES:
        value = attributes.get(attribute)
        address = value.get("string") if isinstance(value, dict) else None
        if isinstance(address, str) and address:
            return address.lower()
    match = PCI_NAME.fullmatch(name)
    if match:
        domain, bus, slot, function = match.groups()
        return f"{domain}:{bus}:{slot}.{function}".lower()
    return None


class NamedDevice(NamedTuple):
    """A device named as its driver publishes it: `node` "" means the batch's node, `pool`
    "" any pool of the driver on that node."""

    node: str
    driver: str
    pool: str
    device: str  # the device's name, or PCI_KEY, its PCI address, PCI_KEY, its partition

    @property
    def pci(self) -> tuple[str, int | None] | None:
        """(PCI address, partition index or None) of a device named by its PCI address."""
        if not self.device.startswith(PCI_KEY):
            return None
        bus_id, _, partition = self.device[1:].partition(PCI_KEY)
        return bus_id, int(partition) if partition else None

    @property
    def label(self) -> str:
        where = f"node {self.node!r}" if self.node else "this node"
        return f"{self.sent} on {where}"

    @property
    def sent(self) -> str:
        """The device as the sample named it (driver, device or PCI address, pool), for
        messages: never the identity the inventory forms from them, which means nothing to
        the sender."""
        pool = f" (pool {self.pool!r})" if self.pool else ""
        pci = self.pci
        if pci is None:
            return f"{self.driver} device {self.device!r}{pool}"
        part = f" partition {pci[1]}" if pci[1] is not None else ""
        return f"{self.driver} device at PCI {pci[0]}{part}{pool}"


def _named_key(sample: dict[str, Any]) -> str:
    """The key a sample naming its device by `driver` and `device` travels under."""
    driver = _checked_name(sample, "driver")
    if "device" in sample or "pci_bus_id" not in sample:
        device = _checked_name(sample, "device")
    else:
        bus_id = sample["pci_bus_id"]
        if type(bus_id) is not str or not PCI_BUS_ID.fullmatch(bus_id):
            raise InvalidSample(
                "pci_bus_id", f"{_show(bus_id)} is not a PCI address like 0000:19:00.0"
            )
        partition = sample.get("partition")
        if partition is not None and (type(partition) is not int or not 0 <= partition < 4096):
            raise InvalidSample(
                "partition", f"must be an integer from 0 to 4095, not {_show(partition)}"
            )
        device = f"{PCI_KEY}{bus_id.lower()}{PCI_KEY}{'' if partition is None else partition}"
    pool = sample.get("pool")
    pool = "" if pool is None else _checked_name(sample, "pool")
    node = sample.get("node")
    if node is None:
        node = ""
    elif type(node) is not str or not NODE_NAME.fullmatch(node):
        raise InvalidSample(
            "node", f"{_show(node)} is not a Kubernetes node name (a DNS subdomain, <= 253)"
        )
    return NAMED + NAMED.join((node, driver, pool, device))


def _checked_name(sample: dict[str, Any], name: str) -> str:
    value = sample.get(name)
    if type(value) is not str or not value:
        raise InvalidSample(
            name, f"must be a non-empty string as the ResourceSlice gives it, not {_show(value)}"
        )
    if len(value) > MAX_NAME_LENGTH or not (value.isascii() and value.isprintable()):
        raise InvalidSample(
            name, f"{_show(value)} is not printable ASCII of at most {MAX_NAME_LENGTH} characters"
        )
    return value


def named_device(key: str) -> NamedDevice | None:
    """The device a validated sample's key names by driver and device; None for a UUID."""
    if not key.startswith(NAMED):
        return None
    return NamedDevice(*key[1:].split(NAMED))


def _checked_ms(ts: str, *, window: Window) -> int:
    """Milliseconds since the epoch of an ISO 8601 text with a timezone, sub-ms digits cut,
    within `window`."""
    try:
        at = datetime.fromisoformat(ts)
    except ValueError:
        raise InvalidSample("ts", f"{_show(ts)} is not an ISO 8601 timestamp") from None
    if at.utcoffset() is None:
        raise InvalidSample("ts", f"{_show(ts)} has no timezone")
    ts_ms = epoch_ms(at)
    if ts_ms > window.latest_ms:
        ahead = _duration(int(settings.TALLY_INGEST_MAX_SKEW_SECONDS))
        raise InvalidSample(
            "ts",
            f"{_show(ts)} is more than {ahead} in the future (TALLY_INGEST_MAX_SKEW_SECONDS); "
            "is the sender's clock right?",
            label="ts_window",
        )
    if ts_ms < window.earliest_ms:
        raise InvalidSample(
            "ts",
            f"{_show(ts)} is more than {_days(int(settings.TALLY_INGEST_MAX_AGE_DAYS))} old "
            "(TALLY_INGEST_MAX_AGE_DAYS)",
            label="ts_window",
        )
    return ts_ms


def _duration(seconds: int) -> str:
    if seconds % 60 or not seconds:
        return f"{seconds} second{'' if seconds == 1 else 's'}"
    return f"{seconds // 60} minute{'' if seconds == 60 else 's'}"


def _days(days: int) -> str:
    return f"{days} day{'' if days == 1 else 's'}"


_PROCESSES_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), check_circular=False
)
# `JSONEncoder.encode` makes a new C encoder at every call; made once, encoding a sample's
# process list costs a third less. (A structure that contains itself, which JSON input never
# does, ends in RecursionError instead of the circular reference check.)
_encode_processes: Callable[[list[Any]], str] = _PROCESSES_ENCODER.encode
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)  # CPython's, from _json
if _c_make_encoder is not None:
    _c_encoder = _c_make_encoder(
        None,  # no circular reference check
        _PROCESSES_ENCODER.default,
        json.encoder.encode_basestring,  # ensure_ascii=False
        None,  # no indent
        ":",
        ",",
        False,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )

    def _encode_processes(processes: list[Any]) -> str:
        return "".join(_c_encoder(processes, 0))


def _processes_json(processes: list[Any]) -> str:
    try:
        text = _encode_processes(processes)
        if not text.isascii():
            text.encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError: a lone surrogate
        raise InvalidSample(
            "processes", "holds a value JSON cannot carry (NaN, Infinity, a lone surrogate)"
        ) from None
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        raise InvalidSample("processes", "holds a NUL character")
    return text


def validate_samples(
    raw: Sequence[object], *, now: datetime | None = None
) -> tuple[list[SampleRow], list[Rejection]]:
    """Split `raw` into the samples to store and the rejected ones (`samples[i].field: why`).

    A bad sample never rejects the batch. `now` (default: the current time) is what the
    timestamps' window (`sample_window`) is counted from.
    """
    check = SampleChecker(window=sample_window(now)).check
    valid: list[SampleRow] = []
    rejected: list[Rejection] = []
    for index, sample in enumerate(raw):
        try:
            valid.append(check(sample))
        except InvalidSample as exc:
            where = f"samples[{index}]"
            reason = f"{where}.{exc}" if exc.field_name else f"{where}: {exc}"
            rejected.append({"index": index, "reason": reason, "label": exc.label})
    return valid, rejected


# Storage


def touched_hours(timestamps_ms: Sequence[int]) -> set[datetime]:
    """The UTC hour starts that samples at these instants count in.

    A sample holds forward only, over `[ts, ts + TALLY_SAMPLE_HOLD_SECONDS)`: its own hour,
    and the next one too when it reaches past the hour's end.
    """
    last_ms = max(sample_hold_ms(), 1) - 1
    hours: set[int] = set()
    for ts_ms in timestamps_ms:
        hours.update(range(ts_ms // MS_PER_HOUR, (ts_ms + last_ms) // MS_PER_HOUR + 1))
    return {hour_at(hour) for hour in hours}


def latest_per_hour(timestamps_ms: Iterable[int]) -> list[int]:
    """The latest of `timestamps_ms` in each UTC hour: their `touched_hours` are those of all
    of them (every instant of an hour starts in it, and the latest reaches furthest)."""
    ordered = sorted(timestamps_ms)
    # A dict keeps the last value given for a key: in ascending order, each hour's latest.
    return list(
        dict(zip([ts_ms // MS_PER_HOUR for ts_ms in ordered], ordered, strict=True)).values()
    )


def _table(model: type[models.Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def _insert_new(
    cursor: CursorWrapper,
    target: type[models.Model],
    *,
    select: str,
    source: str,
    where: str,
    params: Sequence[Any],
    first: str,
    columns: str = COLUMNS,
) -> tuple[int, list[int]]:
    """`INSERT INTO target SELECT ...` skipping rows already stored; of rows of the same
    device and instant in `source`, the one that sorts first by `first` is kept (for samples
    set aside: of the same device, instant, sending node and cluster, `UNIQUE_SET_ASIDE`);
    a DCGM sample the spells placed gives way to the device's own (`_own_sample_wins`).

    Returns how many rows were inserted, and instants whose `touched_hours` are those of all
    inserted rows: the latest per hour, so a large batch sends back a row per hour, not per
    row.
    """
    if target is UnknownDeviceSample:
        distinct, conflict = "", f"ON CONFLICT ({UNIQUE_SET_ASIDE}) DO NOTHING"
    else:
        # One per device and instant: an update may not meet a row the statement wrote.
        distinct, conflict = "DISTINCT ON (device_uuid, ts_ms) ", _own_sample_wins(columns)
    # Key order: two writers of overlapping batches then wait on each other, never deadlock.
    cursor.execute(
        f"WITH inserted AS (INSERT INTO {_table(target)} AS s ({columns}) "
        f"SELECT {distinct}{select} "
        f"FROM {source} WHERE {where} ORDER BY device_uuid, ts_ms, {first} "
        f"{conflict} RETURNING ts_ms) "
        f"SELECT count(*), max(ts_ms) FROM inserted GROUP BY floor(ts_ms / {MS_PER_HOUR}.0)",
        params,
    )
    per_hour = cursor.fetchall()
    return sum(count for count, _ in per_hour), [latest for _, latest in per_hour]


def _own_sample_wins(columns: str) -> str:
    """The conflict clause of a device's own samples stored in `billing_sample` (`columns`):
    one already there at the instant is kept, but for a DCGM sample the spells placed there
    (`placed_gpu_instance`), which gives way, so the device's own sample holds the instant
    whichever came first (the spells are made of own samples only). The DCGM reading's
    utilisation and memory stay where the own sample has none (NVML measures no utilisation
    on a MIG device), as `_PLACE_SQL` merges them arriving second: the same row either way."""
    sets = []
    for column in columns.split(", "):
        if column in ("gpu_util", "mem_used_bytes"):
            sets.append(f"{column} = COALESCE(excluded.{column}, s.{column})")
        elif column == "covered_ms":
            # A mean's covered time goes with the utilisation kept.
            sets.append(
                "covered_ms = CASE WHEN excluded.gpu_util IS NULL THEN s.covered_ms "
                "ELSE excluded.covered_ms END"
            )
        elif column not in ("device_uuid", "ts_ms"):
            sets.append(f"{column} = excluded.{column}")
    sets.append("placed_gpu_instance = NULL")
    return (
        f"ON CONFLICT (device_uuid, ts_ms) DO UPDATE SET {', '.join(sets)} "
        "WHERE s.placed_gpu_instance IS NOT NULL"
    )


# The column types of `ROW_COLUMNS`, for a binary COPY (`processes` is the JSON text
# `check_sample` made).
_ROW_TYPES = ("text", "int8", "float8", "int8", "jsonb", "int8")
_STORED = len(_ROW_TYPES)  # the fields of a `SampleRow` that are stored


_KEY = itemgetter(0, 1)  # device_uuid, ts_ms


def _store(
    cursor: CursorWrapper,
    target: type[models.Model],
    rows: Sequence[SampleRow],
    *,
    node: str,
    received_at: datetime,
    gaps: Sequence[int | None] | None = None,
    agent: AgentToken | None = None,
) -> tuple[int, list[int]]:
    """Store `rows` in `target` unless already there, the general way: into a temporary
    table, then `INSERT ... SELECT ... ON CONFLICT DO NOTHING`. As `_insert_new`, the first of
    rows of the same device and instant is kept. `gaps` (one per row) go to `gap_ms`, `agent`
    (samples set aside) to `agent_token`; a sample set aside keeps its placement
    (`mig_placement`), by which it may be adopted, and its GPU instance (`gpu_instance`).
    """
    if not rows:
        return 0, []
    columns = f"{COLUMNS}, covered_ms"
    select = "device_uuid, ts_ms, gpu_util, mem_used_bytes, processes, %s, %s, covered_ms"
    params: list[Any] = [node, received_at]
    if agent is not None:
        # Set aside, a token's sample is of its cluster (`UNIQUE_SET_ASIDE`).
        cluster = ", cluster_id" if target is UnknownDeviceSample else ""
        columns = f"{columns}, agent_token_id{cluster}"
        select = f"{select}, %s{', %s' if cluster else ''}"
        params.extend([agent.pk, agent.cluster_id] if cluster else [agent.pk])
    copied = f"{ROW_COLUMNS}, position"  # the temporary table's columns the batch fills
    types: tuple[str, ...] = (*_ROW_TYPES, "int4")
    batch: Iterable[tuple[Any, ...]] = (
        (*row[:_STORED], position) for position, row in enumerate(rows)
    )
    if gaps is not None:
        columns, select = f"{columns}, gap_ms", f"{select}, gap_ms"
        copied, types = f"{copied}, gap_ms", (*types, "int8")
        batch = (
            (*row[:_STORED], position, gap)
            for position, (row, gap) in enumerate(zip(rows, gaps, strict=True))
        )
    elif target is UnknownDeviceSample:
        mig = "mig_placement, gpu_instance"
        columns, select, copied = f"{columns}, {mig}", f"{select}, {mig}", f"{copied}, {mig}"
        types = (*types, "jsonb", "jsonb")
        batch = (
            (*row[:_STORED], position, _json(row.placement), _json(row.instance))
            for position, row in enumerate(rows)
        )
    # The DELETE empties what an outer transaction's earlier `ingest` left.
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {BATCH_TABLE} (device_uuid text, ts_ms bigint, "
        "gpu_util double precision, mem_used_bytes bigint, processes jsonb, covered_ms bigint, "
        "position int, gap_ms bigint, mig_placement jsonb, gpu_instance jsonb) "
        "ON COMMIT DELETE ROWS; "
        f"DELETE FROM {BATCH_TABLE}"
    )
    copy_rows(cursor, f"{BATCH_TABLE} ({copied})", batch, types)
    return _insert_new(
        cursor,
        target,
        select=select,
        source=BATCH_TABLE,
        where="true",
        params=params,
        first="position",
        columns=columns,
    )


def _json(fields: MigPlacement | GpuInstance | None) -> str | None:
    """A sample's placement or GPU instance as a sample set aside keeps it
    (`UnknownDeviceSample.mig_placement`, `.gpu_instance`: the fields by name, read back with
    `MigPlacement(**fields)`, `GpuInstance(**fields)`), or None."""
    return None if fields is None else json.dumps(fields._asdict())


# Gaps


class _Bounds(NamedTuple):
    """One device's samples in a batch: its first and last instants."""

    first_ms: int
    last_ms: int


def _batch_gaps(ordered: Sequence[SampleRow]) -> tuple[list[int | None], dict[str, _Bounds], bool]:
    """For rows in (device, instant) order: each row's gap to the next later row of its
    device (None for a device's latest), each device's bounds, and whether a device and
    instant repeats."""
    gaps: list[int | None] = [None] * len(ordered)
    bounds: dict[str, _Bounds] = {}
    repeats = False
    following_uuid, following_ms = None, 0  # the nearest later row seen (walking backwards)
    for index in range(len(ordered) - 1, -1, -1):
        uuid, ts_ms = ordered[index][0], ordered[index][1]
        if uuid == following_uuid:
            if following_ms == ts_ms:
                repeats = True
                gaps[index] = gaps[index + 1]  # the same instant: the same next one
            else:
                gaps[index] = following_ms - ts_ms
            bounds[uuid] = _Bounds(ts_ms, bounds[uuid].last_ms)
        else:
            bounds[uuid] = _Bounds(ts_ms, ts_ms)
        following_uuid, following_ms = uuid, ts_ms
    return gaps, bounds, repeats


def _lock_devices(cursor: CursorWrapper, uuids: Iterable[str]) -> None:
    """Hold the devices' advisory locks to the end of the transaction, taken in key order so
    that two writers never wait on each other in a cycle; the key is a hash of the UUID (a
    collision only makes two devices wait on each other)."""
    advisory_xact_lock(
        "billing.ingest.device",
        {text_key(uuid) for uuid in uuids},
        cursor=cursor,
    )


# Per device in `r`: its samples from the one before `lo` to the one after `hi`, their gaps
# worked out again; the rows whose gap changed, with their new gap. The sample after `hi`
# keeps its own (its next sample is not read).
_REFRESH_GAPS_SQL = """
WITH r(uuid, lo, hi) AS ({bounds}),
span AS (
    SELECT r.uuid, r.hi AS last_ms,
           COALESCE((SELECT MAX(p.ts_ms) FROM billing_sample AS p
                     WHERE p.device_uuid = r.uuid AND p.ts_ms < r.lo), r.lo) AS lo,
           COALESCE((SELECT MIN(n.ts_ms) FROM billing_sample AS n
                     WHERE n.device_uuid = r.uuid AND n.ts_ms > r.hi), r.hi) AS hi
    FROM r
),
near AS (
    -- The ends worked out first, so each device's samples are one index range.
    SELECT s.id, s.device_uuid, s.ts_ms, s.gap_ms, span.last_ms
    FROM span JOIN billing_sample AS s
      ON s.device_uuid = span.uuid AND s.ts_ms >= span.lo AND s.ts_ms <= span.hi
),
following AS (
    SELECT id, ts_ms, gap_ms AS stored, last_ms,
           LEAD(ts_ms) OVER (PARTITION BY device_uuid ORDER BY ts_ms) - ts_ms AS gap
    FROM near
)
-- A sample with none after it in range has no next one only when it is not the first after
-- the range (whose next one lies beyond): its gap is then cleared, as when the sample after
-- it was moved to another device.
SELECT id, ts_ms, gap FROM following
WHERE (gap IS NOT NULL OR ts_ms <= last_ms) AND stored IS DISTINCT FROM gap
"""
# The changed gaps, by primary key. A separate statement: joined to the samples within one
# UPDATE, the planner expects many rows from the window and hashes the whole table. The key
# is (id, ts_ms), the partitioned table's: by id alone, a day's partition not yet analysed
# looks as if an id matched half its rows, and is hashed whole.
_SET_GAPS_SQL = """
WITH changed(id, ts_ms, gap) AS ({changed})
UPDATE billing_sample SET gap_ms = changed.gap
FROM changed
WHERE billing_sample.id = changed.id AND billing_sample.ts_ms = changed.ts_ms
"""


def refresh_gaps(cursor: CursorWrapper, bounds: dict[str, _Bounds]) -> None:
    """Work out again the gaps of the devices' samples from the one before `first_ms` to
    `last_ms`: after samples were stored between them, in any order."""
    if not bounds:
        return
    # Over a partition of millions of samples (a day of 1,000 GPUs is 1.4 million) the
    # planner's cost for these few index ranges passes `jit_above_cost`, and compiling the
    # statement took ~0.5 s of a call it runs in 2 ms: ingest fell from 60,000 samples a
    # second to 20,000 as the partition grew. Off for the caller's transaction (each holds
    # one), the update below included.
    cursor.execute(
        "SELECT set_config('jit', 'off', true); "
        + _REFRESH_GAPS_SQL.format(bounds=json_rows("text", "bigint", "bigint")),
        [json.dumps([[uuid, *bound] for uuid, bound in sorted(bounds.items())])],
    )
    cursor.nextset()
    changed = cursor.fetchall()
    if changed:
        cursor.execute(
            _SET_GAPS_SQL.format(changed=json_rows("bigint", "bigint", "bigint")),
            [json.dumps([list(row) for row in changed])],
        )


def fill_gaps(uuids: Iterable[str]) -> None:
    """Work out the gaps of every sample of these devices: for samples written other than by
    `ingest` (the demo's, a test's)."""
    uuids = sorted(set(uuids))
    if not uuids:
        return
    bounds = {
        uuid: _Bounds(first, last)
        for uuid, first, last in Sample.objects.filter(device_uuid__in=uuids)
        .values("device_uuid")
        .annotate(first=models.Min("ts_ms"), last=models.Max("ts_ms"))
        .values_list("device_uuid", "first", "last")
    }
    with transaction.atomic(), connection.cursor() as cursor:
        _lock_devices(cursor, bounds)
        refresh_gaps(cursor, bounds)


# Per device of the batch: the first sample stored at or after its first instant.
_FOLLOWING_SQL = """
SELECT r.uuid, (SELECT MIN(s.ts_ms) FROM billing_sample AS s
                WHERE s.device_uuid = r.uuid AND s.ts_ms >= r.lo)
FROM unnest(%s::text[], %s::bigint[]) AS r(uuid, lo)
"""


def _store_samples(
    cursor: CursorWrapper,
    rows: Sequence[SampleRow],
    *,
    node: str,
    received_at: datetime,
    also_lock: Iterable[str] = (),
) -> tuple[int, list[int]]:
    """Store samples of known devices unless already there, with their gaps.

    The devices are locked first (with `also_lock`, the other devices the transaction will
    write samples of: all in one round, in key order), so their gaps are worked out against
    every sample stored before. A batch that repeats nothing and falls after (or between) what is
    stored, the usual case, is COPYed straight into `billing_sample` with its gaps, then the
    gap of each device's sample just before it is worked out again; the COPY runs under a
    savepoint, and should it meet a stored sample after all it is undone. Otherwise the batch
    takes the general way (`_store`), then its devices' gaps are worked out again over its
    span.
    """
    also_lock = set(also_lock)
    if not rows:
        if also_lock:
            _lock_devices(cursor, also_lock)
        return 0, []
    ordered = sorted(rows, key=_KEY)
    gaps, bounds, repeats = _batch_gaps(ordered)
    _lock_devices(cursor, bounds.keys() | also_lock)
    if not repeats:
        uuids = sorted(bounds)
        cursor.execute(_FOLLOWING_SQL, [uuids, [bounds[uuid].first_ms for uuid in uuids]])
        following = dict(cursor.fetchall())
        if all(after is None or after > bounds[uuid].last_ms for uuid, after in following.items()):
            for index, (row, gap) in enumerate(zip(ordered, gaps, strict=True)):
                if gap is None and following[row[0]] is not None:
                    gaps[index] = following[row[0]] - row[1]
            tail = (node, received_at)
            try:
                with transaction.atomic():
                    copy_rows(
                        cursor,
                        f"{_table(Sample)} ({ROW_COLUMNS}, node, received_at, gap_ms)",
                        # Made as written, not held: thousands of live tuples would wake the
                        # garbage collector, over and over, to walk everything the batch holds.
                        (
                            row[:_STORED] + tail + (gap,)
                            for row, gap in zip(ordered, gaps, strict=True)
                        ),
                        (*_ROW_TYPES, "text", "timestamptz", "int8"),
                    )
            except UniqueViolation:
                pass
            else:
                # Only each device's sample just before the batch has a gap to set now.
                refresh_gaps(
                    cursor, {uuid: _Bounds(b.first_ms, b.first_ms) for uuid, b in bounds.items()}
                )
                return len(rows), latest_per_hour(row[1] for row in rows)
    stored, instants = _store(
        cursor, Sample, ordered, node=node, received_at=received_at, gaps=gaps
    )
    if stored:
        refresh_gaps(cursor, bounds)
    return stored, instants


class _Place(NamedTuple):
    """Where the inventory puts a device: its cluster and node (None: on no node), and the
    GPU it is part of (a MIG device's or partition's `parent_uuid`; "" for none)."""

    cluster_id: int
    node: str | None
    parent: str = ""


def _metered(ids: Iterable[str]) -> models.QuerySet[Device]:
    """The devices samples name by `ids`: by meter id (`Device.meter_id`: a NVIDIA device's
    UUID, a formed identity for one without); a device imported before meter ids were
    formed (meter id empty) by its UUID."""
    ids = list(ids)
    return Device.objects.filter(models.Q(meter_id__in=ids) | models.Q(meter_id="", uuid__in=ids))


def _places(uuids: set[str]) -> dict[str, set[_Place]]:
    """Where the devices carrying `uuids` are, per UUID the inventory knows: the present
    devices' places if any carries it, else the gone ones'. A MIG device published without a
    node of its own is where its parent GPU is."""
    rows = [
        (meter_id or uuid, cluster_id, node, parent, gone_at)
        for meter_id, uuid, cluster_id, node, parent, gone_at in _metered(uuids).values_list(
            "meter_id", "uuid", "cluster_id", "node__name", "parent_uuid", "gone_at"
        )
    ]
    orphans = {parent for _, _, node, parent, _ in rows if node is None and parent}
    parents: dict[tuple[str, int], str] = {}
    if orphans:
        parents = {
            (uuid, cluster_id): node
            for uuid, cluster_id, node in Device.objects.filter(
                uuid__in=orphans, node__isnull=False
            )
            .order_by("gone_at")  # a present parent (null sorts last) wins
            .values_list("uuid", "cluster_id", "node__name")
        }
    present: dict[str, set[_Place]] = defaultdict(set)
    gone: dict[str, set[_Place]] = defaultdict(set)
    for uuid, cluster_id, node, parent, gone_at in rows:
        if node is None and parent:
            node = parents.get((parent, cluster_id))
        (present if gone_at is None else gone)[uuid].add(_Place(cluster_id, node, parent or ""))
    return {uuid: present.get(uuid) or gone[uuid] for uuid in present.keys() | gone.keys()}


def inventory_nodes(uuids: set[str]) -> dict[str, set[str]]:
    """The nodes the inventory puts the devices carrying `uuids` on (a MIG device: its GPU's),
    per UUID it knows; an empty set for a device on no node."""
    return {
        uuid: {place.node for place in places if place.node}
        for uuid, places in _places(uuids).items()
    }


def _misplaced(places: set[_Place], agent: AgentToken) -> str:
    """Why `agent` may not send samples of a device at `places`; "" when it may: the device
    is on the token's node (a cluster-wide token's: any device of its cluster)."""
    mine = [place for place in places if place.cluster_id == agent.cluster_id]
    if agent.node == "*" and mine:
        return ""
    if any(place.node == agent.node for place in mine):
        return ""
    if not mine:
        return f"is in another cluster than this token's ({agent.cluster})"
    nodes = sorted(place.node for place in mine if place.node)
    where = f"on node {nodes[0]!r}" if nodes else "on no node (only a cluster-wide token's)"
    return f"is {where}, not on this token's node {agent.node!r}"


def _refusal(position: int, row: SampleRow, sent: dict[int, str], label: str, why: str) -> Refusal:
    """The refusal of the sample at `position`, naming its device as the sender did: a UUID,
    or (`sent`, by position) the driver, pool and device it named, never the identity formed
    from them."""
    named = sent.get(position)
    if named is None:
        return Refusal(position, label, f"device {row[0]} {why}")
    return Refusal(position, label, f"{named} {why}", "device")


def _unknown_devices_allowed(
    agent: AgentToken, rows: list[tuple[int, SampleRow]], sent: dict[int, str]
) -> tuple[list[tuple[int, SampleRow]], list[Refusal]]:
    """Of samples of devices the inventory does not know (with their positions), those the
    token may set aside, and the rest refused with why: a token holds samples of at most
    TALLY_INGEST_MAX_UNKNOWN_DEVICES unknown devices, and at most
    TALLY_INGEST_MAX_UNKNOWN_SAMPLES of them, until they are adopted or expire. The token's
    row is locked, so two of its batches at once cannot both take the last room."""
    AgentToken.objects.select_for_update().only("pk").get(pk=agent.pk)
    held = UnknownDeviceSample.objects.filter(agent_token=agent)
    devices = set(held.values_list("device_uuid", flat=True).distinct())
    room = int(settings.TALLY_INGEST_MAX_UNKNOWN_SAMPLES) - held.count()
    most_devices = int(settings.TALLY_INGEST_MAX_UNKNOWN_DEVICES)
    allowed: list[tuple[int, SampleRow]] = []
    refused: list[Refusal] = []
    for position, row in rows:
        if row[0] not in devices and len(devices) >= most_devices:
            refused.append(
                _refusal(
                    position,
                    row,
                    sent,
                    "unknown_device_limit",
                    "is not in the inventory, and this token already has samples of "
                    f"{most_devices} unknown devices set aside (TALLY_INGEST_MAX_UNKNOWN_DEVICES)",
                )
            )
        elif len(allowed) >= room:
            refused.append(
                _refusal(
                    position,
                    row,
                    sent,
                    "unknown_device_limit",
                    "is not in the inventory, and this token already has "
                    f"{settings.TALLY_INGEST_MAX_UNKNOWN_SAMPLES} samples of unknown devices "
                    "set aside (TALLY_INGEST_MAX_UNKNOWN_SAMPLES)",
                )
            )
        else:
            devices.add(row[0])
            allowed.append((position, row))
    return allowed, refused


@transaction.atomic
def ingest(
    *,
    node: str,
    samples: Sequence[SampleRow],
    received_at: datetime,
    agent: AgentToken | None = None,
) -> IngestReport:
    """Store validated `samples` sent by `node`, in one transaction.

    Samples of known devices go to `Sample`, the others aside to `UnknownDeviceSample`, but
    for those of a dynamic MIG device, stored under the partition device published for their
    placement on `node` (`_placed_mig_samples`), and DCGM's named `<parent UUID>::gi<N>`,
    stored under the device that GPU instance was at their instant (`_place`). A device and
    instant already stored, or sent twice in this batch, is kept as first stored and counted
    as a duplicate. Every hour that newly stored samples count in is marked dirty. The GPU
    instances of MIG samples stored (or duplicates) are recorded (`_instance_points`), with a
    token or without, and DCGM's samples their spells placed are placed again where the
    spells changed.

    Sent with an agent token (`agent`), a sample is refused, never stored, when the inventory
    puts its device on another node than the token's (any node but its cluster's, for a
    cluster-wide token), or it is of an unknown device past the token's limits
    (`_unknown_devices_allowed`). Without one (an operator's backfill) neither applies. A
    node's token sends for its own node only: `node` another is a ValueError (the view
    answers 403 before).
    """
    if agent is not None and agent.node != "*" and node != agent.node:
        # What is set aside records the node that sent it, and adoption trusts that node to
        # be the token's (`adopt_unknown_samples`).
        raise ValueError(f"the token of node {agent.node!r} cannot send for node {node!r}")
    given = samples
    named_refused: dict[int, Refusal] = {}
    unknown_named: dict[str, str] = {}
    sent: dict[int, str] = {}  # position -> the device as named by driver and device
    keys = {row[0] for row in samples if row[0][:1] == NAMED}
    if keys:
        samples, named_refused, unknown_named, sent = _resolve_samples(samples, keys, node, agent)
    # DCGM's samples of MIG devices it could not tell, named by their GPU instance.
    keyed_at = {
        position
        for position, row in enumerate(samples)
        if row.instance is not None and _is_keyed(row) and position not in named_refused
    }
    uuids = {row[0] for row in samples if row[0][:1] != NAMED}  # refused names left out
    if keyed_at:
        uuids -= {samples[position][0] for position in keyed_at}
    places = _places(uuids) if uuids else {}
    misplaced: dict[str, str] = {}
    if agent is not None:
        for uuid, place in places.items():
            why = _misplaced(place, agent)
            if why:
                misplaced[uuid] = why
    known_rows: Sequence[SampleRow] = samples
    unknown: list[tuple[int, SampleRow]] = []
    keyed: list[tuple[int, SampleRow]] = []
    refused: list[Refusal] = []
    unknown_ids: set[str] = set()
    if keyed_at or misplaced or named_refused or len(places) != len(uuids):
        kept: list[SampleRow] = []
        for position, row in enumerate(samples):
            if position in named_refused:
                refused.append(named_refused[position])
            elif position in keyed_at:
                keyed.append((position, row))
            elif row[0] in misplaced:
                refused.append(_refusal(position, row, sent, "device_elsewhere", misplaced[row[0]]))
            elif row[0] in places:
                kept.append(row)
            else:
                unknown.append((position, row))
        if unknown:
            unknown, placed = _placed_mig_samples(unknown, node=node, agent=agent)
            kept.extend(placed)
            unknown_ids = {row[0] for _, row in unknown}
        known_rows = kept
    cluster_id = None if agent is None else agent.cluster_id
    points = _instance_points(
        [
            _InstanceSample(row.device_uuid, row.ts_ms, row.instance, cluster_id, node)
            for row in known_rows
            if row.instance is not None
        ],
        places=places,
    )
    with connection.cursor() as cursor:
        # The GPU instances' locks before the devices': the spells say which devices DCGM's
        # samples go to, and the devices are locked in one round.
        placements = _Placements()
        if points or keyed:
            lock_instances(
                cursor,
                {key.instance for key in points}
                | {(node, *row.instance) for _, row in keyed if row.instance is not None},
            )
            placements = _place(
                cursor,
                record_instances(cursor, points),
                _keyed_samples(keyed, node=node, cluster_id=cluster_id),
            )
            if placements.unplaced:
                unknown = sorted(unknown + placements.unplaced)
                unknown_ids |= {row[0] for _, row in placements.unplaced}
        if unknown and agent is not None:
            unknown, over = _unknown_devices_allowed(agent, unknown, sent)
            refused = sorted(refused + over)
        stored, instants = _store_samples(
            cursor,
            known_rows,
            node=node,
            received_at=received_at,
            also_lock=placements.devices,
        )
        by_instance, shifted = placements.store(cursor, node=node, received_at=received_at)
        set_aside, _ = _store(
            cursor,
            UnknownDeviceSample,
            [row for _, row in unknown],
            node=node,
            received_at=received_at,
            agent=agent,
        )
        _widen_dcgm_spans(cursor, [row for _, row in keyed], node=node)
    hours = touched_hours(instants + shifted)
    mark_dirty(hours=hours, at=received_at)
    accepted = stored + by_instance + set_aside
    set_aside_ids = {row[0] for _, row in unknown}
    return IngestReport(
        accepted=accepted,
        duplicates=len(given) - accepted - len(refused),
        refused=refused,
        unknown_devices=sorted(unknown_ids),
        hours=hours,
        unknown_named={key: why for key, why in unknown_named.items() if key in set_aside_ids},
    )


class _InstanceSample(NamedTuple):
    """A stored MIG sample's GPU instance, to be recorded (`metering.mig_instances`): the device
    it was stored under, when, and who sent it: the agent token's cluster (None: an operator's
    backfill) and the node it sent for."""

    meter_id: str
    ts_ms: int
    instance: GpuInstance
    cluster_id: int | None
    node: str


def _instance_place(
    places: set[_Place], *, cluster_id: int | None, node: str
) -> tuple[int, str] | None:
    """Where a MIG device's GPU instance is recorded: the cluster and node the inventory puts
    the device on (a MIG device without a node: its GPU's; none: ""), in the sender's cluster
    (any, for a backfill), so that an agent's, a backfill's and an adopted sample of one GPU
    instance are one GPU instance's, whatever node the sender named. Where the inventory has
    it on several, the sender's node among them; None where that does not settle it."""
    where = {
        (place.cluster_id, place.node or "")
        for place in places
        if cluster_id is None or place.cluster_id == cluster_id
    }
    if len(where) > 1:
        where = {place for place in where if place[1] == node}
    return where.pop() if len(where) == 1 else None


def _instance_points(
    samples: Sequence[_InstanceSample], *, places: dict[str, set[_Place]] | None = None
) -> dict[InstanceKey, set[Point]]:
    """What to record (`record_instances`) of the GPU instances of stored MIG samples, per
    device they were stored under (a dynamic MIG device's: its partition), duplicates included
    (the instant was seen either way), at the device's place (`_instance_place`; `places`
    those known already). A device the inventory cannot place records nothing, nor a sample
    naming another GPU than the device's own: DCGM's series of that GPU's instance would be
    given to the device (another cluster's GPU, named by a token of this one)."""
    if not samples:
        return {}
    places = places or {}
    missing = {sample.meter_id for sample in samples} - places.keys()
    if missing:
        places = {**places, **_places(missing)}
    points: dict[InstanceKey, set[Point]] = defaultdict(set)
    where: dict[tuple[str, int | None, str], tuple[int, str] | None] = {}
    for sample in samples:
        sender = (sample.meter_id, sample.cluster_id, sample.node)
        if sender not in where:
            where[sender] = _instance_place(
                places.get(sample.meter_id, set()), cluster_id=sample.cluster_id, node=sample.node
            )
        place = where[sender]
        parents = {known.parent for known in places.get(sample.meter_id, set())}
        if place is not None and sample.instance.parent_uuid in parents:
            key = InstanceKey(*place, *sample.instance)
            points[key].add(Point(sample.ts_ms, sample.meter_id))
    return points


# DCGM's samples named by their GPU instance

# The placement of an agent's DCGM samples of MIG devices it could not tell, named
# `<parent UUID>::gi<N>` (`agent.dcgm`): each is stored in `billing_sample` under the device
# that GPU instance was at its instant, by the spells the NVML agents' samples record
# (`metering.mig_instances.covering`, the Prometheus source's rule), and kept aside while no
# spell says (`UnknownDeviceSample`). Where the spells change (a late batch, an id reused A,
# B, A whose B comes last), the samples whose device changed are moved: out of `billing_sample`
# or out of the aside, to their new device or aside. So what is stored is what all the
# samples give at once, whatever order the DCGM and NVML batches came in (the spells are).


def _is_keyed(row: SampleRow) -> bool:
    """Whether `row` is a DCGM sample named by its GPU instance (`<parent UUID>::gi<N>`)."""
    return (
        row.instance is not None
        and "::gi" in row.device_uuid
        and row.device_uuid == instance_key(row.instance)
    )


class _Keyed(NamedTuple):
    """A DCGM sample named by its GPU instance, arriving: its position in the batch, the
    sample, and its GPU instance; `anywhere`: an operator's, of no cluster, placed by the one
    cluster whose spells cover its instant (`key.cluster_id` is then no cluster's)."""

    position: int
    row: SampleRow
    key: InstanceKey
    anywhere: bool


def _keyed_samples(
    keyed: Sequence[tuple[int, SampleRow]], *, node: str, cluster_id: int | None
) -> list[_Keyed]:
    """The GPU instance of each DCGM sample named by one, sent for `node`: in the token's
    cluster (`cluster_id`), never another's, so that a token places nothing on another
    cluster's devices; an operator's (None), in whichever cluster's spells cover its instant
    (a node that moved clusters is each cluster's in its own time)."""
    found: list[_Keyed] = []
    for position, row in keyed:
        assert row.instance is not None  # `_is_keyed`
        key = InstanceKey(cluster_id or 0, node, *row.instance)
        found.append(_Keyed(position, row, key, cluster_id is None))
    return found


class _Held(NamedTuple):
    """A DCGM sample named by its GPU instance that is stored (`device` its meter id) or set
    aside (`device` ""), where its GPU instance's spells changed."""

    key: InstanceKey
    row_id: int
    ts_ms: int
    device: str
    # Set aside without a token or cluster (an operator's): placed as `_Keyed.anywhere`.
    anywhere: bool = False


class _Move(NamedTuple):
    """A DCGM sample to move from where it is (`held`) to `device` ("": aside)."""

    held: _Held
    device: str


@dataclass
class _Placements:
    """What a transaction does with DCGM's samples named by their GPU instance: those it
    moves (`moves`), and where the arriving ones go (`arriving`: with the device, or "" for
    aside, where `unplaced` lists them for `ingest` to set aside as unknown devices')."""

    moves: list[_Move] = field(default_factory=list)
    arriving: list[tuple[_Keyed, str]] = field(default_factory=list)

    @property
    def unplaced(self) -> list[tuple[int, SampleRow]]:
        return [(keyed.position, keyed.row) for keyed, device in self.arriving if not device]

    @property
    def devices(self) -> set[str]:
        """The devices whose samples this moves or adds: locked with the batch's."""
        found = {device for _, device in self.arriving if device}
        for move in self.moves:
            found |= {move.held.device, move.device}
        return found - {""}

    def store(
        self, cursor: CursorWrapper, *, node: str, received_at: datetime
    ) -> tuple[int, list[int]]:
        """Move the samples and store the arriving ones placed, under the devices' locks
        (taken with the batch's, `_store_samples`). A device already holding a sample at that
        instant keeps it, its own taking the DCGM reading's utilisation where it has none
        (`_PLACE_SQL`); otherwise the DCGM one is dropped as a duplicate. Returns how many arriving
        ones were stored, and instants whose `touched_hours` are those of every sample moved
        or stored."""
        if not self.moves and not any(device for _, device in self.arriving):
            return 0, []
        rows = _take_held(cursor, [move.held for move in self.moves])
        placed: list[list[Any]] = []
        aside: list[list[Any]] = []
        for move in self.moves:
            taken = rows.get((move.held.device, move.held.row_id))
            if taken is None:
                continue
            key = move.held.key
            if move.device:
                placed.append([move.device, move.held.ts_ms, *taken, key.gpu_instance_id])
            else:
                # Without its token (a stored sample keeps none), in the cluster it was placed
                # in; received now, so that it waits its retention from the move, as one
                # arriving now would (`metering.retention`).
                gpu = GpuInstance(key.parent_uuid, key.gpu_instance_id)
                kept = [*taken[:4], received_at.isoformat(), *taken[5:]]
                aside.append(
                    [instance_key(gpu), move.held.ts_ms, *kept, _json(gpu), key.cluster_id]
                )
        arriving = [
            [
                device,
                keyed.row.ts_ms,
                keyed.row.gpu_util,
                keyed.row.mem_used_bytes,
                keyed.row.processes,
                node,
                received_at.isoformat(),
                keyed.row.covered_ms,
                keyed.row.instance.gpu_instance_id if keyed.row.instance else None,
            ]
            for keyed, device in self.arriving
            if device
        ]
        stored = _insert_placed(cursor, placed + arriving)
        if aside:
            cursor.execute(_SET_ASIDE_AGAIN_SQL, [json.dumps(aside)])
        accepted = len(stored & {(row[0], row[1]) for row in arriving})
        instants = [
            move.held.ts_ms for move in self.moves if (move.held.device, move.held.row_id) in rows
        ]
        instants.extend(ts_ms for _, ts_ms in stored)
        touched: dict[str, list[int]] = defaultdict(list)
        for move in self.moves:
            if move.held.device:
                touched[move.held.device].append(move.held.ts_ms)
        for device, ts_ms in stored:
            touched[device].append(ts_ms)
        refresh_gaps(cursor, {device: _Bounds(min(at), max(at)) for device, at in touched.items()})
        return accepted, latest_per_hour(instants)


# The DCGM samples of each GPU instance and stretch [lo, hi] where its spells changed, stored
# under one of the devices it was there before (`m`) or set aside: an aside one of its
# cluster's token, or set aside without a token in its cluster, or an operator's of any. Each
# a subquery per stretch (and device): its index range, never a table hashed.
_HELD_SQL = f"""
WITH w(i, cluster_id, node, gpu_instance_id, key, lo, hi) AS MATERIALIZED (
    {json_rows("bigint", "bigint", "text", "integer", "text", "bigint", "bigint",
               placeholder="%(stretches)s")}
),
m(i, meter_id) AS MATERIALIZED ({json_rows("bigint", "text", placeholder="%(meters)s")})
SELECT w.i, s.id, s.ts_ms, s.device_uuid, false
FROM w JOIN m USING (i) CROSS JOIN LATERAL (
    SELECT id, ts_ms, device_uuid FROM {Sample._meta.db_table}
    WHERE device_uuid = m.meter_id AND ts_ms BETWEEN w.lo AND w.hi
      AND placed_gpu_instance = w.gpu_instance_id AND node = w.node
    OFFSET 0
) AS s
UNION ALL
SELECT w.i, u.id, u.ts_ms, '', t.cluster_id IS NULL AND u.cluster_id IS NULL
FROM w CROSS JOIN LATERAL (
    SELECT id, ts_ms, agent_token_id, cluster_id FROM {UnknownDeviceSample._meta.db_table}
    WHERE device_uuid = w.key AND node = w.node AND ts_ms BETWEEN w.lo AND w.hi
    OFFSET 0
) AS u
LEFT JOIN {AgentToken._meta.db_table} AS t ON t.id = u.agent_token_id
WHERE COALESCE(t.cluster_id, u.cluster_id, w.cluster_id) = w.cluster_id
"""  # fmt: skip
# What a moved sample keeps, in the order `_Placements.store` writes them.
_KEPT = "gpu_util, mem_used_bytes, processes::text, node, received_at, covered_ms"
_TAKE_STORED_SQL = f"""
DELETE FROM {Sample._meta.db_table} AS s
USING ({json_rows("bigint", "bigint")}) AS m(id, ts_ms)
WHERE s.id = m.id AND s.ts_ms = m.ts_ms
RETURNING s.device_uuid, s.id, {", ".join(f"s.{column}" for column in _KEPT.split(", "))}
"""
_TAKE_ASIDE_SQL = f"""
DELETE FROM {UnknownDeviceSample._meta.db_table} AS u
WHERE u.id = ANY(%s)
RETURNING '', u.id, {", ".join(f"u.{column}" for column in _KEPT.split(", "))}
"""
# A device's own sample at that instant keeps it, taking the DCGM reading's utilisation and
# memory where it has none, as `_own_sample_wins` does the other way round; a DCGM sample
# placed there first keeps it.
_PLACE_SQL = f"""
INSERT INTO {Sample._meta.db_table} AS s
    ({COLUMNS}, covered_ms, placed_gpu_instance)
SELECT DISTINCT ON (1, 2) * FROM ({json_rows("text", "bigint", "double precision", "bigint",
                                             "jsonb", "text", "timestamptz", "bigint",
                                             "integer")}) AS placed
ORDER BY 1, 2
ON CONFLICT (device_uuid, ts_ms) DO UPDATE
SET gpu_util = COALESCE(s.gpu_util, excluded.gpu_util),
    covered_ms = CASE WHEN s.gpu_util IS NULL THEN excluded.covered_ms ELSE s.covered_ms END,
    mem_used_bytes = COALESCE(s.mem_used_bytes, excluded.mem_used_bytes)
WHERE s.placed_gpu_instance IS NULL
  AND (s.gpu_util IS NULL AND excluded.gpu_util IS NOT NULL
       OR s.mem_used_bytes IS NULL AND excluded.mem_used_bytes IS NOT NULL)
RETURNING device_uuid, ts_ms
"""  # fmt: skip
_SET_ASIDE_AGAIN_SQL = f"""
INSERT INTO {UnknownDeviceSample._meta.db_table}
    ({COLUMNS}, covered_ms, gpu_instance, cluster_id)
SELECT * FROM ({json_rows("text", "bigint", "double precision", "bigint", "jsonb", "text",
                          "timestamptz", "bigint", "jsonb", "bigint")}) AS aside
ORDER BY 1, 2
ON CONFLICT ({UNIQUE_SET_ASIDE}) DO NOTHING
"""  # fmt: skip


def _take_held(cursor: CursorWrapper, held: Sequence[_Held]) -> dict[tuple[str, int], list[Any]]:
    """Delete the samples `held` from where they are; what each keeps (`_KEPT`, JSON-ready),
    by (device, id) as held."""
    taken: dict[tuple[str, int], list[Any]] = {}
    stored = [[one.row_id, one.ts_ms] for one in held if one.device]
    aside = [one.row_id for one in held if not one.device]
    if stored:
        cursor.execute(_TAKE_STORED_SQL, [json.dumps(stored)])
        rows = cursor.fetchall()
    else:
        rows = []
    if aside:
        cursor.execute(_TAKE_ASIDE_SQL, [aside])
        rows += cursor.fetchall()
    for device, row_id, *kept in rows:
        kept[4] = kept[4].isoformat()  # received_at
        taken[device, row_id] = kept
    return taken


def _insert_placed(cursor: CursorWrapper, rows: list[list[Any]]) -> set[tuple[str, int]]:
    """Store DCGM samples under the devices their spells give (rows as `_PLACE_SQL` takes
    them) unless that device has a sample at that instant; the (device, instant) stored."""
    if not rows:
        return set()
    cursor.execute(_PLACE_SQL, [json.dumps(rows)])
    return {(device, ts_ms) for device, ts_ms in cursor.fetchall()}


def _place(
    cursor: CursorWrapper,
    respelled: dict[InstanceKey, Respelled],
    arriving: Sequence[_Keyed],
    *,
    aside: Sequence[_Held] = (),
) -> _Placements:
    """Where DCGM's samples named by their GPU instance go, under the GPU instances' locks and
    after their spells were recorded: the arriving ones, those held (stored or aside) where
    the spells changed (`respelled`), and `aside` (set aside, looked at again), each to the
    device `covering` gives at its instant under the spells now ("", aside: none, or two that
    began at once); an operator's of no cluster by every cluster's spells (`covering_any`)."""
    held = [*_held(cursor, respelled), *aside]
    scoped: dict[InstanceKey, tuple[int, int]] = {}
    anywhere: dict[tuple[str, str, int], tuple[int, int]] = {}
    for key, ts_ms, any_cluster in [(one.key, one.ts_ms, one.anywhere) for one in held] + [
        (keyed.key, keyed.row.ts_ms, keyed.anywhere) for keyed in arriving
    ]:
        wanted: dict[Any, tuple[int, int]] = anywhere if any_cluster else scoped
        name = key.instance if any_cluster else key
        lo, hi = wanted.get(name, (ts_ms, ts_ms))
        wanted[name] = (min(lo, ts_ms), max(hi, ts_ms))
    spells = spells_covering(cursor, scoped)
    spells_anywhere = spells_of_any_cluster(cursor, anywhere)
    hold_ms = sample_hold_ms()

    def device_at(key: InstanceKey, ts_ms: int, any_cluster: bool) -> str:
        meters = (
            covering_any(spells_anywhere.get(key.instance, {}), ts_ms, hold_ms)
            if any_cluster
            else covering(spells.get(key, ()), ts_ms, hold_ms)
        )
        return next(iter(meters)) if len(meters) == 1 else ""

    moves = [
        _Move(one, device)
        for one in held
        if (device := device_at(one.key, one.ts_ms, one.anywhere)) != one.device
    ]
    return _Placements(
        moves=moves,
        arriving=[
            (keyed, device_at(keyed.key, keyed.row.ts_ms, keyed.anywhere)) for keyed in arriving
        ],
    )


def _held(cursor: CursorWrapper, respelled: dict[InstanceKey, Respelled]) -> list[_Held]:
    """The DCGM samples, stored or set aside, in the stretches where their GPU instance's
    spells changed (`record_instances`). One query."""
    stretches: list[list[Any]] = []
    meters: list[list[Any]] = []
    keys: list[InstanceKey] = []
    for key, change in respelled.items():
        for lo, hi in change.intervals:
            index = len(keys)
            keys.append(key)
            stretches.append(
                [index, key.cluster_id, key.node, key.gpu_instance_id,
                 instance_key(GpuInstance(key.parent_uuid, key.gpu_instance_id)), lo, hi]
            )  # fmt: skip
            meters.extend([index, meter] for meter in sorted(change.meters))
    if not stretches:
        return []
    cursor.execute(_HELD_SQL, {"stretches": json.dumps(stretches), "meters": json.dumps(meters)})
    found: dict[tuple[str, int], _Held] = {}
    for index, row_id, ts_ms, device, anywhere in cursor.fetchall():
        # An operator's sample set aside may be held by the GPU instance of two clusters.
        found.setdefault((device, row_id), _Held(keys[index], row_id, ts_ms, device, anywhere))
    return list(found.values())


# The span of the DCGM samples sent for each GPU instance, widened (`DcgmInstance`).
_WIDEN_SQL = f"""
INSERT INTO {DcgmInstance._meta.db_table} AS d
    (node, parent_uuid, gpu_instance_id, first_ms, last_ms)
SELECT * FROM ({json_rows("text", "text", "integer", "bigint", "bigint")}) AS sent
ORDER BY 2, 3, 1
ON CONFLICT (parent_uuid, gpu_instance_id, node) DO UPDATE
SET first_ms = LEAST(d.first_ms, excluded.first_ms), last_ms = GREATEST(d.last_ms, excluded.last_ms)
WHERE excluded.first_ms < d.first_ms OR excluded.last_ms > d.last_ms
"""


def _widen_dcgm_spans(cursor: CursorWrapper, rows: Sequence[SampleRow], *, node: str) -> None:
    """Record that DCGM sent samples of these GPU instances, from when to when, so that a
    change of their spells there looks for them (`record_instances`)."""
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for row in rows:
        assert row.instance is not None  # `_is_keyed`
        first, last = spans.get(row.instance, (row.ts_ms, row.ts_ms))
        spans[row.instance] = (min(first, row.ts_ms), max(last, row.ts_ms))
    if spans:
        cursor.execute(
            _WIDEN_SQL,
            [json.dumps([[node, *instance, *span] for instance, span in spans.items()])],
        )


def _placed_mig_samples(
    unknown: list[tuple[int, SampleRow]], *, node: str, agent: AgentToken | None
) -> tuple[list[tuple[int, SampleRow]], list[SampleRow]]:
    """Of samples of devices the inventory does not know (with their positions), those of
    MIG devices NVIDIA's driver made for a claim (dynamic MIG), under the meter id of the
    partition device published for their placement when they were taken
    (`metering.mig_samples.partitions_at`), and the rest. Only a partition on `node`, in the
    token's cluster, is matched: a device `_misplaced` allows the token, so naming a parent
    GPU elsewhere stores nothing there."""
    placements = {row.placement for _, row in unknown if row.placement is not None}
    if not placements:
        return unknown, []
    found = partitions_at(
        placements,
        node=node,
        cluster_id=agent.cluster_id if agent is not None else None,
        since_ms=min(row.ts_ms for _, row in unknown if row.placement is not None),
    )
    if not found:
        return unknown, []
    rest: list[tuple[int, SampleRow]] = []
    placed: list[SampleRow] = []
    for position, row in unknown:
        timeline = found.get(row.placement) if row.placement is not None else None
        meter_id = timeline.meter_id_at(row.ts_ms) if timeline is not None else None
        if meter_id is None:
            rest.append((position, row))
        else:
            placed.append(row._replace(device_uuid=meter_id))
    return rest, placed


def _resolve_samples(
    samples: Sequence[SampleRow], keys: set[str], node: str, agent: AgentToken | None
) -> tuple[list[SampleRow], dict[int, Refusal], dict[str, str], dict[int, str]]:
    """`samples` with each device named by driver and device replaced by its meter id, the
    ones refused (by position), the unknown ones' identities -> why (see `resolve_named`),
    and how each sample replaced named its device (`NamedDevice.sent`, by position), so that
    a later refusal names it so."""
    resolved, refusals, unknown = resolve_named(keys, node=node, agent=agent)
    rows: list[SampleRow] = []
    refused: dict[int, Refusal] = {}
    sent: dict[int, str] = {}
    ids = {key: meter for key, (meter, _) in unknown.items()} | resolved
    names = {key: name.sent for key in ids if (name := named_device(key)) is not None}
    for position, row in enumerate(samples):
        key = row[0]
        if key[:1] != NAMED:
            rows.append(row)
        elif key in refusals:
            label, reason = refusals[key]
            refused[position] = Refusal(position, label, reason, "device")
            rows.append(row)  # never stored: its position is refused
        else:
            rows.append(SampleRow(ids[key], *row[1:]))
            sent[position] = names[key]
    return rows, refused, dict(why for _, why in unknown.values()), sent


def formed_meter_id(cluster: str, driver: str, pool: str, device: str) -> str:
    """The identity the inventory forms for a device published without a UUID
    (`inventory.profiles.meter_id`, from the cluster's name): samples of such a device not
    known yet are kept aside under it, and adopted when the sync learns the device."""
    return profiles.meter_id(cluster, driver, pool, device)


class _Match(NamedTuple):
    """A present device a named sample may mean."""

    pool: str
    meter_id: str
    name: str
    kind: str


def _natural(name: str) -> list[Any]:
    """`gpu-2-130` before `gpu-10-138`: digits compared as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _pci_device(matches: list[_Match], partition: int | None) -> tuple[list[_Match], str]:
    """Of the devices carrying one PCI address, the one meant: the whole GPU without a
    partition, else the `partition`-th of its partitions in name order (AMD's driver names
    a GPU's partitions by their DRM card index, which follows the partition index); or why
    none can be chosen."""
    whole = [match for match in matches if match.kind != "partition"]
    parts = sorted(
        (match for match in matches if match.kind == "partition"), key=lambda m: _natural(m.name)
    )
    if partition is None:
        if len(whole) == 1 or len(matches) == 1:
            return (whole or matches)[:1], ""
        return [], f"{len(matches)} devices carry that PCI address; give the partition"
    if not parts and partition == 0 and len(whole) == 1:
        return whole, ""
    if partition < len(parts):
        return [parts[partition]], ""
    return [], f"that GPU has {len(parts)} partitions in the inventory, not a partition {partition}"


def resolve_named(
    keys: set[str], *, node: str, agent: AgentToken | None
) -> tuple[dict[str, str], dict[str, tuple[str, str]], dict[str, tuple[str, tuple[str, str]]]]:
    """Resolve devices named by driver and device name (`named_device` keys) through the
    inventory: a present device of that driver and name on that node (the sample's, else
    `node`), in the agent token's cluster (any, for an operator's backfill), in that pool
    if one is named.

    Returns three dicts by key: the meter ids found; the refused, as (label, reason): a node
    not the token's, a node of another cluster, a device that is not metered (not an
    accelerator), a name on several pools or clusters; and the unknown ones, as (the formed
    identity their samples are kept aside under, (that identity, why)). One query for the
    whole batch.
    """
    named = {key: named_device(key) for key in keys}
    wanted: dict[str, NamedDevice] = {}
    refused: dict[str, tuple[str, str]] = {}
    for key, name in named.items():
        assert name is not None
        where = name.node or node
        if agent is not None and agent.node != "*" and where != agent.node:
            refused[key] = (
                "device_elsewhere",
                f"{name.label}: node {where!r} is not this token's node {agent.node!r}",
            )
        else:
            wanted[key] = name._replace(node=where)
    found: dict[tuple[str, str, str], list[_Match]] = defaultdict(list)
    by_name = {key: name for key, name in wanted.items() if name.pci is None}
    by_pci = {key: name for key, name in wanted.items() if name.pci is not None}
    for named_here, by_address in ((by_name, False), (by_pci, True)):
        if not named_here:
            continue
        devices = Device.objects.filter(
            gone_at__isnull=True,
            node__name__in={name.node for name in named_here.values()},
            driver__in={name.driver for name in named_here.values()},
        )
        if by_address:
            devices = devices.filter(
                Q(attributes__has_any_keys=list(PCI_ATTRIBUTES)) | Q(name__regex=PCI_NAME_SQL)
            )
        else:
            devices = devices.filter(name__in={name.device for name in named_here.values()})
        if agent is not None:
            devices = devices.filter(cluster_id=agent.cluster_id)
        for (
            node_name,
            driver,
            device,
            pool,
            meter_id,
            uuid,
            kind,
            attributes,
        ) in devices.values_list(
            "node__name",
            "driver",
            "name",
            "pool",
            "meter_id",
            "uuid",
            "kind",
            "attributes" if by_address else "pk",
        ):
            if by_address:
                bus_id = pci_address(attributes, device)
                if bus_id is None:
                    continue
                found[node_name, driver, PCI_KEY + bus_id].append(
                    _Match(pool, meter_id or uuid, device, kind)
                )
            else:
                found[node_name, driver, device].append(
                    _Match(pool, meter_id or uuid, device, kind)
                )
    resolved: dict[str, str] = {}
    unknown: dict[str, tuple[str, tuple[str, str]]] = {}
    missing: dict[str, NamedDevice] = {}
    for key, name in wanted.items():
        label = name.label.replace("this node", f"node {name.node!r}")
        pci = name.pci
        where = name.device if pci is None else PCI_KEY + pci[0]
        matches = [
            match
            for match in found.get((name.node, name.driver, where), [])
            if not name.pool or match.pool == name.pool
        ]
        if pci is not None and matches:
            matches, why = _pci_device(matches, pci[1])
            if why:
                refused[key] = ("device", f"{label}: {why}")
                continue
        if len(matches) > 1:
            refused[key] = (
                "ambiguous_device",
                f"{label} names {len(matches)} devices (pools "
                f"{', '.join(sorted(repr(match.pool) for match in matches))}"
                f"{'' if agent else ', or clusters'}); give its pool"
                f"{'' if agent else ' (or its uuid)'}",
            )
        elif matches and not matches[0].meter_id:
            refused[key] = (
                "not_metered",
                f"{label} is not an accelerator Tally meters (no meter id in the inventory)",
            )
        elif matches:
            resolved[key] = matches[0].meter_id
        else:
            missing[key] = name
    if missing and agent is not None:
        # A node of another cluster is a wrong token, not a device the sync will bring.
        elsewhere = set(
            Device.objects.filter(
                gone_at__isnull=True, node__name__in={name.node for name in missing.values()}
            )
            .exclude(cluster_id=agent.cluster_id)
            .values_list("node__name", flat=True)
        ) - set(
            Device.objects.filter(
                cluster_id=agent.cluster_id,
                node__name__in={name.node for name in missing.values()},
            ).values_list("node__name", flat=True)
        )
        for key, name in list(missing.items()):
            if name.node in elsewhere:
                refused[key] = (
                    "device_elsewhere",
                    f"{name.label.replace('this node', 'node ' + repr(name.node))}: node "
                    f"{name.node!r} is in another cluster than this token's ({agent.cluster})",
                )
                del missing[key]
    for key, name in missing.items():
        label = name.label.replace("this node", f"node {name.node!r}")
        if name.pci is not None:
            # No device name to form its identity from: nothing to keep its samples under.
            refused[key] = (
                "device",
                f"{label} is not in the inventory (no device of that driver publishes "
                f"{' or '.join(PCI_ATTRIBUTES[:2])} {name.pci[0]} there); run sync_inventory "
                "first",
            )
            continue
        if agent is None:
            refused[key] = (
                "device",
                f"{label} is not in the inventory; run sync_inventory first, or send its uuid",
            )
            continue
        pool = name.pool or name.node
        meter = formed_meter_id(agent.cluster.name, name.driver, pool, name.device)
        unknown[key] = (
            meter,
            (
                meter,
                f"{label} is not in the inventory of cluster {agent.cluster.name!r}; its samples "
                f"are kept aside as {meter} (pool {pool!r}) until the sync learns it",
            ),
        )
    return resolved, refused, unknown


class _SetAside(NamedTuple):
    """A sample set aside, as adoption reads it."""

    id: int
    device_uuid: str
    agent_token_id: int | None
    node: str
    ts_ms: int
    mig_placement: dict[str, Any] | None
    gpu_instance: dict[str, Any] | None


def _adoptable(candidates: Sequence[_SetAside]) -> dict[int, str]:
    """Of samples set aside, the meter id each one that may be adopted is stored under, by
    id, as `ingest` would have stored it had the inventory known then what it knows now: a
    device carrying its identity, if its sender may send for that device (`_misplaced`);
    else, for a dynamic MIG device's sample, the partition at its placement on the node the
    sample records, in its token's cluster (`_placed_mig_samples`). Adoption trusts nothing
    ingest would not."""
    tokens = AgentToken.objects.select_related("cluster").in_bulk(
        {row.agent_token_id for row in candidates if row.agent_token_id is not None}
    )
    places = _places({row.device_uuid for row in candidates})
    adopted: dict[int, str] = {}
    placed: dict[tuple[str, int | None], list[tuple[int, MigPlacement, int]]] = defaultdict(list)
    for row in candidates:
        token = None if row.agent_token_id is None else tokens[row.agent_token_id]
        if row.device_uuid in places:
            if token is None or not _misplaced(places[row.device_uuid], token):
                adopted[row.id] = row.device_uuid
        elif row.mig_placement is not None:
            cluster_id = None if token is None else token.cluster_id
            placed[row.node, cluster_id].append(
                (row.id, MigPlacement(**row.mig_placement), row.ts_ms)
            )
    for (node, cluster_id), rows in placed.items():
        found = partitions_at(
            {placement for _, placement, _ in rows},
            node=node,
            cluster_id=cluster_id,
            since_ms=min(ts_ms for _, _, ts_ms in rows),
        )
        for row_id, placement, ts_ms in rows:
            timeline = found.get(placement)
            meter_id = timeline.meter_id_at(ts_ms) if timeline is not None else None
            if meter_id is not None:
                adopted[row_id] = meter_id
    return adopted


def _adopted_instances(
    candidates: Sequence[_SetAside], meter_ids: dict[int, str]
) -> list[_InstanceSample]:
    """The GPU instances of the adopted samples (`meter_ids`, by id) that carry one, as
    `ingest` records them: under the meter id adopted, from their token's cluster (None: an
    operator's) and the node that sent them. Adopted or already stored (a twin sent again
    once the device was known), the instant was seen."""
    with_instance = [
        row for row in candidates if row.id in meter_ids and row.gpu_instance is not None
    ]
    clusters = dict(
        AgentToken.objects.filter(pk__in={row.agent_token_id for row in with_instance}).values_list(
            "pk", "cluster_id"
        )
    )
    return [
        _InstanceSample(
            meter_ids[row.id],
            row.ts_ms,
            GpuInstance(**row.gpu_instance),
            None if row.agent_token_id is None else clusters[row.agent_token_id],
            row.node,
        )
        for row in with_instance
        if row.gpu_instance is not None
    ]


# DCGM samples named by their GPU instance, set aside, that a spell of their GPU instance on
# their node may cover now (of any cluster: `_place` tells), from id `after` on: one index range
# of the GPU's spells per sample. The cluster each is of (null: an operator's, any).
_COVERED_ASIDE_SQL = f"""
SELECT u.id, u.device_uuid, u.ts_ms, u.node, u.gpu_instance ->> 'parent_uuid',
       (u.gpu_instance ->> 'gpu_instance_id')::integer, COALESCE(t.cluster_id, u.cluster_id)
FROM {_table(UnknownDeviceSample)} AS u
LEFT JOIN {_table(AgentToken)} AS t ON t.id = u.agent_token_id
WHERE u.id > %(after)s AND u.gpu_instance IS NOT NULL AND u.device_uuid LIKE '%%::gi%%'
  AND EXISTS (
      SELECT FROM {MigInstance._meta.db_table} AS m
      WHERE m.parent_uuid = u.gpu_instance ->> 'parent_uuid' AND m.last_ms >= u.ts_ms - %(hold)s
        AND m.first_ms <= u.ts_ms AND m.node = u.node
        AND m.gpu_instance_id = (u.gpu_instance ->> 'gpu_instance_id')::integer
  )
ORDER BY u.id LIMIT %(chunk)s
"""


def _place_set_aside(*, now: datetime) -> int:
    """Place the DCGM samples named by their GPU instance that are set aside though a spell
    covers their instant now, as `ingest` would place them arriving now; how many. Those set
    aside before their GPU instance's span was recorded (`DcgmInstance`: before migration
    0013) are found by no change of the spells, so adoption looks for them; their span is
    recorded, so a later change finds them. Read without locks: under the GPU instances'
    locks, a sample another writer moved meanwhile is no longer there to move. Each chunk is
    its own transaction."""
    placed = 0
    after = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                _COVERED_ASIDE_SQL, {"after": after, "hold": sample_hold_ms(), "chunk": ADOPT_CHUNK}
            )
            rows = cursor.fetchall()
            if not rows:
                return placed
            after = rows[-1][0]
            aside = [
                _Held(InstanceKey(cluster_id or 0, node, parent, instance), row_id, ts_ms, "",
                      cluster_id is None)
                for row_id, uuid, ts_ms, node, parent, instance, cluster_id in rows
                if uuid == instance_key(GpuInstance(parent, instance))
            ]  # fmt: skip
            if not aside:
                continue
            lock_instances(cursor, {one.key.instance for one in aside})
            placements = _place(cursor, {}, [], aside=aside)
            _lock_devices(cursor, placements.devices)
            _, shifted = placements.store(cursor, node="", received_at=now)
            spans: dict[tuple[str, str, int], tuple[int, int]] = {}
            for one in aside:
                first, last = spans.get(one.key.instance, (one.ts_ms, one.ts_ms))
                spans[one.key.instance] = (min(first, one.ts_ms), max(last, one.ts_ms))
            cursor.execute(
                _WIDEN_SQL, [json.dumps([[*instance, *span] for instance, span in spans.items()])]
            )
            mark_dirty(hours=touched_hours(shifted), at=now)
            placed += len(placements.moves)


def adopt_unknown_samples(*, now: datetime) -> int:
    """Move the samples set aside whose device has become known into `Sample`; how many.

    A sample is adopted only where `ingest` would have stored it had the device been known
    when it came (`_adoptable`): one an agent token sent, only for a device where that token
    may send (a node's token: a device on its node, the node the sample records; a
    cluster-wide token: one of its cluster); one an operator loaded (no token), for any
    device. A token cannot plant samples under the identity of a device elsewhere by naming
    it before the inventory knows it. A dynamic MIG device's sample is adopted by the
    partition at its placement, once the sync has published it, as `ingest` would have
    matched it. An adopted sample's GPU instance is recorded as `ingest` records it, and
    DCGM's samples named by that GPU instance are placed again where its spells changed (those
    are never adopted here: no device carries their name); and DCGM's samples set aside that a
    spell covers now are placed (`_place_set_aside`). The others stay aside until they expire
    (`metering.retention.purge_unknown_device_samples`).

    A sample already in `Sample` for the same device and instant wins; the one set aside is
    dropped. An adopted mean keeps its covered time. Hours the moved samples count in are
    marked dirty. Each chunk is its own transaction; rows another run holds are skipped, not
    waited for.
    """
    known = Exists(Device.objects.filter(meter_id=OuterRef("device_uuid"))) | Exists(
        Device.objects.filter(meter_id="", uuid=OuterRef("device_uuid"))
    )
    # Those of a GPU with partitions published on their node: `_adoptable` matches them.
    on_partitioned_gpu = Exists(
        Device.objects.filter(
            kind=DeviceKind.MIG,
            uuid="",
            parent_uuid=OuterRef("placed_on"),
            node__name=OuterRef("node"),
        ).exclude(meter_id="")
    )
    moved = 0
    after = 0  # the rows up to this id were seen: those not adoptable are not looked at again
    while True:
        with transaction.atomic():
            candidates = [
                _SetAside(*row)
                for row in UnknownDeviceSample.objects.filter(id__gt=after)
                .annotate(placed_on=KT("mig_placement__parent_uuid"))
                .filter(known | on_partitioned_gpu)
                .select_for_update(skip_locked=True)
                .order_by("id")
                .values_list(
                    "id",
                    "device_uuid",
                    "agent_token_id",
                    "node",
                    "ts_ms",
                    "mig_placement",
                    "gpu_instance",
                )[:ADOPT_CHUNK]
            ]
            if not candidates:
                return moved + _place_set_aside(now=now)
            after = candidates[-1].id
            meter_ids = _adoptable(candidates)
            if not meter_ids:
                continue
            # The samples set aside, each with the meter id it is adopted under.
            adopted = (
                f"{_table(UnknownDeviceSample)} JOIN ({json_rows('bigint', 'text')}) "
                "AS adopted(id, meter_id) USING (id)"
            )
            params = [json.dumps(list(meter_ids.items()))]
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT meter_id, MIN(ts_ms), MAX(ts_ms) FROM {adopted} GROUP BY meter_id",
                    params,
                )
                bounds = {uuid: _Bounds(first, last) for uuid, first, last in cursor.fetchall()}
                # The GPU instances' locks before the devices' (as `ingest`): the spells the
                # adopted samples record may move DCGM's samples to other devices.
                points = _instance_points(_adopted_instances(candidates, meter_ids))
                placements = _Placements()
                if points:
                    lock_instances(cursor, {key.instance for key in points})
                    placements = _place(cursor, record_instances(cursor, points), [])
                _lock_devices(cursor, bounds.keys() | placements.devices)
                stored, instants = _insert_new(
                    cursor,
                    Sample,
                    # Named as the column it fills, so that rows are kept in its order.
                    select="meter_id AS device_uuid, ts_ms, gpu_util, mem_used_bytes, "
                    "processes, node, received_at, covered_ms",
                    source=adopted,
                    where="true",
                    params=params,
                    first="id",
                    columns=f"{COLUMNS}, covered_ms",
                )
                if stored:
                    refresh_gaps(cursor, bounds)
                _, shifted = placements.store(cursor, node="", received_at=now)
            UnknownDeviceSample.objects.filter(id__in=meter_ids).delete()
            mark_dirty(hours=touched_hours(instants + shifted), at=now)
            moved += stored
