"""Samples set aside are unique per device, instant, sending node and cluster (a token's: its
token's, now written with it), so that one cluster's token naming a GPU instance of another
cluster's node of the same name cannot make that cluster's own DCGM sample a duplicate
(`billing.ingest`). The samples set aside before, with a token, are given its cluster first.

The table is bounded (each token's TALLY_INGEST_MAX_UNKNOWN_SAMPLES, and what no device claims
within TALLY_INGEST_UNKNOWN_RETENTION_DAYS is deleted), so the update and the new unique index
are small; the rows satisfy the narrower constraint, so it is added before the old one goes.

DCGM samples named `<parent UUID>::gi<N>` set aside before migration 0013 need no step here:
the rollup's adoption places every such sample a spell covers (`adopt_unknown_samples`).
"""

from django.db import migrations, models

_TOKENS_CLUSTER_SQL = """
UPDATE billing_unknowndevicesample AS u SET cluster_id = t.cluster_id
FROM billing_agenttoken AS t
WHERE u.agent_token_id = t.id AND u.cluster_id IS NULL
"""


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0013_dcgm_instance_samples"),
    ]

    operations = [
        migrations.RunSQL(_TOKENS_CLUSTER_SQL, migrations.RunSQL.noop),
        migrations.AddConstraint(
            model_name="unknowndevicesample",
            constraint=models.UniqueConstraint(
                fields=("device_uuid", "ts_ms", "node", "cluster"),
                nulls_distinct=False,
                name="unknownsample_unique_per_cluster",
            ),
        ),
        migrations.RemoveConstraint(
            model_name="unknowndevicesample",
            name="unknownsample_unique_per_node",
        ),
    ]
