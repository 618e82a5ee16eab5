"""Review round 30: an adversarial look at two commits, DCGM MIG samples named
`<parent UUID>::gi<N>` placed by their GPU instance's spells (98e1c81: `metering.ingest`,
`metering.mig_instances`, migration billing 0013), and pools whose devices consume unpublished
counter sets counted by no quota rule, cached by their slices' marks (5f9c172:
`quota.admission.shapes`, `quota.admission.decision`, `inventory.checks`).

A test marked `xfail(strict=True)` shows a defect, named in its reason:

- A DCGM sample at the very instant of its device's own NVML sample: the first stored wins,
  and placed first it makes the NVML sample a duplicate no spell search sees; the device's own
  sample is lost and the spells shrink.
- A dynamic MIG partition that was another GPU instance between: its samples of that one
  extend this one's spell when a later batch splits it, by order.
- An operator's backfill where two clusters have spells (a node moved): placed or set aside
  by order, and never placed by the instant's own cluster.
- Another cluster's token sets aside a sample at a cluster's GPU instance, node and instant
  first: the cluster's own DCGM sample is dropped as its duplicate, never billed.
- A sample moved aside keeps its first arrival's time and is purged at once.
- The Prometheus source bills a reading no spell covers to the profile's only MIG device; the
  samples path sets it aside.
- Placements made under an earlier TALLY_SAMPLE_HOLD_SECONDS are never looked at again.
- DCGM samples set aside before migration 0013 are never placed.
- An `All` request's warning for mixed reasons names no whole pool once cut to 256.

The others guard a risk that was tried and held: moves mark their hours for the rollup,
replays after moves, the tokens' limits, odd `::gi` names, five writers on five connections,
any split of a token's and an operator's batches; pool checks across rolled-back
transactions, a pool flipped within a second, another process, a restored database, a
thousand invalid pools, two clusters with one pool name.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inventory import services as inventory_services
from inventory.models import Device
from metering import ingest, prometheus, rollup
from metering.hours import MS_PER_HOUR, epoch_ms, hour_at, sample_hold_ms
from metering.ingest import adopt_unknown_samples
from metering.models import (
    AgentToken,
    DcgmInstance,
    DirtyHour,
    MigInstance,
    Sample,
    UnknownDeviceSample,
    UsageHour,
)
from metering.retention import purge_unknown_device_samples
from metering.services import issue_agent_token
from quota.admission import shapes
from tests.factories import (
    ClusterFactory,
    DeviceFactory,
    MigDeviceFactory,
    NodeFactory,
)
from tests.metering.test_dcgm_mig_adoption import (
    A100,
    NODE,
    NOW,
    T0,
    agent_of,
    aside,
    at,
    dcgm,
    held_and_priced,
    migs,
    ms,
    nvml,
    placed,
    send,
    state,
)
from tests.metering.test_ingest_dynamic_mig import load as load_dynamic
from tests.quota.fixtures import AT, claim, decide
from tests.quota.test_unpublished_counters import (
    GPU,
    NICS,
    PARTS,
    PARTS_CLASS,
    counter_slice,
    counts_nothing,
    every,
    exact,
    load,
    load_refused_everywhere,
    partitioned,
    parts_team,
)

# --- Helpers --------------------------------------------------------------------------------


def make_a100(cluster: str = "cluster-a", node: str = NODE, uuid: str | None = None) -> Device:
    """An A100 on `node` of `cluster` (made if need be), optionally with a given UUID."""
    host = NodeFactory.create(cluster=ClusterFactory.create(name=cluster), name=node)
    fields: dict[str, Any] = {"uuid": uuid} if uuid else {}
    return DeviceFactory.create(node=host, name="gpu-0", product_name=A100, **fields)


def spells() -> list[tuple[Any, ...]]:
    """Every GPU instance's spells, as compared."""
    return sorted(
        MigInstance.objects.values_list(
            "cluster_id", "node", "parent_uuid", "gpu_instance_id", "meter_id", "first_ms",
            "last_ms",
        )
    )  # fmt: skip


def everything() -> tuple[Any, ...]:
    """What is stored, set aside and recorded as spells."""
    return (*state(), spells())


def in_order(steps: list[Callable[[], object]]) -> tuple[Any, ...]:
    """`everything()` after `steps` run in order, all of it rolled back after."""
    with transaction.atomic():
        for step in steps:
            step()
        result = everything()
        transaction.set_rollback(True)
    return result


def operator(samples: list[dict[str, Any]], node: str = NODE) -> ingest.IngestReport:
    """An operator's backfill (no token), as `manage.py ingest_samples` stores it."""
    return send(samples, agent=None, node=node)


# === 98e1c81: DCGM samples placed by their GPU instance's spells ==============================

# --- A DCGM sample at the very instant of its device's own NVML sample -----------------------


