"""CEL device selectors, evaluated the way the Kubernetes API server and scheduler evaluate them.

Quota rules and ResourceClaims select devices with the same CEL expressions that DRA uses
(`spec.devices.requests[].exactly.selectors[].cel.expression`). This module parses them with
`cel-python` (`celpy`), checks them as the API server's DRA CEL environment does
(k8s.io/dynamic-resource-allocation/cel) and evaluates them with its own interpreter on
celpy's tree:

- `device.driver` (string), `device.allowMultipleAllocations` (bool);
- `device.attributes[domain].name` and `device.capacity[domain].name`: a published name
  without a domain belongs to the driver's domain; looking up a domain the device does not
  publish gives an empty map, looking up a missing name is an evaluation error;
- attribute values as int, bool, string, `Semver` (and lists of those); capacities as
  `Quantity`;
- Kubernetes' libraries: `quantity()`/`semver()` and their methods, `includes()` for
  list-type attributes, lists (`isSorted`, `sum`, `min`, `max`, `indexOf`, `lastIndexOf`),
  regex (`find`, `findAll`), sets (`sets.contains`, ...); CEL's strings extension (`split`,
  `join`, `replace`, `substring`, `trim`, `lowerAscii`, ...), `cel.bind`, and CEL's own
  functions and macros;
- type checking: a selector must be boolean; a macro over a value that is not a list or a map
  is an error, as is an unknown function, variable or field of `device`;
- cost: every selector gets an estimated cost as the API server's estimator works it out, and
  one above `MAX_ESTIMATED_COST` is refused when compiled; every evaluation counts its steps
  and stops at `MAX_EVALUATION_STEPS` (an estimate can be beaten), so no selector holds a
  webhook worker for more than a fraction of its deadline.

An evaluation error makes the device not match, as it makes the scheduler skip it; it is
never raised (`CompiledSelector.evaluate` says what it was). Running past the step limit is
not a no-match but a refusal (`Evaluation.exceeded`): the selector cannot be weighed.

Evaluation is per device *shape* (`quota.admission.shapes`): thousands of GPUs that only differ
by uuid or PCI address are evaluated once.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import Any, Final, cast

import celpy
import lark
import re2
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import Activation, CELEvalError, Evaluator
from kubernetes.utils import parse_quantity

__all__ = [
    "KUBERNETES_MAX_COST",
    "MAX_CLAIM_ESTIMATED_COST",
    "MAX_CLAIM_STEPS",
    "MAX_ESTIMATED_COST",
    "MAX_EVALUATION_STEPS",
    "CELCostError",
    "CELError",
    "CompiledSelector",
    "DeviceShape",
    "Evaluation",
    "Quantity",
    "Semver",
    "compile_selector",
]

# Published attribute data: `{qualified name: {"int"|"bool"|"string"|"version"|...: value}}`.
AttributeData = Mapping[str, Mapping[str, Any]]
# Published capacity data: `{qualified name: {"value": "40Gi", ...}}`.
CapacityData = Mapping[str, Mapping[str, Any]]

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1


class CELError(ValueError):
    """A selector that cannot be compiled: a syntax error, an unknown function, variable or
    field, a type error, or one too expensive (`CELCostError`)."""

    def brief(self) -> str:
        """The message on one line, for an admission answer or a warning: without the
        source line and caret under it."""
        return str(self).splitlines()[0].removesuffix(":")


class CELCostError(CELError):
    """A selector whose estimated cost is over `MAX_ESTIMATED_COST`."""


# --- Kubernetes value types -------------------------------------------------------------------


class Quantity:
    """A Kubernetes resource quantity (`40Gi`, `100m`), compared by value as Kubernetes does."""

    __slots__ = ("text", "value")

    def __init__(self, text: str) -> None:
        self.text = text
        # `parse_quantity` accepts the suffixes and exponents that `resource.ParseQuantity` does.
        self.value: Decimal = parse_quantity(text)

    @classmethod
    def from_decimal(cls, value: Decimal) -> Quantity:
        quantity = cls.__new__(cls)
        quantity.text = format(value.normalize(), "f")
        quantity.value = value
        return quantity

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Quantity):
            # CEL has no `==` between a quantity and another type: "no such overload".
            raise TypeError(f"no such overload: quantity == {type(other).__name__}")
        return self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"Quantity({self.text!r})"


_SEMVER = re.compile(
    r"^(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)\.(?P<patch>0|[1-9]\d*)"
    r"(?:-(?P<pre>[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+(?P<build>[0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


class Semver:
    """A semantic version as `blang/semver` parses it; build metadata is ignored in comparisons."""

    __slots__ = ("build", "major", "minor", "patch", "pre", "text")

    def __init__(self, text: str, *, normalize: bool = False) -> None:
        source = _normalize_semver(text) if normalize else text
        found = _SEMVER.match(source)
        if found is None:
            raise ValueError(f"invalid semantic version {text!r}")
        pre = found["pre"].split(".") if found["pre"] else []
        if any(part.isdigit() and len(part) > 1 and part.startswith("0") for part in pre):
            raise ValueError(f"invalid semantic version {text!r}: leading zero in pre-release")
        self.text = text
        self.major = int(found["major"])
        self.minor = int(found["minor"])
        self.patch = int(found["patch"])
        self.pre: tuple[str, ...] = tuple(pre)
        self.build = found["build"] or ""

    def _precedence(self) -> tuple[Any, ...]:
        # A release sorts after its pre-releases; numeric identifiers sort before alphanumeric.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (self.major, self.minor, self.patch, not self.pre, pre)

    def compare(self, other: Semver) -> int:
        mine, theirs = self._precedence(), other._precedence()
        return (mine > theirs) - (mine < theirs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Semver):
            raise TypeError(f"no such overload: semver == {type(other).__name__}")
        return self.compare(other) == 0

    def __hash__(self) -> int:
        return hash(self._precedence())

    def __repr__(self) -> str:
        return f"Semver({self.text!r})"


def _normalize_semver(text: str) -> str:
    """Kubernetes' `semver(s, true)`: drop a leading `v`, fill in `.0`, drop leading zeros."""
    text = text.removeprefix("v")
    found = re.match(r"^(\d+(?:\.\d+){0,2})(.*)$", text, re.DOTALL)
    if found is None:
        return text
    numbers = [str(int(number)) for number in found[1].split(".")]
    numbers += ["0"] * (3 - len(numbers))
    return ".".join(numbers) + found[2]


# --- Functions --------------------------------------------------------------------------------


def _error(message: str) -> CELEvalError:
    return CELEvalError(message)


def _require(value: Any, kind: type, function: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"no such overload: {function}({type(value).__name__})")


def _quantity(text: Any) -> Quantity | CELEvalError:
    _require(text, str, "quantity")
    try:
        return Quantity(str(text))
    except (ValueError, InvalidOperation):
        return _error(f"quantity: invalid quantity {text!r}")


