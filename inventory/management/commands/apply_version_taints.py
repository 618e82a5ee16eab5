"""`manage.py apply_version_taints [--dry-run] [--force]`: keep GPUs off their validated
driver/CUDA pair out of general scheduling, with DRA DeviceTaintRules (NoSchedule) Tally
creates and removes.

The baseline is per cluster, DRA driver and GPU model (`inventory.versions`): set in the
admin (Version baselines, or the Clusters action) or the policy file, else the pair on most of
the model's GPUs. Undocumented outliers get `tally.dev/unvalidated-driver`; pools whose
deviation is documented (and not expired) get `tally.dev/version-deviation`, which
validation workloads tolerate. The plan is printed first, each rule with its reason; a model
whose rules would take more than TALLY_VERSION_TAINT_MAX_PERCENT of its nodes is held unless
--force (the command then fails, saying so). Rules are written in the DeviceTaintRule version
the cluster serves (discovery). Run it from the syncer's service account, the one bound to the
devicetaintrules ClusterRole (deploy/base/rbac.yaml), e.g. as a CronJob or by hand.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from inventory import kube
from inventory.models import Cluster
from inventory.taints import apply_version_taints


class Command(BaseCommand):
    help = (
        "Taint (NoSchedule) the devices of nodes off the validated driver/CUDA pair; print the "
        "plan first. At most TALLY_VERSION_TAINT_MAX_PERCENT of a model's nodes without --force."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--cluster", default=settings.TALLY_CLUSTER_NAME)
        parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
        parser.add_argument(
            "--force",
            action="store_true",
            help="taint beyond TALLY_VERSION_TAINT_MAX_PERCENT of a model's nodes",
        )
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
                cluster=cluster,
                dry_run=options["dry_run"],
                force=options["force"],
                api_client=client,
            )
        except kube.KubeError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            client.close()
        self.stdout.write(f"DeviceTaintRule API: {report.api_version}")
        self.stdout.write("Plan (dry run, nothing changed):" if report.dry_run else "Plan:")
        for line in report.plan or ["nothing to taint"]:
            self.stdout.write(f"  {line}")
        for limit in report.limits:
            self.stderr.write(f"limit: {limit}")
        for conflict in report.conflicts:
            self.stderr.write(f"conflict: {conflict}")
        if report.conflicts:
            raise CommandError(f"{len(report.conflicts)} rule(s) could not be written")
        if report.limits and not options["force"]:
            raise CommandError(
                "some rules were held by the limit (see above): nothing was tainted for those "
                "models; check their baselines, or run with --force"
            )
