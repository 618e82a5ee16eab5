"""`manage.py apply_version_taints [--dry-run]`: keep GPUs off their validated driver/CUDA pair
out of general scheduling, with DRA DeviceTaintRules (NoSchedule) Tally creates and removes.

The baseline is per cluster and GPU model (`inventory.versions`): set in the admin (Version
baselines, or the Clusters action) or the policy file, else the pair on most of the model's
GPUs. Undocumented outliers get `tally.dev/unvalidated-driver`; pools whose deviation is
documented (and not expired) get `tally.dev/version-deviation`, which validation workloads
tolerate. Rules are written in the DeviceTaintRule version the cluster serves (discovery).
Run it from the syncer's service account, the one bound to the devicetaintrules ClusterRole
(deploy/base/rbac.yaml), e.g. as a CronJob or by hand.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from inventory import kube
from inventory.models import Cluster
from inventory.taints import apply_version_taints


class Command(BaseCommand):
    help = "Taint (NoSchedule) the devices of nodes off the validated driver/CUDA pair."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--cluster", default=settings.TALLY_CLUSTER_NAME)
        parser.add_argument("--dry-run", action="store_true", help="say what would change")
        parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else ~)")
        parser.add_argument("--context", help="kubeconfig context")

    def handle(self, *args: Any, **options: Any) -> None:
        cluster = Cluster.objects.filter(name=options["cluster"]).first()
        if cluster is None:
            raise CommandError(f"Unknown cluster {options['cluster']!r}")
        try:
            client = kube.api_client(kubeconfig=options["kubeconfig"], context=options["context"])
        except kube.KubeError as exc:
            raise CommandError(str(exc)) from exc
        try:
            report = apply_version_taints(
                cluster=cluster, dry_run=options["dry_run"], api_client=client
            )
        except kube.KubeError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            client.close()
        self.stdout.write(f"DeviceTaintRule API: {report.api_version}")
        verb = "would " if report.dry_run else ""
        for action in ("created", "updated", "deleted", "unchanged"):
            for name in getattr(report, action):
                self.stdout.write(
                    f"{verb}{action[:-1] if action != 'unchanged' else 'keep'}: {name}"
                )
        for conflict in report.conflicts:
            self.stderr.write(f"conflict: {conflict}")
        if report.conflicts:
            raise CommandError(f"{len(report.conflicts)} rule(s) could not be written")
