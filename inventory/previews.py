"""A dry run of an import: what a snapshot would change, and the money it would move, with
nothing written (`sync_inventory --from-file ... --dry-run`).

The import is made for real inside a transaction that is rolled back, so the dry run says
exactly what the import would do (objects created and gone, allocations started and ended,
devices refused, allocation starts moved) and goes through every check, lock and receiver the
import would. The money comes from whoever bills (`inventory.signals.charges_requested`):
asked before and after the import, in the same transaction, so the difference is what the
import alone would move, per team, period and currency.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.db import transaction

from inventory import services
from inventory.signals import charges_requested

# (team slug, period label, currency)
ChargeKey = tuple[str, str, str]


@dataclass
class Preview:
    """What an import would do (`report`) and the money as it stands before and after it;
    `unpriced` says why the money could not be worked out, where it could not."""

    report: services.SyncReport
    before: dict[ChargeKey, Decimal] = field(default_factory=dict)
    after: dict[ChargeKey, Decimal] = field(default_factory=dict)
    unpriced: list[str] = field(default_factory=list)

    def moved(self) -> list[tuple[ChargeKey, Decimal, Decimal]]:
        """(team, period, currency), before, after: each figure the import would change."""
        return [
            (key, self.before.get(key, Decimal(0)), self.after.get(key, Decimal(0)))
            for key in sorted({*self.before, *self.after})
            if self.before.get(key, Decimal(0)) != self.after.get(key, Decimal(0))
        ]


def preview_snapshot(
    *,
    cluster_name: str,
    objects: Iterable[dict[str, Any]],
    at: datetime,
    now: datetime,
    kinds: Iterable[str] | None = None,
) -> Preview:
    """What `services.import_snapshot` of `objects` into the cluster `cluster_name` (created
    if new) would do, and the money it would move as billed at `now`; writes nothing. Raises
    what the import raises (a dump that cannot be read), after rolling back."""
    with transaction.atomic():
        cluster = services.get_cluster(cluster_name)
        preview = Preview(report=services.SyncReport())
        preview.before = _charges(now, preview.unpriced)
        preview.report = services.import_snapshot(
            cluster=cluster, objects=objects, at=at, kinds=kinds
        )
        if not preview.unpriced:
            preview.after = _charges(now, preview.unpriced)
        transaction.set_rollback(True)
    return preview


def _charges(now: datetime, unpriced: list[str]) -> dict[ChargeKey, Decimal]:
    """The money as the receivers of `charges_requested` bill it at `now`; a receiver that
    fails (a metrics engine that does not answer) is noted in `unpriced`."""
    charges: dict[ChargeKey, Decimal] = {}
    for _, answer in charges_requested.send_robust(sender=Preview, now=now):
        if isinstance(answer, Exception):
            unpriced.append(f"{type(answer).__name__}: {answer}")
        elif isinstance(answer, Mapping):
            charges.update(answer)
    return charges
