from django.apps import AppConfig


class MeteringConfig(AppConfig):
    name = "metering"
    label = "metering"
    verbose_name = "Metering"

    def ready(self) -> None:
        # At ready(), as Django has it: the receivers' modules import models. The dispatch
        # uids are the ones these receivers had as billing's.
        from inventory.signals import claims_changed, meters_changed
        from metering.dirty import on_claims_changed, on_ownership_changed
        from metering.meter_changes import on_meters_changed
        from teams.ownership import ownership_changed

        claims_changed.connect(on_claims_changed, dispatch_uid="billing.mark_dirty")
        meters_changed.connect(on_meters_changed, dispatch_uid="billing.meters_changed")
        ownership_changed.connect(on_ownership_changed, dispatch_uid="billing.ownership_changed")
