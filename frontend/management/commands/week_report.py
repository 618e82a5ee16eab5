"""`manage.py week_report --team vision [--week 2026-W47 | --start DAY [--end DAY]]
[--format text|csv|json]`: a team's week report on standard output (issue 35, item 9), the
one the portal shows and the leads' email holds (`frontend.week.week_report`, over
`billing.week.team_week`): text as the email's body, CSV as its attachment, or JSON.

A week is seven days from its start: `--week` names an ISO week (its Monday), `--start` any
day, and `--end`, if given, must be seven days after it (the window read by
`billing.windows`, so a reversed or empty one is refused as the API refuses it). Without
either, the last complete ISO week. Bad input exits 2 with one line naming the option.
"""

from __future__ import annotations

import io
import json
import re
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.template.loader import render_to_string
from django.utils import timezone

from billing import week
from billing.windows import WindowError, parse_window
from frontend.week import week_report
from teams.api import write_csv
from teams.models import Team

FORMATS = ("text", "csv", "json")
_WEEK_LABEL = re.compile(r"\d{4}-W\d{2}")


def _bad(message: str) -> CommandError:
    return CommandError(message, returncode=2)


def _plain(value: Any) -> Any:
    """A CSV cell's value as JSON: decimals as exact strings, datetimes in ISO 8601 UTC."""
    if isinstance(value, Decimal):
        return f"{value:f}"
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    return value


def week_json(report: week.TeamWeek) -> dict[str, Any]:
    """The report as one JSON object: the week, then its CSV rows as objects."""
    budget = report.budget
    return {
        "team": report.team.slug,
        "start": _plain(report.start),
        "end": _plain(report.end),
        "complete": report.complete,
        "idle_below_percent": _plain(Decimal(report.idle_below_percent)),
        "budget": None
        if budget is None
        else {name: _plain(value) for name, value in vars(budget).items()},
        "rows": [
            {
                column: _plain(value)
                for column, value in zip(week.WEEK_CSV_COLUMNS, row, strict=True)
            }
            for row in week.week_csv_rows(report)
        ],
    }


class Command(BaseCommand):
    help = "Print a team's week report (text, CSV or JSON)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--team", required=True, help="the team's slug")
        parser.add_argument("--week", help="an ISO week, e.g. 2026-W47 (from its Monday)")
        parser.add_argument("--start", help="the week's first day, YYYY-MM-DD (seven days)")
        parser.add_argument("--end", help="the day after the week, YYYY-MM-DD (start + 7 days)")
        parser.add_argument("--format", choices=FORMATS, default="text", dest="output")

    def handle(self, *args: Any, **options: Any) -> None:
        slug = options["team"]
        # PostgreSQL refuses NUL in text: no such team, rather than a database error.
        team = None if "\x00" in slug else Team.objects.filter(slug=slug).first()
        if team is None:
            raise _bad(f"--team: no team {slug!r}")
        now = timezone.now()
        start = self._start(options, now)
        report = week_report(team=team, start=start, now=now)
        if options["output"] == "json":
            self.stdout.write(json.dumps(week_json(report), indent=2))
        elif options["output"] == "csv":
            out = io.StringIO()
            write_csv(out, columns=week.WEEK_CSV_COLUMNS, rows=week.week_csv_rows(report))
            self.stdout.write(out.getvalue(), ending="")
        else:
            self.stdout.write(render_to_string("billing/week_report.txt", {"report": report}))

    def _start(self, options: dict[str, Any], now: datetime) -> datetime:
        label, start, end = options["week"], options["start"], options["end"]
        if label and (start or end):
            raise _bad("--week: give --week or --start/--end, not both")
        if label and not _WEEK_LABEL.fullmatch(label.strip()):
            raise _bad(f"--week: {label!r} is not an ISO week; give it as 2026-W47")
        if end and not start:
            raise _bad("--end: give --start too")
        try:
            first = week.parse_week_start(label or start, now=now)
        except week.WeekError as exc:
            raise _bad(
                f"--{'week' if label else 'start'}: {str(exc).removeprefix('start: ')}"
            ) from None
        if end:
            try:
                window = parse_window({"start": start, "end": end}, with_period=False)
            except WindowError as exc:
                raise _bad(
                    "; ".join(f"--{name}: {why}" for name, why in exc.errors.items())
                ) from None
            if window.end != first + week.WEEK:
                raise _bad(
                    f"--end: a week report covers seven days: from {first:%Y-%m-%d}, "
                    f"--end is {first + week.WEEK:%Y-%m-%d} (or leave it out)"
                )
        return first
