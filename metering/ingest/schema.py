"""The ingest payload's schema, declared with pydantic: what `POST /ingest/samples` takes (and
the `ingest_samples` command's file, which is the same), `Batch`, and each of its samples,
`Sample`: every field's type, bounds, length and characters, and the nesting of `processes`
and `mig_placement`. `SAMPLES` validates a whole batch's samples in one call (strict: no
string is taken for a number, no `true` for 1; unknown keys are ignored), and
`sample_problems` turns its errors into the messages ingest has always answered, each naming
its field (`gpu_util: 140 is not between 0 and 100`), as `InvalidSample`s.

What the schema cannot say is `metering.ingest.validation`'s: which of a sample's ways of
naming its device it took (`uuid`, or `driver` and `device`, or `driver` and `pci_bus_id`),
so which fields count; the timestamp's reading and window (counted from when the batch came);
`covered_seconds` against TALLY_SAMPLE_HOLD_SECONDS (a setting) and the millisecond it is
stored in; `start + size` of a placement; the fields one needs with another (`parent_uuid`
with `mig_placement`); and what the process list holds (JSON text jsonb takes). The gaps,
placement and adoption, which need the database, are the other modules'.

`json_schema()` is the JSON Schema the API reference documents (`docs/reference/ingest.md`).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any, NotRequired

from django.conf import settings
from pydantic import ConfigDict, Field, InstanceOf, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic's, on Python 3.11

from metering.ingest.named import MAX_NAME_LENGTH
from metering.ingest.rows import (
    MAX_BIGINT,
    MAX_GPU_INSTANCE_ID,
    MAX_MEMORY_SLICES,
    MAX_PROFILE_ID,
    MAX_PROFILE_LENGTH,
    MAX_UUID_LENGTH,
    InvalidSample,
)

# Printable ASCII (`str.isascii() and str.isprintable()`), as a pattern.
PRINTABLE_ASCII = r"^[ -~]*$"
# A Kubernetes node name: a DNS subdomain (RFC 1123); `named.NODE_NAME` with its length apart.
NODE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
MAX_NODE_NAME_LENGTH = 253
PCI_BUS_ID_PATTERN = r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$"
MAX_PARTITION = 4095

Uuid = Annotated[str, Field(min_length=1, max_length=MAX_UUID_LENGTH, pattern=PRINTABLE_ASCII)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=PRINTABLE_ASCII)]
NodeName = Annotated[
    str, Field(min_length=1, max_length=MAX_NODE_NAME_LENGTH, pattern=NODE_NAME_PATTERN)
]


@with_config(ConfigDict(strict=True, extra="ignore"))
class Placement(TypedDict):
    """Where a MIG device sits in its GPU, in memory slices (`start + size` at most
    MAX_MEMORY_SLICES)."""

    start: Annotated[int, Field(ge=0, lt=MAX_MEMORY_SLICES)]
    size: Annotated[int, Field(ge=1, le=MAX_MEMORY_SLICES)]


@with_config(ConfigDict(strict=True, extra="ignore"))
class Sample(TypedDict):
    """One utilisation sample. Its device is named by `uuid`, or by `driver` and `device` (or
    `pci_bus_id`, and `partition`), with `pool` and `node` where needed; never both ways."""

    uuid: NotRequired[Uuid | None]
    driver: NotRequired[Name | None]
    device: NotRequired[Name | None]
    pool: NotRequired[Name | None]
    node: NotRequired[NodeName | None]
    pci_bus_id: NotRequired[Annotated[str, Field(pattern=PCI_BUS_ID_PATTERN)] | None]
    partition: NotRequired[Annotated[int, Field(ge=0, le=MAX_PARTITION)] | None]
    ts: Annotated[str, Field(description="ISO 8601, with a timezone")]
    gpu_util: NotRequired[Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None]
    mem_used_bytes: NotRequired[Annotated[int, Field(ge=0, le=MAX_BIGINT)] | None]
    # What a process's fields hold is the agent's; JSON text jsonb takes, checked apart. Each
    # is checked to be an object, not copied (a copy of each would cost a third of the time).
    processes: NotRequired[list[InstanceOf[dict[Any, Any]]] | None]
    covered_seconds: NotRequired[Annotated[float, Field(gt=0, allow_inf_nan=False)] | None]
    mig_placement: NotRequired[Placement | None]
    parent_uuid: NotRequired[Uuid | None]
    mig_profile: NotRequired[
        Annotated[str, Field(min_length=1, max_length=MAX_PROFILE_LENGTH, pattern=PRINTABLE_ASCII)]
        | None
    ]
    mig_profile_id: NotRequired[Annotated[int, Field(ge=0, le=MAX_PROFILE_ID)] | None]
    gpu_instance_id: NotRequired[Annotated[int, Field(ge=0, le=MAX_GPU_INSTANCE_ID)] | None]


@with_config(ConfigDict(strict=True, extra="ignore"))
class _Sender(TypedDict):
    node: NodeName


@with_config(ConfigDict(strict=True, extra="ignore"))
class Batch(_Sender):
    """What an agent posts: its node and its samples (each validated on its own: a bad one
    is rejected, the rest stored)."""

    samples: list[Sample]


@with_config(ConfigDict(strict=True, extra="ignore"))
class Envelope(_Sender):
    """A batch with its samples unchecked: what the view checks before the token's node."""

    samples: list[Any]


