from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Chargeback"

    def ready(self) -> None:
        # At ready(), as Django has it: the receiver's module imports models.
        from billing.idle import IdleCollector
        from billing.services import (
            on_charges_requested,
            on_usage_closed_until,
            why_samples_kept,
        )
        from core.metrics import DATABASE_COLLECTORS
        from inventory.signals import charges_requested, usage_closed_until
        from metering.retention import RETENTION_HOLDS

        DATABASE_COLLECTORS.append(IdleCollector())
        # A day's samples stay until closed periods have billed it (metering knows no period).
        if why_samples_kept not in RETENTION_HOLDS:
            RETENTION_HOLDS.append(why_samples_kept)

        charges_requested.connect(on_charges_requested, dispatch_uid="billing.charges")
        usage_closed_until.connect(on_usage_closed_until, dispatch_uid="billing.closed_until")
