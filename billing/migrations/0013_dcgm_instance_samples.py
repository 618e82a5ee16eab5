"""DCGM samples named by their GPU instance (`<parent UUID>::gi<N>`) are stored under the device
the GPU instance was at their instant, by its spells, and moved where the spells change
(`billing.ingest`): such a sample keeps its GPU instance id (`Sample.placed_gpu_instance`), one
set aside without a token the cluster whose spells may place it
(`UnknownDeviceSample.cluster`), and `DcgmInstance` says which GPU instances have any, so that
a batch that extends a spell looks for none where DCGM sent none. Adding nullable columns
rewrites no table."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0012_mig_instance_spells"),
        ("inventory", "0008_seen_times"),
    ]

    operations = [
        migrations.AddField(
            model_name="sample",
            name="placed_gpu_instance",
            field=models.IntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="unknowndevicesample",
            name="cluster",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="+",
                to="inventory.cluster",
            ),
        ),
        migrations.CreateModel(
            name="DcgmInstance",
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
                ("first_ms", models.BigIntegerField()),
                ("last_ms", models.BigIntegerField()),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("parent_uuid", "gpu_instance_id", "node"),
                        name="dcgminstance_unique",
                    )
                ],
            },
        ),
    ]
