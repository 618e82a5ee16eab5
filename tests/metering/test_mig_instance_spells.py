"""A GPU instance id's devices as spells, from every path samples come in by.

DCGM names a MIG device by its parent's UUID and GPU instance id; `billing.MigInstance` says
which device an id was, and when (`metering.mig_instances`). An id reused A, B, A, B keeps one
spell per uninterrupted run of one device's samples, so a reading between is never claimed by
both; the spells are those of all the samples at once, whatever order (or however
concurrently) their batches arrive in; and samples backfilled (`ingest_samples`) or set aside
and adopted record them as an agent's batch does, under the node the inventory puts the GPU on.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory.models import Device
from metering import ingest, prometheus
from metering.hours import epoch_ms, sample_hold_ms
from metering.ingest import adopt_unknown_samples
from metering.mig_instances import Point, Spell, spells_of, split_overlapping_spells
from metering.models import AgentToken, MigInstance, UnknownDeviceSample
from metering.services import issue_agent_token
from tests.billing.test_late_data_marks import Connection, OnItsOwn, waited_for
from tests.factories import DeviceFactory, MigDeviceFactory, NodeFactory
from tests.metering import test_ingest_dynamic_mig as dynamic

pytestmark = pytest.mark.django_db

T0 = (timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
NOW = timezone.now()
NODE = "a100-node"


def ms(minute: float) -> int:
    return epoch_ms(T0) + round(minute * 60_000)


@pytest.fixture
def a100() -> Device:
    node = NodeFactory.create(name=NODE)
    return DeviceFactory.create(node=node, name="gpu-0", product_name="NVIDIA A100-SXM4-40GB")


def migs(parent: Device, count: int) -> list[Device]:
    return [
        MigDeviceFactory.create(
            parent=parent, name=f"gpu-0-mig-1g5gb-19-{placement}", profile="1g.5gb"
        )
        for placement in range(count)
    ]


def agent_of(device: Device, node: str = NODE) -> AgentToken:
    token = ingest.authenticate(issue_agent_token(cluster=device.cluster, node=node, actor="ops"))
    assert token is not None
    return token


def sample(device: Device, minute: float, instance: int, **fields: Any) -> dict[str, Any]:
    """A MIG device's sample as its agent sends it, `minute`s after T0, under GPU instance
    `instance` of its GPU."""
    return {
        "uuid": device.uuid,
        "ts": (T0 + timedelta(minutes=minute)).isoformat(),
        "gpu_util": 30.0,
        "parent_uuid": device.parent_uuid,
        "gpu_instance_id": instance,
        **fields,
    }


def unknown_sample(parent: Device, uuid: str, minute: float, instance: int) -> dict[str, Any]:
    """The sample of a MIG device of `parent` the inventory does not know yet."""
    return {**sample(parent, minute, instance), "uuid": uuid, "parent_uuid": parent.uuid}


def send(
    samples: list[dict[str, Any]], *, agent: AgentToken | None, node: str = NODE
) -> ingest.IngestReport:
    valid, rejected = ingest.validate_samples(samples, now=NOW)
    assert rejected == []
    return ingest.ingest(node=node, samples=valid, received_at=NOW, agent=agent)


def in_time(spells: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """(node, GPU instance id, meter id, first ms, last ms) by GPU instance, then in time."""
    return sorted(spells, key=lambda spell: (spell[0], spell[1], spell[3], spell[2]))


def spells() -> list[tuple[Any, ...]]:
    """The stored spells: (node, GPU instance id, meter id, first ms, last ms), by GPU instance
    then in time."""
    return in_time(
        MigInstance.objects.values_list(
            "node", "gpu_instance_id", "meter_id", "first_ms", "last_ms"
        )
    )


def meters(parent: str, instance: int) -> prometheus.InstanceMeters:
    """What the Prometheus source maps a DCGM series of that GPU instance by, as stored."""
    rows = MigInstance.objects.filter(parent_uuid=parent, gpu_instance_id=instance)
    return prometheus.InstanceMeters(
        spans=sorted(rows.values_list("first_ms", "last_ms", "meter_id")),
        fallback=None,
        hold_ms=sample_hold_ms(),
    )


# --- An id reused A, B, A, B -------------------------------------------------------------------


def test_an_id_reused_a_b_a_b_keeps_each_spell_whatever_order_batches_arrive_in(
    a100: Device,
) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    spell = {
        "a1": [sample(first, minute, 1) for minute in range(0, 11)],
        "b1": [sample(second, minute, 1) for minute in range(20, 31)],
        "a2": [sample(first, minute, 1) for minute in range(40, 51)],
        "b2": [sample(second, minute, 1) for minute in range(60, 71)],
    }
    # The second spells first; A's two are one span until B's first spell arrives.
    send(spell["b2"], agent=agent)
    send(spell["a2"], agent=agent)
    send(spell["a1"], agent=agent)
    assert [row[2:] for row in spells()] == [
        (first.meter_id, ms(0), ms(50)),
        (second.meter_id, ms(60), ms(70)),
    ]
    send(spell["b1"], agent=agent)
    assert spells() == [
        (NODE, 1, first.meter_id, ms(0), ms(10)),
        (NODE, 1, second.meter_id, ms(20), ms(30)),
        (NODE, 1, first.meter_id, ms(40), ms(50)),
        (NODE, 1, second.meter_id, ms(60), ms(70)),
    ]
    # Each reading maps to the device of its spell, none to both; between spells, longer
    # than the hold after one, to none of them (the profile rule's, here none).
    mapped = meters(a100.uuid, 1)
    assert [mapped.meter_at(ms(minute)) for minute in (5, 25, 45, 65)] == [
        first.meter_id,
        second.meter_id,
        first.meter_id,
        second.meter_id,
    ]
    assert mapped.meter_at(ms(15)) is None


def test_a_spell_is_split_at_its_own_samples_not_at_the_others(a100: Device) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    # A's samples in two batches (an agent's two sends), then a late batch of B between.
    send([sample(first, minute, 3) for minute in range(0, 6)], agent=agent)
    send([sample(first, minute, 3) for minute in range(50, 56)], agent=agent)
    send([sample(second, minute, 3) for minute in range(20, 31)], agent=agent)
    assert [row[2:] for row in spells()] == [
        (first.meter_id, ms(0), ms(5)),
        (second.meter_id, ms(20), ms(30)),
        (first.meter_id, ms(50), ms(55)),
    ]
    # 5 minutes after A's last sample before B: past the hold, so no device's.
    assert meters(a100.uuid, 3).meter_at(ms(10)) is None


def test_a_sample_under_one_gpu_instance_splits_that_instances_spells_only(
    a100: Device,
) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    send(
        [sample(first, minute, 1) for minute in range(3)]
        + [sample(second, minute, 2) for minute in range(3)],
        agent=agent,
    )
    send([sample(second, 1.5, 1)], agent=agent)  # a sample under instance 1 between A's
    assert [row[1:] for row in spells()] == [
        (1, first.meter_id, ms(0), ms(1)),
        (1, second.meter_id, ms(1.5), ms(1.5)),
        (1, first.meter_id, ms(2), ms(2)),
        (2, second.meter_id, ms(0), ms(2)),
    ]


def test_spans_stored_before_spells_are_split_where_they_overlap(a100: Device) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    minutes = {first: [0, 1, 2, 6, 7, 8], second: [3, 4, 5, 9, 10]}
    for device, sent in minutes.items():
        send([sample(device, minute, 4) for minute in sent], agent=agent)
    # As migration 0011's rows were: each device one span, widened over the other's.
    MigInstance.objects.all().delete()
    for device, sent in minutes.items():
        MigInstance.objects.create(
            cluster=a100.cluster,
            node=NODE,
            parent_uuid=a100.uuid,
            gpu_instance_id=4,
            meter_id=device.meter_id,
            first_ms=ms(sent[0]),
            last_ms=ms(sent[-1]),
        )
    with transaction.atomic(), connection.cursor() as cursor:
        assert split_overlapping_spells(cursor) == 1  # as migration 0012 does
    assert [row[2:] for row in spells()] == [
        (first.meter_id, ms(0), ms(2)),
        (second.meter_id, ms(3), ms(5)),
        (first.meter_id, ms(6), ms(8)),
        (second.meter_id, ms(9), ms(10)),
    ]
    with transaction.atomic(), connection.cursor() as cursor:
        assert split_overlapping_spells(cursor) == 0


# --- Order independence, as a property ----------------------------------------------------------

# Devices 0-2 are GPU instance 1's, 3-4 instance 2's (a MIG UUID is one GPU instance's).
INSTANCE_OF = [1, 1, 1, 2, 2]


def _runs(instance: int) -> st.SearchStrategy[list[tuple[int, int, int]]]:
    """An instance's history: runs of (device, samples a minute apart, minutes before)."""
    devices = [index for index, of in enumerate(INSTANCE_OF) if of == instance]
    return st.lists(
        st.tuples(st.sampled_from(devices), st.integers(1, 6), st.integers(1, 5)), max_size=6
    )


