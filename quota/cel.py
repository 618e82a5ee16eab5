"""CEL device selectors, evaluated the way Kubernetes DRA evaluates them.

Quota rules and ResourceClaims select devices with the same CEL expressions that DRA uses
(`spec.devices.requests[].exactly.selectors[].cel.expression`). This module compiles them with
`cel-python` (`celpy`) and gives them the variable and the functions the Kubernetes scheduler
gives them (k8s.io/dynamic-resource-allocation/cel):

- `device.driver` (string), `device.allowMultipleAllocations` (bool);
- `device.attributes[domain].name` and `device.capacity[domain].name`: a published name
  without a domain belongs to the driver's domain; looking up a domain the device does not
  publish gives an empty map, looking up a missing name is an evaluation error;
- attribute values as int, bool, string, `Semver` (and lists of those); capacities as
  `Quantity`;
- `quantity()`, `isQuantity()`, `semver()`, `isSemver()` and their methods, and the strings
  extension's `lowerAscii()`/`upperAscii()` beside CEL's own `startsWith`, `endsWith`,
  `contains` and `matches` (RE2).

An evaluation error makes the device not match, as it makes the scheduler skip it; it is
never raised (`CompiledSelector.evaluate` says what it was).

Evaluation is per device *shape* (`quota.admission.shapes`): thousands of GPUs that only differ
by uuid or PCI address are evaluated once.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Final

import celpy
import lark
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError, base_functions
from kubernetes.utils import parse_quantity

__all__ = [
    "CELError",
    "CompiledSelector",
    "DeviceShape",
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
    """A selector that cannot be compiled: a syntax error or an unknown function or variable."""


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
    "lowerAscii": _ascii_case(_ASCII_LOWER, "lowerAscii"),
    "upperAscii": _ascii_case(_ASCII_UPPER, "upperAscii"),
}

# Macros bind their first argument as a variable; `has` takes a field selection.
_MACROS: Final = frozenset({"all", "exists", "exists_one", "map", "filter"})
_KNOWN_CALLS: Final = frozenset(FUNCTIONS) | frozenset(base_functions) | _MACROS | {"has"}
_VARIABLE: Final = "device"
_TYPE_NAMES: Final = frozenset(
    {"bool", "bytes", "double", "int", "list", "map", "null_type", "string", "type", "uint"}
)


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


# --- Compilation ------------------------------------------------------------------------------

_ENVIRONMENT: Final = celpy.Environment()


def _position(expression: str, line: int | None, column: int | None) -> str:
    if line is None or column is None:
        return ""
    source_line = expression.splitlines()[line - 1] if expression else ""
    return f" at line {line}, column {column}:\n  {source_line}\n  {' ' * (column - 1)}^"


def _check_names(expression: str, tree: lark.Tree) -> None:
    """Reject unknown functions and variables at compile time, as the Kubernetes checker does."""
    if any(
        node.data == "member_dot_arg" and str(node.children[1]) == "bind"
        for node in tree.iter_subtrees()
    ):
        raise CELError(f"cel.bind is not supported, in CEL selector {expression!r}")
    bound: set[str] = set(_TYPE_NAMES) | {_VARIABLE}
    for node in tree.iter_subtrees():
        if node.data == "member_dot_arg" and str(node.children[1]) in _MACROS:
            arguments = node.children[2]
            if isinstance(arguments, lark.Tree) and arguments.children:
                bound.update(str(token) for token in arguments.children[0].scan_values(_is_ident))
    for node in tree.iter_subtrees():
        known: Collection[str]
        if node.data == "ident":
            kind, token, known = "reference", node.children[0], bound
        elif node.data == "ident_arg":
            kind, token, known = "function", node.children[0], _KNOWN_CALLS
        elif node.data == "member_dot_arg":
            kind, token, known = "function", node.children[1], _KNOWN_CALLS
        else:
            continue
        if isinstance(token, lark.Token) and str(token) not in known:
            raise CELError(
                f"undeclared {kind} {str(token)!r} in CEL selector {expression!r}"
                + _position(expression, token.line, token.column)
            )


def _is_ident(value: Any) -> bool:
    return isinstance(value, lark.Token) and value.type == "IDENT"


@dataclass(eq=False)
class CompiledSelector:
    """One compiled selector, shared by every caller of `compile_selector` with the same text.

    Neither `matches()` nor `evaluate()` raises; `evaluate()` also says why a device did not
    match.
    """

    expression: str
    _program: celpy.Runner = field(repr=False)

    def evaluate(self, device: DeviceShape) -> tuple[bool, str | None]:
        """`(matched, error)`: an evaluation error, or a result that is not a bool, is no match."""
        if device.error is not None:
            return False, device.error
        try:
            result = self._program.evaluate(device.activation)
        except Exception as exc:  # celpy raises CELEvalError, and others on odd input
            return False, f"{self.expression!r}: {_describe(exc)}"
        if isinstance(result, CELEvalError):
            return False, f"{self.expression!r}: {_describe(result)}"
        if not isinstance(result, celtypes.BoolType | bool):
            return False, f"{self.expression!r}: must evaluate to bool, not {type(result).__name__}"
        return bool(result), None

    def matches(self, device: DeviceShape) -> bool:
        """True when the expression is `true` for the device."""
        return self.evaluate(device)[0]


def _describe(exc: Exception) -> str:
    message = exc.args[0] if exc.args else exc.__class__.__name__
    return str(message)


@functools.lru_cache(maxsize=4096)
def compile_selector(expression: str) -> CompiledSelector:
    """Compile a DRA CEL selector, cached by its text.

    Raises `CELError` with the expression and the line and column of the problem for a syntax
    error, an unknown function or an unknown variable.
    """
    try:
        tree = _ENVIRONMENT.compile(expression)
    except CELParseError as exc:
        detail = str(exc.args[0]).strip().splitlines()
        raise CELError(
            f"syntax error in CEL selector {expression!r}"
            + (_position(expression, exc.line, exc.column) or f": {' '.join(detail)}")
        ) from exc
    _check_names(expression, tree)
    program = _ENVIRONMENT.program(tree, functions=FUNCTIONS)
    return CompiledSelector(expression=expression, _program=program)
