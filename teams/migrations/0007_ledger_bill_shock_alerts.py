"""Bill-shock alerts (`billing.shock`): a kind of alert of their own."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("teams", "0006_ledger_dated_ownership"),
    ]

    operations = [
        migrations.AlterField(
            model_name="alert",
            name="kind",
            field=models.CharField(
                choices=[
                    ("idle_claim", "idle claim"),
                    ("stranded_gang", "stranded gang"),
                    ("version_outlier", "version outlier"),
                    ("metering_silent", "metering engine silent"),
                    ("bill_shock", "bill shock"),
                ],
                max_length=32,
            ),
        ),
    ]
