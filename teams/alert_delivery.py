"""Sending alerts' notifications: by email (Django's email backend) and as Alertmanager webhooks.

The one module that talks to receivers. `deliver_pending` sends each pending `AlertDelivery`
that is due, each in its own transaction with its row locked (two workers never send one
twice), and records what went out, or the error and when to try again (minutes apart, doubling
up to an hour, at most TALLY_ALERT_DELIVERY_ATTEMPTS times). A receiver that fails is not tried
again in the same run, so a dead one costs one timeout per run, and never stops the others.

The webhook body is Alertmanager's webhook payload (version 4) holding the one alert, so a
receiver already written for Alertmanager (Slack, PagerDuty, Opsgenie bridges) takes it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction
from django.db.models import Q
from django.urls import NoReverseMatch, reverse

from teams.alerts import EMAIL, WEBHOOK, recipient_addresses
from teams.models import Alert, AlertDelivery, AlertKind, AlertState, DeliveryState

logger = logging.getLogger(__name__)

# Alertmanager's `endsAt` of an alert still firing: Go's zero time.
ZERO_TIME = "0001-01-01T00:00:00Z"
RECEIVER = "tally"
ALERT_NAMES = {
    AlertKind.IDLE_CLAIM: "TallyIdleClaim",
    AlertKind.STRANDED_GANG: "TallyStrandedGang",
    AlertKind.VERSION_OUTLIER: "TallyVersionOutlier",
    AlertKind.METERING_SILENT: "TallyMeteringSilent",
    AlertKind.BILL_SHOCK: "TallyBillShock",
}
_FIRST_RETRY = timedelta(minutes=1)
_LAST_RETRY = timedelta(hours=1)


@dataclass
class DeliveryReport:
    """One `deliver_pending` run: ids of the deliveries sent, failed for now, given up on."""

    sent: list[int] = field(default_factory=list)
    retrying: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def deliver_pending(*, now: datetime, limit: int = 500) -> DeliveryReport:
    """Send the pending notifications due at `now` (oldest first, at most `limit`).

    A firing notification of an alert snoozed at `now` waits; resolved ones never do. Never
    raises for a receiver's failure: it is recorded on the delivery.
    """
    report = DeliveryReport()
    # A firing notification's alert is not snoozed at `now`.
    unsnoozed = (
        Q(event=AlertState.RESOLVED)
        | Q(alert__snoozed_until__isnull=True)
        | Q(alert__snoozed_until__lte=now)
    )
    due = list(
        AlertDelivery.objects.filter(state=DeliveryState.PENDING, next_attempt_at__lte=now)
        .filter(unsnoozed)
        .order_by("next_attempt_at", "pk")
        .values_list("pk", flat=True)[:limit]
    )
    broken: set[tuple[str, str]] = set()
    for pk in due:
        with transaction.atomic():
            delivery = (
                AlertDelivery.objects.select_for_update(skip_locked=True, of=("self",))
                .select_related("alert", "alert__team")
                # Again: a snooze committed while this run sent the ones before holds it.
                .filter(unsnoozed, pk=pk, state=DeliveryState.PENDING)
                .first()
            )
            if delivery is None:
                continue  # another run has it, or sent it
            if (delivery.channel, delivery.target) in broken:
                continue
            _attempt(delivery, now=now, report=report, broken=broken)
    return report


def _attempt(
    delivery: AlertDelivery,
    *,
    now: datetime,
    report: DeliveryReport,
    broken: set[tuple[str, str]],
) -> None:
    delivery.attempts += 1  # the row is locked: no other run counts meanwhile
    try:
        if delivery.channel == EMAIL:
            detail = _send_email(delivery.alert, delivery.event)
        elif delivery.channel == WEBHOOK:
            detail = _post_webhook(delivery.target, delivery.alert, delivery.event)
        else:
            raise ValueError(f"unknown channel {delivery.channel!r}")
    except (OSError, http.client.HTTPException, ValueError) as exc:
        broken.add((delivery.channel, delivery.target))
        attempts = delivery.attempts
        delivery.detail = f"attempt {attempts}: {type(exc).__name__}: {exc}"[:2000]
        if attempts >= settings.TALLY_ALERT_DELIVERY_ATTEMPTS:
            delivery.state = DeliveryState.FAILED
            report.failed.append(delivery.pk)
        else:
            delivery.next_attempt_at = now + min(_FIRST_RETRY * 2 ** (attempts - 1), _LAST_RETRY)
            report.retrying.append(delivery.pk)
        logger.warning(
            "alert notification %s (%s to %s) failed: %s",
            delivery.pk,
            delivery.channel,
            delivery.target or "recipients",
            delivery.detail,
        )
        delivery.save(update_fields=["attempts", "detail", "state", "next_attempt_at"])
        return
    if detail is None:
        delivery.state = DeliveryState.SKIPPED
        delivery.detail = "no recipient has an email address"
        report.skipped.append(delivery.pk)
    else:
        delivery.state = DeliveryState.SENT
        delivery.sent_at = now
        delivery.detail = detail[:2000]
        report.sent.append(delivery.pk)
    delivery.save(update_fields=["attempts", "detail", "state", "sent_at"])


def _send_email(alert: Alert, event: str) -> str | None:
    """Send the alert's email; the addresses it went to, or None when it has none."""
    addresses = recipient_addresses(alert.recipients)
    if not addresses:
        return None
    subject, body = email_content(alert, event)
    EmailMessage(
        subject=subject,
        body=body,
        from_email=settings.DEFAULT_FROM_EMAIL,
        to=addresses,
    ).send()
    return "to " + ", ".join(addresses)


