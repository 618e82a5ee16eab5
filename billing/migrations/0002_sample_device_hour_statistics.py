"""The planner's count of (device, hour) groups among samples.

The rollup sums samples per device and hour (`GROUP BY device_uuid, ts_ms / 3600000`). Left to
multiply the two columns' own distinct counts, PostgreSQL guessed a week of a 1,000-GPU fleet
at a million groups, not 168,000; the hash table it foresaw did not fit `work_mem`, so it
sorted 10 million rows on disk instead, at three times the cost. Extended statistics on the
pair give it the real count; `ANALYZE` (autovacuum's) fills them.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0001_initial"),
    ]

    operations = [
        migrations.RunSQL(
            "CREATE STATISTICS billing_sample_device_hour (ndistinct) "
            "ON device_uuid, (ts_ms / 3600000) FROM billing_sample",
            "DROP STATISTICS billing_sample_device_hour",
        )
    ]
