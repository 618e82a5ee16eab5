"""`manage.py fleet_report`: capacity, driver versions and fragmentation of the GPU fleet."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from inventory.models import Cluster
from inventory.selectors import fleet_report


class Command(BaseCommand):
    help = (
        "Report the GPU fleet: physical GPUs by model, driver/CUDA versions against the "
        "baseline, outlier nodes and fragmentation."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--format", choices=("table", "json"), default="table")
        parser.add_argument("--cluster", help="Only this cluster (default: all clusters).")

    def handle(self, *args: Any, **options: Any) -> None:
        cluster = None
        if options["cluster"]:
            cluster = Cluster.objects.filter(name=options["cluster"]).first()
            if cluster is None:
                raise CommandError(f"Unknown cluster {options['cluster']!r}")
        report = fleet_report(cluster=cluster)
        if options["format"] == "json":
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self.stdout.write(render_table(report))


def render_table(report: dict[str, Any]) -> str:
    """The report as aligned text, one section per topic."""
    scope = f"cluster {report['cluster']}" if report["cluster"] else "all clusters"
    spread = report["fragmentation"]
    outliers = report["outlier_nodes"]
    partial = report["partial_gpus"]
    sections = [
        f"GPU fleet report: {scope}\n"
        f"Nodes with GPUs: {report['nodes']}    MIG devices: {report['mig_devices']}",
        "Capacity by model\n"
        + _table(
            ("MODEL", "GPUS", "ALLOCATED", "FREE", "MIG DEVICES"),
            [
                (
                    row["product_name"] or "(unknown)",
                    row["gpus"],
                    row["allocated"],
                    row["free"],
                    row["mig_devices"],
                )
                for row in report["capacity"]
            ],
        ),
        "Driver / CUDA versions (* marks the baseline)\n"
        + _table(
            ("", "CLUSTER", "DRIVER", "CUDA", "NODES", "GPUS"),
            [
                (
                    "*" if row["baseline"] else "",
                    row["cluster"],
                    row["driver_version"],
                    row["cuda_driver_version"] or "-",
                    row["nodes"],
                    row["gpus"],
                )
                for row in report["driver_matrix"]
            ],
        )
        + "\n"
        + "\n".join(
            f"Baseline of {name}: {_describe_baseline(baseline)}"
            for name, baseline in report["baselines"].items()
        ),
        f"Outlier nodes ({len(outliers)})"
        + "".join(f"\n  {name}" for name in outliers)
        + ("" if outliers else "\n  none"),
        "Fragmentation\n"
        + _table(
            ("NODES FREE", "PARTIAL", "FULL", "LARGEST FREE BLOCK", "LARGEST FREE CLIQUE BLOCK"),
            [
                (
                    spread["nodes_free"],
                    spread["nodes_partial"],
                    spread["nodes_full"],
                    spread["largest_free_block"],
                    spread["largest_free_clique_block"],
                )
            ],
        ),
        f"Partly used GPUs ({spread['gpus_partial']}, "
        f"{spread['partial_free_share']} GPU-equivalents free)\n"
        + _table(
            ("NODE", "GPU", "MODEL", "HELD", "FREE SLICES"),
            [
                (
                    gpu["node"] or "-",
                    gpu["physical_gpu_key"],
                    gpu["product_name"] or "(unknown)",
                    gpu["held_label"],
                    _describe_free(gpu),
                )
                for gpu in partial
            ],
        ),
    ]
    return "\n\n".join(sections)


def _describe_baseline(baseline: dict[str, str] | None) -> str:
    if baseline is None:
        return "none (no GPU publishes a driver version)"
    how = "set by an operator" if baseline["source"] == "operator" else "most common"
    cuda = baseline["cuda_driver_version"] or "any"
    driver = baseline["driver_version"] or "any"
    return f"driver {driver}, CUDA {cuda} ({how})"


def _describe_free(gpu: dict[str, Any]) -> str:
    parts = [f"{profile}: {count}" for profile, count in gpu["free_slices"].items()]
    if gpu["overlapping_unheld"]:
        # Overlapping partitions: any one may rule out the rest, so only the share is known.
        parts.append(f"{gpu['free_share']} GPU free (partitionable)")
    return ", ".join(parts) or "none"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned."""
    if not rows:
        return "  (none)"
    cells = [[str(value) for value in row] for row in rows]
    widths = [max(len(text) for text in column) for column in zip(headers, *cells, strict=True)]
    numeric = [isinstance(value, int) for value in rows[0]]

    def line(values: Sequence[str]) -> str:
        padded = (
            text.rjust(width) if is_number else text.ljust(width)
            for text, width, is_number in zip(values, widths, numeric, strict=True)
        )
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), *(line(row) for row in cells)])
