"""Samples carry the time to their device's next sample; usage rows are cheaper to write.

- `Sample.gap_ms`, filled here for the samples already stored (one pass over the table, in
  (device, time) order: about a minute for 10 million samples on a 2-core machine) and kept
  by `ingest` from now on, so the rollup no longer orders an hour's samples to find each
  one's span.
- `UsageHour` loses its foreign-key constraints (Django's PROTECT still guards deletes) and
  the indexes no read uses (hour alone, allocation, cluster, team alone): a rollup writes
  these rows by the thousand.
"""

import django.db.models.deletion
from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

# PostgreSQL and SQLite (3.33 or later) both take UPDATE ... FROM with a window.
FILL_GAPS = """
UPDATE billing_sample SET gap_ms = following.gap
FROM (
    SELECT id, LEAD(ts_ms) OVER (PARTITION BY device_uuid ORDER BY ts_ms) - ts_ms AS gap
    FROM billing_sample
) AS following
WHERE billing_sample.id = following.id AND following.gap IS NOT NULL
"""


def fill_gaps(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    schema_editor.execute(FILL_GAPS)


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0002_sample_bytewise_uuid_brin_ts"),
        ("inventory", "0004_cluster_fleet_version"),
        ("quota", "0002_reservationline_no_extra_index"),
    ]

    operations = [
        migrations.AddField(
            model_name="sample",
            name="gap_ms",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.RunPython(fill_gaps, migrations.RunPython.noop, elidable=True),
        migrations.AlterField(
            model_name="usagehour",
            name="allocation",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="usage",
                to="inventory.allocation",
            ),
        ),
        migrations.AlterField(
            model_name="usagehour",
            name="cluster",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="usage",
                to="inventory.cluster",
            ),
        ),
        migrations.AlterField(
            model_name="usagehour",
            name="hour",
            field=models.DateTimeField(),
        ),
        migrations.AlterField(
            model_name="usagehour",
            name="team",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                to="quota.team",
            ),
        ),
    ]
