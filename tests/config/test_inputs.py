"""Bounded JSON: each way a body can be bad is refused with a reason."""

from __future__ import annotations

import pytest

from core.inputs import BadInput, parse_json


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 100 + b"]" * 100, "nested deeper than 64 levels"),
        (b"[" * 5000 + b"]" * 5000, "not valid JSON"),  # orjson's own limit
        (b'{"count": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"count": 1e400}', "not valid JSON"),
        (b'{"count": NaN}', "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_bad_bodies_are_refused_with_a_reason(body: bytes, reason: str) -> None:
    with pytest.raises(BadInput, match=reason):
        parse_json(body)


def test_a_body_at_the_limit_is_read() -> None:
    assert parse_json(b"[" * 64 + b"]" * 64, max_depth=64) is not None
    with pytest.raises(BadInput):
        parse_json(b"[" * 65 + b"]" * 65, max_depth=64)
    assert parse_json(b'{"a": {"b": [1, 2.5, "x", null, true]}}') == {
        "a": {"b": [1, 2.5, "x", None, True]}
    }


def test_depth_counts_objects_and_arrays_alike_wherever_they_sit() -> None:
    # The deepest branch counts, however shallow its siblings and whatever comes after it.
    deep = '{"a": [{"b": {"c": [[1]]}}]}'  # 6 levels
    body = f'[1, "x", {{"k": null}}, {deep}, [true]]'.encode()  # 7 levels in all
    assert parse_json(body, max_depth=7) is not None
    with pytest.raises(BadInput, match="nested deeper than 6 levels"):
        parse_json(body, max_depth=6)
    assert parse_json(b'{"a": {}, "b": []}', max_depth=2) is not None
    with pytest.raises(BadInput):
        parse_json(b'{"a": {}, "b": []}', max_depth=1)
    assert parse_json(b'"scalar"', max_depth=0) == "scalar"
