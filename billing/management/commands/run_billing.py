"""`manage.py run_billing --period 2026-11 [--close]`: roll up a period and price it.

What Celery beat does bit by bit (rollups every few minutes, the close on
TALLY_CLOSE_PERIOD_DAY), done at once for one period: for a first run after loading history,
a catch-up after an outage, or closing by hand.
"""

from __future__ import annotations

import getpass
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing import periods, pricing, services
from billing.models import Period
from metering.prometheus import EngineUnavailable


def default_actor() -> str:
    """Who closes the period, as the period records it: this command and the OS user."""
    try:
        return f"run_billing ({getpass.getuser()})"
    except (KeyError, OSError):  # a container's uid with no passwd entry
        return "run_billing"


class Command(BaseCommand):
    help = (
        "Bill one period: adopt samples set aside whose devices are now known, roll up every "
        "hour of the period up to now and the hours marked for rollup, and recompute the "
        "period's statements; with --close, freeze them. Rerunning it changes nothing."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--period",
            required=True,
            help="The period: a month as 2026-11, or an ISO week as 2026-W47 when "
            "TALLY_BILLING_PERIOD=week.",
        )
        parser.add_argument(
            "--close",
            action="store_true",
            help="Then close the period: its statements never change again, and data that "
            "arrives for it later is billed as adjustments in the next open period.",
        )
        parser.add_argument(
            "--actor",
            default=None,
            help="Who closes the period, as recorded (default: run_billing and the OS user).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        now = timezone.now()
        try:
            start, _ = periods.parse_period(options["period"])
            run = services.bill_period(
                period_start=start,
                now=now,
                close=options["close"],
                actor=options["actor"] or default_actor(),
            )
        except periods.PricingError as exc:
            raise CommandError(str(exc)) from exc
        except EngineUnavailable as exc:
            # Nothing billed wrong: the hours it could not measure stay marked for a rerun.
            raise CommandError(
                f"the metrics engine did not answer, so some hours were not rolled up and the "
                f"statements were not refreshed; run again when it answers ({exc})"
            ) from exc
        self._summarise(run, verbosity=options["verbosity"])

    def _summarise(self, run: services.BillingRun, *, verbosity: int) -> None:
        period = run.period
        label = period.label
        self.stdout.write(
            f"Period {label} ({period.start:%Y-%m-%d %H:%M}..{period.end:%Y-%m-%d %H:%M} UTC): "
            f"{run.period_hours} hours rolled up ({run.usage_rows} usage rows), "
            f"{run.marked_hours} marked hours, {run.adopted_samples} samples adopted"
        )
        if verbosity > 1:
            for statement in sorted(run.statements, key=lambda s: (s.team.slug, s.currency)):
                total = pricing.round_money(statement.total, statement.currency)
                self.stdout.write(f"  {statement.team.slug}: {total} {statement.currency}")
        totals = "; ".join(
            f"{pricing.round_money(total, currency)} {currency}"
            for currency, total in run.totals.items()
        )
        teams = len({statement.team_id for statement in run.statements})
        self.stdout.write(
            f"{_count(len(run.statements), 'statement')} for {_count(teams, 'team')}; "
            f"total {totals or 'nothing'}"
        )
        if run.closed:
            period.refresh_from_db()
            assert period.closed_at is not None
            self.stdout.write(
                f"Closed {label} at {period.closed_at:%Y-%m-%d %H:%M} UTC by {period.closed_by}: "
                "its statements are frozen."
            )
        else:
            self.stdout.write(_open_note(period, now=timezone.now()))


def _open_note(period: Period, *, now: datetime) -> str:
    """What becomes of a period left open: beat closes an ended one when its close is due."""
    if period.end > now:
        return (
            f"Period {period.label} is open: its statements change as data arrives until it "
            "is closed."
        )
    due = services.close_due_at(period.end)
    if due is None:
        when = "beat does not close periods (TALLY_CLOSE_PERIOD_DAY=0)"
    elif due <= now:
        when = "Celery beat closes it on its next hourly run"
    else:
        when = f"Celery beat closes it on {due:%Y-%m-%d %H:%M} UTC (TALLY_CLOSE_PERIOD_DAY)"
    return (
        f"Period {period.label} has ended but is open: {when}; to close it now, run "
        f"`python manage.py run_billing --period {period.label} --close`."
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
