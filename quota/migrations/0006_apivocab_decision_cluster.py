"""Each admission decision names its cluster (issue 35): the webhook writes its
TALLY_CLUSTER_NAME from now on. Decisions made before are given the cluster of the reservation
their admission made (the same admission uid), the only record of where they were decided;
the others (denials, claims no rule limits that left no reservation) stay unknown (empty)."""

from django.db import migrations, models

BACKFILL = """
UPDATE quota_admissiondecision AS decision
SET cluster = reservation.cluster
FROM quota_reservation AS reservation
WHERE reservation.admission_uid = decision.uid
  AND decision.uid <> ''
  AND decision.cluster = ''
"""


class Migration(migrations.Migration):
    dependencies = [
        ("quota", "0005_inputs_reservation_spec_digest"),
    ]

    operations = [
        migrations.AddField(
            model_name="admissiondecision",
            name="cluster",
            field=models.CharField(blank=True, db_default="", default="", max_length=63),
        ),
        migrations.RunSQL(BACKFILL, reverse_sql=migrations.RunSQL.noop),
    ]
