"""Consumable capacity (KEP-5075): what one request takes of a device several claims may share.

A device published with `allowMultipleAllocations: true` can be allocated to many requests,
each consuming part of its capacity. What a request consumes follows the resource.k8s.io/v1
API (`DeviceCapacity`, `CapacityRequestPolicy`, `CapacityRequestPolicyRange`,
`CapacityRequirements`, `DeviceRequestAllocationResult.consumedCapacity`) and KEP-5075
(kubernetes/enhancements keps/sig-scheduling/5075-dra-consumable-capacity):

- A request's `capacity.requests` must all be provided by the device (a capacity it does not
  publish, or an amount above the capacity's value, makes the device ineligible).
- A requested amount is adjusted upward by the capacity's `requestPolicy`: `validValues`
  (sorted ascending) to the smallest valid value not below it, none: not satisfiable;
  `validRange` to `min` when below it, then up to `min + n * step` when `step` is set; above
  `max`: not satisfiable.
- A capacity the request does not name consumes `requestPolicy.default`; without a policy
  (or without a default), the full capacity value: "the whole device is claimed".
- The scheduler records the consumed amounts in the claim's
  `status.allocation.devices.results[].consumedCapacity`.

Capacity names are qualified names: an unqualified one is in the driver's domain, so `memory`
and `<driver>/memory` are the same capacity. Drivers and claims in the wild also write another
domain's qualified name (`gpu.nvidia.com/memory` under another driver name) or the bare name
for a qualified one, so a bare name also finds a capacity published as `<domain>/<name>` in any
domain. Plain Python on plain data (the stored `capacity` mapping, quantities as strings): the
quota webhook, the ledger and billing all weigh shares by it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils import parse_quantity


class CapacityError(ValueError):
    """A request the device cannot be given (as the scheduler would not allocate it), or a
    published quantity that cannot be read; the message names the capacity."""


def capacity_name(capacity: Mapping[str, Any], name: str, driver: str) -> str | None:
    """The key of `capacity` that `name` means: the same key, the same name qualified or not
    with the driver's domain, or (for a bare name) that name in any domain; None if none."""
    if name in capacity:
        return name
    domain, _, base = name.rpartition("/")
    if domain in ("", driver):
        for key in (base, f"{driver}/{base}"):
            if key in capacity:
                return key
    if not domain:
        # Sorted, so that a device publishing one name in two domains always gives the same.
        return next((key for key in sorted(capacity) if key.rpartition("/")[2] == base), None)
    return None


def capacity_entry(capacity: Mapping[str, Any], name: str, driver: str) -> dict[str, Any] | None:
    """The published entry (`{"value": ..., "requestPolicy": ...}`) of capacity `name`, looked
    up unqualified or qualified (see `capacity_name`); None when the device has no such one."""
    key = capacity_name(capacity, name, driver)
    entry = capacity.get(key) if key is not None else None
    return entry if isinstance(entry, dict) else None


def requested_amounts(
    capacity: Mapping[str, Any], requests: Mapping[str, str], driver: str
) -> dict[str, Decimal]:
    """What a request with `requests` (its `capacity.requests`) consumes of each capacity of a
    shareable device, by the device's capacity names: each requested amount adjusted by its
    capacity's `requestPolicy`, each capacity not requested its policy's `default` or, without
    one, its full value. Raises CapacityError when the device cannot be given to the request:
    it lacks a requested capacity, or a policy or the capacity's value does not allow the
    amount."""
    asked: dict[str, Decimal] = {}
    for name, quantity in requests.items():
        key = capacity_name(capacity, name, driver)
        if key is None:
            raise CapacityError(f"capacity {name!r}: the device does not publish it")
        asked[key] = _quantity(quantity, f"capacity.requests.{name}")
    amounts: dict[str, Decimal] = {}
    for key, entry in capacity.items():
        if not isinstance(entry, dict) or "value" not in entry:
            continue
        value = _quantity(entry["value"], f"capacity.{key}.value")
        policy = entry.get("requestPolicy") if isinstance(entry.get("requestPolicy"), dict) else {}
        assert isinstance(policy, dict)
        if key in asked:
            amount = _apply_policy(asked[key], policy, key)
        elif policy.get("default") is not None:
            amount = _quantity(policy["default"], f"capacity.{key}.requestPolicy.default")
        else:
            amount = value
        if amount > value:
            raise CapacityError(f"capacity {key!r}: {_show(amount)} is more than the device has")
        amounts[key] = amount
    return amounts


