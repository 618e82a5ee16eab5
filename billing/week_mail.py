"""The week report by email to a team's leads, sent once per team and week.

Sending is at most once and, barring a crash between the mail server's acceptance and the
commit, exactly once: the `WeekReport` row of (team, week) is inserted (`ON CONFLICT DO
NOTHING`: a racing insert waits for the first transaction, then does nothing) and locked
`FOR UPDATE` before the email goes, and marked sent in the same transaction. A second run, or
a second worker, waits for the lock and then finds it sent. An email that fails rolls the
row back, so the next run tries again.
"""

from __future__ import annotations

import io
import logging
from datetime import datetime

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import transaction
from django.template.loader import render_to_string
from django.urls import reverse

from billing.models import WeekReport
from billing.week import (
    WEEK_CSV_COLUMNS,
    TeamWeek,
    WeekError,
    week_csv_rows,
)
from teams.api import write_csv
from teams.models import Membership, Role, Team

log = logging.getLogger(__name__)


def lead_emails(team: Team) -> list[str]:
    """The addresses of the team's active leads that have one, sorted, each once."""
    return sorted(
        set(
            Membership.objects.filter(team=team, role=Role.LEAD, user__is_active=True)
            .exclude(user__email="")
            .values_list("user__email", flat=True)
        )
    )


def already_sent(team: Team, start: datetime) -> bool:
    return WeekReport.objects.filter(team=team, week_start=start, sent_at__isnull=False).exists()


def week_page_url(report: TeamWeek) -> str:
    """The report's page in the portal, absolute with TALLY_PORTAL_URL; empty without it."""
    base = str(settings.TALLY_PORTAL_URL).rstrip("/")
    if not base:
        return ""
    path = reverse("team-week", kwargs={"slug": report.team.slug})
    return f"{base}{path}?start={report.start.date().isoformat()}"


def week_message(report: TeamWeek, recipients: list[str]) -> EmailMessage:
    """The email: the report as text, and its CSV attached."""
    subject = f"Tally week report: {report.team.name}, {report.start:%Y-%m-%d} to {report.last_day}"
    body = render_to_string(
        "billing/week_report.txt",
        {"report": report, "url": week_page_url(report)},
    )
    message = EmailMessage(subject=subject, body=body, to=recipients)
    csv_text = io.StringIO()
    write_csv(csv_text, columns=WEEK_CSV_COLUMNS, rows=week_csv_rows(report))
    message.attach(
        f"tally-{report.team.slug}-week-{report.start:%Y-%m-%d}.csv",
        csv_text.getvalue(),
        "text/csv",
    )
    return message


def send_week_report(*, report: TeamWeek, now: datetime) -> WeekReport | None:
    """Email a complete week's report to the team's leads, unless it was sent before; the
    row recorded, or None when nothing was sent (already sent, or no lead has an address).
    A week that has not ended is a `WeekError`."""
    if not report.complete:
        raise WeekError(
            f"the week from {report.start:%Y-%m-%d} ends {report.end:%Y-%m-%d %H:%M} UTC; "
            "a week report is sent once the week is over"
        )
    recipients = lead_emails(report.team)
    if not recipients:
        log.info("week report of %s not sent: no lead has an email address", report.team.slug)
        return None
    with transaction.atomic():
        WeekReport.objects.bulk_create(
            [WeekReport(team=report.team, week_start=report.start)], ignore_conflicts=True
        )
        row = WeekReport.objects.select_for_update().get(team=report.team, week_start=report.start)
        if row.sent_at is not None:
            return None
        week_message(report, recipients).send()
        row.sent_at, row.recipients = now, recipients
        row.save(update_fields=["sent_at", "recipients"])
    log.info("week report of %s sent to %d leads", report.team.slug, len(recipients))
    return row
