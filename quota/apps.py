from typing import Any

from django.apps import AppConfig


class QuotaConfig(AppConfig):
    name = "quota"
    verbose_name = "Quotas"

    def ready(self) -> None:
        from core.metrics import DATABASE_COLLECTORS
        from inventory.signals import claims_changed
        from quota.metrics import ReservationCollector
        from quota.models import QuotaRule
        from quota.pending import PendingDemandCollector
        from teams import audit
        from teams.models import Team

        # A team's deletion audits its rules, budget, gang and narrowing policies one by one; a
        # rule's usage is the ledger's (quota.ledger), never in an audit snapshot nor saved by
        # one.
        audit.register_children(Team, "rules", "budget", "gang_policy", "narrowing_policy")
        audit.register_unaudited(QuotaRule, "in_use")
        DATABASE_COLLECTORS.append(ReservationCollector())
        DATABASE_COLLECTORS.append(PendingDemandCollector())
        # One receiver for both steps, in the order they must run (not INSTALLED_APPS').
        claims_changed.connect(_claims_changed, dispatch_uid="quota.claims_changed")


def _claims_changed(
    sender: Any, *, cluster: Any, claim_ids: list[int], at: Any, **changes: Any
) -> None:
    """What follows the claims the sync saw, in this order: the reservations (allocated
    exactly, or released), which also fill in who is charged on allocations the sync wrote
    without one (`quota.services.sync_reservations`); then the hours the change touched,
    marked to be rolled up again (`metering.dirty.on_claims_changed`), which compares the
    allocations the sender sent `unfilled` with what they hold once quota has filled them in.
    Run the other way round, hours an allocation was charged to nobody would stay so."""
    from metering.dirty import on_claims_changed
    from quota.services import sync_reservations

    sync_reservations(cluster=cluster, claim_ids=claim_ids, at=at)
    on_claims_changed(sender, cluster=cluster, claim_ids=claim_ids, at=at, **changes)
