"""A GPU instance's devices as spells (`billing.MigInstance`): one row per uninterrupted run of
one device's samples under a GPU instance id, not one per device widened over every other
device's, so an id reused A, B, A maps each reading to one device. Samples set aside keep their
GPU instance (`UnknownDeviceSample.gpu_instance`), so that adopting them records it.

Rows written before are kept, and where an id was reused (two devices' rows overlap) split at
each other's ends and their own samples between (`billing.mig_instances`), as if their samples
had come in again."""

from typing import Any

from django.db import migrations, models

from metering.mig_instances import split_overlapping_spells


def split_overlapping(apps: Any, schema_editor: Any) -> None:
    with schema_editor.connection.cursor() as cursor:
        split_overlapping_spells(cursor)


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0011_mig_instances"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="miginstance",
            name="miginstance_unique_device",
        ),
        migrations.AddField(
            model_name="unknowndevicesample",
            name="gpu_instance",
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AddConstraint(
            model_name="miginstance",
            constraint=models.UniqueConstraint(
                fields=(
                    "cluster",
                    "node",
                    "parent_uuid",
                    "gpu_instance_id",
                    "first_ms",
                    "meter_id",
                ),
                name="miginstance_unique_spell",
            ),
        ),
        migrations.RemoveIndex(
            model_name="miginstance",
            name="billing_mig_parent__f0f47f_idx",
        ),
        migrations.AddIndex(
            model_name="miginstance",
            index=models.Index(
                fields=["cluster", "node", "parent_uuid", "gpu_instance_id", "last_ms"],
                name="billing_mig_cluster_fcbc3c_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="miginstance",
            index=models.Index(
                fields=["parent_uuid", "last_ms"], name="billing_mig_parent__8bb00b_idx"
            ),
        ),
        migrations.RunPython(split_overlapping, migrations.RunPython.noop),
    ]
