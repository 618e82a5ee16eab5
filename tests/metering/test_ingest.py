"""Sample ingest: agent tokens, validation, dedup, devices not yet known, dirty hours.

The HTTP tests go through the Django test client at the real path, `/ingest/samples`, with
this module as the URLconf.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import Count
from django.test import Client, override_settings
from django.urls import path
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from billing import services
from inventory.models import Cluster, Device
from metering import views
from metering.hours import epoch_ms
from metering.ingest import (
    SampleRow,
    adopt_unknown_samples,
    authenticate,
    ingest,
    latest_per_hour,
    refresh_gaps,
    touched_hours,
    validate_samples,
)
from metering.ingest.gaps import Bounds as _Bounds
from metering.models import AgentToken, DirtyHour, Sample, UnknownDeviceSample
from metering.retention import purge_unknown_device_samples as purge_unknown_samples
from metering.services import issue_agent_token
from teams.models import AuditEntry
from tests.factories import DeviceFactory, MigDeviceFactory

urlpatterns = [path("ingest/samples", views.ingest_samples)]

pytestmark = [pytest.mark.django_db, pytest.mark.urls(__name__)]

# Two days ago, on the hour: within the window of sample times accepted now.
T0 = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)
# T0 as text: in UTC, with no timezone, an hour later at +01:00 (the same instant).
TS0 = T0.strftime("%Y-%m-%dT%H:%M:%SZ")
NAIVE0 = T0.strftime("%Y-%m-%dT%H:%M:%S")
PLUS1 = (T0 + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S")


def ms(at: datetime) -> int:
    return epoch_ms(at)


def issue_token(*, cluster: Cluster, node: str) -> str:
    return issue_agent_token(cluster=cluster, node=node, actor="ops")


def sample(uuid: str, at: datetime, **fields: Any) -> dict[str, Any]:
    return {"uuid": uuid, "ts": at.isoformat(), "gpu_util": 50.0, **fields}


@pytest.fixture
def gpu() -> Device:
    return DeviceFactory.create()


@pytest.fixture
def token(gpu: Device) -> str:
    assert gpu.node is not None
    return issue_token(cluster=gpu.cluster, node=gpu.node.name)


def post(body: Any, token: str | None, *, raw: bytes | None = None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = raw if raw is not None else json.dumps(body)
    return Client().post(
        "/ingest/samples", data=data, content_type="application/json", headers=headers
    )


def batch(gpu: Device, samples: list[Any]) -> dict[str, Any]:
    assert gpu.node is not None
    return {"node": gpu.node.name, "samples": samples}


# Tokens


def test_a_token_is_stored_only_as_its_hash(gpu: Device, token: str) -> None:
    stored = AgentToken.objects.get()
    assert stored.token_sha256 == hashlib.sha256(token.encode()).hexdigest()
    assert token not in stored.token_sha256
    assert authenticate(token) == stored
    assert authenticate("not-" + token) is None
    assert authenticate("") is None
    entry = AuditEntry.objects.get()
    assert (entry.actor, entry.action, entry.object_type) == ("ops", "create", "agent token")
    assert entry.after is not None
    assert token not in str(entry.after)


def test_missing_or_wrong_token_is_401(gpu: Device, token: str) -> None:
    body = batch(gpu, [sample(gpu.uuid, T0)])
    for bad in (None, "wrong-token"):
        response = post(body, bad)
        assert response.status_code == 401
        assert response["WWW-Authenticate"] == "Bearer"
        assert "token" in response.json()["error"]
    response = Client().post(
        "/ingest/samples",
        data=json.dumps(body),
        content_type="application/json",
        headers={"Authorization": f"Basic {token}"},
    )
    assert response.status_code == 401
    assert not Sample.objects.exists()


def test_a_revoked_token_is_401(gpu: Device, token: str) -> None:
    AgentToken.objects.update(revoked_at=timezone.now())
    response = post(batch(gpu, [sample(gpu.uuid, T0)]), token)
    assert response.status_code == 401
    assert response.json() == {"error": "unknown or revoked agent token"}


def test_another_nodes_token_is_403(gpu: Device) -> None:
    other_token = issue_token(cluster=gpu.cluster, node="some-other-node")
    response = post(batch(gpu, [sample(gpu.uuid, T0)]), other_token)
    assert response.status_code == 403
    assert "some-other-node" in response.json()["error"]
    assert not Sample.objects.exists()


# Malformed requests


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"this is not json", "body is not JSON"),
        (b"\xff\xfe", "body is not JSON"),
        (b"[" * 100_000, "depth limit exceeded"),
        (b'{"node": "n", "samples": [' + b"[" * 20 + b"]" * 20 + b"]}", "nested deeper than 16"),
        (b'{"node": "n", "samples": [{"mem_used_bytes": 1' + b"0" * 5000 + b"}]}", "infinity"),
        (b"[1, 2]", "body must be a JSON object"),
        (b'{"samples": []}', "node is missing"),
        (b'{"node": 7, "samples": []}', "node is missing"),
    ],
)
def test_a_malformed_body_is_400(token: str, raw: bytes, message: str) -> None:
    response = post(None, token, raw=raw)
    assert response.status_code == 400
    assert message in response.json()["error"]


@pytest.mark.parametrize("samples", [None, {"uuid": "x"}, "[]"])
def test_samples_must_be_a_list(gpu: Device, token: str, samples: Any) -> None:
    response = post(batch(gpu, samples), token)
    assert response.status_code == 400
    assert response.json() == {"error": "samples is missing or not a list"}


def test_only_post(token: str) -> None:
    response = Client().get("/ingest/samples", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 405
    assert response["Allow"] == "POST"


@override_settings(TALLY_INGEST_MAX_SAMPLES=10)
def test_too_many_samples_is_413(gpu: Device, token: str) -> None:
    samples = [sample(gpu.uuid, T0 + timedelta(seconds=i)) for i in range(11)]
    response = post(batch(gpu, samples), token)
    assert response.status_code == 413
    assert "at most 10" in response.json()["error"]
    assert post(batch(gpu, samples[:10]), token).json()["accepted"] == 10


@override_settings(TALLY_INGEST_MAX_BODY_BYTES=1000)
def test_too_large_a_body_is_413(gpu: Device, token: str) -> None:
    samples = [sample(gpu.uuid, T0, processes=[{"pid": 1, "name": "x" * 2000}])]
    response = post(batch(gpu, samples), token)
    assert response.status_code == 413
    assert "larger than 1000 bytes" in response.json()["error"]


# Validation


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("not an object", "samples[0]: must be an object"),
        ({"ts": TS0}, "samples[0].uuid: must be a non-empty string"),
        ({"uuid": "", "ts": TS0}, "samples[0].uuid: must be a non-empty"),
        ({"uuid": "G" * 129, "ts": TS0}, "at most 128 characters"),
        ({"uuid": "GPU-\x00", "ts": TS0}, "samples[0].uuid: "),
        ({"uuid": "GPU-1"}, "samples[0].ts: must be an ISO 8601 string"),
        ({"uuid": "GPU-1", "ts": 1740823200}, "samples[0].ts: must be an ISO 8601 string"),
        ({"uuid": "GPU-1", "ts": "yesterday"}, 'samples[0].ts: "yesterday" is not an ISO 8601'),
        ({"uuid": "GPU-1", "ts": NAIVE0}, "samples[0].ts: "),
        ({"uuid": "GPU-1", "ts": "2999-01-01T00:00:00Z"}, "more than 5 minutes in the future"),
        (
            {"uuid": "GPU-1", "ts": TS0, "gpu_util": 140},
            "samples[0].gpu_util: 140 is not between 0 and 100",
        ),
        ({"uuid": "GPU-1", "ts": TS0, "gpu_util": -1}, "not between 0 and"),
        ({"uuid": "GPU-1", "ts": TS0, "gpu_util": "50"}, "must be a number"),
        ({"uuid": "GPU-1", "ts": TS0, "gpu_util": True}, "must be a number"),
        ({"uuid": "GPU-1", "ts": TS0, "gpu_util": float("nan")}, "between"),
        (
            {"uuid": "GPU-1", "ts": TS0, "mem_used_bytes": -1},
            "samples[0].mem_used_bytes: must be an integer",
        ),
        ({"uuid": "GPU-1", "ts": TS0, "mem_used_bytes": 1.5}, "an integer"),
        ({"uuid": "GPU-1", "ts": TS0, "mem_used_bytes": 2**63}, "an integer"),
        (
            {"uuid": "GPU-1", "ts": TS0, "processes": {"pid": 1}},
            "samples[0].processes: must be a list of objects",
        ),
        ({"uuid": "GPU-1", "ts": TS0, "processes": [1]}, "list of objects"),
        (
            {"uuid": "GPU-1", "ts": TS0, "processes": [{"name": "a\x00"}]},
            "samples[0].processes: holds a NUL character",
        ),
        (
            {"uuid": "GPU-1", "ts": TS0, "processes": [{"x": "\ud800"}]},
            "samples[0].processes: holds a value JSON cannot carry",
        ),
        (
            {"uuid": "GPU-1", "ts": TS0, "processes": [{"x": float("inf")}]},
            "samples[0].processes: holds a value JSON cannot carry",
        ),
    ],
)
def test_validation_names_the_field(bad: Any, reason: str) -> None:
    valid, rejected = validate_samples([bad])
    assert valid == []
    assert len(rejected) == 1
    assert rejected[0]["index"] == 0
    assert rejected[0]["reason"].startswith(reason) or reason in rejected[0]["reason"]


def test_validation_keeps_what_is_stored_and_drops_unknown_keys() -> None:
    raw: list[dict[str, Any]] = [
        {
            "uuid": "GPU-1",
            "ts": f"{PLUS1}.1239+01:00",
            "gpu_util": 7,
            "mem_used_bytes": 1024,
            "processes": [{"pid": 42, "name": "python", "note": "a\\u0000b"}],
            "temperature_c": 61,
        },
        {"uuid": "GPU-1", "ts": f"{NAIVE0[:-2]}01Z", "gpu_util": None, "processes": None},
    ]
    valid, rejected = validate_samples(raw)
    assert rejected == []
    first, second = valid
    assert first.ts_ms == ms(T0) + 123  # sub-millisecond digits cut, never rounded up
    assert first.gpu_util == 7.0
    assert first.mem_used_bytes == 1024
    assert first.processes is not None
    assert json.loads(first.processes) == raw[0]["processes"]
    assert second == SampleRow("GPU-1", ms(T0) + 1000, None, None, None)
    assert (second.covered_ms, second.placement) == (None, None)


def test_each_repeat_of_a_bad_uuid_or_timestamp_is_rejected() -> None:
    # A batch checks each distinct UUID and timestamp text once; bad ones are never remembered.
    good = {"uuid": "GPU-1", "ts": TS0}
    raw = [
        good,
        {"uuid": "GPU-\x00", "ts": TS0},
        {"uuid": "GPU-\x00", "ts": TS0},
        {"uuid": "GPU-1", "ts": NAIVE0},
        {"uuid": "GPU-1", "ts": NAIVE0},
        {"uuid": ["GPU-1"], "ts": TS0},
        {"uuid": "GPU-1", "ts": 7},
        good,
    ]
    valid, rejected = validate_samples(raw, now=T0)
    assert [r["index"] for r in rejected] == [1, 2, 3, 4, 5, 6]
    assert [r["reason"].split(":")[0] for r in rejected] == [
        "samples[1].uuid",
        "samples[2].uuid",
        "samples[3].ts",
        "samples[4].ts",
        "samples[5].uuid",
        "samples[6].ts",
    ]
    assert valid == [SampleRow("GPU-1", ms(T0), None, None, None)] * 2
    # Accepted at one instant, the same text is too far ahead at an earlier one.
    ahead = [{"uuid": "GPU-1", "ts": (T0 + timedelta(minutes=4)).isoformat()}]
    assert validate_samples(ahead, now=T0)[1] == []
    assert "future" in validate_samples(ahead, now=T0 - timedelta(minutes=2))[1][0]["reason"]


def test_a_process_list_that_contains_itself_is_rejected() -> None:
    process: dict[str, Any] = {"pid": 1}
    process["children"] = [process]
    valid, rejected = validate_samples([sample("GPU-1", T0, processes=[process])])
    assert valid == []
    assert "processes: holds a value JSON cannot carry" in rejected[0]["reason"]


def test_a_clock_up_to_five_minutes_ahead_is_accepted() -> None:
    now = T0
    ahead = [{"uuid": "GPU-1", "ts": (now + timedelta(minutes=5)).isoformat()}]
    too_far = [{"uuid": "GPU-1", "ts": (now + timedelta(minutes=5, seconds=1)).isoformat()}]
    assert validate_samples(ahead, now=now)[1] == []
    assert "future" in validate_samples(too_far, now=now)[1][0]["reason"]


def test_times_outside_the_window_are_rejected_naming_the_setting(gpu: Device, token: str) -> None:
    samples = [
        {"uuid": gpu.uuid, "ts": "0001-01-01T00:00:00Z"},
        {"uuid": gpu.uuid, "ts": "9999-12-31T23:59:59+00:00"},
        sample(gpu.uuid, T0),
        sample(gpu.uuid, timezone.now() - timedelta(days=89)),
        sample(gpu.uuid, timezone.now() - timedelta(days=91)),
    ]
    answer = post(batch(gpu, samples), token).json()
    assert answer["accepted"] == 2
    assert answer["rejected"] == [
        {
            "index": 0,
            "reason": 'samples[0].ts: "0001-01-01T00:00:00Z" is more than 90 days old '
            "(TALLY_INGEST_MAX_AGE_DAYS)",
        },
        {
            "index": 1,
            "reason": 'samples[1].ts: "9999-12-31T23:59:59+00:00" is more than 5 minutes in the '
            "future (TALLY_INGEST_MAX_SKEW_SECONDS); is the sender's clock right?",
        },
        {
            "index": 4,
            "reason": f"samples[4].ts: {json.dumps(samples[4]['ts'])} is more than 90 days old "
            "(TALLY_INGEST_MAX_AGE_DAYS)",
        },
    ]
    assert Sample.objects.count() == 2
    assert not DirtyHour.objects.filter(hour__lt=timezone.now() - timedelta(days=90)).exists()


def test_the_window_follows_its_settings(settings: Any) -> None:
    settings.TALLY_INGEST_MAX_AGE_DAYS = 1
    settings.TALLY_INGEST_MAX_SKEW_SECONDS = 90
    now = T0 + timedelta(days=1)
    inside = [sample("GPU-1", T0), sample("GPU-1", now + timedelta(seconds=90))]
    assert validate_samples(inside, now=now)[1] == []
    outside = [
        sample("GPU-1", T0 - timedelta(milliseconds=1)),
        sample("GPU-1", now + timedelta(seconds=91)),
    ]
    reasons = [rejection["reason"] for rejection in validate_samples(outside, now=now)[1]]
    assert "more than 1 day old" in reasons[0]
    assert "more than 90 seconds in the future" in reasons[1]


def test_a_mixed_batch_keeps_the_good_samples(gpu: Device, token: str) -> None:
    samples = [
        sample(gpu.uuid, T0),
        sample(gpu.uuid, T0 + timedelta(seconds=10), gpu_util=140),
        sample(gpu.uuid, T0 + timedelta(seconds=20), mem_used_bytes=2**40),
        {"uuid": gpu.uuid, "ts": f"{NAIVE0[:-2]}30"},
        "junk",
        sample(gpu.uuid, T0 + timedelta(seconds=40), processes=[{"pid": 7, "name": "train"}]),
    ]
    response = post(batch(gpu, samples), token)
    assert response.status_code == 200
    assert response.json() == {
        "accepted": 3,
        "duplicates": 0,
        "rejected": [
            {"index": 1, "reason": "samples[1].gpu_util: 140 is not between 0 and 100"},
            {"index": 3, "reason": f'samples[3].ts: "{NAIVE0[:-2]}30" has no timezone'},
            {"index": 4, "reason": 'samples[4]: must be an object, not "junk"'},
        ],
        "unknown_devices": [],
    }
    stored = list(Sample.objects.order_by("ts_ms"))
    assert [s.ts_ms - ms(T0) for s in stored] == [0, 20_000, 40_000]
    assert stored[1].mem_used_bytes == 2**40
    assert stored[2].processes == [{"pid": 7, "name": "train"}]
    assert {s.node for s in stored} == {gpu.node.name if gpu.node else ""}


# Duplicates


def test_duplicates_are_stored_once_and_counted(gpu: Device, token: str) -> None:
    first = [
        sample(gpu.uuid, T0, gpu_util=10.0),
        sample(gpu.uuid, T0 + timedelta(seconds=1)),
        # The same instant written another way, sent twice in one batch: the first wins.
        {"uuid": gpu.uuid, "ts": f"{PLUS1}+01:00", "gpu_util": 99.0},
    ]
    assert post(batch(gpu, first), token).json()["duplicates"] == 1
    again = [sample(gpu.uuid, T0, gpu_util=20.0), sample(gpu.uuid, T0 + timedelta(seconds=2))]
    answer = post(batch(gpu, again), token).json()
    assert (answer["accepted"], answer["duplicates"]) == (1, 1)
    assert Sample.objects.count() == 3
    assert Sample.objects.get(ts_ms=ms(T0)).gpu_util == 10.0


def test_ingest_twice_in_one_transaction(gpu: Device) -> None:
    rows, _ = validate_samples([sample(gpu.uuid, T0), sample("GPU-unknown", T0)])
    first = ingest(node="n1", samples=rows, received_at=T0)
    second = ingest(node="n1", samples=rows, received_at=T0)
    assert (first.accepted, first.duplicates) == (2, 0)
    assert (second.accepted, second.duplicates) == (0, 2)
    assert second.hours == set()


# Devices not known yet


def test_unknown_devices_are_kept_aside_then_adopted(gpu: Device, token: str) -> None:
    newcomer, departed = "GPU-not-synced-yet", "GPU-gone-but-known"
    DeviceFactory.create(uuid=departed, gone_at=timezone.now(), node=gpu.node)
    samples = [
        sample(newcomer, T0),
        sample(newcomer, T0 + timedelta(seconds=1)),
        sample(departed, T0),
        sample(gpu.uuid, T0),
    ]
    answer = post(batch(gpu, samples), token).json()
    assert answer == {
        "accepted": 4,
        "duplicates": 0,
        "rejected": [],
        "unknown_devices": [newcomer],
    }
    assert set(Sample.objects.values_list("device_uuid", flat=True)) == {gpu.uuid, departed}
    assert UnknownDeviceSample.objects.filter(device_uuid=newcomer).count() == 2
    # Sent again while still unknown: a duplicate, not a second row.
    assert post(batch(gpu, samples[:1]), token).json()["duplicates"] == 1
    assert adopt_unknown_samples(now=timezone.now()) == 0

    DeviceFactory.create(uuid=newcomer, node=gpu.node)  # on the node that sent its samples
    # One of them reached `Sample` another way meanwhile: the stored one wins.
    Sample.objects.create(device_uuid=newcomer, ts_ms=ms(T0), gpu_util=1.0, received_at=T0)
    DirtyHour.objects.all().delete()
    assert adopt_unknown_samples(now=timezone.now()) == 1
    assert not UnknownDeviceSample.objects.exists()
    assert Sample.objects.filter(device_uuid=newcomer).count() == 2
    assert Sample.objects.get(device_uuid=newcomer, ts_ms=ms(T0)).gpu_util == 1.0
    adopted = Sample.objects.get(device_uuid=newcomer, ts_ms=ms(T0) + 1000)
    assert adopted.node == (gpu.node.name if gpu.node else "")
    assert set(DirtyHour.objects.values_list("hour", flat=True)) == {T0}


def test_a_nodes_token_plants_no_samples_under_a_uuid_that_turns_up_on_another_node(
    gpu: Device, token: str
) -> None:
    assert gpu.node is not None
    theirs_later, mine_later, loaded = "GPU-theirs-later", "GPU-mine-later", "GPU-loaded"
    planted = post(
        batch(gpu, [sample(theirs_later, T0, gpu_util=99.0), sample(mine_later, T0)]), token
    ).json()
    assert planted["unknown_devices"] == [mine_later, theirs_later]
    # An operator's backfill (no token) is trusted for whatever device turns up.
    ingest(node="backfill", samples=rows([(loaded, T0, 4.0)]), received_at=T0)
    other_node = DeviceFactory.create(node__cluster=gpu.cluster).node  # same cluster
    DeviceFactory.create(uuid=theirs_later, node=other_node)
    DeviceFactory.create(uuid=mine_later, node=gpu.node)
    DeviceFactory.create(uuid=loaded)  # another cluster
    assert adopt_unknown_samples(now=timezone.now()) == 2
    assert sorted(Sample.objects.values_list("device_uuid", flat=True)) == [loaded, mine_later]
    assert list(UnknownDeviceSample.objects.values_list("device_uuid", "node")) == [
        (theirs_later, gpu.node.name)
    ]
    # Known now, the device is refused outright.
    again = post(batch(gpu, [sample(theirs_later, T0 + timedelta(minutes=1))]), token).json()
    assert again["accepted"] == 0
    assert "is on node" in again["rejected"][0]["reason"]


def test_a_nodes_token_cannot_be_given_another_node_to_record(gpu: Device) -> None:
    assert gpu.node is not None
    issue_token(cluster=gpu.cluster, node=gpu.node.name)
    agent = AgentToken.objects.get()
    with pytest.raises(ValueError, match="cannot send for node 'elsewhere'"):
        ingest(node="elsewhere", samples=rows([("GPU-x", T0, 1.0)]), received_at=T0, agent=agent)
    assert not UnknownDeviceSample.objects.exists()


# Dirty hours


def test_touched_hours_are_marked_dirty_with_the_spill(gpu: Device) -> None:
    rows, _ = validate_samples(
        [
            sample(gpu.uuid, T0 + timedelta(minutes=5)),  # 10:05: hour 10 only
            sample(gpu.uuid, T0 + timedelta(minutes=58)),  # holds until 11:00 exactly: hour 10
            sample(gpu.uuid, T0 + timedelta(hours=2, minutes=59)),  # 12:59: hours 12 and 13
            sample("GPU-unknown", T0 + timedelta(hours=5)),  # not counted yet: no hour
        ]
    )
    received = T0 + timedelta(days=1)
    report = ingest(node="n1", samples=rows, received_at=received)
    expected = {T0, T0 + timedelta(hours=2), T0 + timedelta(hours=3)}
    assert report.hours == expected
    assert {d.hour: d.marked_at for d in DirtyHour.objects.all()} == dict.fromkeys(
        expected, received
    )
    # Marked again when new samples arrive; duplicates alone mark nothing.
    later = received + timedelta(hours=1)
    more, _ = validate_samples([sample(gpu.uuid, T0 + timedelta(minutes=6))])
    ingest(node="n1", samples=rows + more, received_at=later)
    assert DirtyHour.objects.get(hour=T0).marked_at == later
    assert DirtyHour.objects.get(hour=T0 + timedelta(hours=2)).marked_at == received


@given(st.lists(st.integers(min_value=-(10**13), max_value=10**13), max_size=50))
def test_the_latest_instant_of_each_hour_touches_the_hours_of_all(timestamps: list[int]) -> None:
    assert touched_hours(latest_per_hour(timestamps)) == touched_hours(timestamps)


@override_settings(TALLY_SAMPLE_HOLD_SECONDS=600)
def test_the_spill_follows_the_hold_setting(gpu: Device) -> None:
    rows, _ = validate_samples([sample(gpu.uuid, T0 + timedelta(minutes=55))])
    report = ingest(node="n1", samples=rows, received_at=T0)
    assert report.hours == {T0, T0 + timedelta(hours=1)}


# PostgreSQL: the COPY path at size


def test_copy_path_stores_a_large_batch_once(gpu: Device) -> None:
    other = DeviceFactory.create()
    raw = [
        sample(uuid, T0 + timedelta(seconds=second), processes=[{"pid": second}])
        for second in range(5_000)
        for uuid in (gpu.uuid, other.uuid, "GPU-unknown-a", "GPU-unknown-b")
    ]
    rows, rejected = validate_samples(raw)
    assert (len(rows), rejected) == (20_000, [])
    report = ingest(node="n1", samples=rows, received_at=T0)
    assert (report.accepted, report.duplicates) == (20_000, 0)
    assert report.unknown_devices == ["GPU-unknown-a", "GPU-unknown-b"]
    assert report.hours == {T0, T0 + timedelta(hours=1)}
    assert Sample.objects.count() == 10_000
    assert UnknownDeviceSample.objects.count() == 10_000
    assert Sample.objects.get(device_uuid=other.uuid, ts_ms=ms(T0) + 7000).processes == [{"pid": 7}]
    # Half of it again, each sample twice, after the rest: only the new half is stored.
    shifted, _ = validate_samples(
        [sample(s["uuid"], T0 + timedelta(seconds=2_500 + i // 4)) for i, s in enumerate(raw)]
    )
    again = ingest(node="n1", samples=shifted + shifted, received_at=T0)
    assert (again.accepted, again.duplicates) == (10_000, 30_000)
    assert Sample.objects.count() + UnknownDeviceSample.objects.count() == 30_000


def test_a_batch_that_meets_a_stored_sample_at_its_end_stores_the_rest_once(gpu: Device) -> None:
    # On PostgreSQL the batch is first COPYed and fails at its last row: none of it may stay.
    rows, _ = validate_samples(
        [sample(gpu.uuid, T0 + timedelta(seconds=second)) for second in range(3_000)]
        + [sample("GPU-unknown", T0 + timedelta(seconds=second)) for second in range(2)]
    )
    first = ingest(node="n1", samples=[rows[2_999], rows[-1]], received_at=T0)
    assert (first.accepted, first.duplicates) == (2, 0)
    report = ingest(node="n1", samples=rows, received_at=T0)
    assert (report.accepted, report.duplicates) == (3_000, 2)
    assert report.hours == {T0}
    assert Sample.objects.count() == 3_000
    assert UnknownDeviceSample.objects.count() == 2
    assert sorted(Sample.objects.values_list("ts_ms", flat=True)) == [
        ms(T0) + 1_000 * second for second in range(3_000)
    ]


@pytest.mark.django_db(transaction=True)
def test_overlapping_batches_sent_at_once_are_stored_once(gpu: Device) -> None:
    # The second batch's COPY waits for the first's transaction, then meets its samples and
    # takes the general way; neither deadlocks, whatever order the samples came in.
    first_rows, _ = validate_samples(
        [sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in range(0, 2_000)]
    )
    second_rows, _ = validate_samples(
        [sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in reversed(range(1_000, 3_000))]
    )
    first_copied = threading.Event()
    release_first = threading.Event()

    def send_first() -> Any:
        try:
            with transaction.atomic():
                report = ingest(node="n1", samples=first_rows, received_at=T0)
                first_copied.set()
                assert release_first.wait(10)
            return report
        finally:
            connection.close()

    def send_second() -> Any:
        try:
            assert first_copied.wait(10)
            return ingest(node="n2", samples=second_rows, received_at=T0)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(send_first)
        second = pool.submit(send_second)
        assert first_copied.wait(10)
        waited = False
        with connection.cursor() as cursor:  # the second batch waits on the first's rows
            for _ in range(200):
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
                waited = bool(cursor.fetchone()[0])
                if waited:
                    break
                threading.Event().wait(0.05)
        release_first.set()
        reports = first.result(timeout=20), second.result(timeout=20)
    assert waited
    assert [(r.accepted, r.duplicates) for r in reports] == [(2_000, 0), (1_000, 1_000)]
    assert Sample.objects.count() == 3_000
    assert dict(Sample.objects.values_list("node").annotate(n=Count("id"))) == {
        "n1": 2_000,
        "n2": 1_000,
    }


def test_a_cluster_wide_token_may_send_for_any_node(client: Client, gpu: Device) -> None:
    token = issue_token(cluster=gpu.cluster, node="*")
    response = client.post(
        "/ingest/samples",
        data=json.dumps({"node": "any-node", "samples": [sample(gpu.uuid, T0)]}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 200, response.content
    assert response.json()["accepted"] == 1


# A token is bound to its node's devices


def test_a_nodes_token_cannot_write_another_nodes_devices(gpu: Device, token: str) -> None:
    assert gpu.node is not None
    theirs = DeviceFactory.create(node__cluster=gpu.cluster)  # another team's GPU, on another node
    assert theirs.node is not None
    # MIG devices published without a node of their own are where their parent GPU is.
    their_slice = MigDeviceFactory.create(parent=theirs, node=None)
    my_slice = MigDeviceFactory.create(parent=gpu, node=None)
    hour = T0 + timedelta(hours=5)
    ingest(node=theirs.node.name, samples=rows([(theirs.uuid, hour, 90.0)]), received_at=T0)
    DirtyHour.objects.all().delete()
    answer = post(
        batch(
            gpu,
            [
                sample(gpu.uuid, hour),
                sample(theirs.uuid, hour, gpu_util=1.0),  # would rewrite their utilisation
                sample(theirs.uuid, hour + timedelta(minutes=1), gpu_util=1.0),
                sample(their_slice.uuid, hour),
                sample(my_slice.uuid, hour),
                {"uuid": theirs.uuid},  # invalid too: reported once, as invalid
            ],
        ),
        token,
    ).json()
    assert (answer["accepted"], answer["duplicates"]) == (2, 0)
    assert [rejection["index"] for rejection in answer["rejected"]] == [1, 2, 3, 5]
    reasons = [rejection["reason"] for rejection in answer["rejected"]]
    assert reasons[0] == (
        f"samples[1].uuid: device {theirs.uuid} is on node {theirs.node.name!r}, "
        f"not on this token's node {gpu.node.name!r}"
    )
    assert reasons[2].startswith(f"samples[3].uuid: device {their_slice.uuid} is on node")
    assert reasons[3].startswith("samples[5].ts: ")
    assert answer["unknown_devices"] == []
    # Never stored: their utilisation is as their own agent sent it, and no hour of theirs
    # is rolled up again (nor a late-data adjustment made) because of it.
    assert Sample.objects.get(device_uuid=theirs.uuid).gpu_util == 90.0
    assert set(Sample.objects.values_list("device_uuid", flat=True)) == {
        theirs.uuid,
        gpu.uuid,
        my_slice.uuid,
    }
    assert not UnknownDeviceSample.objects.exists()
    assert set(DirtyHour.objects.values_list("hour", flat=True)) == {hour}  # mine


def test_a_cluster_wide_token_writes_its_clusters_devices_only(gpu: Device) -> None:
    elsewhere = DeviceFactory.create()  # in another cluster
    unplaced = DeviceFactory.create(cluster=gpu.cluster, node=None)
    cluster_wide = issue_token(cluster=gpu.cluster, node="*")
    samples = [sample(gpu.uuid, T0), sample(elsewhere.uuid, T0), sample(unplaced.uuid, T0)]
    answer = post({"node": "dcgm", "samples": samples}, cluster_wide).json()
    assert answer["accepted"] == 2
    assert answer["rejected"] == [
        {
            "index": 1,
            "reason": f"samples[1].uuid: device {elsewhere.uuid} is in another cluster than "
            f"this token's ({gpu.cluster})",
        }
    ]
    # A device on no node is no node's: only a cluster-wide token sends its samples.
    assert gpu.node is not None
    node_token = issue_token(cluster=gpu.cluster, node=gpu.node.name)
    refused = post(batch(gpu, [sample(unplaced.uuid, T0)]), node_token).json()["rejected"]
    assert "is on no node (only a cluster-wide token's)" in refused[0]["reason"]


@override_settings(TALLY_INGEST_MAX_UNKNOWN_DEVICES=2, TALLY_INGEST_MAX_UNKNOWN_SAMPLES=5)
def test_samples_of_unknown_devices_are_bounded_per_token(gpu: Device, token: str) -> None:
    made_up = [f"GPU-made-up-{n}" for n in range(3)]
    first = post(
        batch(gpu, [sample(uuid, T0 + timedelta(seconds=n)) for n, uuid in enumerate(made_up)]),
        token,
    ).json()
    assert first["accepted"] == 2
    assert first["unknown_devices"] == made_up
    assert first["rejected"] == [
        {
            "index": 2,
            "reason": f"samples[2].uuid: device {made_up[2]} is not in the inventory, and this "
            "token already has samples of 2 unknown devices set aside "
            "(TALLY_INGEST_MAX_UNKNOWN_DEVICES)",
        }
    ]
    more = [sample(made_up[0], T0 + timedelta(minutes=n)) for n in range(1, 6)]
    second = post(batch(gpu, [*more, sample(gpu.uuid, T0)]), token).json()
    assert (second["accepted"], [r["index"] for r in second["rejected"]]) == (4, [3, 4])
    assert "TALLY_INGEST_MAX_UNKNOWN_SAMPLES" in second["rejected"][0]["reason"]
    assert UnknownDeviceSample.objects.count() == 5
    assert Sample.objects.filter(device_uuid=gpu.uuid).count() == 1  # known devices: no limit
    # Another node's token has room of its own; an operator's backfill (no token) has no limit.
    other = DeviceFactory.create(node__cluster=gpu.cluster)
    assert other.node is not None
    other_token = issue_token(cluster=gpu.cluster, node=other.node.name)
    answer = post({"node": other.node.name, "samples": [sample(made_up[2], T0)]}, other_token)
    assert answer.json()["accepted"] == 1
    report = ingest(
        node="n", samples=rows([(f"GPU-x{n}", T0, 1.0) for n in range(9)]), received_at=T0
    )
    assert report.accepted == 9


def test_samples_set_aside_expire(gpu: Device, token: str, settings: Any) -> None:
    settings.TALLY_INGEST_UNKNOWN_RETENTION_DAYS = 7
    now = timezone.now()
    for days, uuid in ((8, "GPU-long-gone"), (6, "GPU-not-synced-yet")):
        ingest(node="n", samples=rows([(uuid, T0, 1.0)]), received_at=now - timedelta(days=days))
    services.refresh_usage(now=now)  # what beat runs every few minutes
    assert list(UnknownDeviceSample.objects.values_list("device_uuid", flat=True)) == [
        "GPU-not-synced-yet"
    ]
    assert purge_unknown_samples(now=now + timedelta(days=1, seconds=1)) == 1
    assert not UnknownDeviceSample.objects.exists()


def rows(samples: list[tuple[str, datetime, float]]) -> list[SampleRow]:
    return [SampleRow(uuid, ms(at), util, None, None) for uuid, at, util in samples]


@pytest.mark.parametrize("node", ["x" * 254, "gpu\x00node", "GPU-Node", "node_1", "-node"])
def test_a_node_name_kubernetes_would_not_accept_is_a_400(
    client: Client, gpu: Device, node: str
) -> None:
    token = issue_token(cluster=gpu.cluster, node="*")
    response = client.post(
        "/ingest/samples",
        data=json.dumps({"node": node, "samples": [sample(gpu.uuid, T0)]}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 400
    assert "is not a Kubernetes node name" in response.json()["error"]
    assert Sample.objects.count() == 0


# Gaps: each sample's time to its device's next one, kept whatever order samples arrive in


def stored_gaps() -> dict[tuple[str, int], int | None]:
    return {
        (uuid, ts_ms): gap
        for uuid, ts_ms, gap in Sample.objects.values_list("device_uuid", "ts_ms", "gap_ms")
    }


def expected_gaps(keys: set[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
    gaps: dict[tuple[str, int], int | None] = {}
    ordered = sorted(keys)
    for (uuid, ts_ms), following in zip(ordered, [*ordered[1:], None], strict=True):
        gaps[uuid, ts_ms] = following[1] - ts_ms if following and following[0] == uuid else None
    return gaps


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    readings=st.lists(
        st.tuples(st.sampled_from([0, 1]), st.integers(min_value=0, max_value=60)),
        min_size=1,
        max_size=50,
    ),
    order=st.randoms(use_true_random=False),
    batch_size=st.integers(min_value=1, max_value=15),
    resend=st.booleans(),
)
def test_gaps_are_right_whatever_order_samples_arrive_in(
    readings: list[tuple[int, int]], order: Any, batch_size: int, resend: bool
) -> None:
    with transaction.atomic():
        devices = [DeviceFactory.create().uuid, DeviceFactory.create().uuid]
        raw = [sample(devices[d], T0 + timedelta(seconds=second)) for d, second in readings]
        order.shuffle(raw)
        for start in range(0, len(raw), batch_size):
            rows, rejected = validate_samples(raw[start : start + batch_size])
            assert rejected == []
            ingest(node="n1", samples=rows, received_at=T0)
            if resend:  # an agent's retry: duplicates, which must not disturb the gaps
                ingest(node="n1", samples=rows, received_at=T0)
        keys = {(devices[d], ms(T0) + 1000 * second) for d, second in readings}
        assert stored_gaps() == expected_gaps(keys)
        transaction.set_rollback(True)


def test_the_gaps_are_worked_out_without_compiling_the_statement(gpu: Device) -> None:
    """Over a day's partition of millions of samples the planner's cost for the gaps' few
    index ranges passed `jit_above_cost`, and each ingest call spent ~0.5 s compiling a
    statement that runs in 2 ms. With JIT made as eager as it gets, the ingest's own
    statements still run uncompiled: the transaction's `jit` is off once it has stored."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = on")
            cursor.execute("SET LOCAL jit_above_cost = 0")
        rows, _ = validate_samples([sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in (0, 30)])
        ingest(node="n1", samples=rows, received_at=T0)
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('jit')")
            assert cursor.fetchone() == ("off",)
        assert stored_gaps() == {(gpu.uuid, ms(T0)): 30_000, (gpu.uuid, ms(T0) + 30_000): None}
        transaction.set_rollback(True)


