"""`manage.py load_demo`: demo logins, teams, prices, a simulated fleet and a week of usage.

Idempotent: users that exist are left alone (passwords included), the policy is applied (a
second time changes nothing), and the fleet and its usage are loaded only while the cluster
has no devices, so running it again changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from demo.usage import load_demo_usage
from inventory import services, simulate
from inventory.models import Device
from quota import policy
from teams.selectors import FINANCE_GROUP, OPERATORS_GROUP

DEMO_POLICY = Path(settings.BASE_DIR) / "docs" / "demo-policy.yaml"
# (username, password, group, superuser); the policy's leads sign in with their username.
DEMO_USERS = (
    ("operator", "operator", OPERATORS_GROUP, True),
    ("finance", "finance", FINANCE_GROUP, False),
)


class Command(BaseCommand):
    help = "Create the demo logins, teams and prices; import a simulated fleet and its usage."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--nodes", type=int, default=8, help="GPU nodes (default %(default)s)")
        parser.add_argument("--seed", type=int, default=0, help="the fleet's seed")
        parser.add_argument("--days", type=int, default=7, help="days of usage history")

    def handle(self, *args: Any, **options: Any) -> None:
        cluster = services.get_cluster(settings.TALLY_CLUSTER_NAME)
        devices = Device.objects.filter(cluster=cluster).count()
        now = timezone.now()
        # Teams first, so that the claims the fleet brings are attributed and counted.
        self._apply_policy()
        if devices:
            self.stdout.write(f"Cluster {cluster.name} already has {devices} devices; no import.")
        else:
            report = services.import_snapshot(
                cluster=cluster,
                objects=simulate.generate(
                    nodes=options["nodes"], seed=options["seed"], now=now, owners=True
                ),
                at=now,
            )
            if report.errors:
                raise CommandError(f"the simulated fleet had rejected objects: {report.errors[:3]}")
            self.stdout.write(f"Imported a simulated fleet: {report.summary()}.")
        users = self._create_users()
        if not devices:
            samples = load_demo_usage(cluster=cluster, now=now, days=options["days"])
            self.stdout.write(f"Generated {samples} utilisation samples, rolled up and priced.")
        self.stdout.write("Demo logins: " + ", ".join(users))

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
