"""Each admission decision keeps the person behind a claim a controller made for someone
(issue 35): the `tally.dev/created-by` of the claim's owners, read when the webhook decided,
so that a denied template claim names its person and not the resource-claim controller.
Decisions made before stay empty (the decision log falls back on what the inventory found)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("quota", "0007_narrow_narrowing_policy"),
    ]

    operations = [
        migrations.AddField(
            model_name="admissiondecision",
            name="created_by",
            field=models.TextField(blank=True, db_default="", default=""),
        ),
    ]
