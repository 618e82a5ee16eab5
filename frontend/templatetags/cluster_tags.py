"""`{% decisions_cluster as name %}`: the cluster to name on a list of the webhook's decisions,
"" while Tally syncs one cluster (no column then). See `frontend.clusters`."""

from __future__ import annotations

from django import template

from frontend.clusters import own_cluster
from inventory.models import Cluster

register = template.Library()


@register.simple_tag
def decisions_cluster() -> str:
    """The webhook's own cluster (every decision's) when there are several clusters, else ""."""
    return own_cluster() if Cluster.objects.count() > 1 else ""
