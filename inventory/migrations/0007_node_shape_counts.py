"""Present devices counted per (node, shape) by triggers on the device table.

`inventory_nodeshapecount` holds, per device shape and node (NULL: devices published without
one), how many present devices (`gone_at IS NULL`) there are, and the id of the transaction
that last changed the count (`changed_xid`, `pg_current_xact_id()`). Three statement-level
triggers (insert, update, delete; COPY fires the insert one) add what each statement changed,
from its transition tables: one grouped upsert per statement, in (shape, node) order, only for
the counts that moved. So the counts change in the transaction that changed the devices, and
cannot fall behind them whatever path wrote them. A count that falls to zero stays, so that a
reader that reads only what changed since it last read (`quota.admission.shapes`) sees it fall.

The counts of the devices present now are filled in after the triggers exist, in the same
transaction (which holds the device table's lock from the first trigger on): none is missed
or counted twice. Reversible: the reverse drops the triggers, their functions and the table.
"""

import django.db.models.deletion
from django.db import migrations, models

_PRESENT = "gone_at IS NULL AND shape_id IS NOT NULL"

# What each statement changed, as (cluster_id, node_id, shape_id, delta) rows.
_ADDED = f"SELECT cluster_id, node_id, shape_id, 1 AS delta FROM new_devices WHERE {_PRESENT}"
_TAKEN = f"SELECT cluster_id, node_id, shape_id, -1 AS delta FROM old_devices WHERE {_PRESENT}"
_DELTAS = {"insert": _ADDED, "delete": _TAKEN, "update": f"{_ADDED} UNION ALL {_TAKEN}"}
_TRANSITIONS = {
    "insert": "NEW TABLE AS new_devices",
    "delete": "OLD TABLE AS old_devices",
    "update": "OLD TABLE AS old_devices NEW TABLE AS new_devices",
}


def _trigger(event: str) -> list[str]:
    function = f"""
CREATE FUNCTION inventory_nodeshapecount_{event}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO inventory_nodeshapecount AS counted
        (cluster_id, node_id, shape_id, devices, changed_xid)
    SELECT cluster_id, node_id, shape_id, sum(delta), pg_current_xact_id()::text::bigint
    FROM ({_DELTAS[event]}) AS deltas
    GROUP BY cluster_id, node_id, shape_id
    HAVING sum(delta) <> 0
    ORDER BY shape_id, node_id
    ON CONFLICT (shape_id, node_id) DO UPDATE
        SET devices = counted.devices + EXCLUDED.devices, changed_xid = EXCLUDED.changed_xid;
    RETURN NULL;
END
$$"""
    trigger = f"""
CREATE TRIGGER inventory_nodeshapecount_{event}
    AFTER {event.upper()} ON inventory_device
    REFERENCING {_TRANSITIONS[event]}
    FOR EACH STATEMENT EXECUTE FUNCTION inventory_nodeshapecount_{event}()"""
    return [function, trigger]


# Statements one by one (RunSQL would split one string at every semicolon, the functions' too).
_TRIGGERS = tuple(statement for event in _DELTAS for statement in _trigger(event))
_DROP_TRIGGERS = tuple(
    statement
    for event in _DELTAS
    for statement in (
        f"DROP TRIGGER inventory_nodeshapecount_{event} ON inventory_device",
        f"DROP FUNCTION inventory_nodeshapecount_{event}()",
    )
)
_FILL = f"""
INSERT INTO inventory_nodeshapecount (cluster_id, node_id, shape_id, devices, changed_xid)
SELECT cluster_id, node_id, shape_id, count(*), pg_current_xact_id()::text::bigint
FROM inventory_device WHERE {_PRESENT}
GROUP BY cluster_id, node_id, shape_id
"""


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0006_gangs"),
    ]

    operations = [
        migrations.CreateModel(
            name="NodeShapeCount",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("devices", models.IntegerField()),
                ("changed_xid", models.BigIntegerField()),
                (
                    "cluster",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="inventory.cluster",
                    ),
                ),
                (
                    "node",
                    models.ForeignKey(
                        null=True,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="inventory.node",
                    ),
                ),
                (
                    "shape",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="inventory.deviceshape",
                    ),
                ),
            ],
            options={
                "indexes": [
                    models.Index(fields=["cluster", "changed_xid"], name="nodeshapecount_changed")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("shape", "node"),
                        name="nodeshapecount_unique",
                        nulls_distinct=False,
                    )
                ],
            },
        ),
        migrations.RunSQL(_TRIGGERS, _DROP_TRIGGERS),
        migrations.RunSQL(_FILL, migrations.RunSQL.noop),
    ]
