"""`manage.py fleet_report`: capacity, driver versions, fragmentation and sync warnings of the
GPU fleet."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from inventory import checks
from inventory.models import Cluster
from inventory.profiles import unit_label
from inventory.selectors import fleet_report


class Command(BaseCommand):
    help = (
        "Report the accelerator fleet: physical units by unit (GPUs, TPU chips, Gaudi cards) "
        "and model, driver/CUDA versions against each model's baseline, outlier nodes, "
        "documented deviations, free blocks per model, fragmentation by slice and sync warnings."
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
    # What a model's units are called ("GPUs", "TPU chips"), as its capacity row names them.
    units = {row["product_name"]: row["unit_label"] for row in report["capacity"]}
    sections = [
        f"Accelerator fleet report: {scope}\n"
        f"Nodes with accelerators: {report['nodes']}    MIG devices: {report['mig_devices']}",
        _capacity_section(report["capacity"]),
        "Driver / CUDA versions per model (* marks its baseline)\n"
        + _table(
            ("", "CLUSTER", "MODEL", "DRIVER", "CUDA", "NODES", "GPUS"),
            [
                (
                    "*" if row["baseline"] else "",
                    row["cluster"],
                    row["product_name"] or "(unknown)",
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
            f"Baseline of {model['cluster']}, {model['product_name'] or '(unknown)'}: "
            f"{_describe_baseline(model['baseline'])}; "
            f"{model['gpus_on_baseline']} of {model['gpus']} "
            f"{units.get(model['product_name'], 'accelerators')} on it"
            for model in report["version_models"]
        ),
        f"Outlier nodes, undocumented ({len(outliers)})"
        + "".join(f"\n  {name}" for name in outliers)
        + ("" if outliers else "\n  none"),
        f"Version unknown, neither on a baseline nor outliers ({len(report['unknown_nodes'])})"
        + "".join(f"\n  {name}" for name in report["unknown_nodes"])
        + ("" if report["unknown_nodes"] else "\n  none"),
        _deviations_section(report["deviations"]),
        "Fragmentation\n"
        + _table(
            ("NODES FREE", "PARTIAL", "FULL"),
            [(spread["nodes_free"], spread["nodes_partial"], spread["nodes_full"])],
        ),
        "Free blocks by model (wholly free units; a claim gets devices of one model)\n"
        + _table(
            ("UNIT", "MODEL", "LARGEST ON A NODE", "LARGEST IN A CLIQUE"),
            [
                (
                    block["unit_label"],
                    block["product_name"] or "(unknown)",
                    block["largest_free_block"],
                    block["largest_free_clique_block"],
                )
                for block in spread["free_blocks"]
            ],
        ),
        f"Partly used nodes ({spread['nodes_partial']})\n"
        + _table(
            ("NODE", "UNIT", "FREE", "PARTLY USED", "FREE SHARE", "FREE SLICES", "LARGEST"),
            [
                (
                    node["node"],
                    node["unit_label"],
                    node["free"],
                    node["gpus_partial"],
                    node["free_share"],
                    _counts(node["free_slices"]),
                    node["largest_placeable"] or "none",
                )
                for node in report["partly_used_nodes"]
            ],
        ),
        f"Partly used GPUs ({spread['gpus_partial']}, {_free_by_unit(spread)} free)\n"
        + _table(
            ("NODE", "GPU", "MODEL", "HELD", "FREE", "FREE SLICES", "LARGEST PLACEABLE"),
            [
                (
                    gpu["node"] or "-",
                    gpu["physical_gpu_key"],
                    gpu["product_name"] or "(unknown)",
                    gpu["held_label"],
                    f"{gpu['free_label']} {gpu['unit_label']}",
                    _describe_free(gpu),
                    gpu["largest_placeable"] or "none",
                )
                for gpu in partial
            ],
        ),
        _warnings_section(report["sync_warnings"]),
    ]
    return "\n\n".join(sections)


def _capacity_section(capacity: list[dict[str, Any]]) -> str:
    """One table per unit (GPUs, TPU chips, Gaudi cards): units of different kinds never share
    a column. CAPACITY is the units' worth in that unit (a VM's A100-4C vGPU is 0.1 GPU)."""
    by_unit: dict[str, list[dict[str, Any]]] = {}
    for row in capacity:
        by_unit.setdefault(row["unit_label"], []).append(row)
    if not by_unit:
        return "Capacity by model\n  (none)"
    return "\n\n".join(
        f"Capacity by model: {label}\n"
        + _table(
            ("MODEL", label.upper(), "CAPACITY", "ALLOCATED", "FREE", "MIG DEVICES"),
            [
                (
                    row["product_name"] or "(unknown)",
                    row["gpus"],
                    row["equivalents"],
                    row["allocated"],
                    row["free"],
                    row["mig_devices"],
                )
                for row in rows
            ],
        )
        for label, rows in by_unit.items()
    )


def _warnings_section(warnings: list[dict[str, Any]]) -> str:
    """What the sync stored but cannot trust (`inventory.checks`), one line per finding, with
    since when."""
    now = timezone.now()
    lines = [
        f"  {warning['cluster']}: {warning['message']}\n"
        f"    {checks.describe_since(warning['since'], now=now)}"
        for warning in warnings
    ]
    return f"Sync warnings ({len(warnings)})\n" + ("\n".join(lines) or "  none")


def _describe_baseline(baseline: dict[str, str]) -> str:
    how = {
        "product": "set for the model",
        "architecture": "set for its architecture",
        "cluster": "set for the cluster",
    }.get(baseline["scope"], "most GPUs")
    cuda = baseline["cuda_driver_version"] or "any"
    driver = baseline["driver_version"] or "any"
    return f"driver {driver}, CUDA {cuda} ({how})"


def _deviations_section(deviations: list[dict[str, Any]]) -> str:
    """The register: each deviation, who answers for it and until when; expired ones marked."""
    lines = [
        f"  {row['cluster']}: {row['node_name'] or '*'}/{row['pool'] or '*'} "
        f"driver {row['driver_version'] or 'any'}, CUDA {row['cuda_driver_version'] or 'any'}, "
        f"owner {row['owner']}, {'EXPIRED ' if row['expired'] else ''}until {row['expires_at']}: "
        f"{row['reason']}"
        for row in deviations
    ]
    return f"Documented deviations ({len(deviations)})\n" + ("\n".join(lines) or "  none")


def _describe_free(gpu: dict[str, Any]) -> str:
    """Free slices, then what a claim could get only on its own: overlapping partitions (any
    one may rule out the rest) or the largest share of a shared device."""
    parts = [_counts(gpu["free_slices"])] if gpu["free_slices"] else []
    if gpu["overlapping_unheld"]:
        parts.append(f"partitionable, each alone: {_counts(gpu['placeable_alone'])}")
    elif gpu["placeable_alone"]:
        parts.append(f"one claim up to {', '.join(gpu['placeable_alone'])}")
    return "; ".join(parts) or "none"


def _counts(by_profile: dict[str, int]) -> str:
    return ", ".join(f"{profile}: {count}" for profile, count in by_profile.items()) or "none"


def _free_by_unit(spread: dict[str, Any]) -> str:
    """ "1.071429 GPUs", or "0.5 GPUs, 0.25 TPU chips" when units mix."""
    shares = spread["partial_free_by_unit"]
    if not shares:
        return "0 GPUs"
    return ", ".join(f"{share} {unit_label(unit)}" for unit, share in shares.items())


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
