from django.apps import AppConfig


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
