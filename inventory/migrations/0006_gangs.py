# Gangs (issue 20): inventory.Gang and ResourceClaim.gang.
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("inventory", "0005_allocation_metering")]

    operations = [
        migrations.CreateModel(
            name="Gang",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("namespace", models.CharField(max_length=253)),
                ("key", models.CharField(max_length=320)),
                ("source", models.CharField(max_length=32)),
                ("size", models.PositiveIntegerField()),
                ("first_seen", models.DateTimeField()),
                ("last_seen", models.DateTimeField()),
                ("ended_at", models.DateTimeField(blank=True, db_index=True, null=True)),
                (
                    "cluster",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="gangs",
                        to="inventory.cluster",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("cluster", "namespace", "key"), name="gang_unique_key"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("size__gte", 1)), name="gang_size_positive"
                    ),
                ],
            },
        ),
        migrations.AddField(
            model_name="resourceclaim",
            name="gang",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="claims",
                to="inventory.gang",
            ),
        ),
    ]
