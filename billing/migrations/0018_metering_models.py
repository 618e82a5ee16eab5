"""The metering models leave billing's state for the metering app's (issue 37).

State only: their tables stay as they are (`billing_sample`, ...), now the metering models'
(`metering` migration 0001), whose content types were renamed first (`metering` 0002).
"""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0002_metering_content_types"),
        ("billing", "0017_ledger_bill_shock"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.RemoveField(
                    model_name="agenttoken",
                    name="cluster",
                ),
                migrations.RemoveField(
                    model_name="unknowndevicesample",
                    name="agent_token",
                ),
                migrations.DeleteModel(
                    name="DcgmInstance",
                ),
                migrations.DeleteModel(
                    name="DirtyHour",
                ),
                migrations.RemoveField(
                    model_name="miginstance",
                    name="cluster",
                ),
                migrations.DeleteModel(
                    name="RollupProgress",
                ),
                migrations.DeleteModel(
                    name="Sample",
                ),
                migrations.RemoveField(
                    model_name="unknowndevicesample",
                    name="cluster",
                ),
                migrations.RemoveField(
                    model_name="usagehour",
                    name="allocation",
                ),
                migrations.RemoveField(
                    model_name="usagehour",
                    name="cluster",
                ),
                migrations.RemoveField(
                    model_name="usagehour",
                    name="team",
                ),
                migrations.DeleteModel(
                    name="AgentToken",
                ),
                migrations.DeleteModel(
                    name="MigInstance",
                ),
                migrations.DeleteModel(
                    name="UnknownDeviceSample",
                ),
                migrations.DeleteModel(
                    name="UsageHour",
                ),
            ],
        ),
    ]
