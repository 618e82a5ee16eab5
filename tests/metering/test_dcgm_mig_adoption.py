"""DCGM's samples of MIG devices it could not tell, named `<parent UUID>::gi<N>` by the node
agent (`agent.dcgm`, `agent.exporters`), are billed.

Each is stored under the device its GPU instance was at its instant, by the spells the NVML
agents' samples record (`metering.mig_instances`), with the Prometheus source's rule: the
spell covering the instant from its first sample to a hold past its last, the later of two.
One no spell covers is set aside, and placed once a spell covers it; where the spells change
(an id reused A, B, A whose B arrives last), the samples move. So what is stored, rolled up
and billed does not depend on the order DCGM's and NVML's batches come in; a token places
nothing on another cluster's devices; a batch sent again changes nothing.
"""

from __future__ import annotations

import json
import random
from datetime import date, datetime, timedelta
from decimal import Decimal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.readings import GpuReading
from billing import services
from billing.models import RateCard
from inventory.models import Device
from metering import ingest, prometheus
from metering.hours import epoch_ms, sample_hold_ms
from metering.ingest import adopt_unknown_samples
from metering.models import AgentToken, MigInstance, Sample, UnknownDeviceSample, UsageHour
from metering.services import issue_agent_token
from teams.models import Team, TeamNamespace
from tests.billing.test_late_data_marks import Connection, OnItsOwn, waited_for
from tests.factories import (
    AllocationFactory,
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
)
from tests.metering.test_mig_instance_spells import agent_of, migs

pytestmark = pytest.mark.django_db

T0 = (timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)
NOW = timezone.now()
NODE = "a100-node"
A100 = "NVIDIA A100-SXM4-40GB"
GIB = 2**30


def at(minute: float) -> datetime:
    return T0 + timedelta(minutes=minute)


def ms(minute: float) -> int:
    return epoch_ms(at(minute))


@pytest.fixture
def a100() -> Device:
    return DeviceFactory.create(node=NodeFactory.create(name=NODE), name="gpu-0", product_name=A100)


def nvml(device: Device, minute: float, instance: int) -> dict[str, Any]:
    """A MIG device's sample as the NVML agent sends it: its own UUID, its GPU and GPU
    instance id, no utilisation (NVML measures none on MIG devices)."""
    return GpuReading(
        uuid=device.uuid,
        ts=at(minute),
        gpu_util=None,
        mem_used_bytes=GIB,
        parent_uuid=device.parent_uuid,
        gpu_instance_id=instance,
    ).as_sample()


def dcgm(parent: Device, minute: float, instance: int, util: float = 50.0) -> dict[str, Any]:
    """A MIG series' reading as the agent sends it when it cannot tell the MIG device: named
    `<parent UUID>::gi<N>` (`agent.dcgm`)."""
    return GpuReading(
        uuid=f"{parent.uuid}::gi{instance}",
        ts=at(minute),
        gpu_util=util,
        mem_used_bytes=GIB,
        parent_uuid=parent.uuid,
        gpu_instance_id=instance,
        mig_profile="1g.5gb",
        util_source="gr_engine_active",
    ).as_sample()


def send(
    samples: list[dict[str, Any]], *, agent: AgentToken | None, node: str = NODE
) -> ingest.IngestReport:
    valid, rejected = ingest.validate_samples(samples, now=NOW)
    assert rejected == []
    return ingest.ingest(node=node, samples=valid, received_at=NOW, agent=agent)


def placed() -> dict[int, str]:
    """Instant -> the device each DCGM sample is stored under."""
    return dict(
        Sample.objects.filter(placed_gpu_instance__isnull=False).values_list("ts_ms", "device_uuid")
    )


def aside() -> list[int]:
    """The instants of the samples set aside."""
    return sorted(UnknownDeviceSample.objects.values_list("ts_ms", flat=True))


