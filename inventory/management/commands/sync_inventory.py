"""`manage.py sync_inventory`: keep the inventory in step with a cluster, or load a dump file.

Live (the default): list and watch every kind until stopped (SIGTERM or Ctrl-C).
`--once`: one list + import per kind, for a cron job. `--from-file`: import a dump (what
`kubectl get -o yaml|json` prints) as a full snapshot of the kinds it contains, and of those
`--kinds` names (a dump of a cluster with no claims left holds no ResourceClaim to say so).
`--from-file --dry-run`: what the import would change and the money it would move per team
and period, with nothing written (`inventory.previews`). Each run ends with what the sync did
not take as given (devices refused, allocation starts moved) and what the stored slices cannot
be trusted on (`inventory.checks`): a line per finding on stderr and their count in the summary.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from core.metrics import start_metrics_server
from inventory import checks, kube, kube_sync, leader, previews, services
from inventory.models import Cluster


class Command(BaseCommand):
    help = "Sync the GPU inventory from Kubernetes DRA objects, live, once, or from a dump file."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--cluster",
            default=settings.TALLY_CLUSTER_NAME,
            help="the cluster's name in Tally (default: TALLY_CLUSTER_NAME, %(default)s)",
        )
        parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else ~)")
        parser.add_argument("--context", help="kubeconfig context (default: the current one)")
        parser.add_argument(
            "--once", action="store_true", help="list and import each kind once, then exit"
        )
        parser.add_argument(
            "--leader-elect",
            action="store_true",
            help="sync only while holding the Lease tally-sync-<cluster> in POD_NAMESPACE, so "
            "that of several replicas one writes",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            help="serve Prometheus metrics of this process on this port (e.g. 9090)",
        )
        parser.add_argument(
            "--kinds",
            nargs="+",
            metavar="KIND",
            help=f"only these kinds, space or comma separated (of {' '.join(services.KINDS)}); "
            "with --from-file: the dump is a full snapshot of these kinds too, even of one it "
            "holds no object of (their objects it lacks are gone)",
        )
        parser.add_argument(
            "--from-file",
            type=Path,
            metavar="PATH",
            help="import this dump (YAML or JSON) as a full snapshot instead of asking the API",
        )
        parser.add_argument(
            "--at",
            metavar="ISO8601",
            help="with --from-file: when the dump was taken (default: now; no offset means UTC)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="with --from-file: print what the import would change (objects, allocations "
            "started and ended, devices refused) and the money it would move per team and "
            "period, and write nothing",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Every option is checked before anything is written.
        if options["from_file"] is not None:
            for option in ("once", "kubeconfig", "context", "leader_elect"):
                if options[option]:
                    raise CommandError(f"--{option} does not apply to --from-file")
            at = _parse_at(options["at"])
            # A dump says nothing of a kind it holds no object of (`kubectl get` prints an
            # empty List alike for "none left" and "not asked for"): --kinds names the kinds it
            # is a full snapshot of all the same, so the last claims of a cluster are released.
            kinds = _parse_kinds(options["kinds"]) if options["kinds"] else []
            if options["dry_run"]:
                self._preview_file(options["cluster"], options["from_file"], at, kinds)
                return
            cluster = services.get_cluster(options["cluster"])
            self._import_file(cluster, options["from_file"], at, kinds)
            return
        for option in ("at", "dry_run"):
            if options[option]:
                raise CommandError(f"--{option.replace('_', '-')} only applies to --from-file")
        if options["once"] and options["leader_elect"]:
            raise CommandError("--leader-elect does not apply to --once")
        kinds = _parse_kinds(options["kinds"])
        self._sync(services.get_cluster(options["cluster"]), kinds, options)

    def _import_file(self, cluster: Cluster, path: Path, at: datetime, kinds: list[str]) -> None:
        # Imported here: the live sync has no use for the dump reader.
        from inventory.dumps import DumpError, iter_objects

        try:
            report = services.import_snapshot(
                cluster=cluster, objects=iter_objects(path), at=at, kinds=kinds
            )
        except DumpError as exc:
            raise CommandError(f"nothing imported: {exc}") from exc
        self._summarise(report)
        self._warn(cluster, [report])
        for error in report.errors:
            self.stderr.write(f"rejected: {error}")
        if report.errors:
            raise CommandError(
                f"{len(report.errors)} object(s) in {path} rejected; the rest was imported"
            )

    def _preview_file(self, cluster_name: str, path: Path, at: datetime, kinds: list[str]) -> None:
        from inventory.dumps import DumpError, iter_objects

        try:
            preview = previews.preview_snapshot(
                cluster_name=cluster_name,
                objects=iter_objects(path),
                at=at,
                now=timezone.now(),
                kinds=kinds,
            )
        except DumpError as exc:
            raise CommandError(f"nothing would be imported: {exc}") from exc
        report = preview.report
        self.stdout.write(f"Dry run of {path} into cluster {cluster_name}: nothing written.")
        self._summarise(report)
        for note in (*report.notes(), *report.warnings):
            self.stderr.write(f"warning: {note}")
        for error in report.errors:
            self.stderr.write(f"would reject: {error}")
        if preview.unpriced:
            for why in preview.unpriced:
                self.stderr.write(f"warning: the money could not be worked out: {why}")
            return
        moved = preview.moved()
        if not moved:
            self.stdout.write("Money: none would move.")
            return
        self.stdout.write("Money it would move (team, period: before -> after):")
        for (team, period, currency), before, after in moved:
            self.stdout.write(
                f"  {team} {period}: {before:.2f} -> {after:.2f} {currency} ({after - before:+.2f})"
            )

    def _sync(self, cluster: Cluster, kinds: list[str], options: dict[str, Any]) -> None:
        try:
            api_client = kube.api_client(
                kubeconfig=options["kubeconfig"], context=options["context"]
            )
        except kube.KubeError as exc:
            raise CommandError(str(exc)) from exc
        try:
            if options["once"]:
                reports = kube_sync.sync(
                    api_client=api_client, cluster=cluster, kinds=kinds, once=True
                )
            else:
                reports = self._run_live(api_client, cluster, kinds, options)
        except kube.KubeError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            api_client.close()
        for report in reports.values():
            self._summarise(report)
        self._warn(cluster, list(reports.values()))
        rejected = sum(len(report.errors) for report in reports.values())
        if rejected:
            # Each one was logged as it happened.
            raise CommandError(f"{rejected} object(s) rejected; the rest was imported")

    def _run_live(
        self, api_client: Any, cluster: Cluster, kinds: list[str], options: dict[str, Any]
    ) -> dict[str, services.SyncReport]:
        verbosity = options["verbosity"]
        if not logging.getLogger().handlers:
            # A long-running process: say what it does unless the deployment set up logging.
            logging.basicConfig(
                level=logging.DEBUG if verbosity > 1 else logging.INFO,
                format="%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s",
            )
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: stop.set())
        self.stdout.write(
            f"Syncing {', '.join(kinds)} of cluster {cluster.name}; stop with SIGTERM"
        )
        if options["metrics_port"]:
            start_metrics_server(options["metrics_port"], token=settings.TALLY_METRICS_TOKEN)

        def work(stop_working: threading.Event) -> dict[str, services.SyncReport]:
            return kube_sync.sync(
                api_client=api_client, cluster=cluster, kinds=kinds, stop=stop_working
            )

        if not options["leader_elect"]:
            return work(stop)
        # Lost leadership raises (a KubeError): the process exits and restarts as a standby.
        reports = leader.lead(
            api_client=api_client, name=f"tally-sync-{cluster.name}", stop=stop, work=work
        )
        return reports or {}

    def _summarise(self, report: services.SyncReport) -> None:
        kinds = sorted({*report.created, *report.updated, *report.gone, *report.skipped})
        for kind in kinds:
            self.stdout.write(
                f"{kind}: {report.created.get(kind, 0)} created, "
                f"{report.updated.get(kind, 0)} updated, {report.gone.get(kind, 0)} gone, "
                f"{report.skipped.get(kind, 0)} skipped"
            )

    def _warn(self, cluster: Cluster, reports: list[services.SyncReport]) -> None:
        """What the sync did not take as given (`SyncReport.notes`) and what the stored
        inventory cannot be trusted on, one line each on stderr, counted on stdout. Warnings
        leave the exit status alone: the rows were stored as published."""
        notes = [note for report in reports for note in (*report.notes(), *report.warnings)]
        for note in notes:
            self.stderr.write(f"warning: {note}")
        warnings = checks.sync_warnings(cluster=cluster)
        now = timezone.now()
        for warning in warnings:
            self.stderr.write(f"warning: {warning['message']}")
            self.stderr.write(f"  {checks.describe_since(warning['since'], now=now)}")
        summary = checks.summarise(warnings)
        if notes:
            summary = f"{len(notes)} from this run; stored: {summary}"
        self.stdout.write(f"Sync warnings: {summary}")


# The earliest `--at`, and how far past this machine's clock one may be (the clocks of the
# machine that took the dump and of this one).
EARLIEST_AT = datetime(1970, 1, 1, tzinfo=UTC)
AT_CLOCK_SKEW = timedelta(minutes=5)


def _parse_at(value: str | None) -> datetime:
    if value is None:
        return timezone.now()
    try:
        at = datetime.fromisoformat(value)
    except ValueError as exc:
        raise CommandError(
            f"--at {value!r} is not an ISO 8601 time (e.g. 2025-06-01T12:00:00Z)"
        ) from exc
    at = at if timezone.is_aware(at) else at.replace(tzinfo=UTC)
    # A snapshot is of a moment that has been: one dated ahead would release the claims it
    # lacks in the future, charging them until then; one before 1970 is a typo (year 1).
    latest = timezone.now() + AT_CLOCK_SKEW
    if not EARLIEST_AT <= at <= latest:
        raise CommandError(
            f"--at {value!r} is outside {EARLIEST_AT:%Y-%m-%d} to now "
            f"({latest:%Y-%m-%dT%H:%M}Z at the latest): a dump is a snapshot taken in the past"
        )
    return at


def _parse_kinds(values: list[str] | None) -> list[str]:
    if not values:
        return list(services.KINDS)
    kinds = [kind for value in values for kind in value.split(",") if kind]
    unknown = sorted(set(kinds) - set(services.KINDS))
    if unknown:
        raise CommandError(
            f"--kinds: unknown kind(s) {', '.join(unknown)}; known: {', '.join(services.KINDS)}"
        )
    return kinds
