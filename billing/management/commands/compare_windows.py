"""`manage.py compare_windows (--team SLUG | --fleet) --before START END --after START END
[--unit gpu] [--format table|json|csv]`.

Did it help? The utilisation (utilised over measured hours) of a team or of the fleet in two
windows, and its change split into workload mix, the jobs' own efficiency, and jobs entering
and leaving (`billing.compare`). START and END are UTC dates or whole UTC hours, END
exclusive. Reads usage as rolled up; writes nothing.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from billing.compare import (
    PART_NAMES,
    ROW_COLUMNS,
    Comparison,
    compare_windows,
    job_rows,
    parse_unit,
    parse_window,
    summary,
    total_row,
)
from inventory.models import Unit
from metering.moments import MOMENT_HELP
from teams.api import write_csv
from teams.models import Team

PLACES = 4
TABLE_PLACES = 2
PART_LABELS = {
    "mix": "workload mix (jobs in both)",
    "efficiency": "jobs' own efficiency",
    "entering": "jobs entering",
    "leaving": "jobs leaving",
}


def _text(value: Any) -> str:
    """A figure for the table and the CSV: decimals as written, none as empty."""
    if value is None:
        return ""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _signed(value: Any) -> str:
    """Points with their sign, zero without one."""
    if value is None:
        return "n/a"
    return f"{value:+f}" if value else f"{value:f}"


class Command(BaseCommand):
    help = (
        "Compare a team's (or the fleet's) utilisation in two windows: the change split into "
        "workload mix, the jobs' own efficiency, and jobs entering and leaving, per job."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        scope = parser.add_mutually_exclusive_group(required=True)
        scope.add_argument("--team", help="The team's slug.")
        scope.add_argument(
            "--fleet", action="store_true", help="Every team, and namespaces of no team."
        )
        for side in ("before", "after"):
            parser.add_argument(
                f"--{side}",
                nargs=2,
                required=True,
                metavar=("START", "END"),
                help=f"The {side} window [START, END): each {MOMENT_HELP}.",
            )
        parser.add_argument(
            "--unit",
            default=Unit.GPU,
            help=f"Hours of which unit ({', '.join(Unit.values)}; default gpu).",
        )
        parser.add_argument(
            "--format",
            choices=("table", "json", "csv"),
            default="table",
            help="table (default): to read; json: one object, decimals as strings; csv: one "
            "row per job, the whole scope first.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        team = None
        if options["team"] is not None:
            team = Team.objects.filter(slug=options["team"]).first()
            if team is None:
                raise CommandError(f"--team: no team {options['team']!r}.")
        windows = {}
        for side in ("before", "after"):
            try:
                windows[side] = parse_window(*options[side])
            except ValueError as exc:
                raise CommandError(f"--{side}: {exc}") from None
        try:
            unit = parse_unit(options["unit"])
        except ValueError as exc:
            raise CommandError(f"--unit: {exc}") from None
        comparison = compare_windows(
            team=team, before=windows["before"], after=windows["after"], unit=unit
        )
        if options["format"] == "json":
            body = {**summary(comparison, PLACES), "results": job_rows(comparison, PLACES)}
            self.stdout.write(json.dumps(body, default=_text, indent=2))
        elif options["format"] == "csv":
            rows = [total_row(comparison, PLACES), *job_rows(comparison, PLACES)]
            write_csv(
                self.stdout,
                columns=ROW_COLUMNS,
                rows=([_text(row[column]) for column in ROW_COLUMNS] for row in rows),
            )
        else:
            self._table(comparison)

    def _table(self, comparison: Comparison) -> None:
        head = summary(comparison, TABLE_PLACES)
        out = self.stdout
        out.write(f"{comparison.scope}: utilisation of {head['hours_label']} (utilised / measured)")
        for side in ("before", "after"):
            window = head[side]
            ratio = window["utilisation_pct"]
            out.write(
                f"  {side:<6} {getattr(comparison, f'{side}_window')}  "
                f"{'n/a' if ratio is None else f'{ratio}%':>8}  "
                f"allocated {window['allocated_hours']:.2f} h, "
                f"measured {window['measured_hours']:.2f} h, "
                f"unmeasured {window['unmeasured_hours']:.2f} h (left out)"
            )
        if head["change_pp"] is None:
            out.write("  No change to split: a window has no measured hours.")
            return
        out.write(f"  {'change':<30} {_signed(head['change_pp']):>9} points, of which")
        for name in PART_NAMES:
            out.write(f"    {PART_LABELS[name]:<28} {_signed(head['parts_pp'][name]):>9}")
        rows = job_rows(comparison, TABLE_PLACES)
        if not rows:
            return
        width = max(len(_job(row)) for row in rows)
        out.write("")
        out.write(
            f"  {'job':<{width}}  {'kind':<10} {'before %':>9} {'after %':>9} "
            f"{'mix':>8} {'effic.':>8} {'in/out':>8} {'total':>8}"
        )
        for row in rows:
            moved = row["entering_pp"] + row["leaving_pp"]
            out.write(
                f"  {_job(row):<{width}}  {row['kind']:<10} "
                f"{_text(row['before_utilisation_pct']) or '-':>9} "
                f"{_text(row['after_utilisation_pct']) or '-':>9} "
                f"{_signed(row['mix_pp']):>8} {_signed(row['efficiency_pp']):>8} "
                f"{_signed(moved):>8} {_signed(row['change_pp']):>8}"
            )


def _job(row: dict[str, Any]) -> str:
    team = f"{row['team']}:" if row["team"] else ""
    return f"{team}{row['namespace']}/{row['job'] or 'claim ' + row['claim']}"
