from typing import Any

from django.apps import AppConfig
from django.db import DEFAULT_DB_ALIAS
from django.db.models.signals import post_migrate


class MeteringConfig(AppConfig):
    name = "metering"
    label = "metering"
    verbose_name = "Metering"

    def ready(self) -> None:
        # At ready(), as Django has it: the receivers' modules import models. The dispatch
        # uids are the ones these receivers had as billing's.
        from inventory.signals import meters_changed
        from metering.dirty import on_ownership_changed
        from metering.meter_changes import on_meters_changed
        from teams.ownership import ownership_changed

        # `claims_changed` reaches metering.dirty.on_claims_changed through quota's receiver,
        # which must run its own step first (quota/apps.py).
        meters_changed.connect(on_meters_changed, dispatch_uid="billing.meters_changed")
        ownership_changed.connect(on_ownership_changed, dispatch_uid="billing.ownership_changed")
        post_migrate.connect(keep_sums, sender=self, dispatch_uid="metering.keep_sums")


def keep_sums(using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> None:
    """After `migrate` (and `flush`, which empties every table and then sends post_migrate):
    where the per device-hour sums have no hold recorded, they are made again from what is
    stored (`metering.hoursums.rebuild_sums`), so the triggers keep them from then on rather
    than keep none (the rollup would scan the samples, right but slower)."""
    from django.db import connections

    from metering import hoursums

    if using != DEFAULT_DB_ALIAS:
        return
    if hoursums.STATE not in connections[using].introspection.table_names():
        return  # migrated to before the sums
    if hoursums.recorded_hold_ms() is None:
        hoursums.rebuild_sums()
