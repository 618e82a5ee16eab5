"""Since when each sync warning has been true, and when a device shape was last in use.

`Pool.newest_generation_seen_at` and `ResourceSlice.generation_seen_at` say since when a pool
has been incomplete and since when a generation's slices have said what they say
(`inventory.checks`); `DeviceShape.unused_since` lets the relist delete a shape once no device
has had it for a while (`inventory.services.delete_unused_shapes`).

Rows stored before are filled in with the best time they hold: a pool's last recount
(`updated_at`, when its newest generation last changed or later) and a slice's `first_seen`.
Reversible: the reverse drops the columns.
"""

from django.db import migrations, models

_FILL = (
    "UPDATE inventory_pool SET newest_generation_seen_at = updated_at",
    "UPDATE inventory_resourceslice SET generation_seen_at = first_seen",
)


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0007_node_shape_counts"),
    ]

    operations = [
        migrations.AddField(
            model_name="deviceshape",
            name="unused_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="pool",
            name="newest_generation_seen_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="resourceslice",
            name="generation_seen_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunSQL(_FILL, migrations.RunSQL.noop),
    ]
