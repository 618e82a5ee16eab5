"""Hours before a device's meter id changed, rolled up again where the engine can tell.

A device the sync first saw without a UUID is metered by a formed identity; once its driver
publishes the UUID, its allocations' hours from then on are marked (`claims_changed`) and
counted under either id. A Prometheus engine keeps DCGM's series by UUID for its whole
retention, so the hours before the change have readings under the new id too: rolled up
again, they are measured. Where they were rolled up first decides nothing, so they are marked
whatever order the sync and the rollup ran in. Samples sent under the UUID before the change
were set aside, and adopting them marks their own hours: the samples path needs nothing here.

A device published again as a new row (its slice deleted and published with the UUID) takes
over the open allocations of the gone row, and their hours are marked as above: a claim that
held the device through the change held one GPU, the one the UUID now names. An allocation
that ended on the gone row is not marked, on purpose. Its meter ids are the gone row's formed
identity, so the rollup would read nothing new for it; and nothing known shows that the GPU
the UUID names was the one it held. A device name (and a PCI address) is a slot: between the
allocation's end and the new row, the node may have been rebuilt and its cards moved, and the
engine then holds readings under the UUID from another slot at that time. Readings tell their
slot only by their own labels (DCGM's `pci_bus_id` and `Hostname`): matching those against the
device's PCI address, as the Prometheus source matches AMD's and Intel's, would measure it,
without guessing (`tests/metering/test_meter_changes_republish.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from db.bulk import AnyOf
from inventory.models import Allocation, Cluster
from metering import prometheus
from metering.dirty import mark_dirty, span_hours

log = logging.getLogger(__name__)


def on_meters_changed(
    sender: Any, *, cluster: Cluster, devices: Mapping[int, datetime], **_: Any
) -> None:
    """`inventory.signals.meters_changed` receiver: for a cluster metered by a Prometheus
    engine, mark the hours the devices' allocations held before each device's meter id
    changed, back as far as a late sample is taken (TALLY_INGEST_MAX_AGE_DAYS). A setting the
    source cannot read marks them too: a needless rollup costs time, a missed one a figure."""
    if not devices or not _reads_the_past(cluster):
        return
    max_age = timedelta(days=int(settings.TALLY_INGEST_MAX_AGE_DAYS))
    intervals: list[tuple[datetime, datetime | None]] = []
    # One JSON parameter however many devices (`AnyOf`): no chunks under the parameter limit.
    for device_id, start, end in Allocation.objects.filter(
        AnyOf("device_id", sorted(devices))
    ).values_list("device_id", "start", "end"):
        assert device_id is not None  # the filter's
        changed = devices[device_id]
        start = max(start, changed - max_age)
        end = min(end or changed, changed)
        if start < end:
            intervals.append((start, end))
    at = max(devices.values())
    mark_dirty(hours=span_hours(intervals, at=at), at=at)


def _reads_the_past(cluster: Cluster) -> bool:
    """Whether `cluster` is metered by a Prometheus engine (unsure: yes)."""
    try:
        return prometheus.config().source(cluster.name) == "prometheus"
    except ImproperlyConfigured as error:
        log.warning("cannot tell how %s is metered (%s): its hours are marked", cluster, error)
        return True
