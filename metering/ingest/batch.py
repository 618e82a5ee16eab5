"""`ingest`: one batch of valid samples stored. Named devices are resolved, each sample is
checked against the sending token's node and limits, stored or set aside, and its MIG
samples' GPU instances recorded and placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.conf import settings
from django.db import connection, transaction

from metering.dirty import mark_dirty
from metering.ingest.gaps import touched_hours
from metering.ingest.named import NAMED, resolve_samples
from metering.ingest.placement import (
    InstanceSample,
    Placements,
    instance_points,
    is_keyed,
    keyed_samples,
    place_keyed,
    placed_mig_samples,
    widen_dcgm_spans,
)
from metering.ingest.rows import IngestReport, Refusal, SampleRow
from metering.ingest.store import device_places, store_batch, store_samples, why_misplaced
from metering.mig_instances import (
    lock_instances,
    record_instances,
)
from metering.models import AgentToken, UnknownDeviceSample


def _refusal(position: int, row: SampleRow, sent: dict[int, str], label: str, why: str) -> Refusal:
    """The refusal of the sample at `position`, naming its device as the sender did: a UUID,
    or (`sent`, by position) the driver, pool and device it named, never the identity formed
    from them."""
    named = sent.get(position)
    if named is None:
        return Refusal(position, label, f"device {row[0]} {why}")
    return Refusal(position, label, f"{named} {why}", "device")


def _unknown_devices_allowed(
    agent: AgentToken, rows: list[tuple[int, SampleRow]], sent: dict[int, str]
) -> tuple[list[tuple[int, SampleRow]], list[Refusal]]:
    """Of samples of devices the inventory does not know (with their positions), those the
    token may set aside, and the rest refused with why: a token holds samples of at most
    TALLY_INGEST_MAX_UNKNOWN_DEVICES unknown devices, and at most
    TALLY_INGEST_MAX_UNKNOWN_SAMPLES of them, until they are adopted or expire. The token's
    row is locked, so two of its batches at once cannot both take the last room."""
    AgentToken.objects.select_for_update().only("pk").get(pk=agent.pk)
    held = UnknownDeviceSample.objects.filter(agent_token=agent)
    devices = set(held.values_list("device_uuid", flat=True).distinct())
    room = int(settings.TALLY_INGEST_MAX_UNKNOWN_SAMPLES) - held.count()
    most_devices = int(settings.TALLY_INGEST_MAX_UNKNOWN_DEVICES)
    allowed: list[tuple[int, SampleRow]] = []
    refused: list[Refusal] = []
    for position, row in rows:
        if row[0] not in devices and len(devices) >= most_devices:
            refused.append(
                _refusal(
                    position,
                    row,
                    sent,
                    "unknown_device_limit",
                    "is not in the inventory, and this token already has samples of "
                    f"{most_devices} unknown devices set aside (TALLY_INGEST_MAX_UNKNOWN_DEVICES)",
                )
            )
        elif len(allowed) >= room:
            refused.append(
                _refusal(
                    position,
                    row,
                    sent,
                    "unknown_device_limit",
                    "is not in the inventory, and this token already has "
                    f"{settings.TALLY_INGEST_MAX_UNKNOWN_SAMPLES} samples of unknown devices "
                    "set aside (TALLY_INGEST_MAX_UNKNOWN_SAMPLES)",
                )
            )
        else:
            devices.add(row[0])
            allowed.append((position, row))
    return allowed, refused


@transaction.atomic
def ingest(
    *,
    node: str,
    samples: Sequence[SampleRow],
    received_at: datetime,
    agent: AgentToken | None = None,
) -> IngestReport:
    """Store validated `samples` sent by `node`, in one transaction.

    Samples of known devices go to `Sample`, the others aside to `UnknownDeviceSample`, but
    for those of a dynamic MIG device, stored under the partition device published for their
    placement on `node` (`placed_mig_samples`), and DCGM's named `<parent UUID>::gi<N>`,
    stored under the device that GPU instance was at their instant (`place_keyed`). A device and
    instant already stored, or sent twice in this batch, is kept as first stored and counted
    as a duplicate. Every hour that newly stored samples count in is marked dirty. The GPU
    instances of MIG samples stored (or duplicates) are recorded (`instance_points`), with a
    token or without, and DCGM's samples their spells placed are placed again where the
    spells changed.

    Sent with an agent token (`agent`), a sample is refused, never stored, when the inventory
    puts its device on another node than the token's (any node but its cluster's, for a
    cluster-wide token), or it is of an unknown device past the token's limits
    (`_unknown_devices_allowed`). Without one (an operator's backfill) neither applies. A
    node's token sends for its own node only: `node` another is a ValueError (the view
    answers 403 before).
    """
    if agent is not None and agent.node != "*" and node != agent.node:
        # What is set aside records the node that sent it, and adoption trusts that node to
        # be the token's (`adopt_unknown_samples`).
        raise ValueError(f"the token of node {agent.node!r} cannot send for node {node!r}")
    given = samples
    named_refused: dict[int, Refusal] = {}
    unknown_named: dict[str, str] = {}
    sent: dict[int, str] = {}  # position -> the device as named by driver and device
    keys = {row[0] for row in samples if row[0][:1] == NAMED}
    if keys:
        samples, named_refused, unknown_named, sent = resolve_samples(samples, keys, node, agent)
    # DCGM's samples of MIG devices it could not tell, named by their GPU instance.
    keyed_at = {
        position
        for position, row in enumerate(samples)
        if row.instance is not None and is_keyed(row) and position not in named_refused
    }
    uuids = {row[0] for row in samples if row[0][:1] != NAMED}  # refused names left out
    if keyed_at:
        uuids -= {samples[position][0] for position in keyed_at}
    places = device_places(uuids) if uuids else {}
    misplaced: dict[str, str] = {}
    if agent is not None:
        for uuid, place in places.items():
            why = why_misplaced(place, agent)
            if why:
                misplaced[uuid] = why
    known_rows: Sequence[SampleRow] = samples
    unknown: list[tuple[int, SampleRow]] = []
    keyed: list[tuple[int, SampleRow]] = []
    refused: list[Refusal] = []
    unknown_ids: set[str] = set()
    if keyed_at or misplaced or named_refused or len(places) != len(uuids):
        kept: list[SampleRow] = []
        for position, row in enumerate(samples):
            if position in named_refused:
                refused.append(named_refused[position])
            elif position in keyed_at:
                keyed.append((position, row))
            elif row[0] in misplaced:
                refused.append(_refusal(position, row, sent, "device_elsewhere", misplaced[row[0]]))
            elif row[0] in places:
                kept.append(row)
            else:
                unknown.append((position, row))
        if unknown:
            unknown, placed = placed_mig_samples(unknown, node=node, agent=agent)
            kept.extend(placed)
            unknown_ids = {row[0] for _, row in unknown}
        known_rows = kept
    cluster_id = None if agent is None else agent.cluster_id
    points = instance_points(
        [
            InstanceSample(row.device_uuid, row.ts_ms, row.instance, cluster_id, node)
            for row in known_rows
            if row.instance is not None
        ],
        places=places,
    )
    with connection.cursor() as cursor:
        # The GPU instances' locks before the devices': the spells say which devices DCGM's
        # samples go to, and the devices are locked in one round.
        placements = Placements()
        if points or keyed:
            lock_instances(
                cursor,
                {key.instance for key in points}
                | {(node, *row.instance) for _, row in keyed if row.instance is not None},
            )
            placements = place_keyed(
                cursor,
                record_instances(cursor, points),
                keyed_samples(keyed, node=node, cluster_id=cluster_id),
            )
            if placements.unplaced:
                unknown = sorted(unknown + placements.unplaced)
                unknown_ids |= {row[0] for _, row in placements.unplaced}
        if unknown and agent is not None:
            unknown, over = _unknown_devices_allowed(agent, unknown, sent)
            refused = sorted(refused + over)
        stored, instants = store_samples(
            cursor,
            known_rows,
            node=node,
            received_at=received_at,
            also_lock=placements.devices,
        )
        by_instance, shifted = placements.store(cursor, node=node, received_at=received_at)
        set_aside, _ = store_batch(
            cursor,
            UnknownDeviceSample,
            [row for _, row in unknown],
            node=node,
            received_at=received_at,
            agent=agent,
        )
        widen_dcgm_spans(cursor, [row for _, row in keyed], node=node)
    hours = touched_hours(instants + shifted)
    mark_dirty(hours=hours, at=received_at)
    accepted = stored + by_instance + set_aside
    set_aside_ids = {row[0] for _, row in unknown}
    return IngestReport(
        accepted=accepted,
        duplicates=len(given) - accepted - len(refused),
        refused=refused,
        unknown_devices=sorted(unknown_ids),
        hours=hours,
        unknown_named={key: why for key, why in unknown_named.items() if key in set_aside_ids},
    )
