from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Metering and chargeback"

    def ready(self) -> None:
        # At ready(), as Django has it: the receiver's module imports models.
        from billing.dirty import on_ownership_changed
        from billing.idle import IdleCollector
        from billing.meter_changes import on_meters_changed
        from billing.services import on_charges_requested, on_usage_closed_until
        from core.metrics import DATABASE_COLLECTORS
        from inventory.signals import charges_requested, meters_changed, usage_closed_until
        from teams.ownership import ownership_changed

        DATABASE_COLLECTORS.append(IdleCollector())

        # `claims_changed` reaches billing.dirty.on_claims_changed through quota's receiver,
        # which must run its own step first (quota/apps.py).
        meters_changed.connect(on_meters_changed, dispatch_uid="billing.meters_changed")
        charges_requested.connect(on_charges_requested, dispatch_uid="billing.charges")
        usage_closed_until.connect(on_usage_closed_until, dispatch_uid="billing.closed_until")
        ownership_changed.connect(on_ownership_changed, dispatch_uid="billing.ownership_changed")
