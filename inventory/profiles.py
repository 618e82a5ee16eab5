"""How to read each DRA driver's devices: driver profiles, units and meter identities.

Drivers publish what they like: NVIDIA a `type` of gpu/mig/vfio and a `uuid` per device, AMD
`amdgpu`/`amdgpu-partition` and no uuid (its `deviceID` names the model, not the GPU), Intel and
Gaudi no type and no uuid, Google's TPU driver one `uuid` for all chips of a host. A profile
says, for one driver, which devices are accelerators and of what kind, what one physical unit
is (GPU, TPU chip, Gaudi card), which attribute identifies a device and which its physical
unit, where model, architecture, memory and driver version are read from, and how a
partition's share of its parent is computed.

Built-in profiles cover NVIDIA, AMD, Intel GPU, Intel Gaudi and Google TPU; every other driver
gets the generic profile (a GPU driver when "gpu" is in the first label of its name or it is
listed in TALLY_GPU_DRIVERS, else only devices typed gpu/mig/vfio count). A `DriverProfile`
row (the policy file's `drivers:` section, or the admin) describes another driver or overrides
keys of a built-in one; its spec is checked by `validate_spec`, whose errors name the field.

Spec keys (all optional; lists are of attribute or capacity names, tried in order):

- `unit`: gpu | tpu | gaudi | accelerator: what a share of 1 counts.
- `type_attribute`: the attribute naming a device's type ("" when the driver has none).
- `whole_types`, `mig_types`, `partition_types`: type values of whole accelerators, MIG
  devices and partitions. A device typed otherwise is not an accelerator.
- `untyped`: accelerator | other: what a device without a type value is.
- `exclude`: `[{attribute: NAME, equals: VALUE} | {capacity: NAME, equals: QUANTITY}]`: devices
  that match any entry are not accelerators (Intel's integrated GPU: capacity memory equals 0).
- `identity_attributes`: attributes whose value identifies one device (NVIDIA `uuid`); empty
  when none does, and the meter id is formed from cluster, driver, pool and device name.
- `parent_identity_attributes`: a MIG device's or partition's parent (NVIDIA `parentUUID`).
- `physical_unit_attributes`: an attribute every device of one physical unit shares and no
  other unit of the pool has (AMD `resource.kubernetes.io/pciBusID`).
- `model_attributes`, `architecture_attributes`, `driver_version_attributes`,
  `memory_capacities`: where the columns of the same names are read from.
- `profile_attribute`: the attribute naming a MIG, partition or vGPU profile.
- `profile_parts`: attributes whose values, joined with "_", name the profile of a device that
  does not publish `profile_attribute` (AMD auto-partition devices: `computePartition` and
  `memoryPartition`, cpx and nps4 making `cpx_nps4`, as a pre-made partition's profile reads).
- `share`: the rules for a device's share of its physical unit, tried in order: `counters`
  (KEP-4815: the largest fraction of any size counter it consumes from each counter set, summed
  over sets; see `size_counters`), `mig-profile` (`<n>g.<mem>`: n of the GPU's 7 compute slices,
  4 on an A30), `partition-profile` (AMD `spx`/`dpx`/`qpx`/`cpx` modes: one of that many
  partitions, for CPX the partitions published on that GPU), `vgpu-profile` (NVIDIA vGPU types
  `<board>-<GB><series>` such as A100-4C: that framebuffer of the board's). A whole device no
  rule applies to is 1; a partition no rule applies to is one of the partitions published with
  the same physical unit.
- `unit_counters`: counters (names or patterns) that count physical units themselves: a
  multi-host device (KEP-4815's TPU slices) consumes so many chips of each node from a counter
  set that spans several nodes (`tpus-node-1: 4`). A device that consumes any of them counts
  the units it consumes (a 4x4 slice over four nodes of four chips is 16 chips), not a share of
  one unit. Default `gpus*`, `tpus*`, `chips*`.
- `size_counters`: the counters (names, or patterns such as `memorySlice*`) whose share measures
  a partition's size, for the `counters` rule. Others are engines some partitions carry and
  others lack (NVIDIA's single JPEG and optical-flow engines): taking the GPU's only JPEG engine
  does not make a 1g slice the whole GPU. Unset, they are found from the pool (see
  `inventory.dra.size_counters`).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Annotated, Any

from django.conf import settings
from kubernetes.utils import parse_quantity
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from inventory.schemas import PROBLEM, Problem, path_of, problem, problems

UNITS = ("gpu", "tpu", "gaudi", "accelerator")
SHARE_RULES = ("counters", "mig-profile", "partition-profile", "vgpu-profile")
KINDS_OF_UNTYPED = ("accelerator", "other")
# Counters that count whole units (see `unit_counters` above): chips or GPUs of one node.
UNIT_COUNTERS = ("gpus*", "tpus*", "chips*")


def unit_order(unit: str) -> int:
    """Where `unit` sorts among units: GPUs first, then TPU chips, Gaudi cards, other
    accelerators (`UNITS`' order), then anything else."""
    return UNITS.index(unit) if unit in UNITS else len(UNITS)


_UNIT_LABELS = {
    "gpu": ("GPU", "GPUs", "GPU-hours"),
    "tpu": ("TPU chip", "TPU chips", "TPU chip-hours"),
    "gaudi": ("Gaudi card", "Gaudi cards", "Gaudi card-hours"),
    "accelerator": ("accelerator", "accelerators", "accelerator-hours"),
}


def unit_label(unit: str, plural: bool = True) -> str:
    """What `unit` counts, for messages: "GPUs", "TPU chips"; an unknown unit reads as
    "accelerators" rather than failing a message."""
    singular, many, _ = _UNIT_LABELS.get(unit, _UNIT_LABELS["accelerator"])
    return many if plural else singular


# Figures shown to people (pages, alerts, emails): two decimals at most.
SHOWN = Decimal("0.01")


def shown_number(value: Decimal) -> str:
    """`value` as people read it: two decimals at most, without trailing zeros or an exponent
    (3.999996 reads 4, 0.142857 reads 0.14, 3.50 reads 3.5, 100 reads 100). For display only:
    the ledger's figures are never rounded by it."""
    text = f"{value.quantize(SHOWN, rounding=ROUND_HALF_EVEN).normalize():f}"
    return "0" if text == "-0" else text


def hours_label(unit: str) -> str:
    """ "GPU-hours", "TPU chip-hours", "Gaudi card-hours", "accelerator-hours"."""
    return _UNIT_LABELS.get(unit, _UNIT_LABELS["accelerator"])[2]


def meter_id(cluster: str, driver: str, pool: str, device: str, uuid: str = "") -> str:
    """What samples name a device by and billing meters it by.

    The published identity where the driver's profile says one identifies the device (a GPU's
    or MIG device's UUID); otherwise one formed from where the device is published, stable for
    as long as the driver names the device the same in the same pool.
    """
    if uuid:
        return uuid
    text = f"{cluster}/{driver}/{pool}/{device}"
    return "dra-" + hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:32]


