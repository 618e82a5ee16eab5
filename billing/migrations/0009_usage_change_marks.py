"""Late data since close: every write of usage rows marks its hours (`UsageChange`), in the
writing transaction, by statement-level triggers on `billing_usagehour` (each statement's rows
as a transition table, so the cost is a copy of the rows written, not a call per row). A
refresh then reads a closed period only while it holds marks (`billing.late_data`).

Every period already closed is marked once: what reached it since its close, and whether the
open period's adjustments account for it, is not known until it is read again.
"""

from django.db import migrations, models

# The hours a statement wrote rows of, each once and in order (two writers of the same hours
# then lock their marks in the same order, never in a cycle), marked with a new version: a
# number from a sequence, never given twice, so a mark deleted and made again is never taken
# for the one a close read (`billing.late_data.clear_marks`).
MARK = """
INSERT INTO billing_usagechange (hour, version)
SELECT hour, nextval('billing_usagechange_version')
FROM (SELECT DISTINCT hour FROM ({rows}) AS written) AS hours
ORDER BY hour
ON CONFLICT (hour) DO UPDATE SET version = EXCLUDED.version;
"""
TRIGGERS = f"""
CREATE SEQUENCE billing_usagechange_version;
CREATE FUNCTION billing_mark_usage_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        {MARK.format(rows="SELECT hour FROM usage_after")}
    ELSIF TG_OP = 'DELETE' THEN
        {MARK.format(rows="SELECT hour FROM usage_before")}
    ELSE
        {MARK.format(rows="SELECT hour FROM usage_before UNION SELECT hour FROM usage_after")}
    END IF;
    RETURN NULL;
END
$$;
-- A trigger with transition tables has one event each.
CREATE TRIGGER usagehour_insert_marks AFTER INSERT ON billing_usagehour
    REFERENCING NEW TABLE AS usage_after
    FOR EACH STATEMENT EXECUTE FUNCTION billing_mark_usage_change();
CREATE TRIGGER usagehour_delete_marks AFTER DELETE ON billing_usagehour
    REFERENCING OLD TABLE AS usage_before
    FOR EACH STATEMENT EXECUTE FUNCTION billing_mark_usage_change();
CREATE TRIGGER usagehour_update_marks AFTER UPDATE ON billing_usagehour
    REFERENCING OLD TABLE AS usage_before NEW TABLE AS usage_after
    FOR EACH STATEMENT EXECUTE FUNCTION billing_mark_usage_change();
-- Truncating usage is a write too; it has no transition table, so it marks every period.
CREATE FUNCTION billing_mark_usage_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    {MARK.format(rows="SELECT start AS hour FROM billing_period")}
    RETURN NULL;
END
$$;
CREATE TRIGGER usagehour_truncate_marks AFTER TRUNCATE ON billing_usagehour
    FOR EACH STATEMENT EXECUTE FUNCTION billing_mark_usage_truncate();
"""
DROP_TRIGGERS = """
DROP TRIGGER usagehour_truncate_marks ON billing_usagehour;
DROP TRIGGER usagehour_update_marks ON billing_usagehour;
DROP TRIGGER usagehour_delete_marks ON billing_usagehour;
DROP TRIGGER usagehour_insert_marks ON billing_usagehour;
DROP FUNCTION billing_mark_usage_truncate();
DROP FUNCTION billing_mark_usage_change();
DROP SEQUENCE billing_usagechange_version;
"""
MARK_CLOSED = MARK.format(
    rows="SELECT start AS hour FROM billing_period WHERE closed_at IS NOT NULL"
)


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0008_sample_covered_ms"),
    ]

    operations = [
        migrations.CreateModel(
            name="UsageChange",
            fields=[
                ("hour", models.DateTimeField(primary_key=True, serialize=False)),
                ("version", models.BigIntegerField()),
            ],
        ),
        migrations.RunSQL(TRIGGERS, DROP_TRIGGERS),
        migrations.RunSQL(MARK_CLOSED, migrations.RunSQL.noop),
    ]
