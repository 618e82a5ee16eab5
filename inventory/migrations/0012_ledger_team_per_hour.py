"""The team is charged per hour from the dated namespace ownership (`teams.ownership`), no
longer fixed on the allocation: `Allocation.team` is dropped, after what it said is kept as
dated ownership. Per namespace, the teams its allocations were charged to, in the order they
started, become its past owners (each from the hour its first allocation started, the first
since always, until the next one's); its current owner (if any) owns it from the hour the first
of its own charged allocations after them started (else from this migration's hour); a
namespace no team owns now keeps its last team until this migration's hour. So rolling up an
hour again charges it as before."""

from datetime import UTC, datetime

from django.db import migrations


def _hour(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def keep_attribution(apps, schema_editor):
    allocation_model = apps.get_model("inventory", "Allocation")
    ownership_model = apps.get_model("teams", "TeamNamespace")
    now = _hour(datetime.now(UTC))
    runs: dict[str, list[tuple[datetime, int]]] = {}
    rows = (
        allocation_model.objects.filter(team__isnull=False)
        .order_by("claim__namespace", "start", "pk")
        .values_list("claim__namespace", "start", "team_id")
    )
    for namespace, start, team_id in rows.iterator():
        namespace_runs = runs.setdefault(namespace, [])
        if not namespace_runs or namespace_runs[-1][1] != team_id:
            namespace_runs.append((_hour(start), team_id))
    current = {row.namespace: row for row in ownership_model.objects.filter(valid_until=None)}
    for namespace, namespace_runs in runs.items():
        owner = current.get(namespace)
        owner_since = None
        if owner is not None and namespace_runs[-1][1] == owner.team_id:
            owner_since = namespace_runs.pop()[0]  # the current owner's own run
        if not namespace_runs:
            continue
        if owner is not None:
            owner.valid_from = owner_since or now
        bounds = [start for start, _ in namespace_runs[1:]] + [
            owner.valid_from if owner is not None else now
        ]
        for index, ((start, team_id), until) in enumerate(
            zip(namespace_runs, bounds, strict=False)
        ):
            ownership_model.objects.create(
                namespace=namespace,
                team_id=team_id,
                valid_from=None if index == 0 else start,
                valid_until=max(until, start),
            )
        if owner is not None:
            owner.save(update_fields=["valid_from"])


class Migration(migrations.Migration):
    dependencies = [
        ("inventory", "0011_clusters_identity_and_first_sync"),
        ("teams", "0006_ledger_dated_ownership"),
        # billing's 0003 sets `Allocation.team` from the usage rows, which this drops.
        ("billing", "0003_bounded_unknown_samples_charged_allocations"),
    ]

    operations = [
        migrations.RunPython(keep_attribution, migrations.RunPython.noop, elidable=True),
        migrations.RemoveField(model_name="allocation", name="team"),
    ]
