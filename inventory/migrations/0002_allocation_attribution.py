"""Who is charged for an allocation, kept on it from its start (team, job, username).

Allocations stored before this take what the inventory knows now: the team owning the claim's
namespace, the claim's job (else the one the webhook saw), the user who created it.
`billing`'s migration after this one corrects the team of those already charged in a rollup
to the team that was charged then.
"""

import django.db.models.deletion
from django.db import migrations, models

BACKFILL = """
UPDATE inventory_allocation AS allocation
SET team_id = owner.team_id,
    job = COALESCE(NULLIF(claim.job, ''), claim.admitted_job),
    username = claim.created_by
FROM inventory_resourceclaim AS claim
LEFT JOIN teams_teamnamespace AS owner ON owner.namespace = claim.namespace
WHERE claim.id = allocation.claim_id
"""


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0001_initial"),
        ("teams", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="allocation",
            name="job",
            field=models.TextField(blank=True),
        ),
        migrations.AddField(
            model_name="allocation",
            name="team",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="allocations",
                to="teams.team",
            ),
        ),
        migrations.AddField(
            model_name="allocation",
            name="username",
            field=models.TextField(blank=True),
        ),
        migrations.RunSQL(BACKFILL, migrations.RunSQL.noop, elidable=True),
    ]
