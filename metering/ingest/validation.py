"""Validation: a batch's samples checked against their schema (`metering.ingest.schema`,
in one call), then each taken field by field into its stored form (`SampleRow`), or left out
with a reason that names the field (`validate_samples`): the schema's refusal, in the order the
fields have always been checked, or what the schema cannot say (see `schema`). Every value
that reaches the database is checked here, so a stored batch never fails on a value.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any, NamedTuple

import orjson
from django.conf import settings
from django.utils import timezone

from metering.hours import epoch_ms
from metering.ingest.named import NAMED, PCI_KEY
from metering.ingest.rows import (
    MAX_GPU_INSTANCE_ID,
    MAX_MEMORY_SLICES,
    InvalidSample,
    Rejection,
    SampleRow,
)
from metering.ingest.schema import (
    MESSAGES,
    Problems,
    covered_bounds_message,
    placement_bounds_message,
    refuse,
    sample_problems,
)
from metering.ingest.schema import Sample as SampleSchema
from metering.ingest.schema import (
    show as _show,
)
from metering.mig_samples import GpuInstance, MigPlacement

# A NUL escaped in JSON text (an odd run of backslashes before u0000): jsonb refuses it.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


# Validation


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
    found = sample_problems([sample])
    return SampleChecker(window=window).check(sample, None if found is None else found[0])


# The fields of a plain sample, an agent's usual one: named by `uuid`, with its readings. A
# sample with any other field of the schema (naming its device otherwise, or a MIG device's),
# even null, is checked field by field.
_PLAIN = frozenset(["uuid", "ts", "gpu_util", "mem_used_bytes", "processes", "covered_seconds"])
_NOT_PLAIN = frozenset(SampleSchema.__annotations__) - _PLAIN
_PLAIN_FIELDS_ONLY = _NOT_PLAIN.isdisjoint


class SampleChecker:
    """`check_sample` for the samples of one batch, which repeat a few device UUIDs and
    instants thousands of times: each distinct UUID and timestamp text is checked once."""

    def __init__(self, *, window: Window) -> None:
        self.window = window
        self._valid_uuids: set[str] = set()
        self._instants: dict[str, int] = {}  # timestamp text -> ms, valid ones only
        self._named_keys: dict[tuple[Any, ...], str] = {}  # identity fields -> key, valid ones
        self._covered_ms: dict[float, int] = {}  # a float covered_seconds -> ms, valid ones
        # (parent_uuid, gpu_instance_id) -> the GPU instance, valid ones (the schema took both)
        self._instances: dict[tuple[Any, Any], GpuInstance] = {}
        # A DCGM sample's `<parent UUID>::gi<N>` as sent -> (its key as stored, its GPU instance)
        self._keyed: dict[str, tuple[str, GpuInstance]] = {}

    def _named(self, sample: dict[str, Any], problems: Problems | None) -> str:
        """`_named_key(sample)`, worked out once per distinct identity of the batch."""
        if problems is not None:  # the schema refused a field: checked in order, not kept
            return _named_key(sample, problems)
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
            key = self._named_keys[fields] = _named_key(sample, None)
            return key

    def plain_rows(self, raw: Sequence[Any]) -> list[SampleRow] | None:
        """The stored forms of a batch the schema found valid in which every sample names its
        device by `uuid` alone and gives none of a MIG device's fields: an agent's usual
        batch. Worked out a field at a time across the batch (each distinct UUID, instant and
        covered time once), which gives the rows `check` gives sample by sample, for a sixth
        of the time. None when a sample needs `check`: another field, or a value refused (a
        timestamp out of the window, a process list jsonb cannot take), which `check` then
        reports, sample by sample."""
        if not all(map(_PLAIN_FIELDS_ONLY, raw)):
            return None
        uuids = [sample.get("uuid") for sample in raw]
        instants = [sample["ts"] for sample in raw]
        utils = [sample.get("gpu_util") for sample in raw]
        processes = [sample.get("processes") for sample in raw]
        covered = [sample.get("covered_seconds") for sample in raw]
        try:
            for uuid in set(uuids):
                if uuid is None or _keyed_instance(uuid) is not None:
                    return None
            ms = {ts: _checked_ms(ts, window=self.window) for ts in set(instants)}
            covered_ms: dict[Any, int | None] = {
                value: _covered_ms(value) for value in set(covered) if value is not None
            }
            processes_json = [
                None if value is None else _processes_json(value) for value in processes
            ]
        except InvalidSample:
            return None
        covered_ms[None] = None
        return list(
            map(
                SampleRow,
                uuids,
                map(ms.__getitem__, instants),
                [None if value is None else float(value) for value in utils],
                [sample.get("mem_used_bytes") for sample in raw],
                processes_json,
                map(covered_ms.__getitem__, covered),
            )
        )

    def check(self, sample: Any, problems: Problems | None) -> SampleRow:
        """As `check_sample`, for a sample `problems` says what the schema refused in (None:
        nothing)."""
        if problems is not None:
            refuse(problems, sample, "")
        uuid = sample.get("uuid")
        if not (isinstance(uuid, str) and uuid in self._valid_uuids) or (
            "driver" in sample or "device" in sample
        ):
            if uuid is None and ("driver" in sample or "device" in sample):
                uuid = self._named(sample, problems)
            elif sample.get("driver") is not None or sample.get("device") is not None:
                raise InvalidSample(
                    "uuid",
                    "give uuid, or driver and device, not both: they could name two devices",
                )
            else:
                uuid = _checked_uuid(sample, problems)
                keyed = _keyed_instance(uuid)
                if keyed is not None:
                    self._keyed[uuid] = (instance_key(keyed), keyed)
                self._valid_uuids.add(uuid)
        keyed_as = self._keyed.get(uuid) if self._keyed else None
        if problems is not None:
            refuse(problems, sample, "ts")
        ts = sample["ts"]
        ts_ms = self._instants.get(ts)
        if ts_ms is None:
            ts_ms = self._instants[ts] = _checked_ms(ts, window=self.window)
        if problems is not None:
            refuse(problems, sample, "gpu_util")
            refuse(problems, sample, "mem_used_bytes")
            refuse(problems, sample, "processes")
        gpu_util = sample.get("gpu_util")
        if gpu_util is not None:
            gpu_util = float(gpu_util)
        mem_used_bytes = sample.get("mem_used_bytes")
        processes = sample.get("processes")
        processes_json = None if processes is None else _processes_json(processes)
        covered = sample.get("covered_seconds")
        covered_ms = None
        if covered is not None:
            if problems is not None:
                refuse(problems, sample, "covered_seconds")
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
            placement = _checked_placement(sample, placement, problems)
        instance = sample.get("gpu_instance_id")
        if keyed_as is not None:
            uuid, instance = keyed_as
            _check_agrees(sample, instance)
        elif instance is not None:
            if uuid[:1] == NAMED:
                raise InvalidSample(
                    "gpu_instance_id", "goes with a MIG device's uuid, not with driver and device"
                )
            if problems is not None:
                instance = _checked_instance(sample, instance, problems)
            else:
                key = (sample.get("parent_uuid"), instance)
                try:
                    instance = self._instances[key]
                except KeyError:
                    instance = self._instances[key] = _checked_instance(sample, instance, None)
        return SampleRow(
            uuid, ts_ms, gpu_util, mem_used_bytes, processes_json, covered_ms, placement, instance
        )


_MS = Decimal(1)


def _covered_ms(covered: Any) -> int:
    """A mean's `covered_seconds` in whole milliseconds: the sample is the mean of readings
    over `[ts, ts + covered_seconds)` (an agent sampling each second sends minute means).

    Rounded half up from the decimal the agent sent (a float's shortest text reads back as
    that decimal), so 4.0005 is 4,001 ms, never 4,000 through binary error. The rollup holds
    a sample's utilisation until the device's next sample, at most TALLY_SAMPLE_HOLD_SECONDS,
    so back-to-back means each weigh their whole interval; a longer one would count in part
    only, and is refused rather than undercounted; one under half a millisecond would hold
    for none, and is refused too."""
    if not covered <= int(settings.TALLY_SAMPLE_HOLD_SECONDS):  # a number, more than 0: schema
        raise InvalidSample("covered_seconds", covered_bounds_message(covered))
    if type(covered) is int:
        return covered * 1000
    covered_ms = int(Decimal(repr(covered)).scaleb(3).quantize(_MS, ROUND_HALF_UP))
    if not covered_ms:
        raise InvalidSample(
            "covered_seconds",
            f"{_show(covered)} is under half a millisecond, which is what it is stored in",
        )
    return covered_ms


def _checked_uuid(
    sample: dict[str, Any], problems: Problems | None, field_name: str = "uuid"
) -> str:
    """A sample's `uuid` (or `parent_uuid`), which must be given."""
    if problems is not None:
        refuse(problems, sample, field_name)
    uuid = sample.get(field_name)
    if uuid is None:
        raise InvalidSample(field_name, MESSAGES[field_name]("type", uuid))
    return uuid


