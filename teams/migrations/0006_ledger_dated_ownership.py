"""Namespace ownership dated (`TeamNamespace.valid_from`, `valid_until`): a namespace keeps
its past owners, one current. The rows kept are current and owned since before dating
(`valid_from` null); `inventory` 0010 dates them from what the allocations were charged."""

import django.db.models.manager
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("teams", "0005_sso_group_roles"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="teamnamespace",
            options={"base_manager_name": "dated", "default_manager_name": "objects"},
        ),
        migrations.AlterModelManagers(
            name="teamnamespace",
            managers=[
                ("dated", django.db.models.manager.Manager()),
                ("objects", django.db.models.manager.Manager()),
            ],
        ),
        migrations.AddField(
            model_name="teamnamespace",
            name="valid_from",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="teamnamespace",
            name="valid_until",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name="teamnamespace",
            name="namespace",
            field=models.CharField(max_length=63),
        ),
        migrations.AddIndex(
            model_name="teamnamespace",
            index=models.Index(fields=["namespace", "valid_from"], name="teamnamespace_dated"),
        ),
        migrations.AddConstraint(
            model_name="teamnamespace",
            constraint=models.UniqueConstraint(
                condition=models.Q(("valid_until__isnull", True)),
                fields=("namespace",),
                name="teamnamespace_one_owner_now",
            ),
        ),
        migrations.AddConstraint(
            model_name="teamnamespace",
            constraint=models.CheckConstraint(
                condition=models.Q(
                    ("valid_from__isnull", True),
                    ("valid_until__isnull", True),
                    ("valid_until__gte", models.F("valid_from")),
                    _connector="OR",
                ),
                name="teamnamespace_valid_order",
            ),
        ),
    ]
