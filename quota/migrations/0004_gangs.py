# Gang-aware admission (issue 20): a team's gang policy, the holds of gangs admitted whole and
# their lines, and the gang of each reservation's claim.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("quota", "0003_budget_unit"),
        ("inventory", "0006_gangs"),
        ("teams", "0002_drop_plaintext_api_tokens"),
    ]

    operations = [
        migrations.CreateModel(
            name="GangPolicy",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "mode",
                    models.CharField(
                        choices=[
                            ("enforce", "enforce (admit a gang whole or not at all)"),
                            (
                                "warn",
                                "warn (decide each claim alone; warn when its gang cannot fit "
                                "whole)",
                            ),
                            ("off", "off (decide each claim alone)"),
                        ],
                        default="enforce",
                        max_length=8,
                    ),
                ),
                (
                    "team",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="gang_policy",
                        to="teams.team",
                    ),
                ),
            ],
            options={"verbose_name_plural": "gang policies"},
        ),
        migrations.CreateModel(
            name="GangReservation",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("cluster", models.CharField(max_length=63)),
                ("namespace", models.CharField(max_length=253)),
                ("key", models.CharField(max_length=320)),
                ("source", models.CharField(max_length=16)),
                ("size", models.PositiveIntegerField()),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("reserved", "reserved at admission"),
                            ("allocated", "allocated by the scheduler"),
                            ("released", "released"),
                        ],
                        default="reserved",
                        max_length=16,
                    ),
                ),
                ("created_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField(blank=True, null=True)),
                ("released_at", models.DateTimeField(blank=True, null=True)),
                (
                    "team",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="gang_reservations",
                        to="teams.team",
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(fields=["state", "expires_at"], name="gangreservation_expiry")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("state", "released"), _negated=True),
                        fields=("cluster", "namespace", "key"),
                        name="gangreservation_unique_live",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="GangReservationLine",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("amount", models.DecimalField(decimal_places=6, max_digits=24)),
                (
                    "gang_reservation",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="lines",
                        to="quota.gangreservation",
                    ),
                ),
                (
                    "rule",
                    models.ForeignKey(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="gang_lines",
                        to="quota.quotarule",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        fields=("gang_reservation", "rule"), name="gangreservationline_unique"
                    ),
                    models.CheckConstraint(
                        condition=models.Q(("amount__gte", 0)),
                        name="gangreservationline_amount_positive",
                    ),
                ]
            },
        ),
        migrations.AddField(
            model_name="reservation",
            name="gang_key",
            field=models.CharField(blank=True, db_default="", default="", max_length=320),
        ),
        migrations.AddIndex(
            model_name="reservation",
            index=models.Index(
                condition=models.Q(
                    models.Q(("gang_key", ""), _negated=True),
                    models.Q(("state", "released"), _negated=True),
                ),
                fields=["cluster", "namespace", "gang_key"],
                name="reservation_live_gang_member",
            ),
        ),
    ]
