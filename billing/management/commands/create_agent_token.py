"""`manage.py create_agent_token --node NAME`: a bearer token for one node's agent."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from billing.services import issue_agent_token
from inventory.services import get_cluster


class Command(BaseCommand):
    help = (
        "Create a bearer token for the agent on one node and print it, once: only its SHA-256 "
        "is stored, so it cannot be shown again."
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
            "--actor",
            default="create_agent_token",
            help="Who the audit trail names for the new token (default: create_agent_token).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        cluster = get_cluster(options["cluster"] or settings.TALLY_CLUSTER_NAME)
        token = issue_agent_token(cluster=cluster, node=options["node"], actor=options["actor"])
        self.stdout.write(token)