@pytest.mark.django_db
def test_a_dcgm_sample_at_its_devices_own_instant_gives_the_same_result_in_any_order() -> None:
    """Instance 1 is `first` from minute 0 to 20; at minute 10 both NVML (its own sample, no
    utilisation) and DCGM (50 %) read it. Then `second` reports instance 1 at minute 15 (an id
    reused) and DCGM reads it at minute 11. What is stored, billed and recorded must not
    depend on whether DCGM's or NVML's minute-10 reading came first."""
    gpu = make_a100()
    first, second = migs(gpu, 2)
    agent = agent_of(gpu)

    def batch(*samples: dict[str, Any]) -> Callable[[], object]:
        return lambda: send(list(samples), agent=agent)

    base = batch(nvml(first, 0, 1), nvml(first, 20, 1))
    dcgm_10 = batch(dcgm(gpu, 10, 1, util=50.0))
    nvml_10 = batch(nvml(first, 10, 1))
    rest = [batch(nvml(second, 15, 1)), batch(dcgm(gpu, 11, 1, util=70.0))]
    dcgm_first = in_order([base, dcgm_10, nvml_10, *rest])
    nvml_first = in_order([base, nvml_10, dcgm_10, *rest])
    assert dcgm_first == nvml_first


# --- An operator's backfill where two clusters have spells of the GPU instance ---------------


def _moved_node() -> tuple[Device, Device, AgentToken, AgentToken]:
    """One A100, first on NODE of cluster A, then (the node moved) on NODE of cluster B: the
    same GPU UUID under the same node name in two clusters, each with its 1g.5gb MIG device
    and its agent's token."""
    gpu_a = make_a100("cluster-a")
    gpu_b = make_a100("cluster-b", uuid=gpu_a.uuid)
    (mig_a,) = migs(gpu_a, 1)
    (mig_b,) = migs(gpu_b, 1)
    token_b = ingest.authenticate(issue_agent_token(cluster=gpu_b.cluster, node=NODE, actor="ops"))
    assert token_b is not None
    return mig_a, mig_b, agent_of(gpu_a), token_b


@pytest.mark.django_db
def test_an_operators_sample_two_clusters_may_own_is_placed_alike_in_any_order() -> None:
    mig_a, mig_b, token_a, token_b = _moved_node()
    gpu = Device.objects.get(uuid=mig_a.parent_uuid, cluster=mig_a.cluster)

    def a_first_sample() -> object:
        return send([nvml(mig_a, 0, 1)], agent=token_a)

    def a_second_sample() -> object:
        return send([nvml(mig_a, 5, 1)], agent=token_a)

    def b_spell() -> object:
        return send([nvml(mig_b, minute, 1) for minute in (100, 105)], agent=token_b)

    def backfill() -> object:
        return operator([{**dcgm(gpu, 6, 1), "node": NODE}])

    backfill_last = in_order([a_first_sample, b_spell, a_second_sample, backfill])
    backfill_between = in_order([a_first_sample, b_spell, backfill, a_second_sample])
    # Arriving last, the reading is cluster A's: only A's spell covers its instant (B's
    # begins at minute 100), as `test_an_operators_backfill_of_a_node_that_moved_clusters_is_
    # placed_by_its_instant` has it; the review's first expectation (aside: two clusters have
    # spells of the GPU instance, at any time) contradicted that test.
    assert (len(backfill_last[0]), len(backfill_last[1])) == (5, 0)
    assert backfill_between == backfill_last


@pytest.mark.django_db
def test_an_operators_backfill_of_a_node_that_moved_clusters_is_placed_by_its_instant() -> None:
    mig_a, mig_b, token_a, token_b = _moved_node()
    gpu = Device.objects.get(uuid=mig_a.parent_uuid, cluster=mig_a.cluster)
    send([nvml(mig_a, minute, 1) for minute in (0, 10)], agent=token_a)
    send([nvml(mig_b, minute, 1) for minute in (100, 110)], agent=token_b)
    operator([{**dcgm(gpu, minute, 1), "node": NODE} for minute in (5, 105)])
    assert placed() == {ms(5): mig_a.meter_id, ms(105): mig_b.meter_id}


# --- A token of one cluster setting aside a sample under another cluster's GPU instance -------


@pytest.mark.django_db
def test_another_clusters_token_cannot_stop_a_clusters_own_dcgm_sample_being_placed() -> None:
    own_gpu = make_a100("cluster-a", node="a-node")
    their_gpu = make_a100("cluster-b", node="b-node")
    (theirs,) = migs(their_gpu, 1)
    their_agent = agent_of(their_gpu, node="b-node")
    cluster_wide_a = agent_of(own_gpu, node="*")
    reading = dcgm(their_gpu, 5, 1, util=80.0)
    # Cluster A's cluster-wide token names B's GPU instance at B's node name: set aside.
    assert send([{**reading, "gpu_util": 1.0}], agent=cluster_wide_a, node="b-node").accepted == 1
    # B's own DCGM agent, before B's NVML agent recorded the spell, then the spell.
    report = send([reading], agent=their_agent, node="b-node")
    send([nvml(theirs, minute, 1) for minute in (0, 10)], agent=their_agent, node="b-node")
    assert Sample.objects.filter(device_uuid=theirs.meter_id, gpu_util=80.0).exists()
    assert (report.accepted, report.duplicates) == (1, 0)


