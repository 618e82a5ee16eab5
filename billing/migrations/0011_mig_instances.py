"""Which device each MIG GPU instance id of a GPU was, and when (`billing.MigInstance`), as the
agent's samples say: how the Prometheus source tells apart DCGM series of two MIG devices of
one profile on one GPU (their `GPU_I_ID`)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0010_mark_versions_unknown_sample_means"),
        ("inventory", "0008_seen_times"),
    ]

    operations = [
        migrations.CreateModel(
            name="MigInstance",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("node", models.CharField(max_length=253)),
                ("parent_uuid", models.CharField(max_length=128)),
                ("gpu_instance_id", models.IntegerField()),
                ("meter_id", models.CharField(max_length=128)),
                ("first_ms", models.BigIntegerField()),
                ("last_ms", models.BigIntegerField()),
                (
                    "cluster",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="inventory.cluster",
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(
                        fields=["parent_uuid", "gpu_instance_id"],
                        name="billing_mig_parent__f0f47f_idx",
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("cluster", "node", "parent_uuid", "gpu_instance_id", "meter_id"),
                        name="miginstance_unique_device",
                    )
                ],
            },
        ),
    ]