def test_a_sample_that_leaves_its_device_clears_the_gap_to_it(gpu: Device) -> None:
    """A device's last sample, once the sample after it has gone (a GPU instance's sample
    moved to another device when its spells changed), has no next one: its gap is cleared, as
    if that sample had never come, and a sample before a range keeps its gap to the next."""
    rows, _ = validate_samples([sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in (0, 30, 60)])
    ingest(node="n1", samples=rows, received_at=T0)
    Sample.objects.filter(device_uuid=gpu.uuid, ts_ms=ms(T0) + 60_000).delete()
    with connection.cursor() as cursor:
        refresh_gaps(cursor, {gpu.uuid: _Bounds(ms(T0) + 60_000, ms(T0) + 60_000)})
    assert stored_gaps() == {(gpu.uuid, ms(T0)): 30_000, (gpu.uuid, ms(T0) + 30_000): None}
    # Gone from within: the one before it reaches the one after.
    rows, _ = validate_samples([sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in (60, 90)])
    ingest(node="n1", samples=rows, received_at=T0)
    Sample.objects.filter(device_uuid=gpu.uuid, ts_ms=ms(T0) + 60_000).delete()
    with connection.cursor() as cursor:
        refresh_gaps(cursor, {gpu.uuid: _Bounds(ms(T0) + 60_000, ms(T0) + 60_000)})
    assert stored_gaps() == {
        (gpu.uuid, ms(T0)): 30_000,
        (gpu.uuid, ms(T0) + 30_000): 60_000,
        (gpu.uuid, ms(T0) + 90_000): None,
    }


