"""A mark made while a rollup runs outlives it, whatever time the mark says.

`rollup_pending` rolls up the marked hours, then takes away the marks it has dealt with. A
writer (late samples, the sync) marks with its own time (`marked_at`: the samples' receipt,
the event's), which may be before the rollup started though the writer commits after the
rollup read the hour: only the mark's version, new at every write, tells the mark the rollup
read from one made since.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from metering import dirty
from metering.models import DirtyHour, UsageHour
from metering.rollup import rollup_pending
from tests.billing.test_idle_alerts import T0, claim_holding, devices_of, samples
from tests.billing.test_late_data_marks import Connection, OnItsOwn, waited_for
from tests.factories import ClusterFactory
from tests.quota.factories import TeamFactory


@pytest.mark.django_db(transaction=True)
def test_samples_committed_after_the_rollup_read_their_hour_stay_marked() -> None:
    team = TeamFactory.create(slug="race")
    cluster = ClusterFactory.create(name="prod")
    devices = devices_of(claim_holding(cluster, team, "train", 1, start=T0))
    hour = T0 + timedelta(hours=1)
    now = T0 + timedelta(hours=3, minutes=5)
    # The hour was marked before (an earlier late sample), and is due.
    dirty.mark_dirty(hours={hour}, at=now - timedelta(minutes=30))

    def late_write() -> None:
        # An agent's buffer, received (and so marked) before the rollup started.
        samples(devices, hour, 1, 80.0)
        dirty.mark_dirty(hours={hour}, at=now - timedelta(minutes=1))

    # The writer holds its transaction open: the rollup reads the hour meanwhile, without
    # these rows.
    writer = Connection(late_write)
    assert writer.done_work.wait(timeout=30) and writer.error is None
    roller = OnItsOwn(lambda: rollup_pending(now=now))
    # The rollup has read the mark (its first statement, which waits for no lock) and waits,
    # taking it away, for the writer's uncommitted new version: only then does the writer
    # commit.
    waited_for(writer, roller, "the rollup did not wait for the writer")

    assert DirtyHour.objects.filter(hour=hour).exists(), "the writer's mark was taken away"
    rollup_pending(now=now + timedelta(minutes=5))
    row = UsageHour.objects.get(hour=hour)
    assert row.utilised_gpu_ms > 0
    assert not DirtyHour.objects.filter(hour=hour).exists()
