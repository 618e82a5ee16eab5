"""`manage.py compact_samples [--dry-run] [--limit N]`: compact closed days' samples now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from metering.compaction import compact_samples


class Command(BaseCommand):
    help = (
        "Compact the samples of each day older than TALLY_SAMPLE_COMPACT_AFTER_DAYS into one "
        "row of arrays per device and day (metering.compaction), oldest day first, and give "
        "the day partitions' space back. What beat's metering.tasks.compact_samples runs "
        "hourly; idempotent, and safe to interrupt and run again. The rollup, statements and "
        "every report read compacted days as before."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the samples each day would move, and change nothing.",
        )
        parser.add_argument(
            "--limit",
            type=int,
            default=None,
            help="At most this many days with samples to move (default: every one).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        limit = options["limit"]
        if limit is not None and limit < 1:
            raise CommandError(f"--limit must be at least 1, not {limit}")
        report = compact_samples(dry_run=options["dry_run"], limit=limit)
        verb = "would move" if options["dry_run"] else "moved"
        for day, count in sorted(report.partitioned.items()):
            self.stdout.write(
                f"{day}: {count} sample(s) in the DEFAULT partition "
                + ("would be given" if options["dry_run"] else "given")
                + " their day's partition, to be compacted there"
            )
        for day, moved in sorted(report.moved.items()):
            blocks = "" if options["dry_run"] else f" into {report.blocks[day]} block(s)"
            self.stdout.write(f"{day}: {verb} {moved} sample(s){blocks}")
        if report.default_rewritten:
            self.stdout.write("DEFAULT partition: the space of the rows moved out given back")
        if report.default_busy:
            self.stdout.write("DEFAULT partition busy, its space is given back on the next run")
        for day in report.busy:
            self.stdout.write(f"{day}: partition busy, its space is given back on the next run")
        if not (report.moved or report.partitioned or report.default_rewritten):
            self.stdout.write("nothing to compact")
