"""The values and functions CEL device selectors see (`inventory.cel`): Kubernetes' value types
(`Quantity`, `Semver`), its libraries and CEL's strings extension, as celpy functions."""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any, Final

import re2
from celpy import celtypes
from celpy.evaluation import CELEvalError
from kubernetes.utils import parse_quantity

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

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


def eval_error(message: str) -> CELEvalError:
    return CELEvalError(message)


def _require(value: Any, kind: type, function: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"no such overload: {function}({type(value).__name__})")


def _quantity(text: Any) -> Quantity | CELEvalError:
    _require(text, str, "quantity")
    try:
        return Quantity(str(text))
    except (ValueError, InvalidOperation):
        return eval_error(f"quantity: invalid quantity {text!r}")


def _is_quantity(text: Any) -> celtypes.BoolType:
    return celtypes.BoolType(isinstance(_quantity(text), Quantity))


def _semver(text: Any, normalize: Any = False) -> Semver | CELEvalError:
    _require(text, str, "semver")
    try:
        return Semver(str(text), normalize=bool(normalize))
    except ValueError as exc:
        return eval_error(f"semver: {exc}")


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
        return eval_error(f"asInteger: {receiver.text} is not an integer or does not fit in int64")
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


def runtime_type(value: Any) -> str:
    """The name cel-go gives the type of `value` in its errors (`types.String`)."""
    for kind, name in _TYPE_NAMES_AT_RUN_TIME:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _same(left: Any, right: Any) -> bool:
    """CEL equality between two values of any types: different types are simply unequal."""
    if runtime_type(left) != runtime_type(right):
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
            return eval_error(
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
        return eval_error(f"index out of range: {at}")
    return celtypes.StringType(text[at : at + 1])


def _index_of(receiver: Any, value: Any, offset: Any = 0) -> celtypes.IntType | CELEvalError:
    if isinstance(receiver, celtypes.ListType):  # Kubernetes' lists library
        return celtypes.IntType(next((i for i, v in enumerate(receiver) if _same(v, value)), -1))
    text, start = _string(receiver, "indexOf"), _int(offset, "indexOf")
    if not 0 <= start <= len(text):
        return eval_error(f"index out of range: {start}")
    return celtypes.IntType(text.find(_string(value, "indexOf"), start))


def _last_index_of(receiver: Any, value: Any, *offset: Any) -> celtypes.IntType | CELEvalError:
    if isinstance(receiver, celtypes.ListType):
        found = [i for i, v in enumerate(receiver) if _same(v, value)]
        return celtypes.IntType(found[-1] if found else -1)
    text, wanted = _string(receiver, "lastIndexOf"), _string(value, "lastIndexOf")
    end = _int(offset[0], "lastIndexOf") if offset else len(text)
    if not 0 <= end <= len(text):
        return eval_error(f"index out of range: {end}")
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
        return eval_error(f"substring: index out of range: [{first}:{last}] of {len(text)}")
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
        return eval_error(f"{function}: invalid regular expression {pattern!r}: {exc}")


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
            return eval_error(f"{name} called on an empty list")
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
