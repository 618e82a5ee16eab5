"""Alerts (teams.alerts): idle-claim alert policies per team, alerts with one firing row per
kind and key (a partial unique constraint), and each alert's notifications."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("teams", "0002_drop_plaintext_api_tokens")]

    operations = [
        migrations.CreateModel(
            name="Alert",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "kind",
                    models.CharField(
                        choices=[
                            ("idle_claim", "idle claim"),
                            ("stranded_gang", "stranded gang"),
                            ("version_outlier", "version outlier"),
                        ],
                        max_length=32,
                    ),
                ),
                ("key", models.CharField(max_length=1100)),
                ("subject", models.CharField(max_length=300)),
                ("description", models.TextField(blank=True)),
                ("labels", models.JSONField(blank=True, default=dict)),
                ("recipients", models.JSONField(blank=True, default=list)),
                (
                    "state",
                    models.CharField(
                        choices=[("firing", "firing"), ("resolved", "resolved")],
                        default="firing",
                        max_length=16,
                    ),
                ),
                ("first_seen", models.DateTimeField()),
                ("last_seen", models.DateTimeField()),
                ("resolved_at", models.DateTimeField(blank=True, null=True)),
                ("snoozed_until", models.DateTimeField(blank=True, null=True)),
                ("snoozed_by", models.CharField(blank=True, max_length=253)),
                (
                    "team",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="alerts",
                        to="teams.team",
                    ),
                ),
            ],
        ),
        migrations.CreateModel(
            name="AlertDelivery",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "event",
                    models.CharField(
                        choices=[("firing", "firing"), ("resolved", "resolved")], max_length=16
                    ),
                ),
                ("channel", models.CharField(max_length=16)),
                ("target", models.CharField(blank=True, max_length=2000)),
                (
                    "state",
                    models.CharField(
                        choices=[
                            ("pending", "pending"),
                            ("sent", "sent"),
                            ("failed", "failed (gave up)"),
                            ("skipped", "skipped"),
                        ],
                        default="pending",
                        max_length=16,
                    ),
                ),
                ("attempts", models.PositiveIntegerField(default=0)),
                ("next_attempt_at", models.DateTimeField()),
                ("sent_at", models.DateTimeField(blank=True, null=True)),
                ("detail", models.TextField(blank=True)),
                (
                    "alert",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="deliveries",
                        to="teams.alert",
                    ),
                ),
            ],
            options={
                "verbose_name_plural": "alert deliveries",
            },
        ),
        migrations.CreateModel(
            name="IdleAlertPolicy",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("below_percent", models.DecimalField(decimal_places=2, max_digits=5)),
                ("for_hours", models.PositiveIntegerField()),
                (
                    "team",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="idle_alert_policy",
                        to="teams.team",
                    ),
                ),
            ],
            options={
                "verbose_name_plural": "idle alert policies",
            },
        ),
        migrations.AddIndex(
            model_name="alert",
            index=models.Index(fields=["state", "kind"], name="alert_state_kind"),
        ),
        migrations.AddConstraint(
            model_name="alert",
            constraint=models.UniqueConstraint(
                condition=models.Q(("state", "firing")),
                fields=("kind", "key"),
                name="alert_one_firing_per_key",
            ),
        ),
        migrations.AddIndex(
            model_name="alertdelivery",
            index=models.Index(
                condition=models.Q(("state", "pending")),
                fields=["next_attempt_at"],
                name="alertdelivery_pending",
            ),
        ),
        migrations.AddConstraint(
            model_name="alertdelivery",
            constraint=models.UniqueConstraint(
                fields=("alert", "event", "channel", "target"), name="alertdelivery_once"
            ),
        ),
        migrations.AddConstraint(
            model_name="idlealertpolicy",
            constraint=models.CheckConstraint(
                condition=models.Q(("below_percent__gt", 0), ("below_percent__lte", 100)),
                name="idlealertpolicy_percent",
            ),
        ),
        migrations.AddConstraint(
            model_name="idlealertpolicy",
            constraint=models.CheckConstraint(
                condition=models.Q(("for_hours__gte", 1)), name="idlealertpolicy_hours"
            ),
        ),
    ]