def _points(histories: list[list[tuple[int, int, int]]]) -> list[tuple[int, int]]:
    """(device, minute) of each sample of the histories: one device per id at a time."""
    points: list[tuple[int, int]] = []
    for runs in histories:
        minute = 0
        for device, count, gap in runs:
            minute += gap
            points.extend((device, minute + step) for step in range(count))
            minute += count
    return points


points_strategy = st.tuples(_runs(1), _runs(2)).map(lambda both: _points(list(both))).filter(bool)


@pytest.fixture
def five(a100: Device) -> list[Device]:
    return migs(a100, len(INSTANCE_OF))


def mapping(parent: str, instants: set[int]) -> dict[tuple[int, int], str | None]:
    """(GPU instance id, instant) -> the device the Prometheus source maps a reading to."""
    return {
        (instance, ts): meters(parent, instance).meter_at(ts)
        for instance in set(INSTANCE_OF)
        for ts in instants
    }


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    points=points_strategy,
    order=st.randoms(use_true_random=False),
    batch_size=st.integers(min_value=1, max_value=8),
    resent=st.booleans(),
    backfilled=st.booleans(),
)
def test_spells_and_mapping_do_not_depend_on_how_batches_arrive(
    a100: Device,
    five: list[Device],
    points: list[tuple[int, int]],
    order: Any,
    batch_size: int,
    resent: bool,
    backfilled: bool,
) -> None:
    devices = five
    agent = agent_of(a100)
    samples = [sample(devices[index], minute, INSTANCE_OF[index]) for index, minute in points]
    hold = sample_hold_ms()
    instants = {ms(minute) + shift for _, minute in points for shift in (-1, 0, 1, hold, hold + 1)}
    with transaction.atomic():
        # All at once.
        send(samples, agent=agent)
        expected_spells, expected = spells(), mapping(a100.uuid, instants)
        transaction.set_rollback(True)
    with transaction.atomic():
        # Shuffled, split, maybe sent twice; an agent's batches or an operator's backfill.
        shuffled = list(samples)
        order.shuffle(shuffled)
        for start in range(0, len(shuffled), batch_size):
            batch = shuffled[start : start + batch_size]
            send(batch, agent=None if backfilled else agent)
            if resent:
                send(batch, agent=agent)
        assert spells() == expected_spells
        assert mapping(a100.uuid, instants) == expected
        transaction.set_rollback(True)
    # The spells are the runs of the samples in time order, and a reading at a sample's
    # instant goes to that sample's device.
    by_instance: dict[int, list[Point]] = defaultdict(list)
    for index, minute in points:
        by_instance[INSTANCE_OF[index]].append(Point(ms(minute), devices[index].meter_id))
    assert expected_spells == in_time(
        (NODE, instance, *spell)
        for instance, found in by_instance.items()
        for spell in spells_of(found)
    )
    for index, minute in points:
        assert expected[INSTANCE_OF[index], ms(minute)] == devices[index].meter_id