def _is_quantity(text: Any) -> celtypes.BoolType:
    return celtypes.BoolType(isinstance(_quantity(text), Quantity))


def _semver(text: Any, normalize: Any = False) -> Semver | CELEvalError:
    _require(text, str, "semver")
    try:
        return Semver(str(text), normalize=bool(normalize))
    except ValueError as exc:
        return _error(f"semver: {exc}")


def _is_semver(text: Any, normalize: Any = False) -> celtypes.BoolType:
    return celtypes.BoolType(isinstance(_semver(text, normalize), Semver))


def _ordered(receiver: Any, other: Any, function: str) -> int:
    """`compareTo` for two quantities or two semvers, as -1, 0 or 1."""
    if isinstance(receiver, Quantity) and isinstance(other, Quantity):
        return (receiver.value > other.value) - (receiver.value < other.value)
    if isinstance(receiver, Semver) and isinstance(other, Semver):
        return receiver.compare(other)
    raise TypeError(
        f"no such overload: {type(receiver).__name__}.{function}({type(other).__name__})"
    )


def _compare_to(receiver: Any, other: Any) -> celtypes.IntType:
    return celtypes.IntType(_ordered(receiver, other, "compareTo"))


def _is_greater_than(receiver: Any, other: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_ordered(receiver, other, "isGreaterThan") > 0)


def _is_less_than(receiver: Any, other: Any) -> celtypes.BoolType:
    return celtypes.BoolType(_ordered(receiver, other, "isLessThan") < 0)


def _arithmetic(combine: Callable[[Decimal, Decimal], Decimal], name: str) -> Callable[..., Any]:
    def apply(receiver: Any, other: Any) -> Quantity:
        _require(receiver, Quantity, name)
        if isinstance(other, Quantity):
            return Quantity.from_decimal(combine(receiver.value, other.value))
        if isinstance(other, int) and not isinstance(other, bool):
            return Quantity.from_decimal(combine(receiver.value, Decimal(other)))
        raise TypeError(f"no such overload: quantity.{name}({type(other).__name__})")

    return apply


def _is_integer(receiver: Any) -> celtypes.BoolType:
    _require(receiver, Quantity, "isInteger")
    value = receiver.value
    return celtypes.BoolType(value == value.to_integral_value() and INT64_MIN <= value <= INT64_MAX)


def _as_integer(receiver: Any) -> celtypes.IntType | CELEvalError:
    if not _is_integer(receiver):
        return _error(f"asInteger: {receiver.text} is not an integer or does not fit in int64")
    return celtypes.IntType(int(receiver.value))


def _as_approximate_float(receiver: Any) -> celtypes.DoubleType:
    _require(receiver, Quantity, "asApproximateFloat")
    return celtypes.DoubleType(float(receiver.value))


def _sign(receiver: Any) -> celtypes.IntType:
    _require(receiver, Quantity, "sign")
    return celtypes.IntType((receiver.value > 0) - (receiver.value < 0))


def _semver_part(part: str) -> Callable[[Any], celtypes.IntType]:
    def read(receiver: Any) -> celtypes.IntType:
        _require(receiver, Semver, part)
        return celtypes.IntType(getattr(receiver, part))

    return read


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_ASCII_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _ascii_case(table: dict[int, int], name: str) -> Callable[[Any], celtypes.StringType]:
    def convert(receiver: Any) -> celtypes.StringType:
        _require(receiver, str, name)
        return celtypes.StringType(str(receiver).translate(table))

    return convert


# --- Kubernetes' libraries and CEL's strings extension ------------------------------------------

# `includes()` is meant for list-type attributes, which hold at most this many values
# (`resourceapi.ResourceSliceMaxAttributeValuesPerDevice`); the API server estimates its cost
# by it and refuses a longer list at run time.
MAX_ATTRIBUTE_VALUES: Final = 48

_TYPE_NAMES_AT_RUN_TIME: Final[tuple[tuple[type, str], ...]] = (
    (celtypes.BoolType, "types.Bool"),
    (celtypes.IntType, "types.Int"),
    (celtypes.UintType, "types.Uint"),
    (celtypes.DoubleType, "types.Double"),
    (celtypes.StringType, "types.String"),
    (celtypes.BytesType, "types.Bytes"),
    (Semver, "cel.Semver"),
    (Quantity, "cel.Quantity"),
)


def _runtime_type(value: Any) -> str:
    """The name cel-go gives the type of `value` in its errors (`types.String`)."""
    for kind, name in _TYPE_NAMES_AT_RUN_TIME:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _same(left: Any, right: Any) -> bool:
    """CEL equality between two values of any types: different types are simply unequal."""
    if _runtime_type(left) != _runtime_type(right):
        return False
    try:
        return bool(left == right)
    except TypeError:
        return False


def _includes(receiver: Any, value: Any) -> celtypes.BoolType | CELEvalError:
    """Kubernetes' `includes()`: whether a list-type attribute holds `value`; a scalar attribute
    is a list of one, so one selector reads both kinds of attribute."""
    if isinstance(receiver, celtypes.ListType):
        if len(receiver) > MAX_ATTRIBUTE_VALUES:
            return _error(
                f"'includes' function cannot be applied to lists longer than "
                f"{MAX_ATTRIBUTE_VALUES} values"
            )
        return celtypes.BoolType(any(_same(item, value) for item in receiver))
    return celtypes.BoolType(_same(receiver, value))


def _string(value: Any, function: str) -> str:
    _require(value, str, function)
    return str(value)


def _int(value: Any, function: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"no such overload: {function}({type(value).__name__})")
    return int(value)


def _char_at(receiver: Any, index: Any) -> celtypes.StringType | CELEvalError:
    text, at = _string(receiver, "charAt"), _int(index, "charAt")
    if not 0 <= at <= len(text):
        return _error(f"index out of range: {at}")
    return celtypes.StringType(text[at : at + 1])


def _index_of(receiver: Any, value: Any, offset: Any = 0) -> celtypes.IntType | CELEvalError:
    if isinstance(receiver, celtypes.ListType):  # Kubernetes' lists library
        return celtypes.IntType(next((i for i, v in enumerate(receiver) if _same(v, value)), -1))
    text, start = _string(receiver, "indexOf"), _int(offset, "indexOf")
    if not 0 <= start <= len(text):
        return _error(f"index out of range: {start}")
    return celtypes.IntType(text.find(_string(value, "indexOf"), start))


def _last_index_of(receiver: Any, value: Any, *offset: Any) -> celtypes.IntType | CELEvalError:
    if isinstance(receiver, celtypes.ListType):
        found = [i for i, v in enumerate(receiver) if _same(v, value)]
        return celtypes.IntType(found[-1] if found else -1)
    text, wanted = _string(receiver, "lastIndexOf"), _string(value, "lastIndexOf")
    end = _int(offset[0], "lastIndexOf") if offset else len(text)
    if not 0 <= end <= len(text):
        return _error(f"index out of range: {end}")
    return celtypes.IntType(text.rfind(wanted, 0, end + len(wanted)))


