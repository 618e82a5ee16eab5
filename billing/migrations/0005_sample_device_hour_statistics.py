"""The planner's count of (device, hour) groups among samples (PostgreSQL).

The rollup sums samples per device and hour (`GROUP BY device_uuid, ts_ms / 3600000`). Left to
multiply the two columns' own distinct counts, PostgreSQL guessed a week of a 1,000-GPU fleet
at a million groups, not 168,000; the hash table it foresaw did not fit `work_mem`, so it
sorted 10 million rows on disk instead, at three times the cost. Extended statistics on the
pair (PostgreSQL 14+) give it the real count; `ANALYZE` (autovacuum's, or the one here) fills
them. SQLite has no such statistics and needs none.
"""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def create_statistics(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE STATISTICS IF NOT EXISTS billing_sample_device_hour (ndistinct) "
            "ON device_uuid, (ts_ms / 3600000) FROM billing_sample"
        )
        schema_editor.execute("ANALYZE billing_sample")


def drop_statistics(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP STATISTICS IF EXISTS billing_sample_device_hour")


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0004_statement_money_to_the_fils_and_slice_share"),
    ]

    operations = [migrations.RunPython(create_statistics, drop_statistics)]
