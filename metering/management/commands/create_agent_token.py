"""`manage.py create_agent_token --node NAME`: a bearer token for one node's agent."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from inventory.models import Cluster, Node
from inventory.services import get_cluster
from metering.services import issue_agent_token


class Command(BaseCommand):
    help = (
        "Create a bearer token for the agent on one node and print it, once: only its SHA-256 "
        "is stored, so it cannot be shown again. The node must be in the inventory (run "
        "sync_inventory first) unless --force is given."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--node",
            required=True,
            help='The Kubernetes node the agent runs on; "*" for an agent that reports for every'
            " node (reading DCGM exporter metrics from Prometheus).",
        )
        parser.add_argument(
            "--cluster",
            default=None,
            help="The cluster the node belongs to (default: TALLY_CLUSTER_NAME).",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="Issue the token even for a node the inventory has never seen (with a warning).",
        )
        parser.add_argument(
            "--actor",
            default="create_agent_token",
            help="Who the audit trail names for the new token (default: create_agent_token).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        cluster_name = options["cluster"] or settings.TALLY_CLUSTER_NAME
        node = options["node"]
        if node != "*":
            unseen = _unseen(cluster_name, node)
            if unseen and not options["force"]:
                raise CommandError(
                    f"{unseen}; check the name, run `python manage.py sync_inventory` first, "
                    "or pass --force to issue the token anyway"
                )
            if unseen:
                self.stderr.write(f"warning: {unseen}; issuing the token anyway (--force)")
        cluster = get_cluster(cluster_name)
        token = issue_agent_token(cluster=cluster, node=node, actor=options["actor"])
        self.stdout.write(token)


def _unseen(cluster_name: str, node: str) -> str:
    """Why `node` is not one the inventory knows in the cluster; "" when it is."""
    if not Cluster.objects.filter(name=cluster_name).exists():
        return (
            f"node {node!r} is not in the inventory (Tally has never seen cluster {cluster_name!r})"
        )
    if not Node.objects.filter(cluster__name=cluster_name, name=node).exists():
        return f"node {node!r} is not in the inventory of cluster {cluster_name!r}"
    return ""