def _join(receiver: Any, separator: Any = "") -> celtypes.StringType:
    _require(receiver, celtypes.ListType, "join")
    return celtypes.StringType(
        _string(separator, "join").join(_string(item, "join") for item in receiver)
    )


def _replace(receiver: Any, old: Any, new: Any, count: Any = -1) -> celtypes.StringType:
    text, limit = _string(receiver, "replace"), _int(count, "replace")
    return celtypes.StringType(
        text.replace(_string(old, "replace"), _string(new, "replace"), limit)
    )


def _split(receiver: Any, separator: Any, count: Any = -1) -> celtypes.ListType:
    """Go's `strings.SplitN`: `count` 0 gives no parts, a negative one every part."""
    text, sep, limit = _string(receiver, "split"), _string(separator, "split"), _int(count, "split")
    if limit == 0:
        return celtypes.ListType()
    if sep == "":
        parts = (
            list(text)
            if limit < 0 or limit >= len(text)
            else [*text[: limit - 1], text[limit - 1 :]]
        )
    else:
        parts = text.split(sep, limit - 1 if limit > 0 else -1)
    return celtypes.ListType(celtypes.StringType(part) for part in parts)


def _substring(receiver: Any, start: Any, *end: Any) -> celtypes.StringType | CELEvalError:
    text = _string(receiver, "substring")
    first = _int(start, "substring")
    last = _int(end[0], "substring") if end else len(text)
    if not 0 <= first <= last <= len(text):
        return _error(f"substring: index out of range: [{first}:{last}] of {len(text)}")
    return celtypes.StringType(text[first:last])


def _trim(receiver: Any) -> celtypes.StringType:
    return celtypes.StringType(_string(receiver, "trim").strip())


def _reverse(receiver: Any) -> celtypes.StringType | celtypes.ListType:
    if isinstance(receiver, celtypes.ListType):
        return celtypes.ListType(reversed(receiver))
    return celtypes.StringType(_string(receiver, "reverse")[::-1])


def _regex(pattern: Any, function: str) -> Any:
    """`pattern` compiled by RE2, as cel-go's: linear in the text's length, whatever the
    pattern (Python's `re` can take exponential time, which no step count would see)."""
    try:
        return re2.compile(_string(pattern, function))
    except re2.error as exc:
        return _error(f"{function}: invalid regular expression {pattern!r}: {exc}")


def _find(receiver: Any, pattern: Any) -> celtypes.StringType | CELEvalError:
    """Kubernetes' regex library: the first match of `pattern`, or ""."""
    compiled = _regex(pattern, "find")
    if isinstance(compiled, CELEvalError):
        return compiled
    found = compiled.search(_string(receiver, "find"))
    return celtypes.StringType(found.group(0) if found else "")


def _find_all(receiver: Any, pattern: Any, count: Any = -1) -> celtypes.ListType | CELEvalError:
    compiled = _regex(pattern, "findAll")
    if isinstance(compiled, CELEvalError):
        return compiled
    limit = _int(count, "findAll")
    found = [m.group(0) for m in compiled.finditer(_string(receiver, "findAll"))]
    if limit >= 0:
        found = found[:limit]
    return celtypes.ListType(celtypes.StringType(item) for item in found)


def _comparable(receiver: Any, function: str) -> list[Any]:
    _require(receiver, celtypes.ListType, function)
    return list(receiver)


def _is_sorted(receiver: Any) -> celtypes.BoolType:
    items = _comparable(receiver, "isSorted")
    return celtypes.BoolType(all(a <= b for a, b in itertools.pairwise(items)))


def _sum(receiver: Any) -> Any:
    items = _comparable(receiver, "sum")
    total: Any = celtypes.IntType(0)
    if items:
        total = items[0]
        for item in items[1:]:
            total = total + item
    return total


def _extreme(pick: Callable[..., Any], name: str) -> Callable[[Any], Any]:
    def apply(receiver: Any) -> Any:
        items = _comparable(receiver, name)
        if not items:
            return _error(f"{name} called on an empty list")
        return pick(items)

    return apply


def _set_function(test: Callable[[list[Any], list[Any]], bool], name: str) -> Callable[..., Any]:
    def apply(first: Any, second: Any) -> celtypes.BoolType:
        return celtypes.BoolType(test(_comparable(first, name), _comparable(second, name)))

    return apply


def _contains_all(first: list[Any], second: list[Any]) -> bool:
    return all(any(_same(a, b) for a in first) for b in second)


FUNCTIONS: Final[dict[str, Callable[..., Any]]] = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _semver,
    "isSemver": _is_semver,
    "compareTo": _compare_to,
    "isGreaterThan": _is_greater_than,
    "isLessThan": _is_less_than,
    "add": _arithmetic(operator.add, "add"),
    "sub": _arithmetic(operator.sub, "sub"),
    "isInteger": _is_integer,
    "asInteger": _as_integer,
    "asApproximateFloat": _as_approximate_float,
    "sign": _sign,
    "major": _semver_part("major"),
    "minor": _semver_part("minor"),
    "patch": _semver_part("patch"),
    "includes": _includes,
    "lowerAscii": _ascii_case(_ASCII_LOWER, "lowerAscii"),
    "upperAscii": _ascii_case(_ASCII_UPPER, "upperAscii"),
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "join": _join,
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": _trim,
    "reverse": _reverse,
    "find": _find,
    "findAll": _find_all,
    "isSorted": _is_sorted,
    "sum": _sum,
    "min": _extreme(min, "min"),
    "max": _extreme(max, "max"),
    "sets.contains": _set_function(_contains_all, "sets.contains"),
    "sets.equivalent": _set_function(
        lambda a, b: _contains_all(a, b) and _contains_all(b, a), "sets.equivalent"
    ),
    "sets.intersects": _set_function(
        lambda a, b: any(_same(x, y) for x in a for y in b), "sets.intersects"
    ),
}

_MACROS: Final = frozenset({"all", "exists", "exists_one", "map", "filter"})
_VARIABLE: Final = "device"


# --- Device view ------------------------------------------------------------------------------


class _DomainMap(celtypes.MapType):
    """`device.attributes` / `device.capacity`: an unknown domain reads as an empty map."""

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            return celtypes.MapType()


def _split_name(name: str, driver: str) -> tuple[str, str]:
    domain, sep, identifier = name.partition("/")
    return (domain, identifier) if sep else (driver, name)


