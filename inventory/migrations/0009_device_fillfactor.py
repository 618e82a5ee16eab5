"""Room on each page of `inventory_device` for a device's next version (fillfactor 70).

A pool's new generation rewrites `pool_generation` of each of its devices (`inventory.services`,
a watch's slice event), a column no index holds. PostgreSQL can then write the new version
beside the old one on the same page without touching the table's 33 indexes (a HOT update),
but only where the page has room: at the default fillfactor of 100 the pages are full, and
each such update inserted into every index. Measured replaying the sync's benchmark
(`bench.sync`, 10,000 GPUs, batches of 100 slice events): no device update was HOT before,
81-84% after, and a slice event's PostgreSQL CPU went from 0.81-0.87 to 0.46-0.50 ms.

Applies to the pages written from now on (new devices, and versions moved off full pages); a
`VACUUM FULL inventory_device` repacks the existing ones. Reversible: the reverse resets it.
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0008_seen_times"),
    ]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE inventory_device SET (fillfactor = 70)",
            reverse_sql="ALTER TABLE inventory_device RESET (fillfactor)",
        ),
    ]
