"""`manage.py ingest_samples PATH`: load samples from a JSON-lines file, as the agents send them."""

from __future__ import annotations

import heapq
import json
import sys
from argparse import RawDescriptionHelpFormatter
from collections import Counter, defaultdict
from typing import Any, NamedTuple, TextIO

from django.core.management.base import (
    BaseCommand,
    CommandError,
    CommandParser,
    DjangoHelpFormatter,
)
from django.utils import timezone

from metering.ingest import (
    IngestReport,
    InvalidSample,
    SampleRow,
    Window,
    check_sample,
    ingest,
    inventory_nodes,
    json_type,
    named_device,
    sample_window,
)

BATCH_LINES = 10_000
MAX_NODE_LENGTH = 253
SHOWN_REJECTIONS = 20

EPILOG = """\
Each line is one sample object, as the agent sends it in "samples":

  {"uuid": "GPU-8a1c2f4e-...", "ts": "2026-11-30T12:00:00Z", "gpu_util": 37.5,
   "mem_used_bytes": 21474836480}

  uuid            the device's UUID (a MIG device's own), as the inventory knows it;
                  or, instead, "driver" and "device": the device's driver and its name
                  in the ResourceSlice (and "pool" where one node has several), or
                  "driver", "pci_bus_id" and, for a partition, "partition", on the
                  line's node, resolved through the inventory to its meter id
  ts              ISO 8601 with a timezone, at most TALLY_INGEST_MAX_AGE_DAYS old and
                  TALLY_INGEST_MAX_SKEW_SECONDS ahead
  gpu_util        0 to 100, or null (optional)
  mem_used_bytes  an integer, or null (optional)
  processes       a list of objects (optional)
  node            the device's node (optional)
  parent_uuid, gpu_instance_id
                  a MIG device's GPU and GPU instance id (optional), as the agent
                  sends them: recorded as an agent's are, under the node the
                  inventory puts the GPU on (a device set aside: once adopted), so
                  that DCGM's MIG series of a backfilled day find their device

The node is the inventory's: a "node" on the line (else --node), when given, must agree
with it. A device the inventory does not know is rejected, unless a node is given: then its
samples are kept aside until the sync learns it. The first 20 rejected lines are listed with
their line numbers and reasons, then a count per reason.
"""


class _HelpFormatter(DjangoHelpFormatter, RawDescriptionHelpFormatter):
    """Django's order of options; the description and the line format as written."""


class _Line(NamedTuple):
    """A valid line waiting for its node: its number, the node it gave ("" none), the sample."""

    number: int
    node: str
    row: SampleRow


class Rejections:
    """Rejected lines: how many per reason, and the first few by line number."""

    def __init__(self) -> None:
        self.per_reason: Counter[str] = Counter()
        self._first: list[tuple[int, str]] = []

    def add(self, number: int, label: str, message: str) -> None:
        self.per_reason[label] += 1
        self._first.append((number, message))
        if len(self._first) > 10 * SHOWN_REJECTIONS:
            self._first = heapq.nsmallest(SHOWN_REJECTIONS, self._first)

    @property
    def count(self) -> int:
        return self.per_reason.total()

    def first(self) -> list[tuple[int, str]]:
        return heapq.nsmallest(SHOWN_REJECTIONS, self._first)