# A DRA driver name: a lowercase DNS subdomain of at most 63 characters (the API's limit).
DRIVER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
DRIVER_NAME_MAX_LENGTH = 63


def is_driver_name(name: object) -> bool:
    """Whether `name` is one a DRA driver can have."""
    return (
        isinstance(name, str)
        and len(name) <= DRIVER_NAME_MAX_LENGTH
        and DRIVER_NAME.match(name) is not None
    )


class ProfileError(ValueError):
    """A driver profile spec that cannot be used; the message names the field."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


@dataclass(frozen=True, slots=True)
class Exclusion:
    """Devices with attribute (or capacity) `name` equal to `equals` are not accelerators."""

    name: str
    equals: Any
    capacity: bool = False


@dataclass(frozen=True, slots=True)
class Profile:
    """How to read one driver's devices; see the module docstring for what each field means."""

    driver: str
    source: str  # "builtin", "generic", "policy" or "admin"
    unit: str = "accelerator"
    type_attribute: str = "type"
    whole_types: frozenset[str] = frozenset()
    mig_types: frozenset[str] = frozenset()
    partition_types: frozenset[str] = frozenset()
    untyped: str = "accelerator"
    exclude: tuple[Exclusion, ...] = ()
    identity_attributes: tuple[str, ...] = ()
    parent_identity_attributes: tuple[str, ...] = ()
    physical_unit_attributes: tuple[str, ...] = ()
    model_attributes: tuple[str, ...] = ("productName", "model")
    architecture_attributes: tuple[str, ...] = ("architecture",)
    driver_version_attributes: tuple[str, ...] = ("driverVersion",)
    memory_capacities: tuple[str, ...] = ("memory",)
    profile_attribute: str = "profile"
    profile_parts: tuple[str, ...] = ()
    share: tuple[str, ...] = ("counters",)
    size_counters: tuple[str, ...] = ()
    unit_counters: tuple[str, ...] = UNIT_COUNTERS
    spec: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def kind_of(self, type_value: str) -> str | None:
        """The kind a type value gives, "other" for an unlisted one, None for no type."""
        if not type_value:
            return None
        if type_value in self.whole_types:
            return "gpu"
        if type_value in self.mig_types:
            return "mig"
        if type_value in self.partition_types:
            return "partition"
        if self.whole_types or self.mig_types or self.partition_types:
            return "other"
        return None