def state() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every sample stored (with its gap to the device's next) and set aside, as compared."""
    return (
        sorted(
            Sample.objects.values_list(
                "device_uuid", "ts_ms", "gpu_util", "mem_used_bytes", "placed_gpu_instance",
                "gap_ms", "node",
            )
        ),
        sorted(
            UnknownDeviceSample.objects.values_list(
                "device_uuid", "ts_ms", "gpu_util", "node", "gpu_instance"
            )
        ),
    )  # fmt: skip


# --- Where a DCGM sample goes ---------------------------------------------------------------


def test_a_dcgm_sample_is_stored_under_the_device_its_gpu_instance_was_then(
    a100: Device,
) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    send([nvml(first, minute, 1) for minute in (0, 30)], agent=agent)
    send([nvml(second, minute, 2) for minute in (0, 30)], agent=agent)

    report = send(
        [dcgm(a100, minute + 0.5, 1, util=40.0) for minute in range(29)]
        + [dcgm(a100, minute + 0.5, 2, util=10.0) for minute in range(29)],
        agent=agent,
    )

    assert (report.accepted, report.duplicates, report.unknown_devices) == (58, 0, [])
    assert UnknownDeviceSample.objects.count() == 0
    stored = Sample.objects.filter(placed_gpu_instance__isnull=False)
    assert {(row.device_uuid, row.placed_gpu_instance, row.gpu_util) for row in stored} == {
        (first.meter_id, 1, 40.0),
        (second.meter_id, 2, 10.0),
    }
    # Gaps as for any sample: each holds to its device's next one.
    gaps = dict(Sample.objects.filter(device_uuid=first.meter_id).values_list("ts_ms", "gap_ms"))
    assert gaps[ms(0)] == 30_000 and gaps[ms(0.5)] == 60_000 and gaps[ms(28.5)] == 90_000
    # Only the NVML samples make spells: the DCGM ones, placed by them, make none.
    assert sorted(MigInstance.objects.values_list("gpu_instance_id", "first_ms", "last_ms")) == [
        (1, ms(0), ms(30)),
        (2, ms(0), ms(30)),
    ]


def test_within_a_hold_past_a_spell_it_is_its_device_beyond_it_nobodys(a100: Device) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    hold_minutes = sample_hold_ms() / 60_000  # 2
    # GPU instance 3 was `first` from minute 0 to 10, `second` from 11 (within the hold of
    # `first`'s last sample) to 20, then nothing known from minute 20.
    send([nvml(first, minute, 3) for minute in (0, 10)], agent=agent)
    send([nvml(second, minute, 3) for minute in (11, 20)], agent=agent)
    send(
        [
            dcgm(a100, minute, 3)
            for minute in (-0.5, 5, 10.5, 11.25, 11.5, 20 + hold_minutes, 20 + hold_minutes + 0.01)
        ],
        agent=agent,
    )
    assert placed() == {
        ms(5): first.meter_id,  # inside its spell
        ms(10.5): first.meter_id,  # a hold past its last sample: still its
        ms(11.25): second.meter_id,  # both spells cover it: the one that began last
        ms(11.5): second.meter_id,
        ms(20 + hold_minutes): second.meter_id,  # the last instant its hold reaches
    }
    # Before the first spell, and further than a hold past the last: no device.
    assert aside() == [ms(-0.5), ms(20 + hold_minutes + 0.01)]


def test_samples_no_spell_covers_yet_are_set_aside_then_placed(a100: Device) -> None:
    (first,) = migs(a100, 1)
    agent = agent_of(a100)
    report = send([dcgm(a100, minute + 0.5, 4) for minute in range(10)], agent=agent)
    assert (report.accepted, report.unknown_devices) == (10, [f"{a100.uuid}::gi4"])
    assert aside() == [ms(minute + 0.5) for minute in range(10)]
    assert placed() == {}

    # The NVML agent's samples of the MIG device record its spell, from minute 0 to 5 and a
    # hold (2 minutes) past: the ones it covers move.
    send([nvml(first, minute, 4) for minute in (0, 5)], agent=agent)
    assert placed() == {ms(minute + 0.5): first.meter_id for minute in range(7)}
    assert aside() == [ms(minute + 0.5) for minute in range(7, 10)]
    send([nvml(first, 9, 4)], agent=agent)
    assert placed() == {ms(minute + 0.5): first.meter_id for minute in range(10)}
    assert aside() == []
    assert Sample.objects.filter(device_uuid=first.meter_id).count() == 13


def test_a_spell_recorded_by_an_adopted_sample_places_them_too(a100: Device) -> None:
    agent = agent_of(a100)
    later_uuid = "MIG-1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f"
    # The MIG device's own samples come before the sync learns it: set aside, no spell yet.
    unknown = {
        **nvml(a100, 0, 5),
        "uuid": later_uuid,
        "parent_uuid": a100.uuid,
        "gpu_instance_id": 5,
    }
    send([unknown, {**unknown, "ts": at(10).isoformat()}], agent=agent)
    send([dcgm(a100, minute + 0.5, 5) for minute in range(10)], agent=agent)
    assert len(aside()) == 12 and placed() == {}

    device = MigDeviceFactory.create(parent=a100, uuid=later_uuid, name="gpu-0-mig-1g5gb-19-6")
    assert adopt_unknown_samples(now=timezone.now()) == 2
    assert placed() == {ms(minute + 0.5): device.meter_id for minute in range(10)}
    assert aside() == []


# --- An id reused A, B, A ------------------------------------------------------------------

# GPU instance 1 of the A100: `first` from minute 0 to 10, `second` from 20 to 30, `first`
# again from 40 to 50; a DCGM reading at half past each minute from 0 to 55.
RUNS = ((0, range(0, 11)), (1, range(20, 31)), (0, range(40, 51)))
DCGM_MINUTES = [minute + 0.5 for minute in range(56)]


def _expected(devices: list[Device]) -> dict[int, str]:
    """Where each reading goes: inside a spell or within the two minutes' hold after it."""
    first, second = devices
    expected = {}
    for minute in DCGM_MINUTES:
        if minute < 12 or 40 <= minute < 52:
            expected[ms(minute)] = first.meter_id
        elif 20 <= minute < 32:
            expected[ms(minute)] = second.meter_id
    return expected


def _nvml_batches(devices: list[Device]) -> list[list[dict[str, Any]]]:
    return [[nvml(devices[index], minute, 1) for minute in minutes] for index, minutes in RUNS]


def _dcgm_batch(parent: Device) -> list[dict[str, Any]]:
    return [dcgm(parent, minute, 1, util=float(int(minute))) for minute in DCGM_MINUTES]


def test_an_id_reused_a_b_a_moves_the_readings_when_b_comes_last(a100: Device) -> None:
    devices = migs(a100, 2)
    first, second = devices
    agent = agent_of(a100)
    a1, b, a2 = _nvml_batches(devices)
    send(a1 + a2, agent=agent)  # one spell of `first` from 0 to 50, as far as known
    send(_dcgm_batch(a100), agent=agent)
    assert set(placed().values()) == {first.meter_id}
    assert len(placed()) == 52  # 0.5 to 51.5

    send(b, agent=agent)  # `second` held the id between: its readings move to it
    expected = _expected(devices)
    assert placed() == expected
    # Those no spell covers any longer (more than the hold after `first`'s run ended) are
    # set aside again, and were taken out of `first`'s samples.
    assert aside() == sorted(ms(minute) for minute in DCGM_MINUTES if ms(minute) not in expected)
    assert not Sample.objects.filter(
        device_uuid=first.meter_id, ts_ms__gte=ms(12), ts_ms__lt=ms(40)
    ).exists()
    assert Sample.objects.filter(device_uuid=second.meter_id, gpu_util=25.0).exists()


@pytest.fixture
def billed(a100: Device) -> tuple[list[Device], Team]:
    return held_and_priced(a100)


def held_and_priced(a100: Device) -> tuple[list[Device], Team]:
    """The A, B, A instance's two MIG devices, each held by a claim of a team for two hours,
    with a price per 1g.5gb slice-hour and idle time priced at half."""
    team = Team.objects.create(slug="vision", name="Vision")
    TeamNamespace.objects.create(team=team, namespace="vision")
    devices = migs(a100, 2)
    for device in devices:
        AllocationFactory.create(
            device=device, team=team, start=T0, end=T0 + timedelta(hours=2),
            claim__namespace="vision",
        )  # fmt: skip
    RateCard.objects.create(
        product_name=A100,
        profile="1g.5gb",
        per_gpu_hour=Decimal("2.00"),
        idle_factor=Decimal("0.5"),
        currency="USD",
        valid_from=date(2000, 1, 1),
    )
    return devices, team


def _billed_state() -> tuple[Any, ...]:
    """What is stored, the usage rolled up, and the team's statement lines."""
    run = services.bill_period(period_start=T0, now=NOW)
    usage = sorted(
        UsageHour.objects.values_list(
            "allocation__device__name", "hour", "allocated_gpu_ms", "utilised_gpu_ms",
            "unmeasured_gpu_ms",
        )
    )  # fmt: skip
    lines = sorted(
        (
            line.product_name, line.profile, line.kind, line.allocated_gpu_hours,
            line.utilised_gpu_hours, line.idle_gpu_hours, line.unmeasured_gpu_hours,
            line.amount,
        )
        for statement in run.statements
        for line in statement.lines.all()
    )  # fmt: skip
    return state(), usage, lines


def test_what_is_stored_rolled_up_and_billed_does_not_depend_on_the_order(
    a100: Device, billed: tuple[list[Device], Team]
) -> None:
    devices, _ = billed
    agent = agent_of(a100)
    nvml_batches = _nvml_batches(devices)
    readings = _dcgm_batch(a100)
    early, late = readings[:25], readings[25:]
    orders = {
        "spells first": [*nvml_batches, readings],
        "readings first": [readings, *nvml_batches],
        "b last": [nvml_batches[0], nvml_batches[2], readings, nvml_batches[1]],
        "interleaved": [late, nvml_batches[2], early, nvml_batches[1], nvml_batches[0]],
        "one batch": [[sample for batch in [*nvml_batches, readings] for sample in batch]],
    }
    shuffled = [sample for batch in [*nvml_batches, readings] for sample in batch]
    random.Random(18).shuffle(shuffled)
    orders["shuffled"] = [shuffled[start : start + 7] for start in range(0, len(shuffled), 7)]
    results = {}
    for name, batches in orders.items():
        with transaction.atomic():
            for batch in batches:
                send(batch, agent=agent)
            results[name] = _billed_state()
            transaction.set_rollback(True)
    expected = results.pop("spells first")
    for name, result in results.items():
        assert result == expected, name
    (samples, set_aside), usage, lines = expected
    assert {row[0] for row in samples if row[4] is not None} == {d.meter_id for d in devices}
    assert len(set_aside) == 56 - len(_expected(devices))
    # The readings are billed: utilised time on both devices, less unmeasured than none gave.
    utilised = {name: 0 for name, *_ in usage}
    for name, _, _, used, _ in usage:
        utilised[name] += used
    assert all(utilised.values()), utilised
    assert [line[2] for line in lines] == ["usage"]


@pytest.fixture
def pair(a100: Device) -> list[Device]:
    return migs(a100, 2)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    histories=st.lists(
        st.tuples(st.sampled_from([0, 1]), st.integers(1, 5), st.integers(1, 5)),
        min_size=1,
        max_size=5,
    ),
    readings=st.sets(st.integers(0, 80), min_size=1, max_size=40),
    order=st.randoms(use_true_random=False),
    batch_size=st.integers(min_value=1, max_value=9),
    resent=st.booleans(),
)
def test_placement_does_not_depend_on_how_batches_arrive(
    a100: Device,
    pair: list[Device],
    histories: list[tuple[int, int, int]],
    readings: set[int],
    order: Any,
    batch_size: int,
    resent: bool,
) -> None:
    devices = pair
    agent = agent_of(a100)
    # Runs of one device a minute apart, `gap` minutes after the last (an id reused A, B, A,
    # B...); readings every third of a minute, never at a whole one (a reading at the instant
    # of a device's own sample would be a duplicate of it): inside, next to and between runs.
    samples: list[dict[str, Any]] = []
    minute = 0
    for index, count, gap in histories:
        minute += gap
        samples.extend(nvml(devices[index], minute + step, 7) for step in range(count))
        minute += count
    samples.extend(dcgm(a100, reading / 3 + 0.1, 7, util=float(reading)) for reading in readings)
    with transaction.atomic():
        send(samples, agent=agent)
        expected = state()
        transaction.set_rollback(True)
    with transaction.atomic():
        shuffled = list(samples)
        order.shuffle(shuffled)
        for start in range(0, len(shuffled), batch_size):
            batch = shuffled[start : start + batch_size]
            send(batch, agent=agent)
            if resent:
                assert send(batch, agent=agent).accepted == 0
        assert state() == expected
        transaction.set_rollback(True)
    # Every reading is stored or aside, once.
    stored, set_aside = expected
    assert len([row for row in stored if row[4] is not None]) + len(set_aside) == len(readings)


