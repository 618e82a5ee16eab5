"""The alerts beat evaluates: idle claims (issue 19), stranded gangs and undocumented version
outliers (issue 20), raised and resolved through `teams.alerts`, then notified.

Each kind is found whole before any of its alerts is touched, so an evaluation that fails
midway resolves nothing it did not look at; a receiver that is down fails only its own
notifications (`teams.alert_delivery`), after the alerts are stored.

- Idle claims (`billing.idle`): to the claim's user and the team's leads; key
  `cluster/namespace/claim/uid`; resolved when the claim computes again or is released.
- Stranded gangs (`billing.stranded`): to the team's leads (operators for a gang of no
  team); key `cluster/namespace/gang`; resolved once the gang is whole, gone or ended.
- Version outliers (`inventory.versions`): one per node (or, for devices of no node, per
  pool) with GPUs on an undocumented driver/CUDA pair, to the operators; resolved when
  documented or fixed; a deviation that expires makes its node an outlier again.
- Silent metering engines (`metering.silence`): raised by the rollup as it finds a cluster
  whose engine answered with no reading, to the operators; key the cluster; resolved here
  once no rollup has found it silent for an hour.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

from billing.idle import IdleClaim, idle_claims
from billing.models import SLICE_HOUR
from billing.pricing import rate_for, rate_hours, round_money
from billing.stranded import PricedGang, priced_stranded_gangs
from inventory.profiles import hours_label, shown_number, unit_label
from inventory.versions import Outlier, version_matrix
from metering.silence import silence_alerts
from teams.alert_delivery import DeliveryReport, deliver_pending
from teams.alerts import (
    RaisedAlert,
    SyncReport,
    operator_recipients,
    sync_alerts,
    team_leads,
)
from teams.models import AlertKind, Team


@dataclass(frozen=True)
class AlertRun:
    """One evaluation: per kind what was raised, still firing and resolved; then what was sent."""

    evaluated: dict[str, SyncReport]
    delivered: DeliveryReport

    def summary(self) -> dict[str, Any]:
        return {
            **{
                kind: {
                    "raised": len(report.raised),
                    "firing": len(report.raised) + len(report.ongoing),
                    "resolved": len(report.resolved),
                }
                for kind, report in self.evaluated.items()
            },
            "sent": len(self.delivered.sent),
            "retrying": len(self.delivered.retrying),
            "failed": len(self.delivered.failed),
        }


def run_alerts(*, now: datetime) -> AlertRun:
    """Evaluate every kind of alert at `now`, then send the notifications due. Idempotent:
    running it again at once raises, resolves and sends nothing more."""
    evaluated = evaluate_alerts(now=now)
    return AlertRun(evaluated=evaluated, delivered=deliver_pending(now=now))


def evaluate_alerts(*, now: datetime) -> dict[str, SyncReport]:
    """Raise the alerts live at `now` and resolve those that are not, kind by kind."""
    return {
        AlertKind.IDLE_CLAIM: sync_alerts(
            kind=AlertKind.IDLE_CLAIM, raised=idle_claim_alerts(now=now), now=now
        ),
        AlertKind.STRANDED_GANG: sync_alerts(
            kind=AlertKind.STRANDED_GANG, raised=stranded_gang_alerts(now=now), now=now
        ),
        AlertKind.VERSION_OUTLIER: sync_alerts(
            kind=AlertKind.VERSION_OUTLIER, raised=version_outlier_alerts(now=now), now=now
        ),
        AlertKind.METERING_SILENT: silence_alerts(now=now),
    }


def idle_claim_alerts(*, now: datetime) -> list[RaisedAlert]:
    leads: dict[int, list[str]] = {}
    alerts = []
    for claim in idle_claims(now=now):
        if claim.team.pk not in leads:
            leads[claim.team.pk] = team_leads(claim.team)
        alerts.append(_idle_alert(claim, leads[claim.team.pk]))
    return alerts


def _idle_alert(claim: IdleClaim, leads: list[str]) -> RaisedAlert:
    policy = claim.policy
    plural = claim.units_held != 1
    held = f"{shown_number(claim.units_held)} {unit_label(claim.unit, plural=plural)}"
    hours = hours_label(claim.unit)
    who = ", ".join(claim.usernames) or "unknown"
    cost = _idle_cost(claim)
    description = (
        f"Claim {claim.namespace}/{claim.claim_name} in cluster {claim.cluster} holds {held} "
        f"and used {claim.utilised_percent}% of them from {_time(claim.since)} to "
        f"{_time(claim.until)} UTC (under {shown_number(policy.below_percent)}% in each of those "
        f"{policy.for_hours} hours): {shown_number(claim.idle_unit_hours)} idle {hours}"
        + (f", billed {cost}" if cost else "")
        + ".\n"
        f"User: {who}. Job: {claim.job or 'none'}.\n"
        "Release the claim if it is not needed; the alert resolves when it computes again or "
        "is released."
    )
    return RaisedAlert(
        kind=AlertKind.IDLE_CLAIM,
        key=claim.key,
        team=claim.team,
        subject=(
            f"Idle claim {claim.namespace}/{claim.claim_name}: {held} under "
            f"{shown_number(policy.below_percent)}% for {policy.for_hours} h"
        ),
        description=description,
        labels={
            "cluster": claim.cluster,
            "namespace": claim.namespace,
            "claim": claim.claim_name,
            "job": claim.job,
            "user": who,
            "unit": claim.unit,
        },
        recipients=(*claim.usernames, *(lead for lead in leads if lead not in claim.usernames)),
    )


def _idle_cost(claim: IdleClaim) -> str:
    """What the claim's idle hours of the window are billed (the rate card of its model on the
    window's last day, times its idle factor), as "12.34 USD"; "" when its devices mix models
    or no card prices them."""
    if not claim.product_name:
        return ""
    card = rate_for(claim.product_name, claim.profile, claim.until.date())
    if card is None:
        return ""
    slice_share = claim.device_share if card.rate_unit == SLICE_HOUR else None
    exact = rate_hours(claim.idle_ms, slice_share) * Fraction(card.per_gpu_hour)
    return f"{round_money(exact * Fraction(card.idle_factor), card.currency)} {card.currency}"


def stranded_gang_alerts(*, now: datetime) -> list[RaisedAlert]:
    priced = priced_stranded_gangs(user=None, now=now)  # every gang
    teams = {
        team.slug: team for team in Team.objects.filter(slug__in={p.gang.team for p in priced})
    }
    recipients: dict[str, list[str]] = {}
    alerts = []
    for gang_cost in priced:
        team = teams.get(gang_cost.gang.team)
        slug = team.slug if team is not None else ""
        if slug not in recipients:
            recipients[slug] = team_leads(team) if team is not None else operator_recipients()
        alerts.append(_stranded_alert(gang_cost, team, recipients[slug]))
    return alerts


def _stranded_alert(priced: PricedGang, team: Team | None, recipients: list[str]) -> RaisedAlert:
    gang = priced.gang
    held = f"{shown_number(gang.units_held)} {gang.unit_label}"
    cost = ", ".join(f"{amount} {currency}" for currency, amount in priced.cost.items())
    if priced.unpriced_unit_hours:
        cost = (cost + ", " if cost else "") + (
            f"{shown_number(priced.unpriced_unit_hours)} {gang.hours_label} unpriced"
        )
    description = (
        f"Gang {gang.key} ({gang.source}) in {gang.cluster}/{gang.namespace} needs {gang.size} "
        f"members running together; {gang.members_holding} hold {gang.devices_held} devices "
        f"({held}) while {gang.size - gang.members_holding} wait or are missing, since "
        f"{_time(gang.stranded_since)} UTC ({_duration(gang.stranded_seconds)}). Held so far: "
        f"{shown_number(priced.unit_hours)} {gang.hours_label}"
        + (f", {cost} at list price." if cost else ".")
        + "\nNo other job can use those devices meanwhile: complete the gang or delete it."
    )
    return RaisedAlert(
        kind=AlertKind.STRANDED_GANG,
        key=f"{gang.cluster}/{gang.namespace}/{gang.key}",
        team=team,
        subject=(
            f"Stranded gang {gang.namespace}/{gang.key}: {gang.members_holding} of {gang.size} "
            f"members hold {held}"
        ),
        description=description,
        labels={
            "cluster": gang.cluster,
            "namespace": gang.namespace,
            "gang": gang.key,
            "source": gang.source,
            "unit": gang.unit,
        },
        recipients=tuple(recipients),
    )


def version_outlier_alerts(*, now: datetime) -> list[RaisedAlert]:
    matrix = version_matrix(at=now)
    by_place: dict[str, list[tuple[Outlier, str]]] = defaultdict(list)
    for model in matrix["models"]:
        baseline = model["baseline"]
        wanted = _pair(baseline["driver_version"], baseline["cuda_driver_version"])
        for outlier in model["outliers"]:
            if outlier["deviation"] is not None:
                continue
            # Nodes are named cluster/node (every cluster covered); no node: the pool.
            place = outlier["node"] or (
                f"{outlier['cluster']}/pool {outlier['driver']}/{outlier['pool']}"
            )
            by_place[place].append((outlier, wanted))
    if not by_place:
        return []
    recipients = tuple(operator_recipients())
    alerts = []
    for place, outliers in sorted(by_place.items()):
        lines = [
            f"{outlier['gpus']} {outlier['product_name'] or 'GPU'} on "
            f"{_pair(outlier['driver_version'], outlier['cuda_driver_version'])} "
            f"(baseline {wanted}; pool {outlier['driver']}/{outlier['pool']})"
            for outlier, wanted in outliers
        ]
        first = outliers[0][0]
        alerts.append(
            RaisedAlert(
                kind=AlertKind.VERSION_OUTLIER,
                key=place,
                subject=(
                    f"Undocumented driver version on {place}: "
                    f"{_pair(first['driver_version'], first['cuda_driver_version'])}"
                ),
                description=(
                    f"{place} runs a driver/CUDA pair other than its baseline, and no deviation "
                    "documents it:\n"
                    + "\n".join(f"- {line}" for line in lines)
                    + "\nUpgrade it to the baseline, or document the deviation (reason, owner, "
                    "expiry) in the policy file's versions.deviations or the admin."
                ),
                labels={
                    "cluster": first["cluster"],
                    "node": place,
                    "driver_version": first["driver_version"],
                    "cuda_driver_version": first["cuda_driver_version"],
                },
                recipients=recipients,
            )
        )
    return alerts


def _pair(driver_version: str, cuda_driver_version: str) -> str:
    return f"driver {driver_version or 'any'}, CUDA {cuda_driver_version or 'any'}"


def _time(moment: datetime) -> str:
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M}"


def _duration(seconds: int) -> str:
    delta = timedelta(seconds=seconds)
    hours, rest = divmod(int(delta.total_seconds()), 3600)
    return f"{hours} h {rest // 60} min"
