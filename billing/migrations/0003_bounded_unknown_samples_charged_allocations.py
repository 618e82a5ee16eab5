"""Samples of unknown devices bounded per agent token, and expired by their arrival; and the
allocations already charged keep who was charged.

`inventory`'s migration before this one gave every allocation the team that owns its
namespace now. One already rolled up was charged to the team that owned it then: that team,
from its first usage row, stays (so a rerun of a closed period moves nothing), as do the job
and user its rows name where the claim has none.
"""

import django.db.models.deletion
from django.db import migrations, models

CHARGED = """
UPDATE inventory_allocation AS allocation
SET team_id = charged.team_id,
    job = CASE WHEN allocation.job = '' THEN charged.job ELSE allocation.job END,
    username = CASE WHEN allocation.username = '' THEN charged.username
               ELSE allocation.username END
FROM (
    SELECT DISTINCT ON (allocation_id) allocation_id, team_id, job, username
    FROM billing_usagehour
    ORDER BY allocation_id, hour
) AS charged
WHERE charged.allocation_id = allocation.id
"""


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0002_sample_device_hour_statistics"),
        ("inventory", "0002_allocation_attribution"),
    ]

    operations = [
        migrations.AddField(
            model_name="unknowndevicesample",
            name="agent_token",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="unknown_device_samples",
                to="billing.agenttoken",
            ),
        ),
        migrations.AlterField(
            model_name="unknowndevicesample",
            name="received_at",
            field=models.DateTimeField(db_index=True),
        ),
        migrations.RunSQL(CHARGED, migrations.RunSQL.noop, elidable=True),
    ]