def _checked_placement(
    sample: dict[str, Any], placement: Any, problems: Problems | None
) -> MigPlacement:
    """Where a MIG device sits, as its sample gives it: `mig_placement` (`start` and `size`,
    in memory slices) with `parent_uuid`, and optionally `mig_profile` and `mig_profile_id`
    (its GPU instance profile id), as NVML reads them (`agent.nvml`)."""
    if problems is not None:
        refuse(problems, sample, "mig_placement")
    start, size = placement["start"], placement["size"]
    if start + size > MAX_MEMORY_SLICES:
        raise InvalidSample("mig_placement", placement_bounds_message(start, size))
    parent = sample.get("parent_uuid")
    if parent is None:
        raise InvalidSample("parent_uuid", "is needed with mig_placement: the MIG device's GPU")
    if problems is not None:
        refuse(problems, sample, "mig_profile")
        refuse(problems, sample, "mig_profile_id")
    profile = sample.get("mig_profile")
    if profile is None:
        profile = ""
    profile_id = sample.get("mig_profile_id")
    return MigPlacement(
        _checked_uuid(sample, problems, "parent_uuid"), start, size, profile, profile_id
    )


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


def _checked_instance(
    sample: dict[str, Any], instance_id: Any, problems: Problems | None
) -> GpuInstance:
    """A MIG device's GPU instance, as its sample gives it: `gpu_instance_id` with
    `parent_uuid` (`agent.nvml`)."""
    if problems is not None:
        refuse(problems, sample, "gpu_instance_id")
    if sample.get("parent_uuid") is None:
        raise InvalidSample("parent_uuid", "is needed with gpu_instance_id: the MIG device's GPU")
    return GpuInstance(_checked_uuid(sample, problems, "parent_uuid"), instance_id)


