"""A budget is in hours of one unit (`inventory.models.Unit`): GPU-hours, TPU chip-hours, Gaudi
card-hours. Budgets set before were GPU-hour budgets, which the default keeps them.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("quota", "0002_webhook_records")]

    operations = [
        migrations.AddField(
            model_name="budget",
            name="unit",
            field=models.CharField(
                choices=[
                    ("gpu", "GPU"),
                    ("tpu", "TPU chip"),
                    ("gaudi", "Gaudi card"),
                    ("accelerator", "accelerator"),
                ],
                default="gpu",
                max_length=16,
            ),
        ),
    ]
