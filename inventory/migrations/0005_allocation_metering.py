"""Allocations keep what they are metered and counted by, from when they start.

Existing allocations take them from their device as it is now: the best record there is of
what it was when they started. Those that consumed part of a device's capacity (KEP-5075)
hold that part of its share, worked out as the sync does.
"""

from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from django.db import migrations, models

from inventory.capacity import CapacityError, consumed_fraction

_MILLIONTH = Decimal("0.000001")

# One statement for every linked allocation: a device that is no accelerator holds no share.
_FROM_DEVICES = """
UPDATE inventory_allocation AS a
SET meter_id = d.meter_id, unit = d.unit, product_name = d.product_name, profile = d.profile,
    device_share = d.gpu_share,
    gpu_share = CASE WHEN d.kind = 'other' THEN 0 ELSE d.gpu_share END
FROM inventory_device AS d
WHERE d.id = a.device_id
"""


def fill_metering(apps: Any, schema_editor: Any) -> None:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(_FROM_DEVICES)
    allocation_model = apps.get_model("inventory", "Allocation")
    consuming = (
        allocation_model.objects.filter(device__isnull=False)
        .exclude(consumed_capacity={})
        .select_related("device")
        .only("pk", "consumed_capacity", "gpu_share", "device__capacity", "device__driver")
    )
    changed = []
    for allocation in consuming.iterator(chunk_size=1000):
        try:
            fraction = consumed_fraction(
                allocation.device.capacity, allocation.consumed_capacity, allocation.device.driver
            )
        except CapacityError:
            fraction = Decimal(1)
        allocation.gpu_share = (allocation.gpu_share * fraction).quantize(
            _MILLIONTH, ROUND_HALF_EVEN
        )
        changed.append(allocation)
    allocation_model.objects.bulk_update(changed, ["gpu_share"], batch_size=1000)


class Migration(migrations.Migration):
    dependencies = [("inventory", "0004_version_baselines")]

    operations = [
        migrations.AddField(
            model_name="allocation",
            name="meter_id",
            field=models.CharField(blank=True, max_length=128),
        ),
        migrations.AddField(
            model_name="allocation",
            name="unit",
            field=models.CharField(
                blank=True,
                choices=[
                    ("gpu", "GPU"),
                    ("tpu", "TPU chip"),
                    ("gaudi", "Gaudi card"),
                    ("accelerator", "accelerator"),
                ],
                max_length=16,
            ),
        ),
        migrations.AddField(
            model_name="allocation",
            name="product_name",
            field=models.CharField(blank=True, max_length=253),
        ),
        migrations.AddField(
            model_name="allocation",
            name="profile",
            field=models.CharField(blank=True, max_length=64),
        ),
        migrations.AddField(
            model_name="allocation",
            name="device_share",
            field=models.DecimalField(decimal_places=6, default=0, max_digits=9),
        ),
        migrations.AddField(
            model_name="allocation",
            name="gpu_share",
            field=models.DecimalField(decimal_places=6, default=0, max_digits=9),
        ),
        migrations.RunPython(fill_metering, migrations.RunPython.noop),
    ]
