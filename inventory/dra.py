"""Reading DRA objects: ResourceSlices, DeviceClasses, ResourceClaims and Nodes as plain data.

Both API layouts are read. In `resource.k8s.io/v1` and `v1beta2` a slice's device carries its
fields directly and a claim's request wraps them in `exactly`; in `v1beta1` (and `v1alpha3`)
device fields sit under `basic` and request fields sit flat on the request. Everything is
normalised to the v1 shape here, and fields this module does not know are kept, never dropped.

A malformed object raises `DRAObjectError`, which names the object and the field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any

import orjson
from django.utils.dateparse import parse_datetime
from kubernetes.utils import parse_quantity

from inventory import profiles

GROUP = "resource.k8s.io"
# Attribute value types of the v1 API; one of them is set on every attribute value.
ATTRIBUTE_TYPES = ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
# Device fields that become their own columns; the rest of a device entry is kept in `extra`.
DEVICE_COLUMNS = ("name", "attributes", "capacity")
# Attributes that identify one device rather than describe it; left out of device shapes.
IDENTITY_ATTRIBUTES = frozenset(
    {
        "uuid",
        "parentUUID",
        "pciBusID",
        "pcieRoot",
        "index",
        "minor",
        "serialNumber",
        "serial",  # Intel Gaudi
        "pciAddress",  # Intel GPU
        "pciAddr",  # AMD auto-partition and vfio devices
        "gpuIndex",  # AMD auto-partition devices: the physical GPU's index on its node
    }
)
# NVIDIA's attribute domain: qualified names under it are read like unqualified ones.
NVIDIA_DOMAIN = "gpu.nvidia.com"
# The most devices the scheduler gives one claim (resource.k8s.io AllocationResultsMaxSize): a
# request for more can never be allocated.
ALLOCATION_RESULTS_MAX_SIZE = 32
# The most devices one request may ask for. The API's field is an int64, but a count above
# ALLOCATION_RESULTS_MAX_SIZE can never be allocated; this bound, far above that, keeps what a
# claim counts on a quota rule (count times a device's share, in bytes for a memory rule: under
# 2**40 for any GPU made) within the rules' and reservations' NUMERIC(24, 6) columns.
MAX_REQUEST_COUNT = 2**16


class DRAObjectError(ValueError):
    """A DRA object that cannot be read; the message names the object and the field."""

    def __init__(self, obj_ref: str, field_path: str, problem: str) -> None:
        self.obj_ref = obj_ref
        self.field_path = field_path
        self.problem = problem
        super().__init__(f"{obj_ref}: {field_path}: {problem}")


@dataclass(slots=True)
class ParsedDevice:
    """One device entry of a slice, normalised to the v1 layout."""

    name: str
    attributes: dict[str, dict[str, Any]]
    capacity: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    consumes_counters: list[dict[str, Any]]
    node_name: str

    def attribute(self, name: str, driver: str) -> Any:
        """The value of attribute `name`, unqualified or qualified with the driver's domain."""
        for key in (name, f"{driver}/{name}", f"{NVIDIA_DOMAIN}/{name}"):
            value = self.attributes.get(key)
            if value is not None:
                for type_name in ATTRIBUTE_TYPES:
                    if type_name in value:
                        return value[type_name]
        return None

    def capacity_value(self, name: str, driver: str) -> Decimal | None:
        for key in (name, f"{driver}/{name}", f"{NVIDIA_DOMAIN}/{name}"):
            entry = self.capacity.get(key)
            if entry is not None and "value" in entry:
                return Decimal(parse_quantity(entry["value"]))
        return None


@dataclass(slots=True)
class ParsedSlice:
    name: str
    uid: str
    api_version: str
    resource_version: str
    driver: str
    pool: str
    generation: int
    resource_slice_count: int
    node_name: str
    devices: list[ParsedDevice]
    shared_counters: list[dict[str, Any]]
    spec: dict[str, Any]


@dataclass(slots=True)
class ParsedDeviceClass:
    name: str
    uid: str
    api_version: str
    resource_version: str
    selectors: list[str]
    extended_resource_name: str
    spec: dict[str, Any]


@dataclass(slots=True)
class ParsedRequest:
    """A device request, or one alternative of a `firstAvailable` request."""

    name: str
    device_class_name: str
    selectors: list[str]
    allocation_mode: str
    count: int
    admin_access: bool
    capacity_requests: dict[str, str]
    first_available: list[ParsedRequest] = field(default_factory=list)


@dataclass(slots=True)
class ParsedResult:
    """One entry of `status.allocation.devices.results`."""

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool
    share_id: str
    consumed_capacity: dict[str, str]


@dataclass(slots=True)
class ParsedClaim:
    namespace: str
    name: str
    uid: str
    api_version: str
    resource_version: str
    labels: dict[str, str]
    annotations: dict[str, str]
    owner_references: list[dict[str, Any]]
    created_at: datetime | None
    requests: list[ParsedRequest]
    results: list[ParsedResult]
    allocated_at: datetime | None
    spec: dict[str, Any]
    status: dict[str, Any]

    @property
    def key(self) -> str:
        """The claim's identity: its uid, or namespace/name for objects written by hand."""
        return self.uid or f"{self.namespace}/{self.name}"


@dataclass(slots=True)
class ParsedNode:
    name: str
    labels: dict[str, str]


Parsed = ParsedSlice | ParsedDeviceClass | ParsedClaim | ParsedNode


