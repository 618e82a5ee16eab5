"""Per device-hour sums kept as samples are written (issue 38): `metering_hoursum` and
`metering_hoursumstate` (the hold they are made with), the triggers on `billing_sample` that
keep them, and `metering_hoursum_fill()`, which makes them again from every sample.

Three statement-level triggers on the partitioned `billing_sample` (insert, update, delete;
COPY fires the insert one; an INSERT ... ON CONFLICT DO UPDATE the insert and update ones) add
what each statement changed, from its transition tables: per (device, hour) the new rows'
contributions less the old rows', one grouped upsert per statement in key order, only for the
sums that moved. The arithmetic is the rollup's per-hour SQL (`metering.rollup._PER_HOUR_SQL`)
for hours that have ended: integers, each reading rounded to a millionth of a percent, so the
sums are exact in any order. A statement aimed at a partition (compaction's moves, a
partition's rows moved out of DEFAULT or rewritten) fires none of them: each is a move that
changes no sum. A thaw (`metering.blocks.thaw_samples`) goes through the parent and says so:
it sets `tally.hoursum_skip` (transaction-local) as its rows go in, and the trigger that then
skips the statement clears it, so it holds for that statement alone. A TRUNCATE of
`billing_sample` makes the sums again from what is left (the blocks). Dropping a day's
partition makes its hours' sums again from what is left of them
(`metering.retention.drop_day_partition`: usually nothing).

The sums of the samples stored now (`billing_sample` and the blocks) are made after the triggers
exist, in the same transaction (which holds `billing_sample`'s lock from the first trigger on):
none is missed or counted twice. Reversible: the reverse drops the triggers, the functions and
the tables.
"""

from django.conf import settings
from django.db import migrations, models

# Per (device, hour) of the rows of `{deltas}` (device_uuid, ts_ms, gpu_util, gap_ms,
# covered_ms, sign), under the hold `held_ms`: the time their spans cover in their own hour,
# weighted by utilisation, and the same past the hour's end. As `_PER_HOUR_SQL` for an hour
# that has ended: a span is at most the hold long, at most an hour, so it ends before the
# next hour does.
_SUMS = """
SELECT device_uuid, h, sum(sign * a) AS covered, sum(sign * a * u) AS weighted,
       sum(sign * sp) AS spill, sum(sign * sp * u) AS spill_weighted
FROM (
    SELECT device_uuid, sign, h, u, LEAST(e, next_h) - ts_ms AS a,
           GREATEST(e - next_h, 0) AS sp
    FROM (
        SELECT device_uuid, sign, ts_ms, ts_ms / 3600000 AS h,
               (ts_ms / 3600000 + 1) * 3600000 AS next_h,
               ts_ms + LEAST(gap_ms, covered_ms, held_ms) AS e,
               CAST(round(gpu_util * 1000000) AS bigint) AS u
        FROM ({deltas}) AS d
        WHERE gpu_util IS NOT NULL
    ) AS spans
) AS parts
GROUP BY device_uuid, h
"""
_COLUMNS = "device_uuid, ts_ms, gpu_util, gap_ms, covered_ms"
_ADDED = f"SELECT {_COLUMNS}, 1 AS sign FROM new_samples"
_TAKEN = f"SELECT {_COLUMNS}, -1 AS sign FROM old_samples"
_DELTAS = {"insert": _ADDED, "delete": _TAKEN, "update": f"{_ADDED} UNION ALL {_TAKEN}"}
_TRANSITIONS = {
    "insert": "NEW TABLE AS new_samples",
    "delete": "OLD TABLE AS old_samples",
    "update": "OLD TABLE AS old_samples NEW TABLE AS new_samples",
}


def _trigger(event: str) -> list[str]:
    sums = _SUMS.format(deltas=_DELTAS[event])
    function = f"""
CREATE FUNCTION metering_hoursum_{event}() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    held_ms bigint;
BEGIN
    IF current_setting('tally.hoursum_skip', true) = 'on' THEN
        PERFORM set_config('tally.hoursum_skip', '', true);
        RETURN NULL;
    END IF;
    SELECT hold_ms INTO held_ms FROM metering_hoursumstate WHERE id = 1;
    IF held_ms IS NULL THEN
        RETURN NULL;
    END IF;
    INSERT INTO metering_hoursum AS t (device_uuid, h, covered, weighted, spill, spill_weighted)
    SELECT * FROM ({sums}) AS sums
    WHERE covered <> 0 OR weighted <> 0 OR spill <> 0 OR spill_weighted <> 0
    ORDER BY device_uuid, h
    ON CONFLICT (device_uuid, h) DO UPDATE
        SET covered = t.covered + EXCLUDED.covered, weighted = t.weighted + EXCLUDED.weighted,
            spill = t.spill + EXCLUDED.spill,
            spill_weighted = t.spill_weighted + EXCLUDED.spill_weighted;
    RETURN NULL;
END
$$"""
    trigger = f"""
CREATE TRIGGER metering_hoursum_{event}
    AFTER {event.upper()} ON billing_sample
    REFERENCING {_TRANSITIONS[event]}
    FOR EACH STATEMENT EXECUTE FUNCTION metering_hoursum_{event}()"""
    return [function, trigger]


