"""`quota.jsonpatch`: RFC 6902 as the API server applies the mutating webhook's patch."""

from __future__ import annotations

from typing import Any

import pytest

from quota.jsonpatch import JsonPatchError, apply_patch

CLAIM = {
    "metadata": {"name": "c", "annotations": {"a/b": "1"}},
    "spec": {"devices": {"requests": [{"firstAvailable": [{"name": "h100"}, {"name": "a100"}]}]}},
}


def test_the_webhooks_operations_apply_and_leave_the_input_alone() -> None:
    patch = [
        {"op": "remove", "path": "/spec/devices/requests/0/firstAvailable/0"},
        {"op": "add", "path": "/metadata/annotations/tally.dev~1removed", "value": "x"},
        {"op": "add", "path": "/metadata/annotations/a~1b", "value": "2"},  # replaces
        {"op": "replace", "path": "/metadata/name", "value": "d"},
        {"op": "add", "path": "/spec/devices/requests/0/firstAvailable/-", "value": {"name": "z"}},
    ]
    patched = apply_patch(CLAIM, patch)
    assert patched["metadata"] == {
        "name": "d",
        "annotations": {"a/b": "2", "tally.dev/removed": "x"},
    }
    assert patched["spec"]["devices"]["requests"][0]["firstAvailable"] == [
        {"name": "a100"},
        {"name": "z"},
    ]
    assert CLAIM["metadata"] == {"name": "c", "annotations": {"a/b": "1"}}
    assert apply_patch(CLAIM, [{"op": "add", "path": "", "value": 1}]) == 1


@pytest.mark.parametrize(
    ("patch", "problem"),
    [
        ({"op": "remove", "path": "/spec"}, "a JSON Patch is a list of operations"),
        ([{"op": "move", "from": "/a", "path": "/b"}], "unsupported op 'move'"),
        ([{"op": "add", "path": "/metadata/x"}], "add needs a value"),
        ([{"op": "remove", "path": "metadata"}], "does not start with /"),
        ([{"op": "remove", "path": "/missing"}], "no member 'missing'"),
        ([{"op": "add", "path": "/missing/x", "value": 1}], "no member 'missing'"),
        ([{"op": "remove", "path": "/spec/devices/requests/1"}], "no element '1'"),
        ([{"op": "remove", "path": "/spec/devices/requests/00"}], "no element '00'"),
        ([{"op": "add", "path": "/metadata/name/x", "value": 1}], "neither an object nor a list"),
        ([{"op": "remove", "path": ""}], "cannot remove the whole document"),
    ],
)
def test_patches_that_do_not_apply_say_why(patch: Any, problem: str) -> None:
    with pytest.raises(JsonPatchError, match=problem):
        apply_patch(CLAIM, patch)