_LIST_KEYS = (
    "whole_types",
    "mig_types",
    "partition_types",
    "identity_attributes",
    "parent_identity_attributes",
    "physical_unit_attributes",
    "model_attributes",
    "architecture_attributes",
    "driver_version_attributes",
    "memory_capacities",
    "profile_parts",
    "share",
    "size_counters",
    "unit_counters",
)
_STRING_KEYS = ("unit", "type_attribute", "untyped", "profile_attribute")
SPEC_KEYS = frozenset((*_LIST_KEYS, *_STRING_KEYS, "exclude", "description"))

# The generic reading of a driver the project has no profile for: devices typed gpu/vfio are
# whole GPUs and mig MIG devices (any driver modelled on NVIDIA's), untyped ones GPUs only for
# a GPU driver (see `generic_profile`), shares from counters and MIG profiles.
_GENERIC: dict[str, Any] = {
    "unit": "gpu",
    "type_attribute": "type",
    "whole_types": ["gpu", "vfio"],
    "mig_types": ["mig"],
    "identity_attributes": ["uuid"],
    "parent_identity_attributes": ["parentUUID"],
    "memory_capacities": ["memory", "addressableMemory"],
    "share": ["mig-profile", "counters"],
}

BUILTIN_SPECS: dict[str, dict[str, Any]] = {
    # kubernetes-sigs/dra-driver-nvidia-gpu: type gpu/mig/vfio (and vgpu partitions on hosts
    # with VGPUSupport), uuid per device, parentUUID on MIG devices, profile "1g.5gb".
    "gpu.nvidia.com": {
        "description": "NVIDIA GPUs, MIG devices, vfio passthrough and vGPU",
        "unit": "gpu",
        "type_attribute": "type",
        "whole_types": ["gpu", "vfio"],
        "mig_types": ["mig"],
        "partition_types": ["vgpu"],
        "untyped": "accelerator",
        "identity_attributes": ["uuid"],
        "parent_identity_attributes": ["parentUUID"],
        "memory_capacities": ["memory", "addressableMemory"],
        "profile_attribute": "profile",
        "share": ["mig-profile", "counters", "vgpu-profile"],
        # Dynamic MIG's counter set: SMs, memory and one memorySliceN per memory slice measure
        # a slice; copy engines, decoders, encoders, JPEG and OFA engines come with it.
        "size_counters": ["multiprocessors", "memory", "memorySlice*"],
    },
    # ROCm/k8s-gpu-dra-driver: type amdgpu/amdgpu-partition (vfio for passthrough), no uuid;
    # deviceID is the model's PCI id, pciBusID the physical GPU's, shared by its partitions.
    # With AutoPartition on, one device per compute+memory mode of each GPU (gpu-0-cpx-nps1),
    # each consuming the GPU's one-mode counter set whole (a share of 1: the GPU in that mode)
    # and shared by `partitions` capacity, so a claim's share is its fraction of the partitions;
    # the mode names the profile (`profile_parts`), pciAddr the GPU where pciBusID is missing.
    "gpu.amd.com": {
        "description": "AMD Instinct GPUs, their compute partitions and auto-partition modes",
        "unit": "gpu",
        "type_attribute": "type",
        "whole_types": ["amdgpu", "vfio"],
        "partition_types": ["amdgpu-partition"],
        "untyped": "other",
        "physical_unit_attributes": ["resource.kubernetes.io/pciBusID", "pciAddr"],
        "model_attributes": ["productName"],
        "profile_attribute": "partitionProfile",
        "profile_parts": ["computePartition", "memoryPartition"],
        "share": ["counters", "partition-profile"],
    },
    # intel/intel-resource-drivers-for-kubernetes gpu.intel.com: no type, no uuid; `model` and
    # `family` from the PCI id; memory 0 on an integrated GPU, which is not an accelerator here.
    "gpu.intel.com": {
        "description": "Intel discrete GPUs (integrated ones, with no memory, excluded)",
        "unit": "gpu",
        "type_attribute": "",
        "untyped": "accelerator",
        "exclude": [{"capacity": "memory", "equals": "0"}],
        "physical_unit_attributes": ["resource.kubernetes.io/pciBusID", "pciAddress"],
        "model_attributes": ["model"],
        "architecture_attributes": ["family"],
        "driver_version_attributes": [],
    },
    # The same repository's gaudi.intel.com: no type, no uuid; `model` Gaudi2/Gaudi3, `serial`.
    "gaudi.intel.com": {
        "description": "Intel Gaudi cards",
        "unit": "gaudi",
        "type_attribute": "",
        "untyped": "accelerator",
        "model_attributes": ["model"],
        "architecture_attributes": ["model"],
        "driver_version_attributes": [],
        "share": [],
    },
    # Google's TPU DRA driver: chips accel0.. with `index`, `tpuGen` and a `uuid` that is the
    # host's, the same on every chip: it identifies no chip, so chips keep formed identities.
    "tpu.google.com": {
        "description": "Google Cloud TPU chips",
        "unit": "tpu",
        "type_attribute": "",
        "untyped": "accelerator",
        "model_attributes": ["tpuGen"],
        "architecture_attributes": ["tpuGen"],
        "driver_version_attributes": [],
        # A chip of one host consumes no counters and is 1; a multi-host slice published by a
        # central controller (KEP-4815) counts the chips its per-node counters consume.
        "share": ["counters"],
    },
}


