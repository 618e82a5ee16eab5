"""`manage.py apply_policy PATH`: make teams, namespaces, members, quota rules, budgets and rate
cards match a file."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from quota.policy import PolicyError, apply_policy, load_policy


class Command(BaseCommand):
    help = (
        "Apply a quota policy file (YAML; see docs/policy.example.yaml): create and update the "
        "teams, namespaces, memberships, quota rules, budgets and rate cards it declares, in "
        "one audited transaction. Nothing is deleted without --prune, and no closed billing "
        "period is priced differently."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="The policy file, or - for standard input.")
        parser.add_argument(
            "--prune",
            action="store_true",
            help="Also delete the teams, namespaces, memberships, rules and budgets the file "
            "does not declare, and the rate cards when it has a `rates:` list.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Report what would change; write nothing."
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="Apply a versions section even where it makes more than half of a model's "
            "nodes in a cluster outliers (refused without it).",
        )
        parser.add_argument(
            "--actor",
            default="apply_policy",
            help="Who the audit trail names for these changes (default: apply_policy).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = options["path"]
        try:
            if path == "-":
                text = sys.stdin.read()
            else:
                with open(path, encoding="utf-8") as file:
                    text = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}") from exc
        try:
            policy = load_policy(text)
            report = apply_policy(
                policy=policy,
                prune=options["prune"],
                actor=options["actor"],
                dry_run=options["dry_run"],
                force=options["force"],
            )
        except PolicyError as exc:
            raise CommandError(
                f"{path}: {len(exc.errors)} error(s), nothing applied:\n"
                + "\n".join(f"  {error}" for error in exc.errors)
            ) from exc
        for note in report.notes:
            self.stdout.write(note)
        for change in report.changes:
            self.stdout.write(change)
        prefix = "dry run, nothing written: " if report.dry_run else ""
        self.stdout.write(self.style.SUCCESS(f"{prefix}{report.summary()}"))
