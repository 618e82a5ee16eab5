"""Usage rows and statement lines say what their hours count (`inventory.models.Unit`): GPU-
hours, TPU chip-hours, Gaudi card-hours.

Rows rolled up before carry their device's unit; a statement line the unit of the usage its
team had of that model in that period (lines of closed periods too: the unit names what their
hours were, it changes no figure).
"""

from django.db import migrations, models

USAGE_UNITS = """
UPDATE billing_usagehour AS usage
SET unit = device.unit
FROM inventory_allocation AS allocation
JOIN inventory_device AS device ON device.id = allocation.device_id
WHERE allocation.id = usage.allocation_id AND device.unit <> usage.unit
"""
LINE_UNITS = """
UPDATE billing_statementline AS line
SET unit = used.unit
FROM billing_statement AS statement
JOIN billing_period AS period ON period.id = statement.period_id
JOIN LATERAL (
    SELECT DISTINCT usage.unit, usage.product_name FROM billing_usagehour AS usage
    WHERE usage.team_id = statement.team_id
      AND usage.hour >= period.start AND usage.hour < period."end"
      AND usage.unit <> 'gpu'
) AS used ON true
WHERE statement.id = line.statement_id AND used.product_name = line.product_name
"""

UNITS = [
    ("gpu", "GPU"),
    ("tpu", "TPU chip"),
    ("gaudi", "Gaudi card"),
    ("accelerator", "accelerator"),
]


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0003_bounded_unknown_samples_charged_allocations"),
        ("inventory", "0003_driver_profiles_meter_ids"),
    ]

    operations = [
        migrations.AddField(
            model_name="usagehour",
            name="unit",
            field=models.CharField(choices=UNITS, default="gpu", max_length=16),
        ),
        migrations.AddField(
            model_name="statementline",
            name="unit",
            field=models.CharField(choices=UNITS, default="gpu", max_length=16),
        ),
        migrations.RunSQL(USAGE_UNITS, migrations.RunSQL.noop),
        migrations.RunSQL(LINE_UNITS, migrations.RunSQL.noop),
    ]
