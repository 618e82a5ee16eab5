"""A mean's covered time stored with its sample (`covered_ms`), so the rollup holds a minute
mean's utilisation for the time its readings covered, not the whole gap to the next sample.
Added to the partitioned table, so to every day's partition; null for single readings."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0007_sample_partitions"),
    ]

    operations = [
        migrations.AddField(
            model_name="sample",
            name="covered_ms",
            field=models.BigIntegerField(blank=True, null=True),
        ),
    ]
