"""Mark versions and what a set-aside sample needs to be adopted as it was sent.

`DirtyHour.version`, from its own sequence, is new at every mark (`billing.dirty.mark_dirty`),
so a rollup takes away only the marks it read. An unknown device's sample keeps a mean's
covered time and a dynamic MIG sample's placement, so adoption stores it as ingest would have.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0009_usage_change_marks"),
    ]

    operations = [
        migrations.RunSQL(
            "CREATE SEQUENCE billing_dirtyhour_version",
            "DROP SEQUENCE billing_dirtyhour_version",
        ),
        migrations.AddField(
            model_name="dirtyhour",
            name="version",
            field=models.BigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="unknowndevicesample",
            name="covered_ms",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="unknowndevicesample",
            name="mig_placement",
            field=models.JSONField(blank=True, null=True),
        ),
    ]
