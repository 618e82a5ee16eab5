"""Two clusters' syncs at once never both take one GPU (issue 33, finding 2).

The refusal reads which cluster holds an identity; without a lock, a sync of cluster B would
not see the devices a sync of A has written but not committed, and take them too. Each sync
that may take devices holds the identity lock from the start of its transaction: B waits for A
(the test sees it wait on the lock in `pg_locks`), then refuses what A took.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from django.db import connection, transaction

from inventory import services
from inventory.models import Device
from tests.inventory.test_kube_sync import resource_slice
from tests.waits import wait_until

AT = datetime(2026, 12, 1, tzinfo=UTC)


def waiting_on_advisory_locks() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        (count,) = cursor.fetchone()
    return int(count)


@pytest.mark.django_db(transaction=True)
def test_a_second_clusters_sync_waits_for_the_first_and_refuses_what_it_took() -> None:
    default, lab = services.get_cluster("default"), services.get_cluster("lab")
    taken, release = threading.Event(), threading.Event()
    reports: dict[str, services.SyncReport] = {}

    def sync(cluster: str, *, hold: bool) -> None:
        try:
            with transaction.atomic():
                reports[cluster] = services.import_snapshot(
                    cluster=services.get_cluster(cluster),
                    objects=[resource_slice("node-a", "gpu-0", "gpu-1")],
                    at=AT,
                )
                if hold:
                    taken.set()
                    release.wait(30)
        finally:
            connection.close()

    first = threading.Thread(target=sync, args=("default",), kwargs={"hold": True})
    first.start()
    try:
        assert taken.wait(30)
        second = threading.Thread(target=sync, args=("lab",), kwargs={"hold": False})
        second.start()
        wait_until(lambda: waiting_on_advisory_locks() == 1, "lab's sync waiting", seconds=30)
    finally:
        release.set()
        first.join(30)
    second.join(30)

    assert Device.objects.filter(cluster=default, gone_at__isnull=True).count() == 2
    assert not Device.objects.filter(cluster=lab).exists()
    assert sorted(reports["lab"].refused) == ["default"]
    assert len(reports["lab"].refused["default"]) == 2