# --- Tokens, replays, bad input -------------------------------------------------------------


def test_a_token_never_places_samples_on_another_clusters_devices(a100: Device) -> None:
    # Cluster B's A100 on b-node, its GPU instance 1 recorded by B's own agent.
    host = NodeFactory.create(cluster=ClusterFactory.create(name="cluster-b"), name="b-node")
    their_gpu = DeviceFactory.create(node=host, name="gpu-0", product_name=A100)
    (theirs,) = migs(their_gpu, 1)
    their_agent = agent_of(their_gpu, node="b-node")
    # Cluster A's tokens name B's GPU instance 1: a node's token for its own node, and a
    # cluster-wide one for B's node.
    (own,) = migs(a100, 1)
    readings = [dcgm(their_gpu, minute + 0.5, 1) for minute in range(10)]
    for token, node in ((agent_of(a100), NODE), (agent_of(a100, node="*"), "b-node")):
        send(readings, agent=token, node=node)
    assert placed() == {}
    # B's agent records the spell that covers them: nothing of A's reaches B's device; they
    # stay aside, under cluster A's tokens.
    send([nvml(theirs, minute, 1) for minute in (0, 30)], agent=their_agent, node="b-node")
    send([nvml(theirs, 31, 1)], agent=their_agent, node="b-node")
    assert placed() == {}
    assert UnknownDeviceSample.objects.count() == 20
    # B's own readings are placed on B's device.
    send(
        [dcgm(their_gpu, minute + 0.25, 1) for minute in range(10)],
        agent=their_agent,
        node="b-node",
    )
    assert set(placed().values()) == {theirs.meter_id}
    assert not Sample.objects.filter(device_uuid=own.meter_id).exists()
    assert UnknownDeviceSample.objects.count() == 20