# The sums of the hours in `[lo, hi)` (hour-aligned; NULL, NULL: every hour) made again from
# the samples stored in them (`billing_sample` and the blocks, through `metering_readings`)
# under the recorded hold; how many rows. The caller holds off writers
# (`metering.hoursums.rebuild_sums`; the migration's transaction, a TRUNCATE's, a day's drop).
_STORED_SUMS = _SUMS.format(deltas=f"SELECT {_COLUMNS}, 1 AS sign FROM metering_readings(lo, hi)")
_FILL = f"""
CREATE FUNCTION metering_hoursum_fill(lo bigint, hi bigint) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    held_ms bigint;
    made bigint;
BEGIN
    IF lo IS NULL THEN
        DELETE FROM metering_hoursum;
        SELECT least((SELECT min(ts_ms) FROM billing_sample),
                     (SELECT min(day_ms) FROM metering_sampleblock)),
               greatest((SELECT max(ts_ms) + 1 FROM billing_sample),
                        (SELECT max(day_ms) + 86400000 FROM metering_sampleblock))
        INTO lo, hi;
    ELSE
        DELETE FROM metering_hoursum WHERE h >= lo / 3600000 AND h < hi / 3600000;
    END IF;
    SELECT hold_ms INTO held_ms FROM metering_hoursumstate WHERE id = 1;
    IF held_ms IS NULL OR lo IS NULL THEN
        RETURN 0;
    END IF;
    INSERT INTO metering_hoursum (device_uuid, h, covered, weighted, spill, spill_weighted)
    SELECT * FROM ({_STORED_SUMS}) AS sums
    WHERE covered <> 0 OR weighted <> 0 OR spill <> 0 OR spill_weighted <> 0
    ORDER BY device_uuid, h;
    GET DIAGNOSTICS made = ROW_COUNT;
    RETURN made;
END
$$"""
_TRUNCATE = """
CREATE FUNCTION metering_hoursum_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM metering_hoursum_fill(NULL, NULL);
    RETURN NULL;
END
$$"""
_TRUNCATE_TRIGGER = """
CREATE TRIGGER metering_hoursum_truncate AFTER TRUNCATE ON billing_sample
    FOR EACH STATEMENT EXECUTE FUNCTION metering_hoursum_truncate()"""

# Statements one by one (RunSQL would split one string at every semicolon, the functions' too).
_TRIGGERS = (
    _FILL,
    *(statement for event in _DELTAS for statement in _trigger(event)),
    _TRUNCATE,
    _TRUNCATE_TRIGGER,
)
_DROP_TRIGGERS = (
    *(
        statement
        for event in (*_DELTAS, "truncate")
        for statement in (
            f"DROP TRIGGER metering_hoursum_{event} ON billing_sample",
            f"DROP FUNCTION metering_hoursum_{event}()",
        )
    ),
    "DROP FUNCTION metering_hoursum_fill(bigint, bigint)",
)


def _record_hold(apps, schema_editor) -> None:
    """The hold the sums are made with: the setting's now."""
    state = apps.get_model("metering", "HourSumState")
    state.objects.create(id=1, hold_ms=int(settings.TALLY_SAMPLE_HOLD_SECONDS) * 1000)


class Migration(migrations.Migration):
    dependencies = [
        ("metering", "0004_compact_sampleblock"),
    ]

    operations = [
        migrations.CreateModel(
            name="HourSumState",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("hold_ms", models.BigIntegerField()),
            ],
            options={
                "db_table": "metering_hoursumstate",
            },
        ),
        migrations.CreateModel(
            name="HourSum",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "device_uuid",
                        "h",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("device_uuid", models.CharField(db_collation="C", max_length=128)),
                ("h", models.BigIntegerField()),
                ("covered", models.BigIntegerField()),
                ("weighted", models.BigIntegerField()),
                ("spill", models.BigIntegerField()),
                ("spill_weighted", models.BigIntegerField()),
            ],
            options={
                "db_table": "metering_hoursum",
                "indexes": [models.Index(fields=["h"], name="hoursum_h")],
            },
        ),
        migrations.RunPython(_record_hold, migrations.RunPython.noop),
        migrations.RunSQL(list(_TRIGGERS), list(_DROP_TRIGGERS)),
        migrations.RunSQL("SELECT metering_hoursum_fill(NULL, NULL)", migrations.RunSQL.noop),
    ]
