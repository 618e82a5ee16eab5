"""`manage.py simulate_fleet`: write a simulated GPU fleet as a `kubectl get -o json|yaml` dump."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from inventory import simulate

MIXES = {"default": simulate.DEFAULT_MIX, "whole": simulate.WHOLE_GPU_MIX}


class Command(BaseCommand):
    help = (
        "Write a simulated fleet (Nodes, DeviceClasses, ResourceSlices, ResourceClaims of the "
        "NVIDIA DRA driver) as a kind: List dump, e.g. for sync_inventory --from-file."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--nodes", type=int, default=24, help="GPU nodes (default %(default)s)")
        parser.add_argument("--seed", type=int, default=0, help="the same seed, the same fleet")
        parser.add_argument(
            "--cluster",
            default=settings.TALLY_CLUSTER_NAME,
            help="the cluster the fleet is for, as sync_inventory --cluster names it (default: "
            "TALLY_CLUSTER_NAME, %(default)s): its GPUs' UUIDs are its own, so two clusters "
            "simulated with one seed do not share GPUs",
        )
        parser.add_argument("--output", type=Path, metavar="PATH", help="file (default: stdout)")
        parser.add_argument("--format", choices=("json", "yaml"), default="json")
        parser.add_argument(
            "--mix",
            choices=sorted(MIXES),
            default="default",
            help="node layouts: default (whole GPUs, static MIG, partitionable) or whole GPUs only",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["nodes"] < 0:
            raise CommandError("--nodes must be 0 or more")
        objects = simulate.generate(
            nodes=options["nodes"],
            seed=options["seed"],
            mix=MIXES[options["mix"]],
            cluster=options["cluster"],
        )
        output: Path | None = options["output"]
        if output is None:
            self.stdout.ending = ""  # the dump brings its own newlines
            simulate.write_dump(objects, self.stdout, fmt=options["format"])
            return
        try:
            with open(output, "w", encoding="utf-8") as stream:
                count = simulate.write_dump(objects, stream, fmt=options["format"])
        except OSError as exc:
            raise CommandError(f"cannot write {output}: {exc.strerror or exc}") from exc
        self.stderr.write(f"{count} objects written to {output}")
