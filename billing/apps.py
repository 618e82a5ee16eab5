from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Metering and chargeback"

    def ready(self) -> None:
        # At ready(), as Django has it: the receiver's module imports models.
        from billing.dirty import on_claims_changed, on_ownership_changed
        from billing.idle import IdleCollector
        from billing.meter_changes import on_meters_changed
        from config.metrics import DATABASE_COLLECTORS
        from inventory.signals import claims_changed, meters_changed
        from teams.ownership import ownership_changed

        DATABASE_COLLECTORS.append(IdleCollector())

        claims_changed.connect(on_claims_changed, dispatch_uid="billing.mark_dirty")
        meters_changed.connect(on_meters_changed, dispatch_uid="billing.meters_changed")
        ownership_changed.connect(on_ownership_changed, dispatch_uid="billing.ownership_changed")