def _scalar(kind: str, value: Any) -> Any:
    if kind == "int":
        return celtypes.IntType(int(value))
    if kind == "bool":
        return celtypes.BoolType(bool(value))
    if kind == "string":
        return celtypes.StringType(str(value))
    if kind == "version":
        return Semver(str(value))
    raise ValueError(f"unsupported attribute value type {kind!r}")


_LIST_KINDS: Final = {"ints": "int", "bools": "bool", "strings": "string", "versions": "version"}


def _attribute_value(published: Mapping[str, Any]) -> Any:
    """The CEL value of one published attribute (`{"int": 3}`, `{"strings": [...]}`)."""
    for kind, value in published.items():
        if kind in _LIST_KINDS:
            return celtypes.ListType([_scalar(_LIST_KINDS[kind], item) for item in value])
        if kind in ("int", "bool", "string", "version"):
            return _scalar(kind, value)
    raise ValueError(f"unsupported attribute value {dict(published)!r}")


def _grouped(
    published: Mapping[str, Any], driver: str, convert: Callable[[Any], Any]
) -> _DomainMap:
    domains: dict[str, dict[celtypes.StringType, Any]] = {}
    for name, value in published.items():
        domain, identifier = _split_name(name, driver)
        domains.setdefault(domain, {})[celtypes.StringType(identifier)] = convert(value)
    return _DomainMap(
        {celtypes.StringType(domain): celtypes.MapType(ids) for domain, ids in domains.items()}
    )


@dataclass(frozen=True, eq=False)
class DeviceShape:
    """The `device` variable for one device (or one shape of many), built once and reused.

    `error` is set when a published value cannot be converted (an invalid version string):
    Kubernetes then fails every selector on the device, and so does `matches()`.
    """

    driver: str
    activation: Mapping[str, Any] = field(repr=False)
    error: str | None = None

    @classmethod
    def from_device(
        cls,
        *,
        driver: str,
        attributes: AttributeData,
        capacity: CapacityData,
        allow_multiple_allocations: bool = False,
    ) -> DeviceShape:
        """Group the published attributes and capacity by domain, as DRA's CEL input does."""
        error = None
        try:
            attribute_map = _grouped(attributes, driver, _attribute_value)
            capacity_map = _grouped(capacity, driver, lambda entry: Quantity(str(entry["value"])))
        except (ValueError, InvalidOperation, KeyError, TypeError) as exc:
            error = f"device of driver {driver!r}: {exc}"
            attribute_map = capacity_map = _DomainMap()
        device = celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(driver),
                celtypes.StringType("attributes"): attribute_map,
                celtypes.StringType("capacity"): capacity_map,
                celtypes.StringType("allowMultipleAllocations"): celtypes.BoolType(
                    allow_multiple_allocations
                ),
            }
        )
        return cls(driver=driver, activation={_VARIABLE: device}, error=error)


# --- Type checking and cost estimation ---------------------------------------------------------

# The API server's limit on a selector's length (`resourceapi.CELSelectorExpressionMaxLength`).
MAX_EXPRESSION_LENGTH: Final = 10 * 1024
# The API server's limit on a selector's estimated cost
# (`resourceapi.CELSelectorExpressionMaxCost`).
KUBERNETES_MAX_COST: Final = 1_000_000
# Tally's: its interpreter is about a hundred times slower than cel-go, so a selector the API
# server would still accept can hold a webhook worker for seconds (a 60x60 nested macro:
# about 20,000 by the estimate). The selectors DRA drivers publish cost tens, a macro over a
# list-type attribute a few hundred, a lookup over every attribute domain under two hundred.
MAX_ESTIMATED_COST: Final = 10_000
# What one evaluation may take, in interpreter steps (tree nodes visited, about 12 µs each on
# an idle core): an estimate can be beaten (a list longer than the API server allows, a long
# string), so evaluation stops here whatever the estimate said. A selector within
# `MAX_ESTIMATED_COST` takes at most about 1.4 steps per unit; this is a tenth of the
# webhook's 2.5-s deadline.
MAX_EVALUATION_STEPS: Final = 20_000
# A claim's selectors together: their estimates summed, and the steps of their evaluations
# over every device shape of their classes and every `firstAvailable` alternative (per shape,
# each selector is evaluated once and remembered). Evaluation stops once past it, one
# evaluation's steps later at most: 40,000 steps, a fifth of the webhook's deadline.
MAX_CLAIM_ESTIMATED_COST: Final = 20_000
MAX_CLAIM_STEPS: Final = 20_000

# The largest maps and lists a device can give a selector, as the API server declares them
# (`ResourceSliceMaxAttributesAndCapacitiesPerDevice`; a list-type attribute's values or a
# string attribute's length, whichever is larger).
_MAX_DEVICE_ENTRIES: Final = 32
_MAX_VALUE_ELEMENTS: Final = 64
_MAX_NAME_LENGTH: Final = 63
_LIST_CREATE_COST: Final = 10
_MAP_CREATE_COST: Final = 30

# Static types: CEL's, and those of the `device` variable's parts.
_DYN: Final = "dyn"
_NUMERIC: Final = frozenset({"int", "uint", "double"})
_ORDERED: Final = _NUMERIC | {"string", "bytes", "bool"}
_ADDABLE: Final = _NUMERIC | {"string", "bytes", "list"}
_DEVICE_FIELDS: Final = {
    "driver": "string",
    "attributes": "attribute_domains",
    "capacity": "capacity_domains",
    "allowMultipleAllocations": "bool",
}
# What each function returns; `_DYN` where it depends on its arguments.
_RETURNS: Final[dict[str, str]] = {
    **{name: "bool" for name in ("isQuantity", "isSemver", "isGreaterThan", "isLessThan")},
    **{name: "bool" for name in ("isInteger", "includes", "isSorted", "startsWith")},
    **{name: "bool" for name in ("endsWith", "contains", "matches")},
    **{name: "bool" for name in ("sets.contains", "sets.equivalent", "sets.intersects")},
    **{name: "int" for name in ("compareTo", "sign", "asInteger", "major", "minor", "patch")},
    **{name: "int" for name in ("size", "indexOf", "lastIndexOf", "int")},
    **{name: "string" for name in ("lowerAscii", "upperAscii", "charAt", "join", "replace")},
    **{name: "string" for name in ("substring", "trim", "find", "string")},
    "asApproximateFloat": "double",
    "double": "double",
    "uint": "uint",
    "bool": "bool",
    "bytes": "bytes",
    "split": "list",
    "findAll": "list",
    "quantity": "quantity",
    "add": "quantity",
    "sub": "quantity",
    "semver": "semver",
    "reverse": _DYN,
    "sum": _DYN,
    "min": _DYN,
    "max": _DYN,
    "dyn": _DYN,
    "type": "type",
    # CEL's time functions exist in the API server's environment; no device value has a time.
    "duration": "duration",
    "timestamp": "timestamp",
}
# Functions whose cost grows with the length of what they read (cel-go's traversal factor).
_TRAVERSING: Final = frozenset(
    {"contains", "startsWith", "endsWith", "split", "join", "replace", "indexOf", "lastIndexOf"}
    | {"lowerAscii", "upperAscii", "trim", "reverse", "substring", "sets.contains"}
    | {"sets.equivalent", "sets.intersects", "isSorted", "sum", "min", "max"}
)
_REGEX: Final = frozenset({"matches", "find", "findAll"})
_TYPE_IDENTS: Final = frozenset(
    {"bool", "bytes", "double", "int", "list", "map", "null_type", "string", "type", "uint"}
)
# Pass-through nodes of celpy's grammar (`expr` -> `conditionalor` -> ... -> `primary`).
_PASS_THROUGH: Final = frozenset(
    {"expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication"}
    | {"unary", "member", "primary", "paren_expr"}
)
_OPERATORS: Final = {
    "relation_lt": "<",
    "relation_le": "<=",
    "relation_gt": ">",
    "relation_ge": ">=",
    "relation_eq": "==",
    "relation_ne": "!=",
    "relation_in": "in",
    "addition_add": "+",
    "addition_sub": "-",
    "multiplication_mul": "*",
    "multiplication_div": "/",
    "multiplication_mod": "%",
}