def test_a_batch_sent_again_changes_nothing(a100: Device) -> None:
    first, second = migs(a100, 2)
    agent = agent_of(a100)
    batches = [
        [dcgm(a100, minute + 0.5, 2) for minute in range(30)],
        [nvml(first, minute, 2) for minute in (0, 10)],
        [nvml(second, minute, 2) for minute in (20, 25)],
    ]
    for batch in batches:
        send(batch, agent=agent)
    before = state()
    # 4 NVML samples, 12 + 7 readings placed (to minute 12, and 20 to 27), 11 aside.
    assert (len(before[0]), len(before[1])) == (4 + 19, 11)
    for batch in batches:
        report = send(batch, agent=agent)
        assert (report.accepted, report.duplicates) == (0, len(batch))
    assert state() == before
    # Through the endpoint too: the agent's retry after a lost answer.
    token = issue_agent_token(cluster=a100.cluster, node=NODE, actor="ops")
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": NODE, "samples": batches[0]}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    assert (response.json()["accepted"], response.json()["duplicates"]) == (0, 30)
    assert state() == before


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (
            {"gpu_instance_id": 2},
            "samples[0].gpu_instance_id: 2 is not the GPU instance its uuid names (1)",
        ),
        (
            {"parent_uuid": "GPU-00000000-0000-0000-0000-000000000000"},
            'samples[0].parent_uuid: "GPU-00000000-0000-0000-0000-000000000000" is not the '
            "GPU its uuid names",
        ),
        (
            {"mig_placement": {"start": 0, "size": 1}},
            "samples[0].mig_placement: goes with a MIG device's own uuid, not with a "
            "<parent UUID>::gi<N> one",
        ),
        ({"uuid": "GPU-x::gi4096"}, 'samples[0].uuid: "GPU-x::gi4096" names GPU instance 4096'),
    ],
)
def test_a_dcgm_sample_that_contradicts_its_name_is_rejected_naming_the_field(
    a100: Device, fields: dict[str, Any], reason: str
) -> None:
    valid, rejected = ingest.validate_samples([{**dcgm(a100, 1, 1), **fields}], now=NOW)
    assert valid == []
    assert rejected[0]["reason"].startswith(reason)