SAMPLES: TypeAdapter[list[Sample]] = TypeAdapter(list[Sample])


ENVELOPE: TypeAdapter[Envelope] = TypeAdapter(Envelope)


def envelope_problems(payload: Any) -> Problems:
    """What `Envelope` refuses in a batch: its fields in error ("" for the body itself) -> the
    kind of error (`type`, `value`), as `sample_problems` gives a sample's; {} if none."""
    try:
        ENVELOPE.validate_python(payload)
    except ValidationError as exc:
        found: Problems = {}
        for error in exc.errors(include_url=False, include_input=False, include_context=False):
            loc = error["loc"]
            kind = "type" if error["type"] in _TYPE_ERRORS and len(loc) <= 1 else "value"
            found.setdefault(str(loc[0]) if loc else "", kind)
        return found
    return {}


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a batch, as the API reference gives it."""
    return TypeAdapter(Batch).json_schema()


def json_schema_text() -> str:
    """`json_schema()` as `docs/reference/ingest.md` shows it (a test holds the page to it)."""
    return json.dumps(json_schema(), indent=2)


# --- From pydantic's errors to ingest's messages -----------------------------------------------

# The errors of a value of the wrong type, or of none where one is needed.
_TYPE_ERRORS = frozenset(
    [
        "missing",
        "string_type",
        "int_type",
        "float_type",
        "list_type",
        "dict_type",
        "string_too_short",
    ]
)


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


def show(value: object) -> str:
    """A value for an error message, cut short: the message goes back to the sender."""
    # Scalars as written (true, null, 3, "x"); an object or array by its kind only.
    text = (
        json.dumps(value)
        if value is None or isinstance(value, str | int | float)
        else json_type(value)
    )
    return text if len(text) <= 64 else text[:61] + "..."


Problems = dict[str, str]  # a sample's field -> the type of pydantic's first error there


def sample_problems(raw: Sequence[object]) -> dict[int, Problems] | None:
    """Validate `raw` (a batch's samples) against `Sample` in one call: None if all are
    valid, else each invalid sample's index -> its fields in error ("" for the sample itself)
    -> the kind of error (`type` for a wrong type or none, `value` for one out of bounds)."""
    # The validated copy pydantic makes (a dict a sample, a list and dicts a process list) is
    # dropped at once, freed by reference counting; the cyclic collector, which those
    # allocations would otherwise set off again and again over a 5,000-sample batch (more than
    # doubling the time), is paused meanwhile, if it runs.
    collecting = gc.isenabled()
    gc.disable()
    try:
        SAMPLES.validate_python(raw)
    except ValidationError as exc:
        found: dict[int, Problems] = {}
        for error in exc.errors(include_url=False, include_input=False, include_context=False):
            loc = error["loc"]
            index = loc[0]
            assert isinstance(index, int)
            field_name = str(loc[1]) if len(loc) > 1 else ""
            # A placement's nested fields, a process list's items: the outer field's message.
            kind = "type" if error["type"] in _TYPE_ERRORS and len(loc) <= 2 else "value"
            found.setdefault(index, {}).setdefault(field_name, kind)
        return found
    finally:
        if collecting:
            gc.enable()
    return None


def _uuid_message(field_name: str) -> Callable[[str, object], str]:
    def message(kind: str, value: object) -> str:
        if kind == "type":
            or_named = " (or give driver and device)" if field_name == "uuid" else ""
            return f"must be a non-empty string{or_named}"
        return f"{show(value)} is not printable ASCII of at most {MAX_UUID_LENGTH} characters"

    return message


def _name_message(kind: str, value: object) -> str:
    if kind == "type":
        return f"must be a non-empty string as the ResourceSlice gives it, not {show(value)}"
    return f"{show(value)} is not printable ASCII of at most {MAX_NAME_LENGTH} characters"


def _placement_message(kind: str, value: object) -> str:
    if kind == "type" or type(value) is not dict:
        return f'must be an object {{"start": ..., "size": ...}}, not {show(value)}'
    return placement_bounds_message(value.get("start"), value.get("size"))


def placement_bounds_message(start: object, size: object) -> str:
    return (
        f"start and size must be integers, start from 0 and size from 1, start + size at "
        f"most {MAX_MEMORY_SLICES} (memory slices), not {show(start)} and {show(size)}"
    )


def covered_bounds_message(covered: object) -> str:
    hold = int(settings.TALLY_SAMPLE_HOLD_SECONDS)
    return (
        f"must be more than 0 and at most {hold} (TALLY_SAMPLE_HOLD_SECONDS, how long a "
        f"sample holds), not {show(covered)}: send means over a shorter interval"
    )


# Each field's message for a value the schema refuses: (the kind of error, the value) -> why.
MESSAGES: dict[str, Callable[[str, object], str]] = {
    "": lambda kind, value: f"must be an object, not {show(value)}",
    "uuid": _uuid_message("uuid"),
    "parent_uuid": _uuid_message("parent_uuid"),
    "driver": _name_message,
    "device": _name_message,
    "pool": _name_message,
    "node": lambda kind, value: (
        f"{show(value)} is not a Kubernetes node name (a DNS subdomain, <= 253)"
    ),
    "pci_bus_id": lambda kind, value: f"{show(value)} is not a PCI address like 0000:19:00.0",
    "partition": lambda kind, value: (
        f"must be an integer from 0 to {MAX_PARTITION}, not {show(value)}"
    ),
    "ts": lambda kind, value: "must be an ISO 8601 string with a timezone",
    "gpu_util": lambda kind, value: (
        f"must be a number or null, not {show(value)}"
        if kind == "type"
        else f"{show(value)} is not between 0 and 100"
    ),
    "mem_used_bytes": lambda kind, value: (
        f"must be an integer from 0 to 2^63-1, not {show(value)}"
    ),
    "processes": lambda kind, value: "must be a list of objects",
    "covered_seconds": lambda kind, value: (
        f"must be a number of seconds, not {show(value)}"
        if kind == "type"
        else covered_bounds_message(value)
    ),
    "mig_placement": _placement_message,
    "mig_profile": lambda kind, value: (
        f"must be printable ASCII of 1 to {MAX_PROFILE_LENGTH} characters, like 1g.10gb, "
        f"not {show(value)}"
    ),
    "mig_profile_id": lambda kind, value: (
        f"must be an integer from 0 to {MAX_PROFILE_ID}, not {show(value)}"
    ),
    "gpu_instance_id": lambda kind, value: (
        f"must be an integer from 0 to {MAX_GPU_INSTANCE_ID}, not {show(value)}"
    ),
}


def refuse(problems: Problems | None, sample: Any, field_name: str) -> None:
    """Raise the `InvalidSample` of `field_name` if the schema refused its value in `sample`.

    Only the fields a sample's checks reach count: a `node` beside a `uuid` is not read."""
    if problems is not None and field_name in problems:
        value = sample.get(field_name) if field_name else sample
        raise InvalidSample(field_name, MESSAGES[field_name](problems[field_name], value))