class Command(BaseCommand):
    help = (
        "Load utilisation samples from a JSON-lines file (one sample object per line),\n"
        "through the same validation and storage as POST /ingest/samples, in transactions\n"
        "of 10,000 lines. Rejected lines are summarised and the rest is loaded; the exit\n"
        "status is then 1."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("epilog", EPILOG)
        return super().create_parser(prog_name, subcommand, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("path", help="The JSON-lines file, or - for standard input.")
        parser.add_argument(
            "--node",
            default="",
            help='The node of lines that carry no "node" of their own; it must agree with '
            "the inventory (default: the inventory's).",
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
        if rejected.count:
            for number, message in rejected.first():
                self.stderr.write(f"line {number}: {message}")
            if rejected.count > SHOWN_REJECTIONS:
                self.stderr.write(f"... and {rejected.count - SHOWN_REJECTIONS:,} more")
            self.stderr.write(
                "rejected lines by reason: "
                + ", ".join(
                    f"{label} {count:,}" for label, count in rejected.per_reason.most_common()
                )
            )
        unknown = totals.unknown_devices
        self.stdout.write(
            f"{path}: {totals.accepted} accepted, {totals.duplicates} duplicates, "
            f"{rejected.count} rejected; {len(totals.hours)} hours marked for rollup"
            + (
                f"; {len(unknown)} unknown devices kept aside: {', '.join(unknown)}"
                if unknown
                else ""
            )
        )
        if rejected.count:
            raise CommandError(
                f"{rejected.count} lines rejected (summarised above); the rest was loaded"
            )

    def _load(self, lines: TextIO, *, default_node: str) -> tuple[IngestReport, Rejections]:
        """Validate and store `lines`; the totals, and the lines rejected."""
        totals = IngestReport()
        rejected = Rejections()
        pending: list[_Line] = []
        window = sample_window()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                node, row = _parse(line, default_node=default_node, window=window)
            except InvalidSample as exc:
                rejected.add(number, exc.label, str(exc))
                continue
            pending.append(_Line(number, node, row))
            if len(pending) >= BATCH_LINES:
                _flush(pending, totals, rejected)
                pending.clear()
                window = sample_window()
        _flush(pending, totals, rejected)
        totals.unknown_devices = sorted(set(totals.unknown_devices))
        return totals, rejected


def _parse(line: str, *, default_node: str, window: Window) -> tuple[str, SampleRow]:
    """The node a line gives ("" none) and its sample, or `InvalidSample`."""
    try:
        sample = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidSample("", f"not JSON: {exc}", label="json") from None
    node = sample.pop("node", default_node) if isinstance(sample, dict) else default_node
    if not isinstance(node, str):
        raise InvalidSample("node", f"must be a string, not {json_type(node)}")
    if len(node) > MAX_NODE_LENGTH or not node.isprintable():
        raise InvalidSample("node", f"must be printable, at most {MAX_NODE_LENGTH} characters")
    return node, check_sample(sample, window=window)


def _flush(pending: list[_Line], totals: IngestReport, rejected: Rejections) -> None:
    """Store `pending` under the nodes the inventory puts their devices on; lines whose node
    disagrees with it, or whose unknown device has no node given, are rejected."""
    if not pending:
        return
    places = inventory_nodes(
        {line.row.device_uuid for line in pending if named_device(line.row.device_uuid) is None}
    )
    batch: dict[str, list[SampleRow]] = defaultdict(list)
    numbers: dict[str, list[int]] = defaultdict(list)
    for line in pending:
        uuid = line.row.device_uuid
        nodes = places.get(uuid)
        if named_device(uuid) is not None:
            # Named by driver and device: `ingest` resolves it on the line's node.
            if line.node:
                batch[line.node].append(line.row)
                numbers[line.node].append(line.number)
            else:
                rejected.add(
                    line.number,
                    "node",
                    "node: a device named by driver and device needs its node (--node, or "
                    '"node" on the line)',
                )
            continue
        if nodes is None and not line.node:
            rejected.add(
                line.number,
                "unknown_device",
                f"uuid: device {uuid} is not in the inventory; run sync_inventory first, or "
                'give its node (--node, or "node" on the line) to keep its samples aside '
                "until the sync learns it",
            )
        elif nodes and line.node and line.node not in nodes:
            rejected.add(
                line.number,
                "node",
                f"node: {line.node!r}, but the inventory puts device {uuid} on "
                f"{', '.join(map(repr, sorted(nodes)))}",
            )
        elif nodes and not line.node and len(nodes) > 1:
            rejected.add(
                line.number,
                "node",
                f"node: the inventory puts device {uuid} on several nodes "
                f"({', '.join(map(repr, sorted(nodes)))}); give its node on the line or with "
                "--node",
            )
        else:
            # A device on no node (a cluster's own) is stored under the node given, if any.
            node = line.node or (min(nodes) if nodes else "")
            batch[node].append(line.row)
            numbers[node].append(line.number)
    received_at = timezone.now()
    for node, rows in batch.items():
        report = ingest(node=node, samples=rows, received_at=received_at)
        for refusal in report.refused:
            rejected.add(
                numbers[node][refusal.position], refusal.label, f"{refusal.field}: {refusal.reason}"
            )
        totals.accepted += report.accepted
        totals.duplicates += report.duplicates
        totals.hours |= report.hours
        totals.unknown_devices.extend(report.unknown_devices)