def test_an_instance_id_written_with_leading_zeros_is_the_same_gpu_instance(
    a100: Device,
) -> None:
    (first,) = migs(a100, 1)
    agent = agent_of(a100)
    send([nvml(first, minute, 3) for minute in (0, 10)], agent=agent)
    send([{**dcgm(a100, 1, 3), "uuid": f"{a100.uuid}::gi003"}], agent=agent)
    report = send([dcgm(a100, 1, 3)], agent=agent)
    assert (report.accepted, report.duplicates) == (0, 1)
    assert placed() == {ms(1): first.meter_id}


def test_an_operators_backfill_is_placed_in_the_cluster_its_spells_are_in(
    a100: Device, tmp_path: Path
) -> None:
    (first,) = migs(a100, 1)
    send([nvml(first, minute, 6) for minute in (0, 10)], agent=agent_of(a100))
    lines = tmp_path / "dcgm.jsonl"
    lines.write_text(
        "".join(json.dumps({**dcgm(a100, minute, 6), "node": NODE}) + "\n" for minute in (1, 20))
    )
    out = StringIO()
    call_command("ingest_samples", str(lines), stdout=out)
    assert "2 accepted" in out.getvalue()
    assert placed() == {ms(1): first.meter_id}
    assert aside() == [ms(20)]
    # Set aside without a token, it is placed once the spells reach it.
    send([nvml(first, 19, 6)], agent=agent_of(a100))
    assert placed() == {ms(1): first.meter_id, ms(20): first.meter_id}


