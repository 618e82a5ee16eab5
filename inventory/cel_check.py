"""Type checking and cost estimation of CEL device selectors (`inventory.cel`), as the API
server's DRA CEL environment checks them: the errors a selector is refused with, and the
limits on its length, estimated cost and evaluation steps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

import lark

from inventory.cel_library import FUNCTIONS, MAX_ATTRIBUTE_VALUES


class CELError(ValueError):
    """A selector that cannot be compiled: a syntax error, an unknown function, variable or
    field, a type error, or one too expensive (`CELCostError`)."""

    def brief(self) -> str:
        """The message on one line, for an admission answer or a warning: without the
        source line and caret under it."""
        return str(self).splitlines()[0].removesuffix(":")


class CELCostError(CELError):
    """A selector whose estimated cost is over `MAX_ESTIMATED_COST`."""


MACROS: Final = frozenset({"all", "exists", "exists_one", "map", "filter"})
VARIABLE: Final = "device"


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
PASS_THROUGH: Final = frozenset(
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


def unwrap(tree: lark.Tree) -> lark.Tree:
    while (
        tree.data in PASS_THROUGH
        and len(tree.children) == 1
        and isinstance(tree.children[0], lark.Tree)
    ):
        tree = tree.children[0]
    return tree


def ident_of(tree: Any) -> str | None:
    """The name `tree` is, when it is a plain identifier."""
    if not isinstance(tree, lark.Tree):
        return None
    node = unwrap(tree)
    if node.data == "ident":
        return str(node.children[0])
    return None


def call_arguments(tree: lark.Tree, index: int) -> list[lark.Tree]:
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
            + position(self.expression, line, column)
        )

    def check(self, tree: lark.Tree) -> _Static:
        node = unwrap(tree)
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
        arguments = call_arguments(node, 2)
        namespace = ident_of(receiver_tree)
        if namespace == "cel" and self._scope(namespace) is None:
            if name != "bind" or len(arguments) != 3:
                raise self.fail(f"undeclared reference to 'cel.{name}'", name_token)
            return self._bind(arguments, name_token)
        if namespace == "sets" and self._scope(namespace) is None:
            if f"sets.{name}" not in FUNCTIONS:
                raise self.fail(f"undeclared reference to 'sets.{name}'", name_token)
            return self._call(f"sets.{name}", None, arguments, name_token)
        if name in MACROS:
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
        arguments = call_arguments(node, 1)
        if name == "has":
            if len(arguments) != 1 or unwrap(arguments[0]).data != "member_dot":
                raise self.fail("invalid argument to has() macro", name_token)
            inner = unwrap(arguments[0])
            receiver = self.check(inner.children[0])
            self._field(receiver, str(inner.children[1]), inner.children[1], index=False)
            return _Static("bool", receiver.cost + 1)
        if name in MACROS or name in _DEVICE_FIELDS:
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
        name = ident_of(tree)
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
        if name == VARIABLE:
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
        items = [self.check(item) for item in call_arguments(node, 0)]
        kinds = {item.type for item in items}
        element = kinds.pop() if len(kinds) == 1 else _DYN
        return _Static("list", _LIST_CREATE_COST + sum(i.cost for i in items), len(items), element)

    def _map_lit(self, node: lark.Tree) -> _Static:
        entries = [self.check(item) for item in call_arguments(node, 0)]
        values = {entry.type for entry in entries[1::2]}
        element = values.pop() if len(values) == 1 else _DYN
        return _Static(
            "map", _MAP_CREATE_COST + sum(e.cost for e in entries), len(entries) // 2, element
        )


def _literal_string(tree: lark.Tree) -> str | None:
    node = unwrap(tree)
    if node.data == "literal" and getattr(node.children[0], "type", "") == "STRING_LIT":
        text = str(node.children[0])
        return text[2:-1] if text[0] in "rR" else text[1:-1]
    return None


def position(expression: str, line: int | None, column: int | None) -> str:
    if line is None or column is None:
        return ""
    source_line = expression.splitlines()[line - 1] if expression else ""
    return f" at line {line}, column {column}:\n  {source_line}\n  {' ' * (column - 1)}^"


def check_selector(expression: str, tree: lark.Tree) -> int:
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
