"""A cluster's baseline driver/CUDA pair becomes its cluster-wide `VersionBaseline` row.

The two `Cluster.baseline_*` columns are copied, where either was set, into the row with no
product and no architecture (the scope they always meant), then dropped. Reversing copies
the cluster-wide rows back; rows of a product or architecture have no place there.
"""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

NOTE = "Moved from the cluster's baseline fields (migration 0004)."


def copy_to_rows(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    cluster_model = apps.get_model("inventory", "Cluster")
    baseline_model = apps.get_model("inventory", "VersionBaseline")
    for cluster in cluster_model.objects.exclude(
        baseline_driver_version="", baseline_cuda_driver_version=""
    ):
        baseline_model.objects.update_or_create(
            cluster=cluster,
            product_name="",
            architecture="",
            defaults={
                "driver_version": cluster.baseline_driver_version,
                "cuda_driver_version": cluster.baseline_cuda_driver_version,
                "source": "admin",
                "note": NOTE,
            },
        )


def copy_to_clusters(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    baseline_model = apps.get_model("inventory", "VersionBaseline")
    cluster_model = apps.get_model("inventory", "Cluster")
    for row in baseline_model.objects.filter(product_name="", architecture=""):
        cluster_model.objects.filter(pk=row.cluster_id).update(
            baseline_driver_version=row.driver_version,
            baseline_cuda_driver_version=row.cuda_driver_version,
        )


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0003_driver_profiles_meter_ids"),
    ]

    operations = [
        migrations.RunPython(copy_to_rows, copy_to_clusters),
        migrations.RemoveField(model_name="cluster", name="baseline_driver_version"),
        migrations.RemoveField(model_name="cluster", name="baseline_cuda_driver_version"),
    ]
