"""The newest hour beat's rollup has taken as the hour just ended (`RollupProgress`): hours a
workers' outage skipped are marked from it at the next run. No row until that run: a new table,
no rows to move."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0014_set_aside_per_cluster"),
    ]

    operations = [
        migrations.CreateModel(
            name="RollupProgress",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("rolled_through", models.DateTimeField()),
            ],
        ),
    ]
