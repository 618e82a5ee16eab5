"""The JSON Patch the mutating webhook answers with, for a claim's spec: the `firstAvailable`
alternatives it removes and the selectors it adds to the requests it narrows to the models that
fit. Written once, for the answer (`views`) and for finding a create sent again the claim its
reservation was made for (`plans.spec_digest`: the spec as the patch leaves it). Plain data.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch

from inventory import dra


def spec_operations(
    claim: dict[str, Any],
    *,
    removed: Mapping[str, list[str]],
    narrowed: Mapping[str, str],
) -> list[dict[str, Any]]:
    """The patch operations on `claim`'s spec: the alternatives `removed` (by request name)
    taken out, and each selector of `narrowed` (by "request", or "request/alternative" for
    one alternative of a `firstAvailable` request) added after the selectors the request (or
    alternative) has: all must match, so the added one only narrows what they select. A
    request is written on itself in v1beta1 and v1alpha3 (`dra.flat_requests`), under its
    `exactly` in v1beta2 and v1; an alternative always on itself. An alternative's selector is
    added before any removal, at its index as sent; removals run from the last, so each leaves
    the indexes before it as they were."""
    operations: list[dict[str, Any]] = []
    spec = claim.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    if not isinstance(requests, list):
        return operations
    flat = dra.flat_requests(str(claim.get("apiVersion") or ""))
    for index, request in enumerate(requests):
        if not isinstance(request, dict):
            continue
        name = request.get("name")
        base = f"/spec/devices/requests/{index}"
        alternatives = request.get("firstAvailable")
        alternatives = alternatives if isinstance(alternatives, list) else []
        if isinstance(name, str) and name in narrowed:
            holder = request if flat else request.get("exactly")
            operations.append(
                _add_selector(holder, base + ("" if flat else "/exactly"), narrowed[name])
            )
        for alt_index, alternative in enumerate(alternatives):
            key = f"{name}/{alternative.get('name')}" if isinstance(alternative, dict) else ""
            if key in narrowed:
                operations.append(
                    _add_selector(alternative, f"{base}/firstAvailable/{alt_index}", narrowed[key])
                )
        gone = set(removed.get(name, ())) if isinstance(name, str) else set()
        for alt_index in reversed(range(len(alternatives))):
            alternative = alternatives[alt_index]
            if isinstance(alternative, dict) and alternative.get("name") in gone:
                operations.append({"op": "remove", "path": f"{base}/firstAvailable/{alt_index}"})
    return operations


def _add_selector(holder: Any, base: str, expression: str) -> dict[str, Any]:
    """The operation that adds the selector `expression` to the request (or alternative) at
    `base`, `holder` as sent: appended to its selectors, or its first."""
    selector = {"cel": {"expression": expression}}
    if isinstance(holder, dict) and isinstance(holder.get("selectors"), list):
        return {"op": "add", "path": f"{base}/selectors/-", "value": selector}
    return {"op": "add", "path": f"{base}/selectors", "value": [selector]}


def patched_spec(
    claim: dict[str, Any],
    *,
    removed: Mapping[str, list[str]],
    narrowed: Mapping[str, str],
) -> Any:
    """`claim`'s spec as the mutating webhook's patch (`spec_operations`) leaves it; the spec
    as sent where the patch does not apply (a claim the API server would refuse)."""
    operations = spec_operations(claim, removed=removed, narrowed=narrowed)
    if not operations:
        return claim.get("spec")
    try:
        result = jsonpatch.apply_patch({"spec": copy.deepcopy(claim.get("spec"))}, operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError):
        return claim.get("spec")
    return result["spec"]
