"""Each statement keeps a baseline total, at most an hour old, that a refresh compares its
total with to see a jump (`billing.shock`)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0016_inputs_usage_text_fields"),
    ]

    operations = [
        migrations.AddField(
            model_name="statement",
            name="baseline_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="statement",
            name="baseline_total",
            field=models.DecimalField(decimal_places=3, default=0, max_digits=17),
        ),
    ]
