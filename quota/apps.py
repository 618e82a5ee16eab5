from typing import Any

from django.apps import AppConfig
from django.core.signals import request_started


class QuotaConfig(AppConfig):
    name = "quota"
    verbose_name = "Quotas"

    def ready(self) -> None:
        from inventory.signals import claims_changed

        claims_changed.connect(_sync_reservations, dispatch_uid="quota.sync_reservations")
        request_started.connect(_end_admission_session, dispatch_uid="quota.end_admission")


def _end_admission_session(sender: Any, environ: dict[str, Any] | None = None, **_: Any) -> None:
    """A request that is no admission gets the connection's own timeouts back, if admissions
    (which run in autocommit with the webhook's timeouts on the session) left theirs on it."""
    from config.logging import ADMISSION_PREFIX
    from quota.selectors import end_admission_session

    if environ is not None and str(environ.get("PATH_INFO", "")).startswith(ADMISSION_PREFIX):
        return
    end_admission_session()


def _sync_reservations(
    sender: Any, *, cluster: Any, claim_ids: list[int], at: Any, **_: Any
) -> None:
    """Reservations follow the claims the sync saw: allocated exactly, or released."""
    from quota.services import sync_reservations

    sync_reservations(cluster=cluster, claim_ids=claim_ids, at=at)
