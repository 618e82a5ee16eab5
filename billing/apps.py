from typing import Any

from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"
    verbose_name = "Metering and chargeback"

    def ready(self) -> None:
        from inventory.signals import claims_changed

        claims_changed.connect(_mark_dirty, dispatch_uid="billing.mark_dirty")


def _mark_dirty(sender: Any, *, cluster: Any, claim_ids: list[int], at: Any, **_: Any) -> None:
    """Hours that claims' allocations touch are rolled up again."""
    from billing.rollup import mark_claims_dirty

    mark_claims_dirty(claim_ids=claim_ids, at=at)