def email_content(alert: Alert, event: str) -> tuple[str, str]:
    """The subject and plain-text body of `alert`'s email for `event` (firing or resolved)."""
    state = "RESOLVED" if event == AlertState.RESOLVED else "FIRING"
    subject = f"[Tally] {state}: {alert.subject}"
    lines = [alert.subject, ""]
    if alert.description:
        lines += [alert.description, ""]
    lines.append(f"Since: {_iso(alert.first_seen)}")
    if event == AlertState.RESOLVED and alert.resolved_at is not None:
        lines.append(f"Resolved: {_iso(alert.resolved_at)}")
    if alert.team is not None:
        lines.append(f"Team: {alert.team.slug}")
    lines += ["", "Labels:"]
    lines += [f"  {name}: {value}" for name, value in sorted(_labels(alert).items())]
    lines += [
        "",
        f'Snooze it: POST /api/v1/alerts/{alert.pk}/snooze/ {{"hours": 24}} (the team\'s '
        "leads and operators), or in Tally's admin under Alerts.",
    ]
    return subject[:250], "\n".join(lines) + "\n"


def _post_webhook(url: str, alert: Alert, event: str) -> str:
    body = json.dumps(alertmanager_payload(alert, event)).encode()
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    # The URLs are the operator's own (http or https, checked at start).
    with urllib.request.urlopen(
        request, timeout=settings.TALLY_ALERT_WEBHOOK_TIMEOUT_SECONDS
    ) as response:
        return f"HTTP {response.status} from {url}"


def _labels(alert: Alert) -> dict[str, str]:
    labels = {str(name): str(value) for name, value in (alert.labels or {}).items()}
    labels["alertname"] = ALERT_NAMES.get(AlertKind(alert.kind), alert.kind)
    labels["severity"] = labels.get("severity", "warning")
    if alert.team is not None:
        labels["team"] = alert.team.slug
    labels["tally_key"] = alert.key
    return labels


def fingerprint(labels: dict[str, str]) -> str:
    """A stable 16-hex-digit hash of a label set, as Alertmanager's fingerprints are."""
    text = "\xff".join(f"{name}\xff{value}" for name, value in sorted(labels.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def alertmanager_payload(alert: Alert, event: str) -> dict[str, Any]:
    """Alertmanager's webhook payload (version 4) for `alert`'s `event`, the alert alone."""
    labels = _labels(alert)
    status = "resolved" if event == AlertState.RESOLVED else "firing"
    annotations = {"summary": alert.subject}
    if alert.description:
        annotations["description"] = alert.description
    ends = (
        _iso(alert.resolved_at)
        if status == "resolved" and alert.resolved_at is not None
        else ZERO_TIME
    )
    group_labels = {"alertname": labels["alertname"]}
    return {
        "version": "4",
        "groupKey": "{}:" + _label_text({"alertname": labels["alertname"], "tally_key": alert.key}),
        "truncatedAlerts": 0,
        "status": status,
        "receiver": RECEIVER,
        "groupLabels": group_labels,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": _portal(),
        "alerts": [
            {
                "status": status,
                "labels": labels,
                "annotations": annotations,
                "startsAt": _iso(alert.first_seen),
                "endsAt": ends,
                "generatorURL": _alert_page(alert),
                "fingerprint": fingerprint(labels),
            }
        ],
    }


def _portal() -> str:
    """The portal's public URL (TALLY_PORTAL_URL), "" when not set."""
    return str(settings.TALLY_PORTAL_URL).rstrip("/")


def _alert_page(alert: Alert) -> str:
    """Where to look at what the alert is about: its team's page in the portal, else the
    portal; "" without TALLY_PORTAL_URL."""
    base = _portal()
    team = alert.team
    if not base or team is None:
        return base
    try:
        return base + reverse("team", args=[team.slug])
    except NoReverseMatch:
        return base


def _label_text(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f"{name}={json.dumps(value)}" for name, value in labels.items()) + "}"


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")