@dataclass(frozen=True)
class _Static:
    """What the checker knows of a sub-expression: its type, estimated cost and largest size."""

    type: str
    cost: int
    size: int = _MAX_VALUE_ELEMENTS
    element: str = _DYN


def _unwrap(tree: lark.Tree) -> lark.Tree:
    while (
        tree.data in _PASS_THROUGH
        and len(tree.children) == 1
        and isinstance(tree.children[0], lark.Tree)
    ):
        tree = tree.children[0]
    return tree


def _ident_of(tree: Any) -> str | None:
    """The name `tree` is, when it is a plain identifier."""
    if not isinstance(tree, lark.Tree):
        return None
    node = _unwrap(tree)
    if node.data == "ident":
        return str(node.children[0])
    return None


def _arguments(tree: lark.Tree, index: int) -> list[lark.Tree]:
    if len(tree.children) > index and isinstance(tree.children[index], lark.Tree):
        return [c for c in tree.children[index].children if isinstance(c, lark.Tree)]
    return []


class _Checker:
    """Type checks a parsed selector and estimates its cost, as the API server's DRA CEL
    environment does: `device` and its parts are typed, attribute values are `dyn` (a value
    of any type, checked when evaluated)."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.scopes: list[dict[str, _Static]] = []

    def fail(self, message: str, token: Any = None) -> CELError:
        line = getattr(token, "line", None)
        column = getattr(token, "column", None)
        return CELError(
            f"{message} in CEL selector {self.expression!r}"
            + _position(self.expression, line, column)
        )

    def check(self, tree: lark.Tree) -> _Static:
        node = _unwrap(tree)
        method = getattr(self, f"_{node.data}", None)
        if method is None:
            raise self.fail(f"unsupported expression {node.data!r}")
        result: _Static = method(node)
        return result

    # Operators --------------------------------------------------------------------------------

    def _boolean(self, value: _Static, operator_name: str, token: Any = None) -> None:
        if value.type not in ("bool", _DYN):
            raise self.fail(
                f"found no matching overload for '{operator_name}' applied to '{value.type}'", token
            )

    def _expr(self, node: lark.Tree) -> _Static:  # condition ? left : right
        condition, left, right = (self.check(child) for child in node.children)
        self._boolean(condition, "_?_:_")
        kind = left.type if left.type == right.type else _DYN
        return _Static(
            kind, condition.cost + max(left.cost, right.cost), max(left.size, right.size)
        )

    def _logical(self, node: lark.Tree, operator_name: str) -> _Static:
        left, right = (self.check(child) for child in node.children)
        self._boolean(left, operator_name)
        self._boolean(right, operator_name)
        return _Static("bool", left.cost + right.cost)

    def _conditionalor(self, node: lark.Tree) -> _Static:
        return self._logical(node, "_||_")

    def _conditionaland(self, node: lark.Tree) -> _Static:
        return self._logical(node, "_&&_")

    def _binary(self, node: lark.Tree) -> _Static:
        operation, right_tree = node.children
        symbol = _OPERATORS[operation.data]
        left, right = self.check(operation.children[0]), self.check(right_tree)
        cost = left.cost + right.cost + 1
        known = _DYN not in (left.type, right.type)
        mismatch = (
            f"found no matching overload for '_{symbol}_' applied to '({left.type}, {right.type})'"
        )
        if symbol in ("==", "!=") and "string" in (left.type, right.type):
            # Comparing strings reads the shorter (cel-go's traversal factor, a tenth).
            cost = left.cost + right.cost + -(-min(left.size, right.size) // 10)
        if symbol == "in":
            if right.type not in (
                "list",
                "map",
                _DYN,
                "attribute_domains",
                "capacity_domains",
            ) and not right.type.endswith("_map"):
                raise self.fail(mismatch)
            if right.type in ("list", _DYN):  # a search through the list
                return _Static("bool", left.cost + right.cost + right.size)
            return _Static("bool", cost)
        if symbol in ("==", "!="):
            if known and left.type != right.type and not {left.type, right.type} <= _NUMERIC:
                raise self.fail(mismatch)
            return _Static("bool", cost)
        if symbol in ("<", "<=", ">", ">="):
            if known and not (
                (left.type == right.type and left.type in _ORDERED)
                or {left.type, right.type} <= _NUMERIC
            ):
                raise self.fail(mismatch)
            return _Static("bool", cost)
        allowed = _ADDABLE if symbol == "+" else _NUMERIC
        if known and (left.type != right.type or left.type not in allowed):
            raise self.fail(mismatch)
        if left.type == "list" or right.type == "list":
            return _Static("list", cost, left.size + right.size)
        kind = left.type if left.type == right.type else _DYN
        return _Static(kind, cost, left.size + right.size)

    _relation = _addition = _multiplication = _binary

    def _unary(self, node: lark.Tree) -> _Static:
        operation, operand_tree = node.children
        operand = self.check(operand_tree)
        if operation.data == "unary_not":
            self._boolean(operand, "!_")
            return _Static("bool", operand.cost + 1)
        if operand.type not in _NUMERIC | {_DYN} or operand.type == "uint":
            raise self.fail(f"found no matching overload for '-_' applied to '{operand.type}'")
        return _Static(operand.type, operand.cost + 1)

    # Members ----------------------------------------------------------------------------------

    def _field(self, receiver: _Static, name: str, token: Any, *, index: bool) -> _Static:
        cost = receiver.cost + 1
        if receiver.type == "device":
            if index or name not in _DEVICE_FIELDS:
                raise self.fail(f"undefined field '{name}'", token)
            kind = _DEVICE_FIELDS[name]
            return _Static(
                kind, cost, _MAX_DEVICE_ENTRIES if kind.endswith("domains") else _MAX_NAME_LENGTH
            )
        if receiver.type == "attribute_domains":
            return _Static("attribute_map", cost, _MAX_DEVICE_ENTRIES)
        if receiver.type == "capacity_domains":
            return _Static("capacity_map", cost, _MAX_DEVICE_ENTRIES)
        if receiver.type == "attribute_map":
            return _Static(_DYN, cost)
        if receiver.type == "capacity_map":
            return _Static("quantity", cost)
        if receiver.type == "map":
            return _Static(receiver.element, cost)
        if receiver.type == "list" and index:
            return _Static(receiver.element, cost)
        if receiver.type == _DYN:
            return _Static(_DYN, cost)
        selection = "indexing" if index else "field selection"
        raise self.fail(f"type '{receiver.type}' does not support {selection}", token)

    def _member_dot(self, node: lark.Tree) -> _Static:
        receiver_tree, name = node.children
        return self._field(self.check(receiver_tree), str(name), name, index=False)

    def _member_index(self, node: lark.Tree) -> _Static:
        receiver_tree, key_tree = node.children
        key = self.check(key_tree)
        field = _literal_string(key_tree)
        result = self._field(self.check(receiver_tree), field or "", None, index=True)
        return _Static(result.type, result.cost + key.cost, result.size, result.element)

    def _member_dot_arg(self, node: lark.Tree) -> _Static:
        receiver_tree, name_token = node.children[:2]
        name = str(name_token)
        arguments = _arguments(node, 2)
        namespace = _ident_of(receiver_tree)
        if namespace == "cel" and self._scope(namespace) is None:
            if name != "bind" or len(arguments) != 3:
                raise self.fail(f"undeclared reference to 'cel.{name}'", name_token)
            return self._bind(arguments, name_token)
        if namespace == "sets" and self._scope(namespace) is None:
            if f"sets.{name}" not in FUNCTIONS:
                raise self.fail(f"undeclared reference to 'sets.{name}'", name_token)
            return self._call(f"sets.{name}", None, arguments, name_token)
        if name in _MACROS:
            return self._macro(name, receiver_tree, arguments, name_token)
        return self._call(name, self.check(receiver_tree), arguments, name_token)

    def _member_object(self, node: lark.Tree) -> _Static:
        raise self.fail("message construction is not supported")

    # Calls ------------------------------------------------------------------------------------

    def _call(
        self, name: str, receiver: _Static | None, arguments: list[lark.Tree], token: Any
    ) -> _Static:
        if name not in _RETURNS:
            raise self.fail(f"undeclared reference to '{name}'", token)
        values = [self.check(argument) for argument in arguments]
        cost = 1 + sum(value.cost for value in values) + (receiver.cost if receiver else 0)
        read = receiver.size if receiver else max((v.size for v in values), default=0)
        if name == "includes":
            cost += MAX_ATTRIBUTE_VALUES - 1
        elif name in _TRAVERSING:
            cost += -(-read // 10)
        elif name in _REGEX:  # the string's length times the pattern's
            pattern = values[-1].size if name != "findAll" or len(values) == 1 else values[0].size
            cost += -(-read // 10) * -(-pattern // 4) - 1
        kind = _RETURNS[name]
        if name in ("reverse", "min", "max", "sum") and receiver is not None:
            kind = receiver.type if name == "reverse" else receiver.element
        return _Static(kind, cost, read, _DYN if kind != "list" else "string")

    def _ident_arg(self, node: lark.Tree) -> _Static:
        name_token = node.children[0]
        name = str(name_token)
        arguments = _arguments(node, 1)
        if name == "has":
            if len(arguments) != 1 or _unwrap(arguments[0]).data != "member_dot":
                raise self.fail("invalid argument to has() macro", name_token)
            inner = _unwrap(arguments[0])
            receiver = self.check(inner.children[0])
            self._field(receiver, str(inner.children[1]), inner.children[1], index=False)
            return _Static("bool", receiver.cost + 1)
        if name in _MACROS or name in _DEVICE_FIELDS:
            raise self.fail(f"undeclared reference to '{name}'", name_token)
        return self._call(name, None, arguments, name_token)

    def _dot_ident_arg(self, node: lark.Tree) -> _Static:
        return self._ident_arg(node)

    # Macros -----------------------------------------------------------------------------------

    def _scope(self, name: str) -> _Static | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def _variable(self, tree: lark.Tree, token: Any) -> str:
        name = _ident_of(tree)
        if name is None:
            raise self.fail("argument is not an identifier", token)
        return name

    def _macro(
        self, name: str, receiver_tree: lark.Tree, arguments: list[lark.Tree], token: Any
    ) -> _Static:
        if len(arguments) != 2 and not (name == "map" and len(arguments) == 3):
            raise self.fail(f"{name}() takes a variable and an expression", token)
        source = self.check(receiver_tree)
        if source.type in (
            "attribute_domains",
            "capacity_domains",
            "attribute_map",
            "capacity_map",
            "map",
        ):
            element = "string"
        elif source.type == "list":
            element = source.element
        elif source.type == _DYN:
            element = _DYN
        else:
            raise self.fail(
                f"expression of type '{source.type}' cannot be range of a comprehension", token
            )
        variable = self._variable(arguments[0], token)
        self.scopes.append({variable: _Static(element, 1)})
        try:
            bodies = [self.check(argument) for argument in arguments[1:]]
        finally:
            self.scopes.pop()
        step = sum(body.cost for body in bodies)
        if name in ("all", "exists", "exists_one", "filter"):
            self._boolean(bodies[0], name)
        # cel-go's loop condition and step around the body, per element; and its result.
        per_element = {"all": 3, "exists": 4, "exists_one": 2, "map": 2, "filter": 3}[name] + step
        cost = source.cost + source.size * per_element + (2 if name == "exists_one" else 1)
        if name in ("map", "filter"):
            return _Static("list", cost, source.size, bodies[-1].type if name == "map" else element)
        return _Static("bool", cost)

    def _bind(self, arguments: list[lark.Tree], token: Any) -> _Static:
        variable = self._variable(arguments[0], token)
        value = self.check(arguments[1])
        self.scopes.append({variable: replace(value, cost=1)})
        try:
            body = self.check(arguments[2])
        finally:
            self.scopes.pop()
        # cel-go expands it into a comprehension over an empty list.
        return _Static(body.type, value.cost + body.cost + 10, body.size, body.element)

    # Primaries --------------------------------------------------------------------------------

    def _ident(self, node: lark.Tree) -> _Static:
        token = node.children[0]
        name = str(token)
        bound = self._scope(name)
        if bound is not None:
            return _Static(bound.type, 1, bound.size, bound.element)
        if name == _VARIABLE:
            return _Static("device", 1)
        if name in _TYPE_IDENTS:
            return _Static("type", 1)
        raise self.fail(f"undeclared reference '{name}'", token)

    def _dot_ident(self, node: lark.Tree) -> _Static:
        return self._ident(node)

    def _literal(self, node: lark.Tree) -> _Static:
        token = node.children[0]
        kinds = {
            "INT_LIT": "int",
            "UINT_LIT": "uint",
            "FLOAT_LIT": "double",
            "STRING_LIT": "string",
            "MLSTRING_LIT": "string",
            "BYTES_LIT": "bytes",
            "BOOL_LIT": "bool",
            "NULL_LIT": "null",
        }
        kind = kinds.get(getattr(token, "type", ""), _DYN)
        text = _literal_string(node)
        return _Static(kind, 0, len(text) if text is not None else len(str(token)))

    def _list_lit(self, node: lark.Tree) -> _Static:
        items = [self.check(item) for item in _arguments(node, 0)]
        kinds = {item.type for item in items}
        element = kinds.pop() if len(kinds) == 1 else _DYN
        return _Static("list", _LIST_CREATE_COST + sum(i.cost for i in items), len(items), element)

    def _map_lit(self, node: lark.Tree) -> _Static:
        entries = [self.check(item) for item in _arguments(node, 0)]
        values = {entry.type for entry in entries[1::2]}
        element = values.pop() if len(values) == 1 else _DYN
        return _Static(
            "map", _MAP_CREATE_COST + sum(e.cost for e in entries), len(entries) // 2, element
        )


def _literal_string(tree: lark.Tree) -> str | None:
    node = _unwrap(tree)
    if node.data == "literal" and getattr(node.children[0], "type", "") == "STRING_LIT":
        text = str(node.children[0])
        return text[2:-1] if text[0] in "rR" else text[1:-1]
    return None


def _check(expression: str, tree: lark.Tree) -> int:
    """Type check `tree`, refuse it above `MAX_ESTIMATED_COST`, and give its estimated cost."""
    checker = _Checker(expression)
    result = checker.check(tree)
    if result.type not in ("bool", _DYN):
        raise CELError(
            f"CEL selector {expression!r} must evaluate to bool or the unknown type, "
            f"not {result.type}"
        )
    if result.cost > MAX_ESTIMATED_COST:
        raise CELCostError(
            f"CEL selector {expression!r} is too expensive: its estimated cost is "
            f"{result.cost:,}, over Tally's limit of {MAX_ESTIMATED_COST:,}"
            + (
                f" (and the API server's of {KUBERNETES_MAX_COST:,})"
                if result.cost > KUBERNETES_MAX_COST
                else f" (the API server allows {KUBERNETES_MAX_COST:,}, but Tally evaluates "
                "selectors far more slowly)"
            )
        )
    return result.cost


# --- Evaluation -------------------------------------------------------------------------------


class _StepLimitExceeded(Exception):
    """Raised out of an evaluation that ran past its steps (never a CEL error, never caught
    by the interpreter's own handling of those)."""


# Characters of a string (elements of a list) that cost one step.
_SIZE_PER_STEP: Final = 100


class _Meter:
    __slots__ = ("limit", "steps")

    def __init__(self, limit: int) -> None:
        self.steps = 0
        self.limit = limit


class _Evaluator(Evaluator):
    """celpy's interpreter, metered, with CEL's macros as cel-go has them (over a list or a
    map's keys only; `all`/`exists` stop at the first answer and ignore errors the answer
    makes moot), `cel.bind`, and Kubernetes' `sets.*` functions."""

    def __init__(self, ast: lark.Tree, activation: Activation, meter: _Meter) -> None:
        super().__init__(ast=ast, activation=activation)
        self._meter = meter

    def sub_evaluator(self, ast: lark.Tree) -> _Evaluator:
        return _Evaluator(ast, self.activation, self._meter)

    def _visit_tree(self, tree: lark.Tree) -> Any:
        meter = self._meter
        meter.steps += 1
        if meter.steps > meter.limit:
            raise _StepLimitExceeded
        value = super()._visit_tree(tree)
        if isinstance(value, str | bytes | list | dict):
            # What a value holds is paid for too, as cel-go's actual cost counts it: a string
            # doubled at each step is stopped at a megabyte or so, not a gigabyte later.
            meter.steps += len(value) // _SIZE_PER_STEP
            if meter.steps > meter.limit:
                raise _StepLimitExceeded
        return value

    def member_dot_arg(self, tree: lark.Tree) -> Any:
        receiver_tree, name_token = tree.children[:2]
        name = str(name_token)
        namespace = _ident_of(receiver_tree)
        if name in _MACROS:
            return self._macro(tree, name)
        if namespace == "cel" and name == "bind":
            return self._bind(tree)
        if namespace == "sets":
            return self._call(FUNCTIONS[f"sets.{name}"], self._values(tree), name)
        if name in ("min", "max", "reduce"):  # celpy takes these for macros; they are methods
            receiver = self.visit(receiver_tree)
            return self.method_eval(receiver, cast(lark.Token, name_token), self._values(tree))
        return super().member_dot_arg(tree)

    def _values(self, tree: lark.Tree) -> list[Any]:
        if len(tree.children) > 2 and isinstance(tree.children[2], lark.Tree):
            return list(self.visit(tree.children[2]))
        return []

    def _call(self, function: Callable[..., Any], values: list[Any], name: str) -> Any:
        for value in values:
            if isinstance(value, CELEvalError):
                return value
        try:
            return function(*values)
        except (TypeError, ValueError) as exc:
            return _error(f"no such overload: {name}: {exc}")

    def _nested(self, body: lark.Tree, variable: str) -> Callable[[Any], Any]:
        evaluator = self.sub_evaluator(body)

        def evaluate(value: Any) -> Any:
            try:
                return evaluator.evaluate({variable: value})
            except CELEvalError as exc:
                return exc

        return evaluate

    def _macro(self, tree: lark.Tree, name: str) -> Any:
        source = self.visit(tree.children[0])
        if isinstance(source, CELEvalError):
            return source
        if isinstance(source, celtypes.MapType):
            items = list(source.keys())
        elif isinstance(source, celtypes.ListType):
            items = list(source)
        else:
            return _error(f"got '{_runtime_type(source)}', expected iterable type")
        arguments = _arguments(tree, 2)
        variable = _ident_of(arguments[0]) or ""
        body = self._nested(arguments[1], variable)
        if name in ("all", "exists"):
            decisive = name == "exists"  # the value that answers at once
            error: Any = None
            for item in items:
                result = body(item)
                if isinstance(result, celtypes.BoolType) and bool(result) == decisive:
                    return celtypes.BoolType(decisive)
                if not isinstance(result, celtypes.BoolType) and error is None:
                    error = (
                        result
                        if isinstance(result, CELEvalError)
                        else _error(f"no such overload: {name} over {_runtime_type(result)}")
                    )
            return error if error is not None else celtypes.BoolType(not decisive)
        if name == "exists_one":
            count = 0
            for item in items:
                result = body(item)
                if not isinstance(result, celtypes.BoolType):
                    return (
                        result if isinstance(result, CELEvalError) else _error("no such overload")
                    )
                count += bool(result)
            return celtypes.BoolType(count == 1)
        if name == "filter" or len(arguments) == 3:
            kept = []
            for item in items:
                result = body(item)
                if not isinstance(result, celtypes.BoolType):
                    return (
                        result if isinstance(result, CELEvalError) else _error("no such overload")
                    )
                if result:
                    kept.append(item)
            if name == "filter":
                return celtypes.ListType(kept)
            items = kept
            body = self._nested(arguments[2], variable)
        mapped = []
        for item in items:
            result = body(item)
            if isinstance(result, CELEvalError):
                return result
            mapped.append(result)
        return celtypes.ListType(mapped)

    def _bind(self, tree: lark.Tree) -> Any:
        variable_tree, value_tree, body_tree = _arguments(tree, 2)
        value = self.visit(value_tree)
        return self._nested(body_tree, _ident_of(variable_tree) or "")(value)


# --- Compilation ------------------------------------------------------------------------------

_ENVIRONMENT: Final = celpy.Environment()


def _position(expression: str, line: int | None, column: int | None) -> str:
    if line is None or column is None:
        return ""
    source_line = expression.splitlines()[line - 1] if expression else ""
    return f" at line {line}, column {column}:\n  {source_line}\n  {' ' * (column - 1)}^"


@dataclass(frozen=True)
class Evaluation:
    """One evaluation of a selector on a device: `matched`, or why not (`error`); `steps` it
    took; `exceeded` when it ran past `MAX_EVALUATION_STEPS` and was stopped (the selector
    cannot be weighed, which is not the same as selecting nothing)."""

    matched: bool
    error: str | None
    steps: int
    exceeded: bool = False


@dataclass(eq=False)
class CompiledSelector:
    """One compiled selector, shared by every caller of `compile_selector` with the same text.

    Neither `run()`, `matches()` nor `evaluate()` raises; `evaluate()` also says why a device
    did not match. `cost` is the estimated cost (at most `MAX_ESTIMATED_COST`).
    """

    expression: str
    cost: int
    _program: celpy.Runner = field(repr=False)
    _base: Activation = field(repr=False)

    def run(self, device: DeviceShape, *, max_steps: int = MAX_EVALUATION_STEPS) -> Evaluation:
        """Evaluate on `device`, stopping after `max_steps` interpreter steps."""
        if device.error is not None:
            return Evaluation(False, device.error, 0)
        meter = _Meter(max_steps)
        evaluator = _Evaluator(self._program.ast, self._base, meter)
        try:
            result = evaluator.evaluate(device.activation)
        except _StepLimitExceeded:
            return Evaluation(
                False,
                f"{self.expression!r}: evaluation stopped after {max_steps:,} steps "
                "(Tally's limit on one evaluation; the selector is too expensive)",
                meter.steps,
                exceeded=True,
            )
        except RecursionError:
            return Evaluation(
                False, f"{self.expression!r}: nested too deeply", meter.steps, exceeded=True
            )
        except Exception as exc:  # celpy raises CELEvalError, and others on odd input
            return Evaluation(False, f"{self.expression!r}: {_describe(exc)}", meter.steps)
        if isinstance(result, CELEvalError):
            return Evaluation(False, f"{self.expression!r}: {_describe(result)}", meter.steps)
        if not isinstance(result, celtypes.BoolType | bool):
            kind = _runtime_type(result)
            if isinstance(result, celtypes.ListType):
                kind = "list"
            return Evaluation(
                False,
                f"{self.expression!r}: CEL result of type {kind} could not be converted to bool "
                "(a selector must evaluate to bool)",
                meter.steps,
            )
        return Evaluation(bool(result), None, meter.steps)

    def evaluate(self, device: DeviceShape) -> tuple[bool, str | None]:
        """`(matched, error)`: an evaluation error, or a result that is not a bool, is no match."""
        outcome = self.run(device)
        return outcome.matched, outcome.error

    def matches(self, device: DeviceShape) -> bool:
        """True when the expression is `true` for the device."""
        return self.run(device).matched


# The grammar's levels of precedence that hold one child: celpy visits each (a `1` is ten
# nodes deep), which is most of its time. Its interpreter reads the nodes below them alike.
_COLLAPSIBLE: Final = _PASS_THROUGH - {"primary", "paren_expr"}


def _collapse(tree: lark.Tree) -> lark.Tree:
    """`tree` without the pass-through levels above each operation, for evaluation."""
    while (
        tree.data in _COLLAPSIBLE
        and len(tree.children) == 1
        and isinstance(tree.children[0], lark.Tree)
    ):
        tree = tree.children[0]
    children = [_collapse(c) if isinstance(c, lark.Tree) else c for c in tree.children]
    return lark.Tree(tree.data, children, tree._meta)


def _describe(exc: Exception) -> str:
    message = exc.args[0] if exc.args else exc.__class__.__name__
    return str(message)


@functools.lru_cache(maxsize=4096)
def compile_selector(expression: str) -> CompiledSelector:
    """Compile a DRA CEL selector, cached by its text.

    Raises `CELError` with the expression (and the line and column of the problem where there
    is one) for a syntax error, an unknown function, variable or field of `device`, a type
    error (a selector must be a bool), one longer than `MAX_EXPRESSION_LENGTH` or nested too
    deeply to parse, and `CELCostError` for one whose estimated cost is over
    `MAX_ESTIMATED_COST`.
    """
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise CELError(
            f"CEL selector {expression[:40]!r}... is {len(expression):,} characters long, over "
            f"the API server's limit of {MAX_EXPRESSION_LENGTH:,}"
        )
    try:
        tree = _ENVIRONMENT.compile(expression)
    except RecursionError as exc:
        raise CELError(f"CEL selector {expression[:40]!r}... is nested too deeply") from exc
    except CELParseError as exc:
        detail = str(exc.args[0]).strip().splitlines()
        raise CELError(
            f"syntax error in CEL selector {expression!r}"
            + (_position(expression, exc.line, exc.column) or f": {' '.join(detail)}")
        ) from exc
    try:
        cost = _check(expression, tree)
        program = _ENVIRONMENT.program(_collapse(tree), functions=FUNCTIONS)
    except RecursionError as exc:
        raise CELError(f"CEL selector {expression[:40]!r}... is nested too deeply") from exc
    return CompiledSelector(
        expression=expression, cost=cost, _program=program, _base=program.new_activation()
    )
