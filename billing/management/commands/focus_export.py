"""`manage.py focus_export --period 2026-11 [--format csv|json] [--team SLUG]`.

Writes the FOCUS 1.2 export of a period (`billing.focus`) to standard output: the same rows
as `/api/v1/billed/focus/`, CSV (the default, with the column header) or a JSON list.
Nothing is computed into the statements or written.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing import periods
from billing.focus import focus_rows
from billing.focus_columns import COLUMN_NAMES
from teams.api import write_csv
from teams.models import Team


class Command(BaseCommand):
    help = (
        "Write a period's FOCUS 1.2 export (what the statements bill, one row per team, "
        "model, day and job of usage and one per adjustment) as CSV or JSON."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--period",
            required=True,
            help="A month as 2026-11, or an ISO week as 2026-W47 when TALLY_BILLING_PERIOD=week.",
        )
        parser.add_argument("--format", choices=("csv", "json"), default="csv")
        parser.add_argument("--team", help="Only this team (its slug).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            start, end = periods.parse_period(options["period"])
        except periods.PricingError as exc:
            raise CommandError(str(exc)) from exc
        teams = Team.objects.order_by("slug")
        if options["team"]:
            teams = teams.filter(slug=options["team"])
            if not teams.exists():
                raise CommandError(f"no team {options['team']!r}")
        rows = focus_rows(teams=list(teams), since=start, until=end)
        if options["format"] == "json":
            self.stdout.write(json.dumps(rows, indent=2))
            return
        write_csv(
            self.stdout,
            columns=COLUMN_NAMES,
            rows=([row[name] for name in COLUMN_NAMES] for row in rows),
        )
