"""`manage.py load_demo`: demo logins and a simulated fleet, for a fresh development database.

Idempotent: users that exist are left alone (passwords included), and the fleet is imported
only while the cluster has no devices, so running it again changes nothing.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from inventory import services, simulate
from inventory.models import Device

# (username, password, superuser) of the demo logins.
DEMO_USERS = (("operator", "operator", True),)


class Command(BaseCommand):
    help = "Create the demo logins and import a simulated GPU fleet (once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--nodes", type=int, default=24, help="GPU nodes (default %(default)s)")
        parser.add_argument("--seed", type=int, default=0, help="the fleet's seed")

    def handle(self, *args: Any, **options: Any) -> None:
        self._create_users()
        cluster = services.get_cluster(settings.TALLY_CLUSTER_NAME)
        devices = Device.objects.filter(cluster=cluster).count()
        if devices:
            self.stdout.write(f"Cluster {cluster.name} already has {devices} devices; no import.")
            return
        now = timezone.now()
        report = services.import_snapshot(
            cluster=cluster,
            objects=simulate.generate(nodes=options["nodes"], seed=options["seed"], now=now),
            at=now,
        )
        created = ", ".join(f"{count} {kind}" for kind, count in sorted(report.created.items()))
        self.stdout.write(f"Imported a simulated fleet into cluster {cluster.name}: {created}.")
        if report.errors:
            raise CommandError(f"the simulated fleet had rejected objects: {report.errors[:3]}")

    def _create_users(self) -> None:
        user_model = get_user_model()
        for username, password, superuser in DEMO_USERS:
            if user_model.objects.filter(username=username).exists():
                self.stdout.write(f"Login {username}: exists, left as it is.")
                continue
            if superuser:
                user_model.objects.create_superuser(username=username, password=password)
            else:
                user_model.objects.create_user(username=username, password=password)
            self.stdout.write(f"Login {username} / {password}: created.")
