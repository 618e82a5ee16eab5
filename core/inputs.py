"""JSON from the outside world, bounded: bad input becomes a `BadInput` naming the problem.

Every endpoint that takes JSON (the admission webhooks, sample ingest, the API's writes) reads
it here, so that a body nested thousands deep, an integer of thousands of digits or a number
past a double's range is answered 400 with a reason, never a 500 or a traceback. orjson
refuses numbers a double cannot hold and nesting past 1,024 levels itself; `max_depth` bounds
what the callers' own code (recursive walks, `jsonb`) is given.
"""

from __future__ import annotations

from itertools import compress
from typing import Any

import orjson

DEFAULT_MAX_DEPTH = 64
# What JSON nests: orjson decodes objects and arrays as exactly these types.
_is_container = frozenset({dict, list}).__contains__


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
    """Refuse containers nested deeper than `max_depth`, without recursion.

    Level by level: each level's containers are picked out of it by builtins (`compress` over
    the values' types), so the Python loop runs once a container, not once a value: a batch of
    samples holds ten scalars for each container, and the walk cost more than parsing it."""
    level = [value]
    depth = 0
    while True:
        containers = list(compress(level, map(_is_container, map(type, level))))
        if not containers:
            return
        if depth >= max_depth:
            raise BadInput(f"the body is nested deeper than {max_depth} levels")
        level = []
        extend = level.extend
        for item in containers:
            extend(item.values() if type(item) is dict else item)
        depth += 1
