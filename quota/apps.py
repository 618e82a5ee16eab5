from typing import Any

from django.apps import AppConfig


class QuotaConfig(AppConfig):
    name = "quota"
    verbose_name = "Quotas"

    def ready(self) -> None:
        from core.metrics import DATABASE_COLLECTORS
        from inventory.signals import claims_changed
        from quota.metrics import ReservationCollector
        from quota.pending import PendingDemandCollector

        DATABASE_COLLECTORS.append(ReservationCollector())
        DATABASE_COLLECTORS.append(PendingDemandCollector())
        claims_changed.connect(_sync_reservations, dispatch_uid="quota.sync_reservations")


def _sync_reservations(
    sender: Any, *, cluster: Any, claim_ids: list[int], at: Any, **_: Any
) -> None:
    """Reservations follow the claims the sync saw: allocated exactly, or released."""
    from quota.services import sync_reservations

    sync_reservations(cluster=cluster, claim_ids=claim_ids, at=at)
