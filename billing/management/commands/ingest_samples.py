"""`manage.py ingest_samples PATH`: load samples from a JSON-lines file, as the agents send them."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, TextIO

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing.ingest import (
    IngestReport,
    InvalidSample,
    SampleRow,
    check_sample,
    ingest,
    latest_allowed_ms,
)

BATCH_LINES = 10_000
MAX_NODE_LENGTH = 253


class Command(BaseCommand):
    help = (
        "Load utilisation samples from a JSON-lines file (one sample object per line, each "
        'optionally with its own "node"), through the same validation and storage as '
        "POST /ingest/samples, in transactions of 10,000 lines. Rejected lines are listed with "
        "their reasons and the rest is loaded; the exit status is then 1."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="The JSON-lines file, or - for standard input.")
        parser.add_argument(
            "--node", default="", help='The node of lines that carry no "node" of their own.'
        )

    def handle(self, *args: Any, **options: Any) -> None:
        path = options["path"]
        try:
            if path == "-":
                totals, rejected = self._load(sys.stdin, default_node=options["node"])
            else:
                with open(path, encoding="utf-8") as file:
                    totals, rejected = self._load(file, default_node=options["node"])
        except (OSError, UnicodeDecodeError) as exc:
            raise CommandError(f"cannot read {path}: {exc}") from exc
        unknown = totals.unknown_devices
        self.stdout.write(
            f"{path}: {totals.accepted} accepted, {totals.duplicates} duplicates, "
            f"{rejected} rejected; {len(totals.hours)} hours marked for rollup"
            + (
                f"; {len(unknown)} unknown devices kept aside: {', '.join(unknown)}"
                if unknown
                else ""
            )
        )
        if rejected:
            raise CommandError(f"{rejected} lines rejected (listed above); the rest was loaded")

    def _load(self, lines: TextIO, *, default_node: str) -> tuple[IngestReport, int]:
        """Validate and store `lines`; the totals, and how many lines were rejected."""
        totals = IngestReport()
        unknown: set[str] = set()
        rejected = 0
        batch: dict[str, list[SampleRow]] = defaultdict(list)
        in_batch = 0
        latest_ms = latest_allowed_ms()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                node, row = self._parse(line, default_node=default_node, latest_ms=latest_ms)
            except InvalidSample as exc:
                rejected += 1
                self.stderr.write(f"line {number}: {exc}")
                continue
            batch[node].append(row)
            in_batch += 1
            if in_batch >= BATCH_LINES:
                self._flush(batch.items(), totals, unknown)
                batch.clear()
                in_batch = 0
                latest_ms = latest_allowed_ms()
        self._flush(batch.items(), totals, unknown)
        totals.unknown_devices = sorted(unknown)
        return totals, rejected

    @staticmethod
    def _parse(line: str, *, default_node: str, latest_ms: int) -> tuple[str, SampleRow]:
        try:
            sample = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidSample("", f"not JSON: {exc}") from None
        node = sample.pop("node", default_node) if isinstance(sample, dict) else default_node
        if not isinstance(node, str) or not node:
            raise InvalidSample("node", "missing (give it on the line or with --node)")
        if len(node) > MAX_NODE_LENGTH or not node.isprintable():
            raise InvalidSample("node", f"must be printable, at most {MAX_NODE_LENGTH} characters")
        return node, check_sample(sample, latest_ms=latest_ms)

    @staticmethod
    def _flush(
        batch: Iterable[tuple[str, list[SampleRow]]], totals: IngestReport, unknown: set[str]
    ) -> None:
        received_at = timezone.now()
        for node, rows in batch:
            report = ingest(node=node, samples=rows, received_at=received_at)
            totals.accepted += report.accepted
            totals.duplicates += report.duplicates
            totals.hours |= report.hours
            unknown.update(report.unknown_devices)