def test_spells_of_are_the_runs_of_one_device_in_time_then_meter_order() -> None:
    assert spells_of(
        [Point(5, "b"), Point(1, "a"), Point(3, "a"), Point(5, "a"), Point(7, "a"), Point(1, "a")]
    ) == [Spell("a", 1, 5), Spell("b", 5, 5), Spell("a", 7, 7)]
    assert spells_of([]) == []


# --- Two connections at once --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_batches_at_once_give_the_spells_of_both(a100: Device) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    # A at minutes 0 and 40: one spell, as far as this batch knows. It holds its transaction
    # open: B's batch comes meanwhile, and must wait.
    writer = Connection(lambda: send([sample(first, 0, 1), sample(first, 40, 1)], agent=agent))
    assert writer.done_work.wait(timeout=30) and writer.error is None
    # Inside A's spell: splits it once A commits.
    batch = OnItsOwn(lambda: send([sample(second, 20, 1)], agent=agent))
    # Not done while A's batch is uncommitted: it waits for a lock, and is still waiting
    # when A's batch is let commit.
    waited_for(writer, batch, "B's batch did not wait for A's")
    assert [row[2:] for row in spells()] == [
        (first.meter_id, ms(0), ms(0)),
        (second.meter_id, ms(20), ms(20)),
        (first.meter_id, ms(40), ms(40)),
    ]


# --- Backfills and adopted samples --------------------------------------------------------------


