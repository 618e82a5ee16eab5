"""The metering models, moved from billing (issue 37): state only.

Their tables keep the names they had as billing's (`billing_sample`, ...), so nothing in the
database changes: the models are created here in Django's state alone, with the same tables,
indexes and constraints, and billing's migration 0018 deletes them from billing's state.
"""

import django.contrib.postgres.indexes
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        # After billing's last migration that touched these models' tables; it comes after
        # the inventory's and teams' migrations that made the models they refer to.
        ("billing", "0017_ledger_bill_shock"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="DirtyHour",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("hour", models.DateTimeField(unique=True)),
                        ("marked_at", models.DateTimeField()),
                        ("version", models.BigIntegerField(default=0)),
                    ],
                    options={
                        "db_table": "billing_dirtyhour",
                    },
                ),
                migrations.CreateModel(
                    name="RollupProgress",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("rolled_through", models.DateTimeField()),
                    ],
                    options={
                        "db_table": "billing_rollupprogress",
                    },
                ),
                migrations.CreateModel(
                    name="AgentToken",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("node", models.CharField(max_length=253)),
                        ("token_sha256", models.CharField(max_length=64, unique=True)),
                        ("created_at", models.DateTimeField()),
                        ("revoked_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "cluster",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="agent_tokens",
                                to="inventory.cluster",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_agenttoken",
                    },
                ),
                migrations.CreateModel(
                    name="DcgmInstance",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("node", models.CharField(max_length=253)),
                        ("parent_uuid", models.CharField(max_length=128)),
                        ("gpu_instance_id", models.IntegerField()),
                        ("first_ms", models.BigIntegerField()),
                        ("last_ms", models.BigIntegerField()),
                    ],
                    options={
                        "db_table": "billing_dcgminstance",
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("parent_uuid", "gpu_instance_id", "node"),
                                name="dcgminstance_unique",
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="Sample",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("device_uuid", models.CharField(db_collation="C", max_length=128)),
                        ("ts_ms", models.BigIntegerField()),
                        ("gpu_util", models.FloatField(blank=True, null=True)),
                        ("mem_used_bytes", models.BigIntegerField(blank=True, null=True)),
                        ("processes", models.JSONField(blank=True, null=True)),
                        ("node", models.CharField(blank=True, max_length=253)),
                        ("received_at", models.DateTimeField()),
                        ("gap_ms", models.BigIntegerField(blank=True, null=True)),
                        ("covered_ms", models.BigIntegerField(blank=True, null=True)),
                        ("placed_gpu_instance", models.IntegerField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "billing_sample",
                        "indexes": [
                            django.contrib.postgres.indexes.BrinIndex(
                                autosummarize=True, fields=["ts_ms"], name="sample_ts"
                            )
                        ],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("device_uuid", "ts_ms"),
                                include=("gpu_util",),
                                name="sample_unique",
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="MigInstance",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("node", models.CharField(max_length=253)),
                        ("parent_uuid", models.CharField(max_length=128)),
                        ("gpu_instance_id", models.IntegerField()),
                        ("meter_id", models.CharField(max_length=128)),
                        ("first_ms", models.BigIntegerField()),
                        ("last_ms", models.BigIntegerField()),
                        (
                            "cluster",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="+",
                                to="inventory.cluster",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_miginstance",
                        "indexes": [
                            models.Index(
                                fields=[
                                    "cluster",
                                    "node",
                                    "parent_uuid",
                                    "gpu_instance_id",
                                    "last_ms",
                                ],
                                name="billing_mig_cluster_fcbc3c_idx",
                            ),
                            models.Index(
                                fields=["parent_uuid", "last_ms"],
                                name="billing_mig_parent__8bb00b_idx",
                            ),
                        ],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=(
                                    "cluster",
                                    "node",
                                    "parent_uuid",
                                    "gpu_instance_id",
                                    "first_ms",
                                    "meter_id",
                                ),
                                name="miginstance_unique_spell",
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="UnknownDeviceSample",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("device_uuid", models.CharField(db_index=True, max_length=128)),
                        ("ts_ms", models.BigIntegerField()),
                        ("gpu_util", models.FloatField(blank=True, null=True)),
                        ("mem_used_bytes", models.BigIntegerField(blank=True, null=True)),
                        ("processes", models.JSONField(blank=True, null=True)),
                        ("node", models.CharField(blank=True, max_length=253)),
                        ("received_at", models.DateTimeField(db_index=True)),
                        ("covered_ms", models.BigIntegerField(blank=True, null=True)),
                        ("mig_placement", models.JSONField(blank=True, null=True)),
                        ("gpu_instance", models.JSONField(blank=True, null=True)),
                        (
                            "agent_token",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="unknown_device_samples",
                                to="metering.agenttoken",
                            ),
                        ),
                        (
                            "cluster",
                            models.ForeignKey(
                                blank=True,
                                db_index=False,
                                null=True,
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="+",
                                to="inventory.cluster",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_unknowndevicesample",
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("device_uuid", "ts_ms", "node", "cluster"),
                                name="unknownsample_unique_per_cluster",
                                nulls_distinct=False,
                            )
                        ],
                    },
                ),
                migrations.CreateModel(
                    name="UsageHour",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("hour", models.DateTimeField()),
                        ("device_uuid", models.CharField(max_length=128)),
                        ("product_name", models.CharField(blank=True, max_length=253)),
                        ("profile", models.CharField(blank=True, max_length=64)),
                        ("gpu_share", models.DecimalField(decimal_places=6, max_digits=9)),
                        (
                            "unit",
                            models.CharField(
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
                        ("namespace", models.CharField(max_length=253)),
                        ("claim_name", models.CharField(max_length=253)),
                        ("job", models.TextField(blank=True)),
                        ("username", models.TextField(blank=True)),
                        ("allocated_gpu_ms", models.BigIntegerField()),
                        ("utilised_gpu_ms", models.BigIntegerField()),
                        ("unmeasured_gpu_ms", models.BigIntegerField()),
                        (
                            "allocation",
                            models.ForeignKey(
                                db_constraint=False,
                                db_index=False,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="usage",
                                to="inventory.allocation",
                            ),
                        ),
                        (
                            "cluster",
                            models.ForeignKey(
                                db_constraint=False,
                                db_index=False,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="usage",
                                to="inventory.cluster",
                            ),
                        ),
                        (
                            "team",
                            models.ForeignKey(
                                blank=True,
                                db_constraint=False,
                                db_index=False,
                                null=True,
                                on_delete=django.db.models.deletion.PROTECT,
                                to="teams.team",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "billing_usagehour",
                        "indexes": [models.Index(fields=["team", "hour"], name="usagehour_team")],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("hour", "allocation"), name="usagehour_unique"
                            )
                        ],
                    },
                ),
            ],
        ),
    ]
