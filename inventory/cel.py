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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import InvalidOperation
from typing import Any, Final, cast

import celpy
import lark
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import Activation, CELEvalError, Evaluator

from inventory.cel_check import (
    KUBERNETES_MAX_COST,
    MACROS,
    MAX_CLAIM_ESTIMATED_COST,
    MAX_CLAIM_STEPS,
    MAX_ESTIMATED_COST,
    MAX_EVALUATION_STEPS,
    MAX_EXPRESSION_LENGTH,
    PASS_THROUGH,
    VARIABLE,
    CELCostError,
    CELError,
    call_arguments,
    check_selector,
    ident_of,
    position,
)
from inventory.cel_library import (
    FUNCTIONS,
    Quantity,
    Semver,
    eval_error,
    runtime_type,
)

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
        return cls(driver=driver, activation={VARIABLE: device}, error=error)


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
        namespace = ident_of(receiver_tree)
        if name in MACROS:
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
            return eval_error(f"no such overload: {name}: {exc}")

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
            return eval_error(f"got '{runtime_type(source)}', expected iterable type")
        arguments = call_arguments(tree, 2)
        variable = ident_of(arguments[0]) or ""
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
                        else eval_error(f"no such overload: {name} over {runtime_type(result)}")
                    )
            return error if error is not None else celtypes.BoolType(not decisive)
        if name == "exists_one":
            count = 0
            for item in items:
                result = body(item)
                if not isinstance(result, celtypes.BoolType):
                    return (
                        result
                        if isinstance(result, CELEvalError)
                        else eval_error("no such overload")
                    )
                count += bool(result)
            return celtypes.BoolType(count == 1)
        if name == "filter" or len(arguments) == 3:
            kept = []
            for item in items:
                result = body(item)
                if not isinstance(result, celtypes.BoolType):
                    return (
                        result
                        if isinstance(result, CELEvalError)
                        else eval_error("no such overload")
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
        variable_tree, value_tree, body_tree = call_arguments(tree, 2)
        value = self.visit(value_tree)
        return self._nested(body_tree, ident_of(variable_tree) or "")(value)


# --- Compilation ------------------------------------------------------------------------------

_ENVIRONMENT: Final = celpy.Environment()


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
            kind = runtime_type(result)
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
_COLLAPSIBLE: Final = PASS_THROUGH - {"primary", "paren_expr"}


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
            + (position(expression, exc.line, exc.column) or f": {' '.join(detail)}")
        ) from exc
    try:
        cost = check_selector(expression, tree)
        program = _ENVIRONMENT.program(_collapse(tree), functions=FUNCTIONS)
    except RecursionError as exc:
        raise CELError(f"CEL selector {expression[:40]!r}... is nested too deeply") from exc
    return CompiledSelector(
        expression=expression, cost=cost, _program=program, _base=program.new_activation()
    )
