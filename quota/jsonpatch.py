"""JSON Patch (RFC 6902) as the API server applies the mutating webhook's answer.

`manage.py review_claims` applies the mutation before it asks the validating webhook, as the
API server does; the tests check with it that every patch the webhook answers applies to the
object it was asked about. Only the operations the webhook may answer (add, remove, replace).
"""

from __future__ import annotations

import copy
from typing import Any


class JsonPatchError(ValueError):
    """A patch that is malformed or does not apply; the message names the operation."""


def apply_patch(document: Any, patch: Any) -> Any:
    """`document` with `patch` applied, as a new value (`document` is left as it was).

    Raises `JsonPatchError` when the patch is no list of operations, an operation is unknown
    or malformed, or a path does not exist where RFC 6902 requires it to.
    """
    if not isinstance(patch, list):
        raise JsonPatchError("a JSON Patch is a list of operations")
    result = copy.deepcopy(document)
    for index, operation in enumerate(patch):
        try:
            result = _apply(result, operation)
        except JsonPatchError as exc:
            raise JsonPatchError(f"operation {index} ({operation!r}): {exc}") from None
    return result


def _apply(document: Any, operation: Any) -> Any:
    if not isinstance(operation, dict) or not isinstance(operation.get("path"), str):
        raise JsonPatchError("an operation is an object with a string path")
    op = operation.get("op")
    if op not in ("add", "remove", "replace"):
        raise JsonPatchError(f"unsupported op {op!r}")
    if op != "remove" and "value" not in operation:
        raise JsonPatchError(f"{op} needs a value")
    value = copy.deepcopy(operation.get("value"))
    tokens = _tokens(operation["path"])
    if not tokens:
        if op == "remove":
            raise JsonPatchError("cannot remove the whole document")
        return value
    parent = document
    for token in tokens[:-1]:
        if not isinstance(parent, (dict, list)):
            _no(token)
        parent = parent[_index(parent, token, len(parent) - 1)]
    last = tokens[-1]
    if isinstance(parent, dict):
        if op != "add" and last not in parent:
            raise JsonPatchError(f"no member {last!r}")
        if op == "remove":
            del parent[last]
        else:
            parent[last] = value
    elif isinstance(parent, list):
        if op == "add":
            parent.insert(len(parent) if last == "-" else _index(parent, last, len(parent)), value)
        elif op == "remove":
            del parent[_index(parent, last, len(parent) - 1)]
        else:
            parent[_index(parent, last, len(parent) - 1)] = value
    else:
        _no(last)
    return document


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise JsonPatchError(f"path {path!r} does not start with /")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _index(container: Any, token: str, size: int) -> Any:
    """The key of `token` in `container`; for a list an index from 0 to `size`."""
    if isinstance(container, dict):
        if token not in container:
            raise JsonPatchError(f"no member {token!r}")
        return token
    is_index = token.isascii() and token.isdigit() and (token == "0" or token[0] != "0")
    if not is_index or int(token) > size:
        raise JsonPatchError(f"no element {token!r} in a list of {len(container)}")
    return int(token)


def _no(token: str) -> Any:
    raise JsonPatchError(f"{token!r} is below a value that is neither an object nor a list")
