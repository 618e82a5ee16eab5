"""Bill shock: money that moves a lot, or moves where it never should, raises an operator alert
(`teams.alerts`, kind `bill_shock`) naming what moved it, instead of surfacing on an invoice.

Checked by every statement refresh (`billing.pricing.refresh_statements`), which says what ran
it (`cause`: a billing run, beat's refresh, a close):

- A team's open-period total that grows by more than TALLY_BILL_SHOCK_PERCENT of what it was
  at most an hour before (`Statement.baseline_total`, moved on once it is an hour old).
- Any change to a closed period's money: late data whose adjustment lines for a closed period
  changed in this refresh (the closed statement itself never changes; what it bills does).

The alert names the run, and the claims the syncs and imports first saw since the baseline,
per cluster (what usually moved the money: a new cluster, an import of old claims). A later
jump or change updates it; a refresh an hour after it was last raised that finds none
resolves it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db.models import Count

from billing.models import Period, Statement
from inventory.models import ResourceClaim
from teams.alerts import RaisedAlert, operator_recipients, raise_alert, resolve_alerts
from teams.models import Alert, AlertKind, AlertState, Team

BASELINE_AGE = timedelta(hours=1)
# Per (team id, closed period id, currency): the adjustments an open period bills for it.
AdjustmentTotals = Mapping[tuple[int, int, str], Decimal]


def check_statements(
    *,
    period: Period,
    statements: list[Statement],
    adjustments_before: AdjustmentTotals,
    adjustments_after: AdjustmentTotals,
    cause: str,
    now: datetime,
) -> list[RaisedAlert]:
    """Raise the bill-shock alerts of one refresh of `period`'s `statements` (their totals just
    written), and move each statement's baseline on once it is an hour old. Returns what was
    raised."""
    alerts = []
    share = Decimal(settings.TALLY_BILL_SHOCK_PERCENT) / 100
    since = min((s.baseline_at for s in statements if s.baseline_at), default=now - BASELINE_AGE)
    moved = []
    for statement in statements:
        base = statement.baseline_total
        known = share and statement.baseline_at is not None and base > 0
        if known and statement.total - base > share * base:
            alerts.append(_jump(statement, period, cause))
        if statement.baseline_at is None or now - statement.baseline_at >= BASELINE_AGE:
            statement.baseline_total, statement.baseline_at = statement.total, now
            moved.append(statement)
    Statement.objects.bulk_update(moved, ["baseline_total", "baseline_at"])
    for key in sorted(set(adjustments_before) | set(adjustments_after)):
        before = adjustments_before.get(key, Decimal(0))
        after = adjustments_after.get(key, Decimal(0))
        if before != after:
            alerts.append(_closed_change(key, before, after, period, cause))
    if alerts:
        seen, recipients = _claims_seen_since(since), tuple(operator_recipients())
        alerts = [_with(alert, seen, recipients) for alert in alerts]
        for alert in alerts:
            raise_alert(spec=alert, now=now)
    # An alert of these teams not raised again for an hour is over (a jump, a change: events).
    quiet = Alert.objects.filter(
        kind=AlertKind.BILL_SHOCK,
        state=AlertState.FIRING,
        team_id__in={statement.team_id for statement in statements},
        last_seen__lte=now - BASELINE_AGE,
    ).exclude(key__in=[alert.key for alert in alerts])
    resolve_alerts(pks=quiet.values_list("pk", flat=True), now=now)
    return alerts


def _jump(statement: Statement, period: Period, cause: str) -> RaisedAlert:
    team, currency = statement.team, statement.currency
    base, total = statement.baseline_total, statement.total
    percent = (total - base) / base * 100
    return RaisedAlert(
        kind=AlertKind.BILL_SHOCK,
        key=f"jump/{team.slug}/{period.label}/{currency}",
        team=team,
        subject=(
            f"Bill shock: {team.slug}'s {period.label} total {_money(base)} → "
            f"{_money(total)} {currency} (+{percent:.0f}%) within an hour"
        ),
        description=(
            f"{team.slug}'s open statement for {period.label} grew from {_money(base)} to "
            f"{_money(total)} {currency} since {statement.baseline_at:%Y-%m-%d %H:%M} UTC, more "
            f"than TALLY_BILL_SHOCK_PERCENT={settings.TALLY_BILL_SHOCK_PERCENT}%.\n"
            f"Recomputed by: {cause}."
        ),
        labels={"team": team.slug, "period": period.label, "currency": currency},
    )


def _closed_change(
    key: tuple[int, int, str], before: Decimal, after: Decimal, period: Period, cause: str
) -> RaisedAlert:
    team_id, closed_id, currency = key
    team = Team.objects.get(pk=team_id)
    closed = Period.objects.get(pk=closed_id)
    return RaisedAlert(
        kind=AlertKind.BILL_SHOCK,
        key=f"closed/{team.slug}/{closed.label}/{currency}",
        team=team,
        subject=(
            f"Closed period {closed.label} changed for {team.slug}: late-data adjustments "
            f"{_money(before)} → {_money(after)} {currency}, billed in {period.label}"
        ),
        description=(
            f"Usage of the closed period {closed.label} changed after it was frozen: "
            f"{team.slug}'s adjustments for it on the {period.label} statement went from "
            f"{_money(before)} to {_money(after)} {currency}.\nRecomputed by: {cause}."
        ),
        labels={"team": team.slug, "period": closed.label, "currency": currency},
    )


def _claims_seen_since(since: datetime) -> dict[str, int]:
    """Claims the syncs and imports first saw since `since`, per cluster."""
    return dict(
        ResourceClaim.objects.filter(first_seen__gte=since)
        .values_list("cluster__name")
        .annotate(count=Count("pk"))
        .values_list("cluster__name", "count")
    )


def _with(alert: RaisedAlert, seen: dict[str, int], recipients: tuple[str, ...]) -> RaisedAlert:
    """The alert with what the syncs and imports brought in meanwhile, to the operators."""
    if seen:
        found = ", ".join(f"{count} in cluster {name}" for name, count in sorted(seen.items()))
        news = f"\nClaims the syncs and imports first saw meanwhile: {found}."
    else:
        news = "\nNo claim was first seen by a sync or import meanwhile."
    return RaisedAlert(
        kind=alert.kind,
        key=alert.key,
        subject=alert.subject,
        team=alert.team,
        description=alert.description + news,
        labels=alert.labels,
        recipients=recipients,
    )


def _money(amount: Decimal) -> str:
    return f"{amount:,.2f}"
