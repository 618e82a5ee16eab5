"""Declarative input schemas (pydantic v2) and the adapter that names their errors the way
Tally always has: by the path of the bad field in the input, then the problem
(`drivers.x.exclude[0].equals: 'lots' is not a quantity`).

A schema's own checks raise `problem(...)`, whose message is kept word for word; pydantic's
built-in errors (a wrong type, a missing or unknown key) are worded by the schema's caller
through the `Problem.kind` and `Problem.loc` each one comes with.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

# The error type of a schema's own checks; the message is the problem as written.
PROBLEM = "problem"


def problem(message: str, kind: str = PROBLEM) -> PydanticCustomError:
    """An error whose message is `message` as written (no formatting), of type `kind`."""
    return PydanticCustomError(kind, message)


def shown(key: str) -> str:
    """A key as errors name it: quoted when it holds a line break or other control character,
    so that the error stays one line."""
    return key if key.isprintable() else repr(key)


def path_of(base: str, loc: tuple[str | int, ...]) -> str:
    """`loc` (pydantic's) below `base`: names as `.name`, list indexes as `[0]`."""
    path = base
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{shown(part)}" if path else shown(part)
    return path


@dataclass(frozen=True)
class Problem:
    """One error of a validation: where (`loc`, pydantic's), what kind (pydantic's error type,
    or `PROBLEM` and the like for a schema's own), the bad input and pydantic's message."""

    loc: tuple[str | int, ...]
    kind: str
    input: Any
    message: str


def problems(exc: ValidationError) -> Iterator[Problem]:
    """The errors of `exc`, in pydantic's order (the fields' order in the schema)."""
    for error in exc.errors(include_url=False):
        yield Problem(
            loc=tuple(error["loc"]),
            kind=error["type"],
            input=error.get("input"),
            message=error["msg"],
        )
