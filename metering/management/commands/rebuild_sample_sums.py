"""`manage.py rebuild_sample_sums [--dry-run]`: make the per device-hour sums again under the
hold TALLY_SAMPLE_HOLD_SECONDS says now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from metering.hoursums import RebuildBusy, rebuild_sums


class Command(BaseCommand):
    help = (
        "Make the per device-hour sums the rollup reads (metering.hoursums) again from every "
        "sample stored, under the hold TALLY_SAMPLE_HOLD_SECONDS gives now, and record it. "
        "Needed after the hold is changed: until then the rollup scans the samples (right, "
        "slower) and logs a warning. Writers of samples (ingest, compaction, retention) wait "
        "while it runs; readers do not. Safe to run again."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Say which hold the sums are made with and which they would be, change nothing.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            report = rebuild_sums(dry_run=options["dry_run"])
        except RebuildBusy as error:
            raise CommandError(f"sums not made again: {error}") from error
        recorded = (
            "no hold recorded"
            if report.recorded_hold_ms is None
            else f"made under {report.recorded_hold_ms} ms"
        )
        if report.rows_after is None:
            verdict = (
                "up to date"
                if report.recorded_hold_ms == report.hold_ms
                else "the rollup scans samples meanwhile"
            )
            self.stdout.write(
                f"sums: {report.rows_before} row(s), {recorded}; would make them again under "
                f"{report.hold_ms} ms ({verdict})"
            )
            return
        self.stdout.write(
            f"sums: {report.rows_before} row(s) {recorded}, made again under {report.hold_ms} ms: "
            f"{report.rows_after} row(s)"
        )