def _no_nul(value: str) -> str:
    """A string PostgreSQL can store in the spec's JSON (no NUL character)."""
    if "\x00" in value:
        raise problem("must not contain a NUL character")
    return value


def _non_empty(value: str) -> str:
    if not value.strip():
        raise problem("must be a non-empty string")
    return value


def _one_of(choices: tuple[str, ...]) -> AfterValidator:
    def check(value: str) -> str:
        if value not in choices:
            raise problem(f"must be one of {', '.join(choices)}", _LATER)
        return value

    return AfterValidator(check)


def _share_rule(value: str) -> str:
    if value not in SHARE_RULES:
        raise problem(f"{value!r} is not a share rule (known: {', '.join(SHARE_RULES)})", _LATER)
    return value


def _quantity_text(value: Any) -> str:
    """A capacity to compare with, as the text stored and parsed again by every sync: a
    finite quantity ("0", "16Gi", 0.5). A boolean, NaN or infinity is none; a number is kept
    as its plain decimal text, which parses back to the same value."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise problem(f"{value!r} is not a quantity")
    if isinstance(value, str):
        _no_nul(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise problem(f"{value!r} is not a finite quantity")
    try:
        # A float by its shortest text (0.1, not the binary fraction nearest to it).
        parsed = Decimal(parse_quantity(str(value) if isinstance(value, float) else value))
    except (ValueError, TypeError, ArithmeticError):
        raise problem(f"{value!r} is not a quantity") from None
    if not parsed.is_finite():
        raise problem(f"{value!r} is not a finite quantity")
    return value.strip() if isinstance(value, str) else format(parsed, "f")


# DRA attribute values are strings, versions (strings here), integers (int64) and booleans.
_INT64 = range(-(2**63), 2**63)


def _attribute_value(value: Any) -> str | int | bool:
    """An attribute value to compare with: what a DRA attribute can hold. A float, a date or
    a list is none (and NaN could not even be stored)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value not in _INT64:
            raise problem(f"{value} is out of range for a DRA integer attribute")
        return value
    if isinstance(value, str):
        return _no_nul(value)
    raise problem(f"must be a string, integer or boolean (a DRA attribute value), not {value!r}")