# --- A sample moved aside expires by the day it first came ------------------------------------


@pytest.mark.django_db
def test_a_sample_moved_aside_waits_its_retention_from_the_move() -> None:
    gpu = make_a100()
    first, second = migs(gpu, 2)
    agent = agent_of(gpu)
    send([nvml(first, minute, 1) for minute in (0, 30)], agent=agent)
    long_ago = NOW - timedelta(days=10)
    valid, _ = ingest.validate_samples([dcgm(gpu, 3.5, 1)], now=NOW)
    ingest.ingest(node=NODE, samples=valid, received_at=long_ago, agent=agent)
    assert placed() == {ms(3.5): first.meter_id}
    # `second` held instance 1 at minute 10 (late news): minute 3.5 is nobody's for now.
    send([nvml(second, 10, 1)], agent=agent)
    assert aside() == [ms(3.5)]
    purge_unknown_device_samples(now=NOW)
    # `first`'s sample at minute 2 (later still) covers it again.
    send([nvml(first, 2, 1)], agent=agent)
    assert placed() == {ms(3.5): first.meter_id}


# --- The Prometheus source and the samples path -----------------------------------------------


def _prometheus_meter(gpu: Device, instance: int, ts_ms: int) -> str | None:
    """The device the Prometheus source bills a DCGM MIG series' reading at `ts_ms` to."""
    (exporter,) = [one for one in prometheus.config().exporters if one.name == "dcgm"]
    labels = {
        exporter.labels["uuid"]: gpu.uuid,
        exporter.labels["gpu_instance"]: str(instance),
        exporter.labels["mig_profile"]: "1g.5gb",
        exporter.labels["node"]: NODE,
    }
    devices = Device.objects.filter(parent_uuid=gpu.uuid) | Device.objects.filter(pk=gpu.pk)
    identities = prometheus._identities(devices, ts_ms - MS_PER_HOUR, ts_ms + MS_PER_HOUR)
    (key,), _ = prometheus.match_series(
        exporter, [prometheus.Series(labels=labels, points=[(ts_ms, 50.0)])], identities, ts_ms
    )
    return key.meter_at(ts_ms) if isinstance(key, prometheus.InstanceMeters) else key


@pytest.mark.django_db
def test_a_reading_no_spell_covers_goes_where_the_prometheus_source_puts_it() -> None:
    gpu = make_a100()
    (only,) = migs(gpu, 1)
    agent = agent_of(gpu)
    send([nvml(only, minute, 1) for minute in (0, 10)], agent=agent)
    send([dcgm(gpu, minute, 1) for minute in (5, 30)], agent=agent)
    # Inside the spell both agree.
    assert _prometheus_meter(gpu, 1, ms(5)) == only.meter_id == placed()[ms(5)]
    # Past the spell's hold: neither bills it (the GPU instance may be another device by then),
    # though the GPU has one 1g.5gb device the engine's series could be matched to by profile.
    samples_path = placed().get(ms(30))
    assert samples_path is None
    assert _prometheus_meter(gpu, 1, ms(30)) is None


# --- The hold changed between two batches -----------------------------------------------------


@pytest.mark.django_db
def test_placements_made_are_kept_when_the_hold_changes() -> None:
    """Documented (docs/reference/configuration.md, TALLY_SAMPLE_HOLD_SECONDS): a placement made
    under the hold then in force is kept when the hold is lowered; what arrives, or is set
    aside, is placed by the hold in force. (The review asked that placements follow the hold;
    looking at every placement again at each change of the setting was judged
    disproportionate.)"""
    gpu = make_a100()
    (only,) = migs(gpu, 1)
    agent = agent_of(gpu)
    with override_settings(TALLY_SAMPLE_HOLD_SECONDS=300):
        send([nvml(only, minute, 1) for minute in (0, 10)], agent=agent)
        send([dcgm(gpu, 14, 1)], agent=agent)  # 4 minutes past the spell: held then
    assert sample_hold_ms() == 120_000
    send([dcgm(gpu, 14.5, 1)], agent=agent)  # the same distance, arriving now: nobody's
    adopt_unknown_samples(now=NOW)
    assert ms(14) in placed() and ms(14.5) not in placed() and aside() == [ms(14.5)]


# --- Guards: what was tried and held -----------------------------------------------------------

