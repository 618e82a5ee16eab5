"""The week report's page and CSV for a team's leads, the fleet's week heatmap for operators,
and the weekly round that emails each team's last week to its leads.

The figures are `billing.week`'s; this module adds what billing may not import: the team's
budget (`quota.models.Budget`).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from billing import week
from billing.week_mail import already_sent, lead_emails, send_week_report
from frontend import selectors
from frontend.views import csv_attachment, operator_required, team_required
from quota.models import Budget
from teams.models import Team

log = logging.getLogger(__name__)

HEATMAP_NODES_PER_PAGE = 50


def budget_terms(team: Team) -> week.BudgetTerms | None:
    budget = Budget.objects.filter(team=team).first()
    if budget is None:
        return None
    return week.BudgetTerms(gpu_hours=budget.gpu_hours, unit=budget.unit, mode=budget.mode)


def week_report(*, team: Team, start: datetime, now: datetime) -> week.TeamWeek:
    """The team's week from `start`, with its budget. `team` comes from `visible_team` (or
    from the weekly round, which reads every team for its own leads)."""
    return week.team_week(team=team, start=start, now=now, budget=budget_terms(team))


def send_last_week_reports(*, now: datetime) -> list[str]:
    """Email every team's last complete week to its leads, once (`send_week_report`), from
    Monday TALLY_WEEK_REPORT_HOUR:00 UTC on; the slugs of the teams sent to. A team whose
    sending fails does not stop the others; the failures are raised together at the end, so
    the task is retried (teams already sent are skipped then)."""
    start = week.last_complete_week(now)
    if now < start + week.WEEK + timedelta(hours=settings.TALLY_WEEK_REPORT_HOUR):
        return []
    sent, failed = [], []
    for team in Team.objects.order_by("slug"):
        if already_sent(team, start) or not lead_emails(team):
            continue
        try:
            if send_week_report(report=week_report(team=team, start=start, now=now), now=now):
                sent.append(team.slug)
        except Exception:
            log.exception("week report of %s for %s failed", team.slug, start.date())
            failed.append(team.slug)
    if failed:
        raise RuntimeError(f"week reports not sent for: {', '.join(failed)}")
    return sent


def _bad_week(request: HttpRequest, error: week.WeekError, template: str) -> HttpResponse:
    return render(request, template, {"error": str(error)}, status=400)


def _navigation(start: datetime, now: datetime) -> dict[str, Any]:
    """The weeks before and after (none after when it would start in the future)."""
    following = start + week.WEEK
    return {
        "previous_week": (start - week.WEEK).date().isoformat(),
        "next_week": following.date().isoformat() if following <= now else None,
        "this_week": (week.last_complete_week(now) + week.WEEK).date().isoformat(),
    }


@team_required
def team_week(request: HttpRequest, team: Team) -> HttpResponse:
    now = timezone.now()
    try:
        start = week.parse_week_start(request.GET.get("start"), now=now)
    except week.WeekError as error:
        return _bad_week(request, error, "frontend/week.html")
    report = week_report(team=team, start=start, now=now)
    context = {
        "team": team,
        "report": report,
        "several_units": len({row.unit for row in report.totals}) > 1,
        "start_param": start.date().isoformat(),
        **_navigation(start, now),
    }
    return render(request, "frontend/week.html", context)


@team_required
def team_week_csv(request: HttpRequest, team: Team) -> HttpResponse:
    now = timezone.now()
    try:
        start = week.parse_week_start(request.GET.get("start"), now=now)
    except week.WeekError as error:
        return HttpResponse(f"{error}\n", status=400, content_type="text/plain; charset=utf-8")
    report = week_report(team=team, start=start, now=now)
    return csv_attachment(
        f"tally-{team.slug}-week-{start:%Y-%m-%d}.csv",
        week.WEEK_CSV_COLUMNS,
        week.week_csv_rows(report),
    )


def _heat_cells(values: list[Decimal], row: week.HeatRow, hours: list[datetime]) -> list[Any]:
    return [
        {
            "value": value,
            "alpha": f"{row.shade(value, n) / 100:.2f}",
            "title": f"{row.node} {hour:%a %d %H}:00: {value} of {row.capacities[n]}",
        }
        for n, (value, hour) in enumerate(zip(values, hours, strict=True))
    ]


@operator_required
def fleet_week(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    try:
        start = week.parse_week_start(request.GET.get("start"), now=now)
    except week.WeekError as error:
        return _bad_week(request, error, "frontend/fleet_week.html")
    report = week.fleet_week(start=start, now=now, cluster=selectors.fleet_scope())
    page = Paginator(report.rows, HEATMAP_NODES_PER_PAGE).get_page(request.GET.get("page"))
    rows = [
        {
            "row": row,
            "allocated": _heat_cells(row.allocated, row, report.hours),
            "utilised": _heat_cells(row.utilised, row, report.hours),
        }
        for row in page
    ]
    context = {
        "report": report,
        "page": page,
        "rows": rows,
        "metrics": [("allocated", "Allocated"), ("utilised", "Utilised")],
        "start_param": start.date().isoformat(),
        **_navigation(start, now),
    }
    return render(request, "frontend/fleet_week.html", context)


@operator_required
def fleet_week_csv(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    try:
        start = week.parse_week_start(request.GET.get("start"), now=now)
    except week.WeekError as error:
        return HttpResponse(f"{error}\n", status=400, content_type="text/plain; charset=utf-8")
    report = week.fleet_week(start=start, now=now, cluster=selectors.fleet_scope())
    return csv_attachment(
        f"tally-fleet-week-{start:%Y-%m-%d}.csv",
        week.FLEET_CSV_COLUMNS,
        week.fleet_csv_rows(report),
    )