class _Reader:
    """Typed access to one object's fields, with errors that name the object and field."""

    def __init__(self, obj_ref: str) -> None:
        self.obj_ref = obj_ref

    def fail(self, path: str, problem: str) -> DRAObjectError:
        return DRAObjectError(self.obj_ref, path, problem)

    def mapping(self, parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
        value = parent.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(f"{path}.{key}", f"must be a mapping, not {_type_name(value)}")
        return value

    def listing(self, parent: dict[str, Any], key: str, path: str) -> list[Any]:
        value = parent.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(f"{path}.{key}", f"must be a list, not {_type_name(value)}")
        return value

    def string(self, parent: dict[str, Any], key: str, path: str, *, required: bool) -> str:
        value = parent.get(key)
        if value is None or value == "":
            if required:
                raise self.fail(f"{path}.{key}", "is required")
            return ""
        if not isinstance(value, str):
            raise self.fail(f"{path}.{key}", f"must be a string, not {_type_name(value)}")
        return value

    def integer(self, parent: dict[str, Any], key: str, path: str, *, default: int | None) -> int:
        value = parent.get(key)
        if value is None:
            if default is None:
                raise self.fail(f"{path}.{key}", "is required")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{path}.{key}", f"must be an integer, not {_type_name(value)}")
        return value

    def quantity(self, value: Any, path: str) -> str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise self.fail(path, f"must be a quantity, not {_type_name(value)}")
        try:
            parse_quantity(value)
        except ValueError as exc:
            raise self.fail(path, f"{value!r} is not a valid quantity") from exc
        return str(value)

    def timestamp(self, parent: dict[str, Any], key: str, path: str) -> datetime | None:
        value = parent.get(key)
        if value is None:
            return None
        if isinstance(value, datetime):  # YAML loaders turn unquoted timestamps into datetimes
            return value
        parsed = parse_datetime(value) if isinstance(value, str) else None
        if parsed is None:
            raise self.fail(f"{path}.{key}", f"{value!r} is not an RFC 3339 timestamp")
        return parsed


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def object_ref(obj: Any) -> str:
    """`Kind namespace/name` for messages, as far as the object allows."""
    if not isinstance(obj, dict):
        return f"object of type {type(obj).__name__}"
    metadata: dict[str, Any] = obj["metadata"] if isinstance(obj.get("metadata"), dict) else {}
    name = metadata.get("name") or metadata.get("generateName") or "<no name>"
    namespace = metadata.get("namespace")
    kind = obj.get("kind") or "<no kind>"
    return f"{kind} {namespace}/{name}" if namespace else f"{kind} {name}"


def object_identity(obj: Any) -> tuple[str, str] | None:
    """(kind, identity) of an object, when it has enough to be known, even if malformed.

    Used so that a malformed version of a known object is not taken for its disappearance.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        return None
    metadata = obj["metadata"]
    kind = obj.get("kind")
    name = metadata.get("name")
    if not isinstance(kind, str) or not isinstance(name, str) or not name:
        return None
    if kind == "ResourceClaim":
        uid = metadata.get("uid")
        namespace = metadata.get("namespace") or "default"
        return kind, uid if isinstance(uid, str) and uid else f"{namespace}/{name}"
    return kind, name


def parse_object(obj: Any) -> Parsed | None:
    """Parse one Kubernetes object; None for kinds the inventory does not keep."""
    ref = object_ref(obj)
    reader = _Reader(ref)
    if not isinstance(obj, dict):
        raise reader.fail("<object>", "must be a mapping")
    kind = obj.get("kind")
    api_version = obj.get("apiVersion")
    if not isinstance(kind, str) or not kind:
        raise reader.fail("kind", "is required")
    if kind not in _PARSERS:
        return None
    if not isinstance(api_version, str) or not api_version:
        raise reader.fail("apiVersion", "is required")
    group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
    if kind != "Node" and group != GROUP:
        raise reader.fail("apiVersion", f"{api_version!r} is not in the {GROUP} group")
    metadata = reader.mapping(obj, "metadata", "")
    return _PARSERS[kind](obj, api_version, metadata, reader)


def _parse_slice(
    obj: dict[str, Any], api_version: str, metadata: dict[str, Any], reader: _Reader
) -> ParsedSlice:
    name = reader.string(metadata, "name", "metadata", required=True)
    spec = reader.mapping(obj, "spec", "")
    if not spec:
        raise reader.fail("spec", "is required")
    pool = reader.mapping(spec, "pool", "spec")
    if not pool:
        raise reader.fail("spec.pool", "is required")
    driver = reader.string(spec, "driver", "spec", required=True)
    slice_node = reader.string(spec, "nodeName", "spec", required=False)
    devices = [
        _parse_device(entry, f"spec.devices[{index}]", reader, slice_node)
        for index, entry in enumerate(reader.listing(spec, "devices", "spec"))
    ]
    shared = reader.listing(spec, "sharedCounters", "spec")
    for index, counter_set in enumerate(shared):
        if not isinstance(counter_set, dict):
            raise reader.fail(f"spec.sharedCounters[{index}]", "must be a mapping")
        reader.string(counter_set, "name", f"spec.sharedCounters[{index}]", required=True)
        _quantities(reader, counter_set, "counters", f"spec.sharedCounters[{index}]")
    slice_count = reader.integer(pool, "resourceSliceCount", "spec.pool", default=1)
    if slice_count < 1:
        raise reader.fail("spec.pool.resourceSliceCount", "must be at least 1")
    return ParsedSlice(
        name=name,
        uid=reader.string(metadata, "uid", "metadata", required=False),
        api_version=api_version,
        resource_version=str(metadata.get("resourceVersion") or ""),
        driver=driver,
        pool=reader.string(pool, "name", "spec.pool", required=True),
        generation=reader.integer(pool, "generation", "spec.pool", default=0),
        resource_slice_count=slice_count,
        node_name=slice_node,
        devices=devices,
        shared_counters=shared,
        spec=spec,
    )


def _quantities(reader: _Reader, parent: dict[str, Any], key: str, path: str) -> None:
    """Check a `{name: {value: quantity}}` mapping, as counters and capacities are."""
    for counter, entry in reader.mapping(parent, key, path).items():
        entry_path = f"{path}.{key}.{counter}"
        if not isinstance(entry, dict) or "value" not in entry:
            raise reader.fail(entry_path, "must be a mapping with a value")
        reader.quantity(entry["value"], f"{entry_path}.value")


def _parse_device(entry: Any, path: str, reader: _Reader, slice_node: str) -> ParsedDevice:
    if not isinstance(entry, dict):
        raise reader.fail(path, "must be a mapping")
    fields = dict(entry)
    basic = fields.pop("basic", None)  # v1beta1 and v1alpha3 wrap the device's fields
    if basic is not None:
        if not isinstance(basic, dict):
            raise reader.fail(f"{path}.basic", "must be a mapping")
        fields = {**basic, **fields}
    name = reader.string(fields, "name", path, required=True)
    attributes = reader.mapping(fields, "attributes", path)
    for key, value in attributes.items():
        if not isinstance(value, dict) or not any(t in value for t in ATTRIBUTE_TYPES):
            raise reader.fail(
                f"{path}.attributes.{key}", f"must set one of {', '.join(ATTRIBUTE_TYPES[:4])}"
            )
    capacity: dict[str, dict[str, Any]] = {}
    for key, value in reader.mapping(fields, "capacity", path).items():
        # v1alpha3 wrote a bare quantity; later versions a mapping with `value`.
        entry_value = value if isinstance(value, dict) else {"value": value}
        if "value" not in entry_value:
            raise reader.fail(f"{path}.capacity.{key}", "must have a value")
        reader.quantity(entry_value["value"], f"{path}.capacity.{key}.value")
        capacity[key] = entry_value
    consumes = reader.listing(fields, "consumesCounters", path)
    for index, consumption in enumerate(consumes):
        consumption_path = f"{path}.consumesCounters[{index}]"
        if not isinstance(consumption, dict):
            raise reader.fail(consumption_path, "must be a mapping")
        reader.string(consumption, "counterSet", consumption_path, required=True)
        _quantities(reader, consumption, "counters", consumption_path)
    node_name = reader.string(fields, "nodeName", path, required=False) or slice_node
    extra = {key: value for key, value in fields.items() if key not in DEVICE_COLUMNS}
    return ParsedDevice(
        name=name,
        attributes=attributes,
        capacity=capacity,
        extra=extra,
        consumes_counters=consumes,
        node_name=node_name,
    )


def _parse_device_class(
    obj: dict[str, Any], api_version: str, metadata: dict[str, Any], reader: _Reader
) -> ParsedDeviceClass:
    spec = reader.mapping(obj, "spec", "")
    return ParsedDeviceClass(
        name=reader.string(metadata, "name", "metadata", required=True),
        uid=reader.string(metadata, "uid", "metadata", required=False),
        api_version=api_version,
        resource_version=str(metadata.get("resourceVersion") or ""),
        selectors=_selectors(reader, spec, "spec"),
        extended_resource_name=reader.string(spec, "extendedResourceName", "spec", required=False),
        spec=spec,
    )


def _selectors(reader: _Reader, parent: dict[str, Any], path: str) -> list[str]:
    expressions = []
    for index, selector in enumerate(reader.listing(parent, "selectors", path)):
        selector_path = f"{path}.selectors[{index}]"
        if not isinstance(selector, dict):
            raise reader.fail(selector_path, "must be a mapping")
        cel = selector.get("cel")
        if not isinstance(cel, dict):
            problem = "is missing" if cel is None else f"must be a mapping, not {_type_name(cel)}"
            raise reader.fail(f"{selector_path}.cel", problem)
        expressions.append(reader.string(cel, "expression", f"{selector_path}.cel", required=True))
    return expressions


def _parse_request(fields: dict[str, Any], path: str, reader: _Reader) -> ParsedRequest:
    capacity_requests = {}
    capacity = reader.mapping(fields, "capacity", path)
    for key, value in reader.mapping(capacity, "requests", f"{path}.capacity").items():
        capacity_requests[key] = reader.quantity(value, f"{path}.capacity.requests.{key}")
    mode = reader.string(fields, "allocationMode", path, required=False) or "ExactCount"
    count = reader.integer(fields, "count", path, default=1)
    # As the API server validates it: an ExactCount request asks for at least one device;
    # with `All` the count is not used.
    least = 1 if mode == "ExactCount" else 0
    if count < least:
        raise reader.fail(f"{path}.count", f"must be at least {least}")
    if count > MAX_REQUEST_COUNT:
        raise reader.fail(f"{path}.count", f"must be at most {MAX_REQUEST_COUNT}")
    admin_access = fields.get("adminAccess") or False
    if not isinstance(admin_access, bool):
        raise reader.fail(f"{path}.adminAccess", "must be a boolean")
    return ParsedRequest(
        name=reader.string(fields, "name", path, required=True),
        device_class_name=reader.string(fields, "deviceClassName", path, required=False),
        selectors=_selectors(reader, fields, path),
        allocation_mode=mode,
        count=count,
        admin_access=admin_access,
        capacity_requests=capacity_requests,
    )


def flat_requests(api_version: str) -> bool:
    """Whether a claim of `api_version` writes a request's class, selectors and count on the
    request itself (v1alpha3, v1beta1), not under its `exactly` (v1beta2, v1)."""
    return api_version.endswith(("/v1beta1", "/v1alpha3"))


def parse_claim_requests(
    spec: dict[str, Any], api_version: str, reader: _Reader | None = None
) -> list[ParsedRequest]:
    """The requests of a claim spec (or a template's inner spec), in the v1 shape."""
    reader = reader or _Reader("ResourceClaim")
    devices = reader.mapping(spec, "devices", "spec")
    flat = flat_requests(api_version)
    requests = []
    for index, request in enumerate(reader.listing(devices, "requests", "spec.devices")):
        path = f"spec.devices.requests[{index}]"
        if not isinstance(request, dict):
            raise reader.fail(path, "must be a mapping")
        name = reader.string(request, "name", path, required=True)
        alternatives = [
            _parse_request(alternative, f"{path}.firstAvailable[{alt_index}]", reader)
            for alt_index, alternative in enumerate(reader.listing(request, "firstAvailable", path))
        ]
        if alternatives:
            parsed = ParsedRequest(
                name=name,
                device_class_name="",
                selectors=[],
                allocation_mode="",
                count=0,
                admin_access=False,
                capacity_requests={},
                first_available=alternatives,
            )
        elif flat:
            parsed = _parse_request(request, path, reader)
        else:
            exactly = reader.mapping(request, "exactly", path)
            if not exactly:
                raise reader.fail(f"{path}.exactly", "is required when firstAvailable is empty")
            parsed = _parse_request({**exactly, "name": name}, f"{path}.exactly", reader)
        if not parsed.first_available and not parsed.device_class_name:
            raise reader.fail(f"{path}.deviceClassName", "is required")
        requests.append(parsed)
    return requests


def _parse_claim(
    obj: dict[str, Any], api_version: str, metadata: dict[str, Any], reader: _Reader
) -> ParsedClaim:
    spec = reader.mapping(obj, "spec", "")
    status = reader.mapping(obj, "status", "")
    allocation = reader.mapping(status, "allocation", "status")
    allocation_devices = reader.mapping(allocation, "devices", "status.allocation")
    results = []
    for index, result in enumerate(
        reader.listing(allocation_devices, "results", "status.allocation.devices")
    ):
        path = f"status.allocation.devices.results[{index}]"
        if not isinstance(result, dict):
            raise reader.fail(path, "must be a mapping")
        consumed = {
            key: reader.quantity(value, f"{path}.consumedCapacity.{key}")
            for key, value in reader.mapping(result, "consumedCapacity", path).items()
        }
        results.append(
            ParsedResult(
                request=reader.string(result, "request", path, required=True),
                driver=reader.string(result, "driver", path, required=True),
                pool=reader.string(result, "pool", path, required=True),
                device=reader.string(result, "device", path, required=True),
                admin_access=result.get("adminAccess") is True,
                share_id=reader.string(result, "shareID", path, required=False),
                consumed_capacity=consumed,
            )
        )
    owners = reader.listing(metadata, "ownerReferences", "metadata")
    return ParsedClaim(
        namespace=reader.string(metadata, "namespace", "metadata", required=False) or "default",
        name=reader.string(metadata, "name", "metadata", required=True),
        uid=reader.string(metadata, "uid", "metadata", required=False),
        api_version=api_version,
        resource_version=str(metadata.get("resourceVersion") or ""),
        labels=_string_map(reader, metadata, "labels"),
        annotations=_string_map(reader, metadata, "annotations"),
        owner_references=owners,
        created_at=reader.timestamp(metadata, "creationTimestamp", "metadata"),
        requests=parse_claim_requests(spec, api_version, reader),
        results=results,
        allocated_at=reader.timestamp(allocation, "allocationTimestamp", "status.allocation"),
        spec=spec,
        status=status,
    )


def _string_map(reader: _Reader, metadata: dict[str, Any], key: str) -> dict[str, str]:
    values = reader.mapping(metadata, key, "metadata")
    for label, value in values.items():
        if not isinstance(value, str):
            raise reader.fail(f"metadata.{key}.{label}", "must be a string")
    return values


def _parse_node(
    obj: dict[str, Any], api_version: str, metadata: dict[str, Any], reader: _Reader
) -> ParsedNode:
    return ParsedNode(
        name=reader.string(metadata, "name", "metadata", required=True),
        labels=_string_map(reader, metadata, "labels"),
    )


_PARSERS: dict[str, Callable[[dict[str, Any], str, dict[str, Any], _Reader], Parsed]] = {
    "ResourceSlice": _parse_slice,
    "DeviceClass": _parse_device_class,
    "ResourceClaim": _parse_claim,
    "Node": _parse_node,
}

_MIG_PROFILE = re.compile(r"^(?P<slices>\d+)g\.")
# Compute slices of a whole GPU, by product; MIG-capable GPUs not listed here have 7.
_MIG_SLICES_BY_PRODUCT = {"A30": 4}
_SHARE_QUANTUM = Decimal("0.000001")
# The most units one device counts: what the share columns hold (`inventory.models`'
# SHARE_DIGITS, SHARE_PLACES: NUMERIC(12, 6)). A multi-host slice of more counts this.
MAX_DEVICE_UNITS = Decimal(999_999)


@dataclass(slots=True)
class CountedDevice:
    """A device of a pool's counted generation, with what counting needs worked out."""

    slice_name: str
    device: ParsedDevice
    kind: str  # one of inventory.models.DeviceKind
    physical_gpu_key: str
    gpu_share: Decimal
    columns: dict[str, Any]
    driver: str = ""
    shape: dict[str, Any] = field(default_factory=dict)
    shape_key: str = ""
    unit: str = "gpu"  # one of inventory.models.Unit: what gpu_share counts
    meter_id: str = ""


def device_shape(
    device: ParsedDevice, kind: str, gpu_share: Decimal, unit: str = "gpu"
) -> dict[str, Any]:
    """What selectors can tell apart, less what only identifies one device (its UUID, PCI
    address, index): thousands of GPUs of one model share a handful of shapes."""
    return {
        "kind": kind,
        "unit": unit,
        "gpu_share": str(gpu_share),
        "attributes": {
            name: value
            for name, value in device.attributes.items()
            if name.rsplit("/", 1)[-1] not in IDENTITY_ATTRIBUTES
        },
        "capacity": device.capacity,
        "allow_multiple_allocations": device.extra.get("allowMultipleAllocations") is True,
    }


def shape_digest(driver: str, shape: dict[str, Any]) -> str:
    """A stable digest of a device shape, for storing each distinct shape once.

    The digest is of the standard library's JSON (keys sorted), as stored shapes' keys have
    always been. Thousands of devices share a handful of shapes: each distinct shape is
    written that way once, and found again by orjson's JSON of it (keys sorted; a twentieth
    of the cost), which two shapes share only when they are the same JSON values. orjson
    writes NaN and infinities as `null`, as it does None: JSON with a `null` is not looked
    up, nor what orjson refuses (keys that are not strings, integers over 64 bits)."""
    try:
        known = orjson.dumps([driver, shape], option=orjson.OPT_SORT_KEYS)
    except TypeError:
        known = b"null"
    if b"null" not in known and (digest := _SHAPE_DIGESTS.get(known)) is not None:
        return digest
    text = json.dumps([driver, shape], sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
    if b"null" not in known:
        if len(_SHAPE_DIGESTS) >= _SHAPE_DIGESTS_KEPT:
            _SHAPE_DIGESTS.clear()  # a fleet of more shapes than this starts again
        _SHAPE_DIGESTS[known] = digest
    return digest


# Digests of the shapes seen lately, by orjson's JSON of them (`shape_digest`).
_SHAPE_DIGESTS: dict[bytes, str] = {}
_SHAPE_DIGESTS_KEPT = 4096


def is_gpu_driver(driver: str, gpu_drivers: frozenset[str]) -> bool:
    """Whether devices without a `type` attribute from `driver` are GPUs."""
    return profiles.is_gpu_driver(driver, gpu_drivers)


@dataclass(slots=True)
class _Entry:
    slice_name: str
    device: ParsedDevice
    columns: dict[str, Any]
    kind: str
    identity: str = ""
    parent: str = ""
    unit_value: str = ""
    counter_sets: list[str] = field(default_factory=list)


def count_pool(
    *,
    driver: str,
    pool: str,
    slices: list[ParsedSlice],
    gpu_drivers: frozenset[str] = frozenset(),
    cluster: str = "",
    profile: profiles.Profile | None = None,
) -> list[CountedDevice]:
    """Classify the devices of one complete pool generation and tie each to its physical unit.

    The driver's profile (`inventory.profiles`; built in, configured, or the generic one) says
    which devices are accelerators and of what kind. A whole device, its MIG devices and its
    partitions get the same `physical_gpu_key`: the unit's published identity (`uuid`, or
    `parentUUID` on MIG devices), else the identity of the device that consumes the same
    counter set (KEP-4815), else the attribute the unit's devices share (AMD's pciBusID), else
    the counter set or the device itself. An identity that several whole devices of one type
    publish (a TPU host's uuid on each chip) identifies none of them. `meter_id` is the
    published identity where exactly one device has it, else one formed from `cluster`,
    driver, pool and device name.
    """
    profile = profile or profiles.builtin_profile(driver, gpu_drivers)
    # By name: what a device published twice, or a counter set defined twice, comes to must
    # not depend on the order the slices were written or read back in.
    slices = sorted(slices, key=lambda parsed_slice: parsed_slice.name)
    totals: dict[str, dict[str, Decimal]] = {}
    for parsed_slice in slices:
        for shared in parsed_slice.shared_counters:
            totals[shared["name"]] = {
                name: Decimal(parse_quantity(entry["value"]))
                for name, entry in (shared.get("counters") or {}).items()
            }
    consumption_by_set: dict[str, list[dict[str, Decimal]]] = defaultdict(list)
    for parsed_slice in slices:
        for device in parsed_slice.devices:
            for consumption in device.consumes_counters:
                consumption_by_set[consumption["counterSet"]].append(
                    _amounts(consumption.get("counters"))
                )
    measures = size_counters(totals, consumption_by_set, profile.size_counters)
    entries: list[_Entry] = []
    for parsed_slice in slices:
        for device in parsed_slice.devices:
            columns = _columns(device, driver, profile)
            entry = _Entry(
                slice_name=parsed_slice.name,
                device=device,
                columns=columns,
                kind=_kind(device, driver, profile, columns["device_type"]),
                counter_sets=[c["counterSet"] for c in device.consumes_counters],
            )
            if entry.kind != "other":
                entry.identity = _first(device, driver, profile.identity_attributes)
                if entry.kind in ("mig", "partition"):
                    entry.parent = _first(device, driver, profile.parent_identity_attributes)
                entry.unit_value = _first(device, driver, profile.physical_unit_attributes)
            entries.append(entry)
    _drop_shared_identities(entries, profile)
    whole_identities = {e.identity for e in entries if e.kind == "gpu" and e.identity}
    # A counter set consumed by a device that names its unit identifies that unit for the rest.
    unit_by_set: dict[str, str] = {}
    for entry in entries:
        unit_identity = entry.parent or (entry.identity if entry.kind == "gpu" else "")
        if unit_identity and entry.counter_sets:
            unit_by_set.setdefault(entry.counter_sets[0], unit_identity)
    keys: dict[int, str] = {}
    for index, entry in enumerate(entries):
        if entry.kind == "other":
            keys[index] = ""
            continue
        first_set = entry.counter_sets[0] if entry.counter_sets else ""
        own = entry.identity if entry.kind == "gpu" else ""
        # A partition published with its parent's identity (NVIDIA vGPU slots carry the GPU's
        # uuid) belongs to that parent.
        inherited = entry.identity if entry.identity in whole_identities else ""
        keys[index] = (
            entry.parent
            or own
            or unit_by_set.get(first_set)
            or (f"{driver}/{pool}/{entry.unit_value}" if entry.unit_value else "")
            or inherited
            or f"{driver}/{pool}/{first_set or entry.device.name}"
        )
    partitions_per_key: dict[str, int] = defaultdict(int)
    for index, entry in enumerate(entries):
        if entry.kind == "partition":
            partitions_per_key[keys[index]] += 1
    meters = _meter_identities(entries, profile)
    counted = []
    for index, entry in enumerate(entries):
        kind = entry.kind
        share = _share(
            entry.device,
            kind,
            entry.columns,
            profile,
            totals,
            measures,
            partitions_per_key.get(keys[index], 0),
        )
        if kind == "gpu" and share < 1:
            kind = "partition"  # a vGPU, or an untyped device that consumes part of a set
        unit = profile.unit
        shape = device_shape(entry.device, kind, share, unit)
        counted.append(
            CountedDevice(
                slice_name=entry.slice_name,
                device=entry.device,
                kind=kind,
                physical_gpu_key=keys[index],
                gpu_share=share,
                columns=entry.columns,
                driver=driver,
                shape=shape,
                shape_key=shape_digest(driver, shape),
                unit=unit,
                meter_id=(
                    ""
                    if kind == "other"
                    else profiles.meter_id(
                        cluster, driver, pool, entry.device.name, meters.get(index, "")
                    )
                ),
            )
        )
    return counted


def _first(device: ParsedDevice, driver: str, names: tuple[str, ...]) -> str:
    """The first of the named attributes the device publishes, as text."""
    for name in names:
        value = device.attribute(name, driver)
        if value is not None and not isinstance(value, list) and str(value) != "":
            return str(value)
    return ""


def _drop_shared_identities(entries: list[_Entry], profile: profiles.Profile) -> None:
    """Forget an identity that two whole devices of the same type publish: it names something
    bigger than either (Google's TPU driver puts the host's uuid on every chip). The same GPU
    published as `gpu` and as `vfio` keeps it: those are two ways of using one device."""
    seen: dict[tuple[str, str], int] = defaultdict(int)
    for entry in entries:
        if entry.kind == "gpu" and entry.identity:
            seen[(entry.identity, entry.columns["device_type"])] += 1
    shared = {identity for (identity, _), count in seen.items() if count > 1}
    for entry in entries:
        if entry.identity in shared:
            entry.identity = ""


def _meter_identities(entries: list[_Entry], profile: profiles.Profile) -> dict[int, str]:
    """Which devices meter by their published identity: the one device that publishes it, or
    of several (a GPU also offered as vfio, vGPU slots carrying their GPU's uuid) the whole
    device of the first type the profile lists; the others get formed identities."""
    holders: dict[str, list[int]] = defaultdict(list)
    for index, entry in enumerate(entries):
        if entry.kind != "other" and entry.identity:
            holders[entry.identity].append(index)
    order = {name: position for position, name in enumerate(sorted(profile.whole_types))}
    if "gpu" in order:
        order["gpu"] = -1
    meters: dict[int, str] = {}
    for identity, indexes in holders.items():
        if len(indexes) == 1:
            meters[indexes[0]] = identity
            continue
        wholes = sorted(
            (order.get(entries[i].columns["device_type"], len(order)), i)
            for i in indexes
            if entries[i].kind == "gpu"
        )
        if wholes and (len(wholes) == 1 or wholes[0][0] != wholes[1][0]):
            meters[wholes[0][1]] = identity
    return meters


def _kind(device: ParsedDevice, driver: str, profile: profiles.Profile, device_type: str) -> str:
    for exclusion in profile.exclude:
        if exclusion.capacity:
            value: Any = device.capacity_value(exclusion.name, driver)
            if value is not None and value == exclusion.equals:
                return "other"
        else:
            value = device.attribute(exclusion.name, driver)
            if value is not None and (
                value == exclusion.equals or str(value) == str(exclusion.equals)
            ):
                return "other"
    kind = profile.kind_of(device_type)
    if kind is not None:
        return kind
    return "gpu" if profile.untyped == "accelerator" else "other"


# A counter numbered like others of its kind: memorySlice3, memory-slice-3.
_NUMBERED = re.compile(r"^(?P<stem>.*?)-?(?P<index>\d+)$")


def _amounts(counters: Any) -> dict[str, Decimal]:
    return {
        name: Decimal(parse_quantity(entry["value"]))
        for name, entry in (counters or {}).items()
        if isinstance(entry, dict) and "value" in entry
    }


def _positions(total: dict[str, Decimal], names: Iterable[str]) -> dict[str, str]:
    """Of `names`, the counters that number positions of one kind (a MIG layout's memory
    slices, `memorySlice0` .. `memorySlice7`: several counters of 1 that differ only in their
    number), each with its kind's stem. A lone counter of 1 is one engine, not a position."""
    stems: dict[str, list[str]] = defaultdict(list)
    for name in names:
        match = _NUMBERED.match(name)
        if match and total.get(name) == 1:
            stems[match["stem"]].append(name)
    return {name: stem for stem, members in stems.items() if len(members) > 1 for name in members}


def _by_stem(positions: dict[str, str]) -> list[list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for name, stem in positions.items():
        groups[stem].append(name)
    return list(groups.values())


def size_counters(
    totals: dict[str, dict[str, Decimal]],
    consumption_by_set: dict[str, list[dict[str, Decimal]]],
    named: Iterable[str] = (),
) -> dict[str, frozenset[str]]:
    """Per counter set, the counters whose share measures the size of a device that consumes
    from it (KEP-4815), for `counter_share`.

    The profile's `size_counters` (names or patterns) where it names any the set has. Else
    those every device consuming from the set takes some of: SMs and memory measure every MIG
    slice, while a JPEG or optical-flow engine (one per GPU, taken by some profiles and not
    others) measures none: counting it would make a 1g slice with the GPU's only JPEG engine
    the whole GPU. Numbered positions (`memorySlice0` .. `memorySlice7`) are weighed as one
    kind, which measures size when every device takes at least one of them. When no counter
    qualifies, all do.
    """
    patterns = tuple(named)
    measures: dict[str, frozenset[str]] = {}
    for set_name, total in totals.items():
        chosen = {name for name in total if any(fnmatchcase(name, p) for p in patterns)}
        consumers = consumption_by_set.get(set_name, [])
        if not chosen and consumers:
            positions = _positions(total, total)
            chosen = {
                name
                for name in total
                if name not in positions and all(c.get(name, 0) > 0 for c in consumers)
            }
            for members in _by_stem(positions):
                if all(any(c.get(m, 0) > 0 for m in members) for c in consumers):
                    chosen.update(members)
        measures[set_name] = frozenset(chosen or total)
    return measures


def _unit_amounts(
    consumed: dict[str, Decimal], total: dict[str, Decimal], unit_counters: Iterable[str]
) -> dict[str, Decimal]:
    """Of the counters consumed from one set, those that count whole units (the profile's
    `unit_counters`: a multi-host set's chips per node), each at most what the set has."""
    patterns = tuple(unit_counters)
    return {
        name: min(amount, total[name])
        for name, amount in consumed.items()
        if amount > 0 and total.get(name, 0) > 0 and _matches(name, patterns)
    }


def counter_units(
    device: ParsedDevice, totals: dict[str, dict[str, Decimal]], unit_counters: Iterable[str] = ()
) -> Decimal:
    """The most units a device's counters can make it: per set it consumes from, the units the
    set's unit counters hold where it takes any (a four-node TPU set of 16 chips), else one
    (a GPU's counter set is that GPU). At least 1."""
    units = Decimal(0)
    patterns = tuple(unit_counters)
    for consumption in device.consumes_counters:
        total = totals.get(consumption["counterSet"]) or {}
        consumed = _amounts(consumption.get("counters"))
        taken = _unit_amounts(consumed, total, patterns)
        units += (
            sum((total[name] for name in total if _matches(name, patterns)), Decimal(0))
            if taken
            else 1
        )
    return max(units, Decimal(1))


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def counter_share(
    device: ParsedDevice,
    totals: dict[str, dict[str, Decimal]],
    measures: dict[str, frozenset[str]] | None = None,
    unit_counters: Iterable[str] = (),
) -> Decimal | None:
    """The share of its physical unit a device consumes through shared counters (KEP-4815).

    Of each counter set it consumes from, the largest fraction of any size counter (`measures`,
    from `size_counters`; all counters when not given) it takes: the scarcest resource it
    blocks, so a quarter of the multiprocessors is a quarter of the GPU even if it takes only
    an eighth of the memory. Summed over the sets (a device spanning two GPUs' sets is two).
    Numbered positions of one kind (memory slices) weigh together as the share of them taken:
    one slice of eight is an eighth. A counter consumed at 0 is not taken. None when it
    consumes nothing countable.

    A set whose counters count units themselves (`unit_counters`: a multi-host TPU slice's
    chips per node) gives the units consumed, not a fraction: KEP-4815's 4x4 slice takes 4
    chips of each of four nodes, 16 chips, where the largest fraction would make it one.
    """
    share: Decimal | None = None
    patterns = tuple(unit_counters)
    for consumption in device.consumes_counters:
        total = totals.get(consumption["counterSet"])
        if not total:
            continue
        measured = (measures or {}).get(consumption["counterSet"]) or frozenset(total)
        consumed = _amounts(consumption.get("counters"))
        units = _unit_amounts(consumed, total, patterns)
        if units:
            share = (share or Decimal(0)) + sum(units.values(), Decimal(0))
            continue
        positions = _positions(total, measured)
        fractions = [
            amount / total[name]
            for name, amount in consumed.items()
            if name in measured and name not in positions and total.get(name, 0) > 0
        ]
        for members in _by_stem(positions):
            taken = sum(1 for name in members if consumed.get(name, 0) > 0)
            if taken:
                fractions.append(Decimal(taken) / len(members))
        if fractions:
            share = (share or Decimal(0)) + min(max(fractions), Decimal(1))
    return share


def _share(
    device: ParsedDevice,
    kind: str,
    columns: dict[str, Any],
    profile: profiles.Profile,
    totals: dict[str, dict[str, Decimal]],
    measures: dict[str, frozenset[str]],
    partitions: int,
) -> Decimal:
    """The device's share of its physical unit, by the profile's rules in order."""
    if kind == "other":
        return Decimal(0)
    share: Decimal | None = None
    for rule in profile.share:
        if rule == "counters":
            share = counter_share(device, totals, measures, profile.unit_counters)
        elif rule == "mig-profile" and kind == "mig":
            match = _MIG_PROFILE.match(columns["profile"])
            if match:
                product = columns["product_name"]
                slices = next(
                    (n for name, n in _MIG_SLICES_BY_PRODUCT.items() if name in product), 7
                )
                share = Decimal(int(match["slices"])) / slices
        elif rule == "partition-profile" and kind == "partition":
            count = profiles.partition_profile_count(columns["profile"], columns["product_name"])
            if count is None and partitions:
                count = partitions
            if count:
                share = Decimal(1) / count
        elif rule == "vgpu-profile" and kind in ("gpu", "partition"):
            share = profiles.vgpu_fraction(columns["profile"]) or profiles.vgpu_fraction(
                columns["product_name"]
            )
        if share is not None:
            break
    if share is None:
        share = Decimal(1) / partitions if kind == "partition" and partitions else Decimal(1)
    if kind == "gpu" and share == 1:
        return Decimal(1)
    # At most one unit per counter set it consumes from (a device may span several GPUs), or
    # the units a multi-host set holds.
    bound = min(counter_units(device, totals, profile.unit_counters), MAX_DEVICE_UNITS)
    return min(share, bound).quantize(_SHARE_QUANTUM)


def _columns(device: ParsedDevice, driver: str, profile: profiles.Profile) -> dict[str, Any]:
    """The attributes promoted to indexed columns, as strings (versions as published)."""

    def text(name: str) -> str:
        value = device.attribute(name, driver) if name else None
        return "" if value is None or isinstance(value, list) else str(value)

    memory = None
    for name in profile.memory_capacities:
        memory = device.capacity_value(name, driver)
        if memory is not None:
            break
    parts = [text(name) for name in profile.profile_parts]
    columns = {
        "product_name": profiles.fallback_model(
            driver,
            _first(device, driver, profile.model_attributes),
            # Intel's driver: the `pciId` attribute, else the id ending the device's name.
            (text("pciId"), device.name.rsplit("-", 1)[-1]),
        ),
        "uuid": text("uuid"),
        "parent_uuid": text("parentUUID"),
        "device_type": text(profile.type_attribute),
        "profile": text(profile.profile_attribute) or "_".join(filter(None, parts)),
        "memory_bytes": int(memory) if memory is not None else None,
        "architecture": _first(device, driver, profile.architecture_attributes),
        "driver_version": _first(device, driver, profile.driver_version_attributes),
        "cuda_driver_version": text("cudaDriverVersion"),
        "cuda_compute_capability": text("cudaComputeCapability"),
    }
    if "vgpu-profile" in profile.share:
        _vgpu_columns(columns)
    return columns


def _vgpu_columns(columns: dict[str, Any]) -> None:
    """A vGPU is a share of a physical GPU, priced and limited as that GPU's model with the
    vGPU type as its profile, as a MIG device is. On the host, NVIDIA's driver (VGPUSupport)
    publishes the physical `productName` and the type as `profile` ("NVIDIA L40S-12Q"): the
    profile becomes the type ("L40S-12Q", one word as rate cards name profiles). In a guest the
    driver sees only the vGPU, its `productName` the type ("GRID A100-4C") and nothing of the
    card: the model becomes the type's board ("NVIDIA A100"; which A100, PCIe or SXM, the
    guest cannot tell) and the profile the type."""
    published = columns["profile"]
    vgpu = profiles.vgpu_type(published) if published else None
    if vgpu is None and not published:
        vgpu = profiles.vgpu_type(columns["product_name"])
        if vgpu is not None:
            columns["product_name"] = f"NVIDIA {vgpu[0]}"
    if vgpu is not None:
        columns["profile"] = vgpu[1]
