"""`manage.py load_demo`: demo logins, teams, prices, a simulated fleet and a week of usage.

The fleet shows what Tally is for: a node on an outlier driver, a MIG GPU partly used, a claim
the quota denied in the decision log, and a claim idle for days. Its claims' every hour up to
now is sampled, rolled up and priced, and the periods are billed (the previous one closed
when due) as beat and `run_billing` bill them, so that running either changes nothing but the
hours the open claims hold after the load (unmeasured: no agent reports in the demo).

Idempotent: users that exist are left alone (passwords included), the policy is applied (a
second time changes nothing), and the fleet and its usage are loaded only while the cluster
has no devices, so running it again changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from billing import alerts
from billing.pricing import round_money
from demo.admission import deny_a_claim
from demo.usage import load_demo_usage
from inventory import services, simulate, sync_state
from inventory.models import Cluster, Device
from quota import policy
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP

DEMO_POLICY = Path(settings.BASE_DIR) / "docs" / "demo-policy.yaml"
# (username, password, group, superuser); the policy's leads sign in with their username.
DEMO_USERS = (
    ("operator", "operator", OPERATORS_GROUP, True),
    ("finance", "finance", FINANCE_GROUP, False),
)
# The node (by index) on an outlier driver: at 5% a draw, an 8-node fleet rarely has one.
OUTLIER_NODE = 1


def fleet_objects(*, nodes: int, seed: int, now: datetime, days: int) -> Iterator[dict[str, Any]]:
    """The demo's simulated fleet: claims made within `days` before `now`, the outlier node,
    and on every static-MIG node with a free GPU, one GPU partly used."""
    return simulate.generate(
        nodes=nodes,
        seed=seed,
        now=now,
        owners=True,
        history=timedelta(days=days),
        outlier_nodes=(OUTLIER_NODE,),
        partly_used_mig=range(nodes),
    )


class Command(BaseCommand):
    help = "Create the demo logins, teams and prices; import a simulated fleet and its usage."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--nodes", type=int, default=8, help="GPU nodes (default %(default)s)")
        parser.add_argument("--seed", type=int, default=0, help="the fleet's seed")
        parser.add_argument(
            "--days", type=int, default=7, help="days of history: claims began within them"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not 1 <= options["days"] <= 366:
            raise CommandError(f"--days {options['days']}: give 1 to 366 days of history")
        cluster = services.get_cluster(settings.TALLY_CLUSTER_NAME)
        devices = Device.objects.filter(cluster=cluster).count()
        now = timezone.now()
        # Teams first, so that the claims the fleet brings are attributed and counted.
        self._apply_policy()
        if devices:
            self.stdout.write(f"Cluster {cluster.name} already has {devices} devices; no import.")
        else:
            # The demo's history is made up as if Tally had synced the cluster all along: its
            # claims are charged from when they began, not from this first import.
            sync_state.note_first_sync(cluster=cluster, at=now - timedelta(days=options["days"]))
            report = services.import_snapshot(
                cluster=cluster,
                objects=fleet_objects(
                    nodes=options["nodes"], seed=options["seed"], now=now, days=options["days"]
                ),
                at=now,
            )
            if report.errors:
                raise CommandError(f"the simulated fleet had rejected objects: {report.errors[:3]}")
            self.stdout.write(f"Imported a simulated fleet: {report.summary()}.")
        users = self._create_users()
        if not devices:
            self._usage(cluster=cluster, now=now, seed=options["seed"])
        self.stdout.write("Demo logins: " + ", ".join(users))

    def _usage(self, *, cluster: Cluster, now: datetime, seed: int) -> None:
        usage = load_demo_usage(cluster=cluster, now=now, seed=seed)
        self.stdout.write(f"Generated {usage.samples} utilisation samples.")
        for run in usage.runs:
            totals = ", ".join(
                f"{round_money(total, currency)} {currency}"
                for currency, total in run.totals.items()
            )
            how = (
                "billed and closed"
                if run.period.is_closed
                else (f"billed to {now:%Y-%m-%d %H:%M} UTC, open")
            )
            self.stdout.write(
                f"Period {run.period.label} {how}: {run.usage_rows} usage rows, "
                f"total {totals or 'nothing'}."
            )
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

    def _apply_policy(self) -> None:
        try:
            loaded = policy.load_policy(DEMO_POLICY.read_text())
            report = policy.apply_policy(
                policy=loaded, prune=False, actor="load_demo", dry_run=False
            )
        except policy.PolicyError as exc:
            raise CommandError(f"{DEMO_POLICY}: {exc}") from exc
        self.stdout.write(f"Applied {DEMO_POLICY.name}: {report.summary()}")

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
