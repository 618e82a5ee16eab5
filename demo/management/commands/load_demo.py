"""`manage.py load_demo`: demo logins, teams and prices, and five weeks of two simulated
clusters with their usage, laid down in time order through the services production runs
(`demo.history`).

The fleet shows what Tally is for: a node on an outlier driver, a MIG GPU partly used, a claim
the quota denied in the decision log, a claim idle for days, a stranded gang and the claims it
waits for in a second cluster; its history a driver upgrade and a quota cut part-way, so the
week report and "did it help" compare real weeks, a closed month with its statements, and
late data that arrived after the close as an adjustment line. Its claims' every hour up to now
is sampled, rolled up and priced, and the periods are billed (every one before the current one
closed) as beat and `run_billing` bill them, so that running either changes nothing but the
hours the open claims hold after the load (unmeasured: no agent reports in the demo).

Idempotent: users that exist are left alone (passwords included), the policy is applied (a
second time changes nothing), and the history is loaded only while the cluster has no
devices, so running it again changes nothing.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing import alerts
from billing.periods import period_bounds
from billing.pricing import round_money
from billing.services import BillingRun
from demo import history
from demo.admission import deny_a_claim
from demo.usage import (
    Slowdown,
    bill_periods,
    deliver_late_samples,
    load_demo_usage,
    outage_on,
)
from inventory import services, sync_state
from inventory.models import Cluster, Device
from quota import policy
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP

DEMO_POLICY = Path(settings.BASE_DIR) / "docs" / "demo-policy.yaml"
# (username, password, group, superuser); the policy's leads sign in with their username.
DEMO_USERS = (
    ("operator", "operator", OPERATORS_GROUP, True),
    ("finance", "finance", FINANCE_GROUP, False),
)
# Jobs before the history's changes ran at these shares of their usual level: on the node of
# the old driver, and vision's before its quota was cut (its people reviewed their claims).
OLD_DRIVER_PACE = 0.35
BEFORE_QUOTA_CUT_PACE = 0.5
# The late data: the agent of one node could not report for these hours before the end of
# the closed period; its samples arrive after the close.
OUTAGE = timedelta(hours=12)
OUTAGE_BEFORE_END = timedelta(hours=6)


class Command(BaseCommand):
    help = (
        "Create the demo logins, teams and prices; lay down five weeks of two simulated "
        "clusters and their usage."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--nodes", type=int, default=8, help="GPU nodes (default %(default)s)")
        parser.add_argument("--seed", type=int, default=0, help="the fleet's seed")
        parser.add_argument(
            "--days",
            type=int,
            default=history.DAYS,
            help="days of history (default %(default)s): claims began within them",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        low = history.DRIVER_CHANGE_DAYS + 2
        if not low <= options["days"] <= 366:
            raise CommandError(
                f"--days {options['days']}: give {low} to 366 days of history (the driver "
                f"change is {history.DRIVER_CHANGE_DAYS} days before today)"
            )
        began = time.monotonic()
        cluster = services.get_cluster(settings.TALLY_CLUSTER_NAME)
        devices = Device.objects.filter(cluster=cluster).count()
        now = timezone.now()
        if devices:
            self._apply_policy(DEMO_POLICY.read_text(), at=None)
            self.stdout.write(f"Cluster {cluster.name} already has {devices} devices; no import.")
            self.stdout.write("Demo logins: " + ", ".join(self._create_users()))
            return
        changes = history.timeline(now=now, days=options["days"])
        second = services.get_cluster(history.SECOND_CLUSTER)
        fleets = self._fleets(options, now=now, cluster=cluster, second=second)
        # Teams first, as the policy was then, so that the claims the fleet brings are
        # attributed and counted from the start.
        self._apply_policy(history.earlier_policy(DEMO_POLICY.read_text()), at=changes.start)
        for synced, fleet in fleets:
            # The history is made up as if Tally had synced the clusters all along.
            sync_state.note_first_sync(cluster=synced, at=fleet.since)
        moments = sorted({m for _, fleet in fleets for m in changes.syncs(fleet.since)})
        for moment in moments:
            if moment == changes.quota_change:
                self._apply_policy(DEMO_POLICY.read_text(), at=moment)
            for synced, fleet in fleets:
                if moment not in changes.syncs(fleet.since):
                    continue
                report = services.import_snapshot(
                    cluster=synced,
                    objects=fleet.at(moment, changes),
                    at=moment,
                    kinds=services.KINDS,
                )
                if report.errors:
                    raise CommandError(
                        f"the simulated fleet had rejected objects: {report.errors[:3]}"
                    )
            if moment == changes.now:
                for synced, fleet in fleets:
                    self.stdout.write(
                        f"Cluster {synced.name}: synced {len(changes.syncs(fleet.since))} times "
                        f"from {fleet.since:%Y-%m-%d %H:%M} UTC, {len(fleet.claims)} claims."
                    )
        self.stdout.write(
            f"Driver of {fleets[0][1].driver_node} upgraded {changes.driver_change:%Y-%m-%d}; "
            f"quota {history.CHANGED_TEAM}/{history.CHANGED_RULE} cut from "
            f"{history.EARLIER_GPUS} GPUs {changes.quota_change:%Y-%m-%d}."
        )
        users = self._create_users()
        self._usage(
            clusters=[cluster, second],
            changes=changes,
            seed=options["seed"],
            driver_node=fleets[0][1].driver_node,
        )
        self.stdout.write("Demo logins: " + ", ".join(users))
        self.stdout.write(f"Loaded in {time.monotonic() - began:.1f} s.")

    def _fleets(
        self, options: dict[str, Any], *, now: datetime, cluster: Cluster, second: Cluster
    ) -> list[tuple[Cluster, history.Fleet]]:
        first = history.simulated_fleet(
            cluster="",
            nodes=options["nodes"],
            seed=options["seed"],
            now=now,
            days=options["days"],
            driver_node=history.DRIVER_NODE if options["nodes"] > history.DRIVER_NODE else None,
        )
        lab = history.simulated_fleet(
            cluster=second.name,
            nodes=history.SECOND_CLUSTER_NODES,
            seed=options["seed"] + 1,
            now=now,
            days=min(options["days"], history.SECOND_CLUSTER_DAYS),
            driver_node=None,
        )
        return [(cluster, first), (second, history.stranded_gang(lab, now=now))]

    def _usage(
        self, *, clusters: list[Cluster], changes: history.Timeline, seed: int, driver_node: str
    ) -> None:
        now = changes.now
        current, _ = period_bounds(now)
        outage = outage_on(
            cluster=clusters[0],
            start=current - OUTAGE_BEFORE_END - OUTAGE,
            end=current - OUTAGE_BEFORE_END,
        )
        slowdowns = [Slowdown(changes.quota_change, BEFORE_QUOTA_CUT_PACE, namespace="vision")]
        if driver_node:
            slowdowns.append(
                Slowdown(
                    changes.driver_change,
                    OLD_DRIVER_PACE,
                    cluster=clusters[0].name,
                    node=driver_node,
                )
            )
        usage = load_demo_usage(
            clusters=clusters, now=now, seed=seed, slowdowns=slowdowns, outage=outage
        )
        self.stdout.write(f"Generated {usage.samples} utilisation samples.")
        for run in bill_periods(since=changes.start, now=now):
            self._report_run(run, now=now)
        if outage is not None and usage.late:
            late = deliver_late_samples(
                cluster=clusters[0], outage=outage, samples=usage.late, now=now
            )
            self.stdout.write(
                f"Late data: the agent of {outage.node} sent {late.report.accepted} samples of "
                f"{outage.start:%Y-%m-%d %H:%M} to {outage.end:%H:%M} UTC after the close."
            )
            self._report_run(late.run, now=now)
        if usage.idle_claim is not None:
            claim = usage.idle_claim
            self.stdout.write(f"Idle since it began: claim {claim.namespace}/{claim.name}.")
        # Raised as beat's `alerts-evaluate` would (nothing is sent from here): the idle claim
        # of a team with an `idleAlert`, the outlier node, on the pages and the alerts API.
        raised = alerts.evaluate_alerts(now=now)
        firing = {kind: len(report.raised) for kind, report in raised.items() if report.raised}
        self.stdout.write(
            "Alerts raised: "
            + (", ".join(f"{n} {kind.replace('_', ' ')}" for kind, n in firing.items()) or "none")
            + "."
        )
        denied = deny_a_claim(at=now)
        if denied is None:
            self.stdout.write("No quota denies the demo's claims on this fleet: no denial shown.")
        else:
            self.stdout.write(f"Denied {denied.namespace}/{denied.name}: {denied.message}")

    def _report_run(self, run: BillingRun, *, now: datetime) -> None:
        totals = ", ".join(
            f"{round_money(total, currency)} {currency}" for currency, total in run.totals.items()
        )
        how = (
            "billed and closed"
            if run.period.is_closed
            else f"billed to {now:%Y-%m-%d %H:%M} UTC, open"
        )
        self.stdout.write(
            f"Period {run.period.label} {how}: {run.usage_rows} usage rows, "
            f"total {totals or 'nothing'}."
        )

    def _apply_policy(self, text: str, *, at: datetime | None) -> None:
        try:
            loaded = policy.load_policy(text)
            report = policy.apply_policy(
                policy=loaded, prune=False, actor="load_demo", dry_run=False, at=at
            )
        except policy.PolicyError as exc:
            raise CommandError(f"{DEMO_POLICY}: {exc}") from exc
        when = "" if at is None else f" as of {at:%Y-%m-%d %H:%M} UTC"
        earlier = " (as it was)" if text != DEMO_POLICY.read_text() else ""
        self.stdout.write(f"Applied {DEMO_POLICY.name}{earlier}{when}: {report.summary()}")

    def _create_users(self) -> list[str]:
        user_model = get_user_model()
        logins = []
        for username, password, group, superuser in DEMO_USERS:
            user = user_model.objects.filter(username=username).first()
            if user is None:
                create = (
                    user_model.objects.create_superuser
                    if superuser
                    else user_model.objects.create_user
                )
                user = create(username=username, password=password)
            user.groups.add(Group.objects.get_or_create(name=group)[0])
            logins.append(f"{username} / {password}")
        # The policy created its leads with unusable passwords; the demo lets them sign in.
        for user in user_model.objects.filter(username__startswith="lead-"):
            if not user.has_usable_password():
                user.set_password(user.username)
                user.save(update_fields=["password"])
            logins.append(f"{user.username} / {user.username}")
        return logins
