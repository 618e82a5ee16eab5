"""Samples set aside are unique per device, instant and the node that sent them.

A node's token could name a device on another node before the inventory knows it; such
samples are never adopted (`billing.ingest.adopt_unknown_samples`), and with a uniqueness
per device and instant alone they would also crowd out what that device's own agent sends at
the same instants. The rows already stored satisfy the wider constraint, so it is added
before the narrow one is dropped.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0004_usage_units"),
    ]

    operations = [
        migrations.AddConstraint(
            model_name="unknowndevicesample",
            constraint=models.UniqueConstraint(
                fields=("device_uuid", "ts_ms", "node"), name="unknownsample_unique_per_node"
            ),
        ),
        migrations.RemoveConstraint(
            model_name="unknowndevicesample",
            name="unknownsample_unique",
        ),
    ]