# --- Two connections at once ----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_readings_sent_while_a_spell_is_being_recorded_wait_for_it(a100: Device) -> None:
    (first,) = migs(a100, 1)
    agent = agent_of(a100)
    # The NVML batch holds its transaction open: the DCGM batch comes meanwhile, and must wait.
    writer = Connection(lambda: send([nvml(first, minute, 2) for minute in (0, 10)], agent=agent))
    assert writer.done_work.wait(timeout=30) and writer.error is None
    batch = OnItsOwn(
        lambda: send([dcgm(a100, minute + 0.5, 2) for minute in range(10)], agent=agent)
    )
    # Not done while the NVML batch is uncommitted: it waits for a lock, and is still
    # waiting when that batch is let commit.
    waited_for(writer, batch, "the DCGM batch did not wait for the NVML one")
    assert placed() == {ms(minute + 0.5): first.meter_id for minute in range(10)}
    assert aside() == []


def test_prometheus_labels_in_digits_int_refuses_are_not_read_as_numbers(a100: Device) -> None:
    """`GPU_I_ID="²"` (a digit to `str.isdigit`, not to `int`) is no GPU instance id: the
    series is matched as a whole GPU's, never a ValueError in the rollup; nor an AMD
    `gpu_id` or partition so written."""
    exporters = {one.name: one for one in prometheus.config().exporters}
    dcgm_exporter, amd = exporters["dcgm"], exporters["amd"]
    labels = {
        dcgm_exporter.labels["uuid"]: a100.uuid,
        dcgm_exporter.labels["gpu_instance"]: "²",
        dcgm_exporter.labels["mig_profile"]: "1g.5gb",
        dcgm_exporter.labels["node"]: NODE,
    }
    identities = prometheus._identities(Device.objects.filter(pk=a100.pk), ms(0) - 3_600_000, ms(0))
    keys, _ = prometheus.match_series(
        dcgm_exporter, [prometheus.Series(labels=labels, points=[(ms(0), 50.0)])], identities, 0
    )
    assert keys == [identities.by_uuid[a100.uuid]]
    odd = {amd.labels["serial"]: "S1", amd.labels["gpu_id"]: "²", amd.labels["node"]: NODE}
    assert prometheus._pci_order_indexes(amd, [prometheus.Series(labels=odd, points=[])]) == {}
    partition = {**odd, amd.labels["gpu_id"]: "0", amd.labels["partition"]: "¹"}
    assert prometheus._pci_order_indexes(amd, [prometheus.Series(labels=partition, points=[])]) == {
        (NODE, "S1"): 0
    }
