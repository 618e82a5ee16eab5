"""A device published again as a new row with the UUID it lacked (a driver upgrade deletes its
slice and publishes it again): what is rolled up again for a Prometheus-metered cluster.

The open allocation the new row takes over held one GPU through the change, the one the UUID
names: its hours before are marked, so the engine's readings under the UUID reach them. An
allocation that ended on the gone row keeps the gone row and its formed meter id, and its
hours are not marked: the device's name is a slot, and nothing known shows that the GPU the
UUID names sat in it at that time (`metering.meter_changes`). Updated in place (one row), the
device's history is its own, and the ended allocation's hours are marked too."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pytest_django.fixtures import SettingsWrapper

from inventory.models import Allocation, Device
from metering.hours import hours_between
from metering.models import DirtyHour
from tests.metering.test_meter_id_day import DAY, NOON, UUID, claim, resource_slice, watch

pytestmark = pytest.mark.django_db

ENDED = (DAY + timedelta(hours=3), DAY + timedelta(hours=6))  # held, then released
OPEN_SINCE = DAY + timedelta(hours=8)  # held through the change


def named(name: str) -> dict[str, Any]:
    """The claim of `claim()` under another name and uid: gpu-0 of node-a."""
    base = claim()
    return {**base, "metadata": {**base["metadata"], "name": name, "uid": f"uid-{name}"}}


def changed_at_noon(settings: SettingsWrapper, *, republished: bool) -> set[Any]:
    """The hours marked when gpu-0 gains its UUID at noon, after one claim held it from 03:00
    to 06:00 and another from 08:00 on (the marks of those claims cleared: rolled up)."""
    settings.TALLY_METERING_SOURCE = "prometheus"
    settings.TALLY_PROMETHEUS_URL = "http://prometheus.invalid:9090"
    watch(
        ("ADDED", resource_slice(1), DAY),
        ("ADDED", named("ended"), ENDED[0]),
        ("DELETED", named("ended"), ENDED[1]),
        ("ADDED", named("open"), OPEN_SINCE),
    )
    DirtyHour.objects.all().delete()
    if republished:
        watch(("DELETED", resource_slice(1), NOON), ("ADDED", resource_slice(2, UUID), NOON))
    else:
        watch(("MODIFIED", resource_slice(2, UUID), NOON))
    return set(DirtyHour.objects.values_list("hour", flat=True))


def test_republished_the_open_allocation_is_remarked_the_ended_one_is_not(
    settings: SettingsWrapper,
) -> None:
    marked = changed_at_noon(settings, republished=True)
    ended = Allocation.objects.get(claim__name="ended")
    held = Allocation.objects.get(claim__name="open")
    assert ended.device is not None and held.device is not None
    # The open one is tied to the new row, metered by the UUID from now on; the ended one
    # stays on the gone row, under the identity formed for it.
    assert (held.device.meter_id, held.device.gone_at) == (UUID, None)
    assert ended.device.gone_at == NOON and ended.device.meter_id == ended.meter_id != UUID
    assert Device.objects.filter(name="gpu-0").count() == 2
    assert hours_between(OPEN_SINCE, NOON) <= marked
    assert not hours_between(*ENDED) & marked


def test_updated_in_place_both_allocations_hours_are_remarked(
    settings: SettingsWrapper,
) -> None:
    marked = changed_at_noon(settings, republished=False)
    assert Device.objects.filter(name="gpu-0").count() == 1
    assert hours_between(*ENDED) <= marked
    assert hours_between(OPEN_SINCE, NOON) <= marked