# GPU instance 1 of the A100: `first` from minute 0 to 10, `second` from 20 to 30, `first`
# again from 40 to 50; DCGM reads it at half past each minute, 0 to 55.
RUNS = ((0, (0, 5, 10)), (1, (20, 25, 30)), (0, (40, 45, 50)))


def _billed_pair() -> tuple[Device, list[Device], AgentToken]:
    """The A100's two MIG devices, each held by a team's claim for two hours from T0, priced
    per 1g.5gb slice-hour with idle time at half."""
    gpu = make_a100()
    devices, _ = held_and_priced(gpu)
    return gpu, devices, agent_of(gpu)


def _usage() -> list[tuple[Any, ...]]:
    return sorted(
        UsageHour.objects.values_list(
            "allocation__device__name", "hour", "allocated_gpu_ms", "utilised_gpu_ms",
            "unmeasured_gpu_ms",
        )
    )  # fmt: skip


@pytest.mark.django_db
def test_moves_mark_their_hours_so_the_rollup_of_marked_hours_alone_follows_them() -> None:
    """The readings are rolled up while `second`'s run is not known; when it comes, the moves
    mark their hours, and rolling up the marked hours alone gives what rolling up everything
    at the end gives."""
    gpu, devices, agent = _billed_pair()
    nvml_batches = [[nvml(devices[index], m, 1) for m in minutes] for index, minutes in RUNS]
    readings = [dcgm(gpu, minute + 0.5, 1, util=float(minute)) for minute in range(56)]
    hours = [hour_at(epoch_ms(T0) // MS_PER_HOUR + offset) for offset in range(3)]
    later = T0 + timedelta(hours=3, minutes=30)
    with transaction.atomic():
        for batch in [*nvml_batches, readings]:
            send(batch, agent=agent)
        rollup.rollup_hours(hours=hours, now=later)
        expected = _usage()
        transaction.set_rollback(True)
    send(nvml_batches[0] + nvml_batches[2], agent=agent)
    send(readings, agent=agent)
    rollup.rollup_hours(hours=hours, now=later)
    DirtyHour.objects.all().delete()
    before = _usage()
    send(nvml_batches[1], agent=agent)  # `second` held the id between: readings move
    assert DirtyHour.objects.filter(hour=T0).exists()
    rollup.rollup_pending(now=later)
    assert before != expected
    assert _usage() == expected


@pytest.mark.django_db
def test_replays_after_a_move_change_nothing() -> None:
    """Readings moved to another device, and moved aside, then every batch sent again (the
    agents' retries after a lost answer): all duplicates, nothing added or moved."""
    gpu = make_a100()
    first, second = migs(gpu, 2)
    agent = agent_of(gpu)
    batches = [
        [nvml(first, minute, 1) for minute in (0, 40)],
        [dcgm(gpu, minute + 0.5, 1) for minute in range(45)],
        [nvml(second, minute, 1) for minute in (20, 25)],
    ]
    for batch in batches:
        send(batch, agent=agent)
    before = everything()
    assert set(placed().values()) == {first.meter_id, second.meter_id} and aside()
    for batch in batches:
        report = send(batch, agent=agent)
        assert (report.accepted, report.duplicates) == (0, len(batch))
    assert everything() == before


@pytest.mark.django_db
def test_samples_moved_aside_take_no_room_of_the_tokens_limit() -> None:
    """A token may keep 3 samples of unknown devices aside. Its 5 readings placed then moved
    aside by a late spell (set aside without a token, in its cluster) leave it that room; what
    it sends past the room is refused naming the setting, not a 500."""
    gpu = make_a100()
    first, second = migs(gpu, 2)
    agent = agent_of(gpu)
    send([nvml(first, minute, 1) for minute in (0, 30)], agent=agent)
    send([dcgm(gpu, minute + 10.5, 1) for minute in range(5)], agent=agent)
    assert len(placed()) == 5
    send([nvml(second, 5, 1)], agent=agent)
    assert len(aside()) == 5 and not UnknownDeviceSample.objects.filter(agent_token=agent)
    token = issue_agent_token(cluster=gpu.cluster, node=NODE, actor="ops")
    with override_settings(TALLY_INGEST_MAX_UNKNOWN_SAMPLES=3):
        response = Client().post(
            "/ingest/samples",
            data=json.dumps(
                {"node": NODE, "samples": [dcgm(gpu, 50 + minute, 2) for minute in range(4)]}
            ),
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["accepted"] == 3
    assert [item["index"] for item in body["rejected"]] == [3]
    assert "TALLY_INGEST_MAX_UNKNOWN_SAMPLES" in body["rejected"][0]["reason"]


@pytest.mark.parametrize(
    ("uuid", "fields", "rejected"),
    [
        ("GPU-x::gi" + "9" * 119, {}, "samples[0].uuid: "),  # 128 characters, a huge id
        ("GPU-x::gi" + "0" * 118 + "3", {"gpu_instance_id": 3}, ""),  # leading zeros: id 3
        ("GPU-x::gi4095", {}, ""),
        ("GPU-x::gi4096", {}, "samples[0].uuid: "),
        ("GPU-x::gi\u0663", {}, "samples[0].uuid: "),  # an Arabic-Indic digit 3
        ("GPU-x::gi\uff13", {}, "samples[0].uuid: "),  # a fullwidth digit 3
        ("GPU-x::gi-1", {}, ""),  # not a GPU instance: a device's own (unknown) uuid
        ("GPU-x::gi1", {"gpu_instance_id": True}, "samples[0].gpu_instance_id: "),
        ("GPU-x::gi1", {"gpu_instance_id": 1.0}, "samples[0].gpu_instance_id: "),
        ("GPU-x::gi1", {"gpu_instance_id": -1}, "samples[0].gpu_instance_id: "),
        ("GPU-x::gi1", {"parent_uuid": ["GPU-x"]}, "samples[0].parent_uuid: "),
        ("GPU-x::gi1", {"mig_placement": {"start": 0, "size": 1}}, "samples[0].mig_placement"),
        ("GPU-x::gi1::gi2", {"gpu_instance_id": 2}, ""),  # the parent is "GPU-x::gi1"
        ("::gi1", {}, ""),
    ],
)
@pytest.mark.django_db
def test_odd_gpu_instance_names_are_answered_never_with_a_500(
    uuid: str, fields: dict[str, Any], rejected: str
) -> None:
    gpu = make_a100()
    token = issue_agent_token(cluster=gpu.cluster, node=NODE, actor="ops")
    sample = {**dcgm(gpu, 1, 1), "uuid": uuid, **fields}
    if "gpu_instance_id" not in fields:
        del sample["gpu_instance_id"]
    del sample["parent_uuid"]
    if "parent_uuid" in fields:
        sample["parent_uuid"] = fields["parent_uuid"]
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": NODE, "samples": [sample]}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    body = response.json()
    if rejected:
        assert body["accepted"] == 0
        assert body["rejected"][0]["reason"].startswith(rejected), body
    else:
        assert (body["accepted"], body["rejected"]) == (1, []), body
    # Whatever it was, it names nothing of this cluster's spells or another's.
    assert not MigInstance.objects.exists()


def _reset_metering() -> None:
    for model in (Sample, UnknownDeviceSample, MigInstance, DcgmInstance, DirtyHour):
        model.objects.all().delete()


@pytest.mark.django_db(transaction=True)
def test_nvml_dcgm_and_adoption_on_five_connections_at_once_store_what_one_would() -> None:
    """Five writers of one GPU's instances at once, each on its connection: NVML's two late
    runs of instance 1 (which move DCGM readings), DCGM's readings of instances 1 and 5 in two
    batches, and the adoption of instance 5's NVML samples (whose spell places DCGM's). Each
    round ends as the serial run does, and none deadlocks."""
    gpu = make_a100()
    first, second = migs(gpu, 2)
    later = MigDeviceFactory.create(parent=gpu, name="gpu-0-mig-1g5gb-19-6", profile="1g.5gb")
    agent = agent_of(gpu)

    def preliminaries() -> None:
        _reset_metering()
        send([nvml(first, minute, 1) for minute in (0, 5, 10)], agent=agent)
        for minute in (0, 10, 20):  # instance 5's own samples, set aside before it was known
            UnknownDeviceSample.objects.create(
                device_uuid=later.uuid, ts_ms=ms(minute), node=NODE, received_at=NOW,
                gpu_instance={"parent_uuid": gpu.uuid, "gpu_instance_id": 5},
                agent_token=agent, mem_used_bytes=2**30,
            )  # fmt: skip

    readings = [dcgm(gpu, minute + 0.5, 1) for minute in range(56)]
    readings += [dcgm(gpu, minute + 0.25, 5, util=10.0) for minute in range(22)]
    writers: list[Callable[[], object]] = [
        lambda: send([nvml(second, minute, 1) for minute in (20, 25, 30)], agent=agent),
        lambda: send([nvml(first, minute, 1) for minute in (40, 45, 50)], agent=agent),
        lambda: send(readings[::2], agent=agent),
        lambda: send(readings[1::2], agent=agent),
        lambda: adopt_unknown_samples(now=NOW),
    ]
    with transaction.atomic():
        preliminaries()
        for write in writers:
            write()
        expected = everything()
        transaction.set_rollback(True)
    assert len(expected[0]) == 6 + 3 + 3 + len(readings) - len(expected[1])
    for _ in range(6):
        preliminaries()
        assert _at_once(writers) == []
        assert everything() == expected


def _at_once(writers: list[Callable[[], object]]) -> list[BaseException]:
    """Run each writer in a transaction on a connection of its own, all released at once;
    what they raised."""
    start = threading.Barrier(len(writers))
    errors: list[BaseException] = []

    def run(write: Callable[[], object]) -> None:
        try:
            start.wait(timeout=30)
            with transaction.atomic():
                write()
        except BaseException as exc:  # returned to the caller
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(write,)) for write in writers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return errors


# === 5f9c172: pools the scheduler allocates nothing from, cached by their slices' marks ========


def _cluster_id() -> int:
    return inventory_services.get_cluster("default").pk


def _invalid_now() -> list[str]:
    return [pool.pool for pool in shapes.invalid_pools(cluster_id=_cluster_id()).pools]


def _watch(event_type: str, obj: dict[str, Any], at: Any) -> None:
    report = inventory_services.apply_watch_event(
        cluster=inventory_services.get_cluster("default"), event_type=event_type, obj=obj, at=at
    )
    assert report.errors == []


@pytest.fixture
def cache_kept(settings: Any) -> None:
    """Each admission looks at the fleet again; the process's pool checks are kept."""
    settings.TALLY_SHAPE_CACHE_SECONDS = 0


@pytest.mark.django_db
def test_a_check_made_in_a_transaction_rolled_back_is_not_trusted_after_it() -> None:
    """The pool is broken inside a savepoint and checked there (the process caches the check
    by the marks that transaction saw), then rolled back: the next check, by the marks now,
    finds the pool sound."""
    good_counters, devices = partitioned("roll-1", "gpu-0-counters", "gpu-0-counters")
    load(PARTS_CLASS, good_counters, devices)
    assert _invalid_now() == []
    broken = counter_slice("roll-1-counters", "roll-1", {"gpu-0-countres": GPU})
    with transaction.atomic():
        _watch("MODIFIED", broken, AT + timedelta(minutes=1))
        assert _invalid_now() == ["roll-1"]
        transaction.set_rollback(True)
    assert _invalid_now() == []
    # And the other way: put right in a transaction rolled back, still broken after it.
    _watch("MODIFIED", broken, AT + timedelta(minutes=2))
    assert _invalid_now() == ["roll-1"]
    with transaction.atomic():
        _watch("MODIFIED", good_counters, AT + timedelta(minutes=3))
        assert _invalid_now() == []
        transaction.set_rollback(True)
    assert _invalid_now() == ["roll-1"]


@pytest.mark.django_db
def test_a_pool_fixed_then_broken_again_in_the_same_second_is_seen_broken(
    client: Client, cache_kept: None
) -> None:
    broken, devices = partitioned("flip-1", "gpu-0-countres", "gpu-0-counters")
    load(PARTS_CLASS, broken, devices)
    parts_team()
    fixed = counter_slice("flip-1-counters", "flip-1", {"gpu-0-counters": GPU})
    same_second = AT + timedelta(minutes=1)
    _watch("MODIFIED", fixed, same_second)
    assert _invalid_now() == []
    _watch("MODIFIED", broken, same_second)
    _watch("MODIFIED", fixed, same_second)
    _watch("MODIFIED", broken, same_second)
    assert _invalid_now() == ["flip-1"]
    assert decide(client, claim("flip", [exact(1)]))["warnings"]
    assert counts_nothing("flip")


@pytest.mark.django_db(transaction=True)
def test_a_pool_broken_by_another_process_is_seen_at_the_next_check() -> None:
    """The sync (another connection) breaks a pool this process checked sound, and commits:
    the marks change, the pool is checked again."""
    good_counters, devices = partitioned("other-1", "gpu-0-counters", "gpu-0-counters")
    load(PARTS_CLASS, good_counters, devices)
    assert _invalid_now() == []
    broken = counter_slice("other-1-counters", "other-1", {"gpu-0-countres": GPU})
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            _watch("MODIFIED", broken, AT + timedelta(minutes=1))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=sync)
    thread.start()
    thread.join(timeout=30)
    assert errors == []
    assert _invalid_now() == ["other-1"]
    shapes.forget_fleet_shapes()


@pytest.mark.django_db
def test_restored_database_pool_checks_are_forgotten_when_transaction_ids_go_back() -> None:
    """A database restored behind the same name can hold slices whose marks (ctid, xmin) equal
    those this process cached of the old one. `refreshed` sees the transaction ids go back and
    checks every pool again: here the cached check (sound, under the very marks now stored)
    stands for the old database's."""
    typo = partitioned("restored-1", "gpu-0-counters", "gpu-0-countres")
    load(PARTS_CLASS, *typo)
    cluster_id = _cluster_id()
    assert _invalid_now() == ["restored-1"]
    cached = shapes._pool_checks[cluster_id]
    shapes._pool_checks[cluster_id] = shapes._PoolChecks(
        mark=cached.mark,
        pools={key: (mark, None) for key, (mark, _) in cached.pools.items()},
        invalid=(),
    )
    assert _invalid_now() == []  # the cache is trusted while the marks are the same
    old_database = shapes.FleetShapes(counted_as_of="9000000000:9000000000:")
    fresh = shapes.refreshed(old_database, cluster_id=cluster_id, version=None)
    assert [pool.pool for pool in fresh.invalid.pools] == ["restored-1"]


@pytest.mark.django_db
def test_a_thousand_invalid_pools_cost_a_few_queries_and_one_short_warning(
    client: Client, cache_kept: None
) -> None:
    """A driver that publishes every pool wrong: each of 1000 pools' quarters consume a set
    their counter slice does not publish. The check is a few queries, never one per pool; an
    admission answers with one warning, cut to what the API server keeps."""
    slices = []
    for index in range(1000):
        slices.extend(partitioned(f"typo-{index:04d}", "gpu-0-counters", "gpu-0-countres"))
    load(PARTS_CLASS, *slices)
    parts_team()
    shapes._pool_checks.clear()
    with CaptureQueriesContext(connection) as queries:
        invalid = shapes.invalid_pools(cluster_id=_cluster_id())
    assert len(invalid.pools) == 1000 and len(queries) < 10
    answer = decide(client, claim("any", [exact(1, shapes_quarters())]))
    assert answer["allowed"]
    (warning,) = answer["warnings"]
    assert len(warning) <= 256 and "(and 999 more such pools)" in warning
    assert counts_nothing("any")


def shapes_quarters() -> str:
    return f"device.capacity['{PARTS}'].multiprocessors.compareTo(quantity('32')) == 0"


@pytest.mark.django_db
def test_two_clusters_with_a_pool_of_one_name_are_checked_apart(client: Client) -> None:
    """The same driver and pool name in two clusters, broken in one only: each cluster's
    check is its own, cached apart."""
    load(PARTS_CLASS, *partitioned("same-1", "gpu-0-counters", "gpu-0-countres"))
    other = inventory_services.get_cluster("other")
    report = inventory_services.import_snapshot(
        cluster=other,
        objects=[PARTS_CLASS, *partitioned("same-1", "gpu-0-counters", "gpu-0-counters")],
        at=AT,
    )
    assert report.errors == []
    assert _invalid_now() == ["same-1"]
    assert shapes.invalid_pools(cluster_id=other.pk).pools == ()
    assert _invalid_now() == ["same-1"]


# A cloud provider's node names: a NIC driver publishes one pool per node, named after it.
CLOUD_NODE = "ip-10-0-130-25.us-west-2.compute.internal"


@pytest.mark.django_db
def test_an_all_request_refused_for_different_reasons_names_the_pool(client: Client) -> None:
    load_refused_everywhere(CLOUD_NODE)
    parts_team()
    (warning,) = decide(client, claim("node", [every()]))["warnings"]
    assert counts_nothing("node")
    assert f"{NICS}/{CLOUD_NODE}" in warning and "nic-0-bandwidth" in warning


# --- DCGM samples set aside before migration 0013 -----------------------------------------------


@pytest.mark.django_db
def test_dcgm_samples_set_aside_before_the_upgrade_are_placed_by_the_spells() -> None:
    gpu = make_a100()
    (first,) = migs(gpu, 1)
    agent = agent_of(gpu)
    # Before 0013: the NVML agent's spell of instance 1 was recorded, and a DCGM sample named
    # by the GPU instance was set aside as an unknown device's, as that code stored it.
    send([nvml(first, minute, 1) for minute in (0, 10)], agent=agent)
    UnknownDeviceSample.objects.create(
        device_uuid=f"{gpu.uuid}::gi1", ts_ms=ms(5), node=NODE, received_at=NOW,
        gpu_util=50.0, mem_used_bytes=2**30, agent_token=agent,
        gpu_instance={"parent_uuid": gpu.uuid, "gpu_instance_id": 1},
    )  # fmt: skip
    assert not DcgmInstance.objects.exists()
    # After it: the spell goes on, the rollup's adoption runs; the same sample arriving now
    # would be placed at once.
    send([nvml(first, 20, 1)], agent=agent)
    adopt_unknown_samples(now=NOW)
    send([nvml(first, 15, 1)], agent=agent)
    assert placed() == {ms(5): first.meter_id}


# --- A dynamic MIG partition that is one GPU instance, then another ---------------------------

A100_DYN = "GPU-8c2d4e6f-0a1b-4c3d-8e5f-7a9b1c3d5e7f"  # on a100-dyn-1: only its partitions


def _dynamic(uuid: str, start: int, instance: int, minute: float) -> dict[str, Any]:
    """A sample of the MIG device NVIDIA's driver made for a claim (a new UUID), at placement
    `start` (1g.10gb) of the dynamic-MIG A100, GPU instance `instance`."""
    return {
        "uuid": uuid, "ts": at(minute).isoformat(), "gpu_util": None, "parent_uuid": A100_DYN,
        "gpu_instance_id": instance, "mig_placement": {"start": start, "size": 1},
        "mig_profile": "1g.10gb",
    }  # fmt: skip


@pytest.mark.django_db
def test_a_partition_that_was_another_gpu_instance_between_gives_the_same_spells() -> None:
    """Placement 6 of the A100 (partition D) is GPU instance 1 at minute 0, instance 2 at
    minute 10 (another claim), then 1 again at minute 30; placement 5 (E) is instance 1 at
    minute 20. DCGM reads instance 1 at minute 11."""
    cluster = load_dynamic()
    token = ingest.authenticate(issue_agent_token(cluster=cluster, node="a100-dyn-1", actor="ops"))
    assert token is not None
    claims = [
        _dynamic("MIG-00000000-0000-4000-8000-000000000001", 6, 1, 0),
        _dynamic("MIG-00000000-0000-4000-8000-000000000004", 6, 1, 30),
    ]
    other_claim = _dynamic("MIG-00000000-0000-4000-8000-000000000002", 6, 2, 10)
    on_e = _dynamic("MIG-00000000-0000-4000-8000-000000000003", 5, 1, 20)
    reading = {
        "uuid": f"{A100_DYN}::gi1", "ts": at(11).isoformat(), "gpu_util": 60.0,
        "parent_uuid": A100_DYN, "gpu_instance_id": 1,
    }  # fmt: skip

    def batch(*samples: dict[str, Any]) -> Callable[[], object]:
        return lambda: send(list(samples), agent=token, node="a100-dyn-1")

    at_once = in_order([batch(*claims, other_claim, on_e, reading)])
    one_by_one = in_order([batch(*claims), batch(other_claim), batch(on_e), batch(reading)])
    assert len(at_once[1]) == 1  # at minute 11 instance 1 was no device an agent saw
    assert one_by_one == at_once


# --- Guard: a token's and an operator's batches, two GPU instances, any split ------------------


@pytest.fixture
def three() -> tuple[Device, list[Device], AgentToken]:
    """The A100's three MIG devices (the first two GPU instance 1 in turn, the third GPU
    instance 2) and its node's token."""
    gpu = make_a100()
    return gpu, migs(gpu, 3), agent_of(gpu)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    runs=st.lists(
        st.tuples(st.sampled_from([0, 1, 2]), st.integers(0, 60), st.integers(1, 4)),
        min_size=1,
        max_size=8,
    ),
    readings=st.sets(
        st.tuples(st.integers(0, 200), st.sampled_from([1, 2])), min_size=1, max_size=40
    ),
    order=st.randoms(use_true_random=False),
    batch_size=st.integers(1, 12),
    operator_share=st.booleans(),
)
@pytest.mark.django_db
def test_two_instances_a_token_and_an_operator_place_alike_however_batches_come(
    three: tuple[Device, list[Device], AgentToken],
    runs: list[tuple[int, int, int]],
    readings: set[tuple[int, int]],
    order: Any,
    batch_size: int,
    operator_share: bool,
) -> None:
    """Runs of NVML samples (instance 1 handed between two devices, instance 2 on a third),
    DCGM readings of both instances between whole minutes, every third of them an operator's
    backfill when `operator_share`: sent at once, or shuffled into batches, the same result.
    (Tried with 2,500 examples while reviewing; 60 kept.)"""
    gpu, devices, agent = three
    instance_of = {0: 1, 1: 1, 2: 2}
    samples: list[tuple[bool, dict[str, Any]]] = []  # (an operator's, the sample)
    seen: set[tuple[int, int]] = set()
    for index, start, count in runs:
        for step in range(count):
            minute = start + 2 * step
            if (minute, instance_of[index]) in seen:
                continue
            seen.add((minute, instance_of[index]))
            samples.append((False, nvml(devices[index], minute, instance_of[index])))
    for n, (reading, instance) in enumerate(sorted(readings)):
        reading_sample = dcgm(gpu, reading / 3 + 0.1, instance, util=float(reading % 100))
        samples.append((operator_share and n % 3 == 0, {**reading_sample, "node": NODE}))

    def go(part: list[tuple[bool, dict[str, Any]]]) -> None:
        mine = [s for by_op, s in part if not by_op]
        ops = [s for by_op, s in part if by_op]
        if mine:
            send(mine, agent=agent)
        if ops:
            send(ops, agent=None)

    with transaction.atomic():
        go(samples)
        expected = everything()
        transaction.set_rollback(True)
    with transaction.atomic():
        shuffled = list(samples)
        order.shuffle(shuffled)
        for start in range(0, len(shuffled), batch_size):
            go(shuffled[start : start + batch_size])
        assert everything() == expected
        transaction.set_rollback(True)