def test_samples_adopted_from_the_side_table_get_their_gaps(gpu: Device) -> None:
    newcomer = "GPU-newcomer"
    rows, _ = validate_samples([sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in (0, 30)])
    ingest(node="n1", samples=rows, received_at=T0)
    early, _ = validate_samples([sample(newcomer, T0 + timedelta(seconds=s)) for s in (10, 40)])
    ingest(node="n1", samples=early, received_at=T0)
    DeviceFactory.create(uuid=newcomer)
    known, _ = validate_samples([sample(newcomer, T0 + timedelta(seconds=s)) for s in (0, 20)])
    ingest(node="n1", samples=known, received_at=T0)
    assert adopt_unknown_samples(now=timezone.now()) == 2
    start = ms(T0)
    assert stored_gaps() == {
        (gpu.uuid, start): 30_000,
        (gpu.uuid, start + 30_000): None,
        (newcomer, start): 10_000,
        (newcomer, start + 10_000): 10_000,
        (newcomer, start + 20_000): 20_000,
        (newcomer, start + 40_000): None,
    }


@pytest.mark.django_db(transaction=True)
def test_gaps_stay_right_when_one_device_is_sent_from_two_places_at_once(gpu: Device) -> None:
    # Two senders interleave one device's samples (even and odd seconds), batch after batch, at
    # the same time: each batch's gaps are worked out under the device's lock, so none is
    # computed against a neighbour the other sender has not committed yet.
    def send(parity: int) -> None:
        try:
            for round_ in range(30):
                seconds = [10 * round_ + s for s in range(parity, 10, 2)]
                rows, _ = validate_samples(
                    [sample(gpu.uuid, T0 + timedelta(seconds=s)) for s in seconds]
                )
                ingest(node=f"n{parity}", samples=rows, received_at=T0)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(send, 0), pool.submit(send, 1)]:
            future.result(timeout=60)
    keys = {(gpu.uuid, ms(T0) + 1000 * second) for second in range(300)}
    assert stored_gaps() == expected_gaps(keys)


def test_rejections_name_json_types_in_json_words() -> None:
    """The sender wrote JSON: null and arrays are called that, not Python's NoneType and list."""
    bad: list[object] = [None, [], {"uuid": "GPU-1", "ts": T0.isoformat(), "gpu_util": [1]}, True]
    reasons = [rejection["reason"] for rejection in validate_samples(bad, now=T0)[1]]
    assert reasons == [
        "samples[0]: must be an object, not null",
        "samples[1]: must be an object, not an array",
        "samples[2].gpu_util: must be a number or null, not an array",
        "samples[3]: must be an object, not true",
    ]
