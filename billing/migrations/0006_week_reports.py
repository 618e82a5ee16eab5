"""Week reports sent: one row per team and week (`billing.models.WeekReport`)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("billing", "0005_unknown_sample_node")]

    operations = [
        migrations.CreateModel(
            name="WeekReport",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("week_start", models.DateTimeField()),
                ("sent_at", models.DateTimeField(blank=True, null=True)),
                ("recipients", models.JSONField(blank=True, default=list)),
                (
                    "team",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="week_reports",
                        to="teams.team",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("team", "week_start"), name="weekreport_unique")
                ],
            },
        ),
    ]
