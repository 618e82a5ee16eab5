"""A device identity live in one cluster at a time (`Pool.refused`), and when each cluster was
first synced (`Cluster.first_synced_at`), issue 33.

A cluster synced before this migration takes as its first sync the earliest time anything of
it was stored (a node, slice or claim first seen); one with nothing stored takes it from its
next sync.
"""

from typing import Any

from django.db import migrations, models
from django.db.models import Min


def first_syncs(apps: Any, schema_editor: Any) -> None:
    Cluster = apps.get_model("inventory", "Cluster")
    for cluster in Cluster.objects.all():
        seen = [
            apps.get_model("inventory", model)
            .objects.filter(cluster=cluster)
            .aggregate(first=Min("first_seen"))["first"]
            for model in ("Node", "ResourceSlice", "ResourceClaim")
        ]
        known = [moment for moment in seen if moment is not None]
        if known:
            Cluster.objects.filter(pk=cluster.pk).update(first_synced_at=min(known))


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0010_versions_driver_scope"),
    ]

    operations = [
        migrations.AddField(
            model_name="cluster",
            name="first_synced_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="pool",
            name="refused",
            field=models.JSONField(blank=True, default=dict),
        ),
        migrations.RunPython(first_syncs, migrations.RunPython.noop),
    ]
