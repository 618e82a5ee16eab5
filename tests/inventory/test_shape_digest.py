"""`dra.shape_digest` finds the digests of shapes it has seen by orjson's JSON of them: the
digest is always that of the standard library's JSON, keys sorted, whatever was seen before."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from inventory import dra

# What a parsed slice may hold: JSON's values, and from YAML NaN and infinities (which orjson
# writes as `null`, as it does None), integers over 64 bits, keys that are not strings.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 1, True, math.nan, math.inf, None, "1", "é"]),
    st.text(max_size=4),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers(0, 2)), inner, max_size=3),
    ),
    max_leaves=8,
)


def _expected(driver: str, shape: dict[Any, Any]) -> str:
    text = json.dumps([driver, shape], sort_keys=True, separators=(",", ":"))
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


@settings(max_examples=300, deadline=None)
@given(shapes=st.lists(st.dictionaries(st.sampled_from("abc"), _VALUES, max_size=3), max_size=6))
def test_the_digest_is_the_standard_librarys_whatever_was_seen_before(
    shapes: list[dict[str, Any]],
) -> None:
    for shape in [*shapes, *reversed(shapes)]:
        try:
            expected = _expected("d", shape)
        except TypeError:  # mixed key types json.dumps cannot sort: refused as before
            continue
        assert dra.shape_digest("d", shape) == expected


def test_values_orjson_writes_alike_keep_their_own_digests() -> None:
    shapes: list[dict[Any, Any]] = [
        {"x": None},
        {"x": math.nan},
        {"x": math.inf},
        {"x": 1},
        {"x": 1.0},
        {"x": True},
        {"x": 0.0},
        {"x": -0.0},
        {"x": 2**64},
        {1: "a"},
        {"1": "a"},
    ]
    for _ in range(2):
        digests = [dra.shape_digest("d", shape) for shape in shapes]
        assert digests == [_expected("d", shape) for shape in shapes]
    # All different, but {1: ...} and {"1": ...}: one JSON object, as `json.dumps` writes them.
    assert len(set(digests)) == len(shapes) - 1
