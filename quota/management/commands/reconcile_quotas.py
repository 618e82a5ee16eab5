"""`manage.py reconcile_quotas [--check]`: recount every quota rule's usage from scratch."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from quota.services import reconcile_usage


class Command(BaseCommand):
    help = (
        "Recount every quota rule's usage from the live reservations and allocations and "
        "report each rule whose stored usage differs (drift), stored against recounted; "
        "without --check, fix it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--check",
            action="store_true",
            help="Report drift and write nothing; exit 1 when a rule has drifted.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        check = options["check"]
        usage = reconcile_usage(at=timezone.now(), fix=not check)
        drifted = [entry for entry in usage if entry.drifted]
        for entry in drifted:
            self.stdout.write(entry.describe())
        rules = f"{len(usage)} quota rule{'' if len(usage) == 1 else 's'}"
        if not drifted:
            self.stdout.write(self.style.SUCCESS(f"{rules} recounted: no drift"))
        elif check:
            raise CommandError(f"drift in {len(drifted)} of {rules}", returncode=1)
        else:
            self.stdout.write(self.style.WARNING(f"drift fixed in {len(drifted)} of {rules}"))