def _named_key(sample: dict[str, Any], problems: Problems | None) -> str:
    """The key a sample naming its device by `driver` and `device` travels under."""
    driver = _checked_name(sample, "driver", problems)
    if "device" in sample or "pci_bus_id" not in sample:
        device = _checked_name(sample, "device", problems)
    else:
        bus_id = sample["pci_bus_id"]
        if bus_id is None:
            raise InvalidSample("pci_bus_id", MESSAGES["pci_bus_id"]("type", bus_id))
        if problems is not None:
            refuse(problems, sample, "pci_bus_id")
            refuse(problems, sample, "partition")
        partition = sample.get("partition")
        device = f"{PCI_KEY}{bus_id.lower()}{PCI_KEY}{'' if partition is None else partition}"
    pool = "" if sample.get("pool") is None else _checked_name(sample, "pool", problems)
    if problems is not None:
        refuse(problems, sample, "node")
    node = sample.get("node")
    if node is None:
        node = ""
    return NAMED + NAMED.join((node, driver, pool, device))


def _checked_name(sample: dict[str, Any], name: str, problems: Problems | None) -> str:
    if problems is not None:
        refuse(problems, sample, name)
    value = sample.get(name)
    if value is None:
        raise InvalidSample(name, MESSAGES[name]("type", value))
    return value


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


# The standard library's encoder, for the process lists orjson will not write (see
# `_processes_json`): it says, as it always did, whether JSON can carry them at all. (A
# structure that contains itself, which JSON input never does, ends in RecursionError instead
# of the circular reference check.)
_PROCESSES_ENCODER = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, separators=(",", ":"), check_circular=False
)


def _non_finite(value: object) -> bool:
    """Whether `value` holds NaN or an infinity anywhere in it (without recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is float:
            if not math.isfinite(item):
                return True
        elif type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    return False


def _processes_json(processes: list[Any]) -> str:
    """A sample's process list as JSON text, compact, non-ASCII characters as themselves.

    orjson writes it (the same text the standard library's compact encoder writes, but for
    how some floats are spelt, `1e-7` for `1e-07`, the same number to jsonb). It writes NaN
    and the infinities as `null`, so a list whose text has a `null` is looked through for them;
    what it refuses to write (an integer past 64 bits, a key that is no string, a lone
    surrogate, nesting past 254 levels) the standard library's encoder writes or refuses, as
    before."""
    try:
        try:
            text = orjson.dumps(processes).decode()
        except orjson.JSONEncodeError:
            text = _PROCESSES_ENCODER.encode(processes)
            if not text.isascii():
                text.encode()
        else:
            if "null" in text and _non_finite(processes):
                raise ValueError("NaN or an infinity")
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
    checker = SampleChecker(window=sample_window(now))
    found = sample_problems(raw)
    if found is None:
        rows = checker.plain_rows(raw)
        if rows is not None:
            return rows, []
    check = checker.check
    valid: list[SampleRow] = []
    rejected: list[Rejection] = []
    for index, sample in enumerate(raw):
        try:
            valid.append(check(sample, None if found is None else found.get(index)))
        except InvalidSample as exc:
            where = f"samples[{index}]"
            reason = f"{where}.{exc}" if exc.field_name else f"{where}: {exc}"
            rejected.append({"index": index, "reason": reason, "label": exc.label})
    return valid, rejected
