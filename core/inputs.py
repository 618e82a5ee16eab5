"""JSON from the outside world, bounded: bad input becomes a `BadInput` naming the problem.

Every endpoint that takes JSON (the admission webhooks, sample ingest, the API's writes) reads
it here, so that a body nested thousands deep, an integer of thousands of digits or a number
past a double's range is answered 400 with a reason, never a 500 or a traceback. orjson
refuses numbers a double cannot hold and nesting past 1,024 levels itself; `max_depth` bounds
what the callers' own code (recursive walks, `jsonb`) is given.
"""

from __future__ import annotations

from typing import Any

import orjson

DEFAULT_MAX_DEPTH = 64


class BadInput(ValueError):
    """Input refused; the message says why, in words a client can act on."""


def parse_json(body: bytes | str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The JSON value of `body`, nested at most `max_depth` levels (a scalar is level 0)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"the body is not valid JSON: {exc}") from None
    check_depth(value, max_depth=max_depth)
    return value


def check_depth(value: Any, *, max_depth: int) -> None:
    """Refuse containers nested deeper than `max_depth`, without recursion."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= max_depth:
            raise BadInput(f"the body is nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)