# A check that comes after every field's type is checked (`validate_spec`'s order).
_LATER = "later"
_Text = Annotated[str, Strict(), AfterValidator(_no_nul)]
_Stripped = Annotated[_Text, AfterValidator(str.strip)]
_Name = Annotated[_Text, AfterValidator(_non_empty)]
_Names = Annotated[list[_Name], Strict()]
_EXCLUDE_HINT = "must be a list of {attribute|capacity: NAME, equals: VALUE}"


class _Exclusion(BaseModel):
    """`{attribute: NAME, equals: VALUE}` or `{capacity: NAME, equals: QUANTITY}`."""

    model_config = ConfigDict(extra="forbid")

    attribute: Annotated[_Name, AfterValidator(str.strip)] = ""
    capacity: Annotated[_Name, AfterValidator(str.strip)] = ""
    equals: Any

    @model_validator(mode="before")
    @classmethod
    def _exactly_one(cls, value: Any) -> Any:
        # After its keys are checked (pydantic's: strings, known), as `validate_spec` reads.
        if (
            isinstance(value, dict)
            and set(value) <= {"attribute", "capacity", "equals"}
            and ("attribute" in value) == ("capacity" in value)
        ):
            raise problem("must name exactly one of attribute or capacity")
        return value

    @field_validator("equals")
    @classmethod
    def _equals(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("capacity"):
            return _quantity_text(value)
        if info.data.get("attribute"):
            return _attribute_value(value)
        return value  # its name was refused: that is the entry's error

    def clean(self) -> dict[str, Any]:
        key = "capacity" if "capacity" in self.model_fields_set else "attribute"
        return {key: getattr(self, key), "equals": self.equals}


class _Spec(BaseModel):
    """A driver profile spec (see the module docstring); every key optional."""

    model_config = ConfigDict(extra="forbid")

    unit: Annotated[_Stripped, _one_of(UNITS)] = ""
    type_attribute: _Stripped = ""
    untyped: Annotated[_Stripped, _one_of(KINDS_OF_UNTYPED)] = ""
    profile_attribute: _Stripped = ""
    description: _Stripped = ""
    whole_types: _Names = Field(default_factory=list)
    mig_types: _Names = Field(default_factory=list)
    partition_types: _Names = Field(default_factory=list)
    identity_attributes: _Names = Field(default_factory=list)
    parent_identity_attributes: _Names = Field(default_factory=list)
    physical_unit_attributes: _Names = Field(default_factory=list)
    model_attributes: _Names = Field(default_factory=list)
    architecture_attributes: _Names = Field(default_factory=list)
    driver_version_attributes: _Names = Field(default_factory=list)
    memory_capacities: _Names = Field(default_factory=list)
    profile_parts: _Names = Field(default_factory=list)
    share: Annotated[list[Annotated[_Name, AfterValidator(_share_rule)]], Strict()] = Field(
        default_factory=list
    )
    size_counters: _Names = Field(default_factory=list)
    unit_counters: _Names = Field(default_factory=list)
    exclude: Annotated[list[_Exclusion], Strict()] = Field(default_factory=list)


_FIELDS = tuple(_Spec.model_fields)
_STRING_FIELDS = frozenset((*_STRING_KEYS, "description"))


def _first_problem(exc: ValidationError, path: str) -> ProfileError:
    """The error `validate_spec` reports of those pydantic found: the first in the order the
    spec is read (keys, strings, their values, lists, share rules, exclusions)."""
    ranked: list[tuple[tuple[int | str, ...], str, str]] = []
    for order, found in enumerate(problems(exc)):
        rank: tuple[int | str, ...]
        loc, kind = found.loc, found.kind
        field_name = loc[0] if loc and isinstance(loc[0], str) else ""
        position = _FIELDS.index(field_name) if field_name in _FIELDS else -1
        if not loc:
            rank, where, message = (0,), path or "spec", "must be a mapping of profile keys"
        elif kind == "invalid_key" and len(loc) == 1:
            rank, where = (1, order), f"{path or 'spec'}[{found.input!r}]"
            message = "a key must be a string"
        elif kind == "extra_forbidden" and "\x00" in str(loc[-1]):
            rank = (1, order) if position < 0 else (7, order)
            where = f"{path_of(path, loc[:-1]) or 'spec'}.{loc[-1]!r}"
            message = "must not contain a NUL character"
        elif kind == "extra_forbidden" and position < 0:
            where = path_of(path, loc)
            message = f"is not a profile key (known: {', '.join(sorted(SPEC_KEYS))})"
            rank = (2, str(loc[0]))
        else:
            where, message = path_of(path, loc), _worded(found)
            if field_name in _STRING_FIELDS:
                rank = (4 if kind == _LATER else 3, position, order)
            elif field_name == "exclude":
                rank = (7, order)
                if len(loc) == 2 and kind == "model_type":
                    message = "must be a mapping with attribute or capacity, equals"
                elif len(loc) == 1:
                    message = _EXCLUDE_HINT
            else:
                rank = (5 if kind != _LATER else 6, position, order)
        ranked.append((rank, where, message))
    _, where, message = min(ranked)
    return ProfileError(where, message)


def _worded(found: Problem) -> str:
    """A pydantic error in `validate_spec`'s words."""
    if found.kind in (PROBLEM, _LATER):
        return found.message
    if found.kind == "missing":
        return "is required"
    if found.kind == "extra_forbidden":
        return "is not attribute, capacity or equals"
    if found.kind == "list_type":
        return "must be a list of names"
    if found.kind == "invalid_key":
        return "a key must be a string"
    return "must be a string"


def validate_spec(spec: Any, path: str = "") -> dict[str, Any]:
    """A driver profile spec checked and normalised (`_Spec`); `ProfileError` names the bad
    field, the first in the order the spec is read.

    `path` prefixes the field in messages (the policy file passes `drivers.<driver>`).
    """
    if not isinstance(spec, dict):
        raise ProfileError(path or "spec", "must be a mapping of profile keys")
    try:
        checked = _Spec.model_validate(spec)
    except ValidationError as exc:
        raise _first_problem(exc, path) from None
    clean = checked.model_dump(exclude_unset=True, exclude={"exclude"})
    kinds: dict[str, str] = {}
    for key in ("whole_types", "mig_types", "partition_types"):
        for value in clean.get(key, []):
            if value in kinds:
                where = f"{path}.{key}" if path else key
                raise ProfileError(where, f"type {value!r} is also in {kinds[value]}")
            kinds[value] = key
    if "exclude" in checked.model_fields_set:
        clean["exclude"] = [entry.clean() for entry in checked.exclude]
    return {key: clean[key] for key in _FIELDS if key in clean}


def _build(driver: str, source: str, spec: Mapping[str, Any]) -> Profile:
    exclusions = tuple(
        Exclusion(
            name=entry.get("attribute") or entry["capacity"],
            equals=(
                Decimal(parse_quantity(entry["equals"])) if "capacity" in entry else entry["equals"]
            ),
            capacity="capacity" in entry,
        )
        for entry in spec.get("exclude", [])
    )
    values: dict[str, Any] = {}
    for key in _LIST_KEYS:
        if key in spec:
            kind_list = key in ("whole_types", "mig_types", "partition_types")
            values[key] = frozenset(spec[key]) if kind_list else tuple(spec[key])
    for key in _STRING_KEYS:
        if key in spec:
            values[key] = spec[key]
    return replace(
        Profile(driver=driver, source=source), exclude=exclusions, spec=dict(spec), **values
    )


def is_gpu_driver(driver: str, gpu_drivers: Iterable[str] = ()) -> bool:
    """Whether untyped devices of a driver with no profile are GPUs: "gpu" in the first label
    of its name, or listed in TALLY_GPU_DRIVERS."""
    return driver in set(gpu_drivers) or "gpu" in driver.split(".", 1)[0]


def generic_profile(driver: str, gpu_drivers: Iterable[str] = ()) -> Profile:
    """The profile of a driver nothing describes."""
    untyped = "accelerator" if is_gpu_driver(driver, gpu_drivers) else "other"
    return _build(driver, "generic", {**_GENERIC, "untyped": untyped})


def builtin_profile(driver: str, gpu_drivers: Iterable[str] = ()) -> Profile:
    """The built-in profile of `driver`, else the generic one."""
    spec = BUILTIN_SPECS.get(driver)
    if spec is None:
        return generic_profile(driver, gpu_drivers)
    return _build(driver, "builtin", spec)


def effective_profile(
    driver: str,
    configured: Mapping[str, Any] | None,
    source: str = "admin",
    *,
    gpu_drivers: Iterable[str] = (),
) -> Profile:
    """A configured spec over the built-in profile of `driver` (keys it sets replace the
    built-in's); for a driver with no built-in profile, over the generic profile, whose unit
    becomes "accelerator" unless the spec says otherwise or the driver is a GPU driver."""
    if configured is None:
        return builtin_profile(driver, gpu_drivers)
    spec = validate_spec(dict(configured))
    base = BUILTIN_SPECS.get(driver)
    if base is None:
        base = {**_GENERIC, "untyped": "accelerator"}
        if not is_gpu_driver(driver, gpu_drivers):
            base["unit"] = "accelerator"
    return _build(driver, source, {**base, **spec})


class ProfileBook:
    """The effective profiles of one sync run: DriverProfile rows read once, profiles built
    once per driver. A row that no longer validates (written before a rule tightened) falls
    back to the built-in profile and is listed in `errors`, never failing the sync."""

    def __init__(
        self,
        rows: Mapping[str, tuple[Mapping[str, Any], str]] | None,
        gpu_drivers: Iterable[str] = (),
    ) -> None:
        # None: read the DriverProfile rows when a profile is first asked for, so that a sync
        # that counts no pool (most watch events) makes no query for them.
        self.rows = dict(rows) if rows is not None else None
        self.gpu_drivers = frozenset(gpu_drivers)
        self.errors: list[str] = []
        self._cache: dict[str, Profile] = {}

    @classmethod
    def load(cls, gpu_drivers: Iterable[str] | None = None) -> ProfileBook:
        """The book of this run; the rows are read on first use."""
        drivers = settings.TALLY_GPU_DRIVERS if gpu_drivers is None else gpu_drivers
        return cls(None, drivers)

    def _rows(self) -> dict[str, tuple[Mapping[str, Any], str]]:
        if self.rows is None:
            from inventory.models import DriverProfile

            self.rows = {
                row.driver: (row.spec, row.source)
                for row in DriverProfile.objects.only("driver", "spec", "source")
            }
        return self.rows

    def get(self, driver: str) -> Profile:
        profile = self._cache.get(driver)
        if profile is None:
            row = self._rows().get(driver)
            try:
                profile = effective_profile(
                    driver,
                    row[0] if row else None,
                    row[1] if row else "admin",
                    gpu_drivers=self.gpu_drivers,
                )
            except ProfileError as exc:
                self.errors.append(f"DriverProfile {driver}: {exc}")
                profile = builtin_profile(driver, self.gpu_drivers)
            self._cache[driver] = profile
        return profile


def profile_for(driver: str) -> Profile:
    """The effective profile of one driver now (reads its DriverProfile row, uncached)."""
    return ProfileBook.load().get(driver)


# vGPU types are named <board>-<framebuffer GB><series> (A100-4C, L40S-12Q), or for MIG-backed
# vGPUs <board>-<compute slices>-<framebuffer GB><series> (A100-2-10C). Framebuffer of each board
# in GB, as NVIDIA's vGPU type tables divide it.
_VGPU_TYPE = re.compile(r"^(?P<board>[A-Z][A-Z0-9]*)-(?:(?P<slices>\d)-)?(?P<gb>\d+)[ABCQ]$")
VGPU_BOARD_MEMORY_GB = {
    "A2": 16,
    "A10": 24,
    "A16": 16,
    "A30": 24,
    "A40": 48,
    "A100": 40,
    "A100D": 80,
    "A100X": 80,
    "A800": 40,
    "A800D": 80,
    "A6000": 48,
    "A5000": 24,
    "L2": 24,
    "L4": 24,
    "L20": 48,
    "L40": 48,
    "L40S": 48,
    "H100": 80,
    "H100L": 94,
    "H100XM": 80,
    "H200X": 141,
    "T4": 16,
    "V100": 16,
    "V100D": 32,
}
_MIG_SLICES_BY_BOARD = {"A30": 4}


def vgpu_type(name: str) -> tuple[str, str] | None:
    """(board, type) of a vGPU type name as drivers publish it ("GRID A100-4C", "NVIDIA
    L40S-12Q"): ("A100", "A100-4C"); None for a name that is no vGPU type (a GPU's own
    product name, "NVIDIA A100-SXM4-40GB")."""
    token = name.strip().split()[-1].upper() if name.strip() else ""
    match = _VGPU_TYPE.match(token)
    return (match["board"], token) if match else None


def vgpu_fraction(name: str) -> Decimal | None:
    """The share of its physical GPU a vGPU type name gives, None if it is not one we know."""
    token = name.strip().split()[-1] if name.strip() else ""
    match = _VGPU_TYPE.match(token.upper())
    if not match:
        return None
    board = match["board"]
    if match["slices"]:
        return Decimal(int(match["slices"])) / _MIG_SLICES_BY_BOARD.get(board, 7)
    total = VGPU_BOARD_MEMORY_GB.get(board)
    if not total:
        return None
    return min(Decimal(int(match["gb"])) / total, Decimal(1))


# AMD compute partition modes and how many partitions each makes of one GPU. CPX makes one
# per XCD: 8 on an MI300X, MI325X, MI350X and MI355X, 4 on an MI308X, 6 on an MI300A; on a
# model not listed it is counted from the partitions the driver publishes on that GPU.
AMD_PARTITIONS = {"spx": 1, "dpx": 2, "tpx": 3, "qpx": 4}
AMD_XCDS = {"MI300X": 8, "MI325X": 8, "MI350X": 8, "MI355X": 8, "MI308X": 4, "MI300A": 6}


def partition_profile_count(profile: str, product: str = "") -> int | None:
    """Partitions per GPU from an AMD partition profile ("dpx_nps2" -> 2, "cpx_nps1" on an
    MI300X -> 8); None when the profile or the model's XCD count is unknown."""
    mode = re.split(r"[_-]", profile.strip().lower(), maxsplit=1)[0] if profile else ""
    if mode == "cpx":
        upper = product.upper()
        return next((n for model, n in AMD_XCDS.items() if model in upper), None)
    return AMD_PARTITIONS.get(mode)


# Intel's GPU driver looks a GPU's `model` up from its PCI device id and publishes "Unknown"
# for an id its table lacks (Arc cards, in the releases seen): every such GPU would be billed
# as one model "Unknown". Names of ids the driver's table has missed, from the Linux kernel's
# PCI id lists; any other id is named "Intel GPU 0x<id>", a name a rate card can still price
# and `inventory.checks` asks an operator to confirm.
INTEL_DRIVER = "gpu.intel.com"
INTEL_GPU_MODELS = {
    "0x56a0": "Arc A770",
    "0x56a1": "Arc A750",
    "0x56a5": "Arc A380",
    "0x56a6": "Arc A310",
    "0x56c0": "Flex 170",
    "0x56c1": "Flex 140",
    "0x0bd5": "Max 1550",
    "0x0bda": "Max 1100",
    "0xe20b": "Arc B580",
    "0xe20c": "Arc B570",
}
INTEL_UNNAMED_PREFIX = "Intel GPU 0x"
_PCI_DEVICE_ID = re.compile(r"(?:0x)?(?P<id>[0-9a-f]{4})\Z")
_UNNAMED_MODELS = frozenset({"", "unknown"})


def fallback_model(driver: str, published: str, pci_ids: Iterable[str]) -> str:
    """The model of a device whose driver published none (or "Unknown"): for Intel GPUs, the
    name of its PCI device id (the first of `pci_ids` that is one), else "Intel GPU 0x<id>";
    `published` as it is otherwise."""
    if driver != INTEL_DRIVER or published.strip().lower() not in _UNNAMED_MODELS:
        return published
    for text in pci_ids:
        match = _PCI_DEVICE_ID.fullmatch(text.strip().lower())
        if match:
            device_id = "0x" + match["id"]
            return INTEL_GPU_MODELS.get(device_id, INTEL_UNNAMED_PREFIX + match["id"])
    return published