def consumed_fraction(
    capacity: Mapping[str, Any], consumed: Mapping[str, Any], driver: str
) -> Decimal:
    """The share of a device that `consumed` (amounts by capacity name, as `requested_amounts`
    gives them or a claim's `consumedCapacity` records them) takes: the largest fraction of any
    capacity named, at most 1. Names the device does not publish, and capacities of value 0,
    say nothing; when nothing is said, the whole device (1), as the API counts a request that
    consumes no capacity of a device with none to share."""
    fractions = []
    for name, amount in consumed.items():
        entry = capacity_entry(capacity, name, driver)
        if entry is None or "value" not in entry:
            continue
        value = _quantity(entry["value"], f"capacity.{name}.value")
        if value > 0:
            fractions.append(_quantity(amount, f"consumedCapacity.{name}") / value)
    return min(max(fractions), Decimal(1)) if fractions else Decimal(1)


def _apply_policy(amount: Decimal, policy: Mapping[str, Any], key: str) -> Decimal:
    """`amount` rounded up to what `policy` allows (KEP-5075's `requestPolicy`)."""
    valid_values = policy.get("validValues")
    if isinstance(valid_values, list) and valid_values:
        values = sorted(
            _quantity(v, f"capacity.{key}.requestPolicy.validValues") for v in valid_values
        )
        allowed = next((value for value in values if value >= amount), None)
        if allowed is None:
            raise CapacityError(
                f"capacity {key!r}: {_show(amount)} is above its largest valid value "
                f"{_show(values[-1])}"
            )
        return allowed
    valid_range = policy.get("validRange")
    if isinstance(valid_range, dict):
        where = f"capacity.{key}.requestPolicy.validRange"
        least = _quantity(valid_range.get("min", 0), f"{where}.min")
        amount = max(amount, least)
        if valid_range.get("step") is not None:
            step = _quantity(valid_range["step"], f"{where}.step")
            if step > 0:
                amount = least + step * math.ceil((amount - least) / step)
        if valid_range.get("max") is not None:
            most = _quantity(valid_range["max"], f"{where}.max")
            if amount > most:
                raise CapacityError(
                    f"capacity {key!r}: {_show(amount)} is above its valid range's max "
                    f"{_show(most)}"
                )
    return amount


def _quantity(value: Any, where: str) -> Decimal:
    try:
        return Decimal(parse_quantity(value))
    except (ValueError, TypeError, InvalidOperation) as exc:
        raise CapacityError(f"{where}: {value!r} is not a quantity") from exc


def _show(amount: Decimal) -> str:
    return f"{amount.normalize():f}"


def largest_allowed(entry: Mapping[str, Any], left: Decimal) -> Decimal | None:
    """The most of a capacity one request may consume within `left`, as the capacity's
    `requestPolicy` allows (`_apply_policy` rounding down, for what is still free): its
    largest valid value, or the top of its valid range (on a step), not above `left`; None
    when the policy allows nothing that small or cannot be read.
    """
    policy = entry.get("requestPolicy")
    if not isinstance(policy, dict):
        return left
    try:
        valid_values = policy.get("validValues")
        if isinstance(valid_values, list) and valid_values:
            allowed = [Decimal(parse_quantity(value)) for value in valid_values]
            return max((value for value in allowed if value <= left), default=None)
        valid_range = policy.get("validRange")
        if not isinstance(valid_range, dict):
            return left
        least = Decimal(parse_quantity(valid_range.get("min", 0)))
        most = left
        if valid_range.get("max") is not None:
            most = min(most, Decimal(parse_quantity(valid_range["max"])))
        if most < least:
            return None
        step = Decimal(parse_quantity(valid_range.get("step") or 0))
        return least + step * ((most - least) // step) if step > 0 else most
    except (ValueError, TypeError, InvalidOperation):
        return None