def test_a_backfill_records_spells_under_the_node_the_inventory_puts_the_gpu_on(
    a100: Device, tmp_path: Path
) -> None:
    first, second = migs(a100, 2)
    lines = tmp_path / "samples.jsonl"
    lines.write_text(
        "".join(
            json.dumps(line) + "\n"
            for line in [
                *(sample(first, minute, 7) for minute in (0, 1)),
                {**sample(second, 2, 7), "node": NODE},
                *(sample(first, minute, 7) for minute in (3, 4)),
            ]
        )
    )
    out = StringIO()
    call_command("ingest_samples", str(lines), stdout=out)
    assert "5 accepted" in out.getvalue()
    assert spells() == [
        (NODE, 7, first.meter_id, ms(0), ms(1)),
        (NODE, 7, second.meter_id, ms(2), ms(2)),
        (NODE, 7, first.meter_id, ms(3), ms(4)),
    ]
    assert set(MigInstance.objects.values_list("cluster", "parent_uuid")) == {
        (a100.cluster_id, a100.uuid)
    }


def test_a_cluster_wide_agent_records_under_the_gpus_node_not_the_one_it_names(
    a100: Device,
) -> None:
    (first,) = migs(a100, 1)
    everywhere = agent_of(a100, node="*")
    send([sample(first, 0, 5)], agent=everywhere, node="elsewhere")
    send([sample(first, 1, 5)], agent=agent_of(a100))
    assert spells() == [(NODE, 5, first.meter_id, ms(0), ms(1))]


def test_a_sample_set_aside_records_its_gpu_instance_once_adopted(a100: Device) -> None:
    agent = agent_of(a100)
    later_uuid = "MIG-5b9e2f6a-0c1d-5e2f-8a3b-4c5d6e7f8a9b"
    report = send([unknown_sample(a100, later_uuid, minute, 6) for minute in (0, 1)], agent=agent)
    assert report.unknown_devices == [later_uuid]
    assert (
        list(UnknownDeviceSample.objects.values_list("gpu_instance", flat=True))
        == [{"parent_uuid": a100.uuid, "gpu_instance_id": 6}] * 2
    )
    assert spells() == []
    # The sync learns the MIG device; its samples are adopted, and its GPU instance recorded.
    device = MigDeviceFactory.create(parent=a100, uuid=later_uuid, name="gpu-0-mig-1g5gb-19-3")
    assert adopt_unknown_samples(now=timezone.now()) == 2
    assert spells() == [(NODE, 6, device.meter_id, ms(0), ms(1))]


def test_an_operators_sample_set_aside_records_its_gpu_instance_once_adopted(
    a100: Device, tmp_path: Path
) -> None:
    later_uuid = "MIG-0e1f2a3b-4c5d-5e6f-9a0b-1c2d3e4f5a6b"
    lines = tmp_path / "samples.jsonl"
    lines.write_text(json.dumps({**unknown_sample(a100, later_uuid, 2, 8), "node": NODE}) + "\n")
    call_command("ingest_samples", str(lines), stdout=StringIO())
    device = MigDeviceFactory.create(parent=a100, uuid=later_uuid, name="gpu-0-mig-1g5gb-19-4")
    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert spells() == [(NODE, 8, device.meter_id, ms(2), ms(2))]


def test_an_adopted_dynamic_mig_sample_records_its_partitions_gpu_instance() -> None:
    cluster = dynamic.services.get_cluster("fx")
    token = issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops")
    # Sent before the sync learns the node's partitions: set aside with placement and instance.
    answer = dynamic.post(
        token, "a100-dyn-1", [dynamic.mig_sample(dynamic.MIG_B, dynamic.A100, 6, 1, dynamic.T0)]
    )
    assert answer["unknown_devices"] == [dynamic.MIG_B]
    dynamic.load(at=dynamic.T0 + timedelta(minutes=10))
    one_g = dynamic.partition(cluster, "a100-dyn-1", "gpu-0-mig-1g10gb-19-6")
    assert adopt_unknown_samples(now=timezone.now()) == 1
    start = epoch_ms(dynamic.T0)
    assert list(
        MigInstance.objects.values_list(
            "cluster", "node", "parent_uuid", "gpu_instance_id", "meter_id", "first_ms", "last_ms"
        )
    ) == [(cluster.pk, "a100-dyn-1", dynamic.A100, 2, one_g.meter_id, start, start)]


def test_a_batch_that_extends_a_spell_costs_three_statements(a100: Device) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    send([sample(device, 0, index) for index, device in enumerate((first, second))], agent=agent)

    def statements(minute: int, **fields: Any) -> int:
        batch = [
            {**sample(device, minute, index), **fields}
            for index, device in enumerate((first, second))
        ]
        with CaptureQueriesContext(connection) as queries:
            send(batch, agent=agent)
        return len(queries)

    # The lock, the spells about the batch, the update of the two it extends.
    assert statements(1) - statements(2, gpu_instance_id=None) == 3
    assert [row[1:] for row in spells()] == [
        (0, first.meter_id, ms(0), ms(1)),
        (1, second.meter_id, ms(0), ms(1)),
    ]
