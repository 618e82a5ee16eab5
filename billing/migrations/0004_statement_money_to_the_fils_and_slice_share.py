"""Statement money holds every currency's minor unit; a line priced per slice-hour says so.

- `Statement.total` and `StatementLine.amount` keep three digits after the point: amounts are
  rounded to the currency's minor unit (`pricing.round_money`), the thousandth for the dinars
  and rials (BHD, KWD, JOD, OMR), which two digits cut short. Amounts already stored keep
  their value.
- `StatementLine.gpu_share`: on a line priced by a MIG profile's own rate card (a price per
  hour of one slice), the slice's share of its GPU; empty on lines priced per GPU-hour.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0003_sample_gap_usage_cheaper_writes"),
    ]

    operations = [
        migrations.AlterField(
            model_name="statement",
            name="total",
            field=models.DecimalField(decimal_places=3, default=0, max_digits=17),
        ),
        migrations.AlterField(
            model_name="statementline",
            name="amount",
            field=models.DecimalField(decimal_places=3, max_digits=17),
        ),
        migrations.AddField(
            model_name="statementline",
            name="gpu_share",
            field=models.DecimalField(blank=True, decimal_places=6, max_digits=9, null=True),
        ),
    ]
