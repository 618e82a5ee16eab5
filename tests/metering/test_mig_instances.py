"""Which MIG device each GPU instance id of a GPU was, and when, as the node agents send it.

DCGM's series name a MIG device by its parent's UUID and GPU instance id (`GPU_I_ID`), never by
its own UUID; the agent sends both with each MIG sample (`agent.readings`), and the ingest
records, per GPU instance, the device its samples were stored under and the first and last
sample time (`billing.models.MigInstance`), which the Prometheus source matches series by.
Through `/ingest/samples`.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from inventory.models import Device
from metering.hours import epoch_ms
from metering.models import MigInstance, Sample
from metering.services import issue_agent_token
from tests.factories import DeviceFactory, MigDeviceFactory, NodeFactory

pytestmark = pytest.mark.django_db

T0 = (timezone.now() - timedelta(days=1)).replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def a100() -> Device:
    node = NodeFactory.create(name="a100-node")
    return DeviceFactory.create(node=node, name="gpu-0", product_name="NVIDIA A100-SXM4-40GB")


def mig(parent: Device, placement: int) -> Device:
    return MigDeviceFactory.create(
        parent=parent, name=f"gpu-0-mig-1g5gb-19-{placement}", profile="1g.5gb"
    )


def token_for(device: Device) -> str:
    assert device.node is not None
    return issue_agent_token(cluster=device.cluster, node=device.node.name, actor="ops")


def sample(device: Device, minute: int, **fields: Any) -> dict[str, Any]:
    return {
        "uuid": device.meter_id,
        "ts": (T0 + timedelta(minutes=minute)).isoformat(),
        "gpu_util": 30.0,
        "parent_uuid": device.parent_uuid,
        **fields,
    }


def post(token: str, samples: list[Any], node: str = "a100-node") -> dict[str, Any]:
    response = Client().post(
        "/ingest/samples",
        data=json.dumps({"node": node, "samples": samples}),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.content
    answer: dict[str, Any] = response.json()
    return answer


def recorded() -> list[tuple[Any, ...]]:
    return sorted(
        MigInstance.objects.values_list(
            "cluster__name", "node", "parent_uuid", "gpu_instance_id", "meter_id", "first_ms",
            "last_ms",
        )
    )  # fmt: skip


def ms(minute: int) -> int:
    return epoch_ms(T0 + timedelta(minutes=minute))


def test_each_gpu_instance_is_recorded_with_its_device_and_span(a100: Device) -> None:
    first, second = mig(a100, 0), mig(a100, 1)
    token = token_for(a100)
    answer = post(
        token,
        [sample(first, minute, gpu_instance_id=9) for minute in range(3)]
        + [sample(second, minute, gpu_instance_id=10) for minute in (1, 2)]
        # The whole GPU's sample carries no GPU instance: nothing recorded for it.
        + [{"uuid": a100.meter_id, "ts": T0.isoformat(), "gpu_util": 5.0}],
    )
    assert (answer["accepted"], answer["rejected"]) == (6, [])
    where = (a100.cluster.name, "a100-node", a100.uuid)
    assert recorded() == [
        (*where, 9, first.meter_id, ms(0), ms(2)),
        (*where, 10, second.meter_id, ms(1), ms(2)),
    ]


def test_spans_are_the_same_whatever_order_batches_arrive_in(a100: Device) -> None:
    first = mig(a100, 0)
    token = token_for(a100)
    batches = [[sample(first, minute, gpu_instance_id=9)] for minute in (5, 0, 9, 3)]
    for batch in batches:
        post(token, batch)
    post(token, batches[2])  # a batch sent again: duplicates, the span as it was
    assert [row[-2:] for row in recorded()] == [(ms(0), ms(9))]
    assert Sample.objects.filter(device_uuid=first.meter_id).count() == 4


def test_a_gpu_instance_id_reused_by_another_device_keeps_both_spans(a100: Device) -> None:
    before, after = mig(a100, 0), mig(a100, 1)
    token = token_for(a100)
    post(token, [sample(after, minute, gpu_instance_id=1) for minute in (60, 90)])
    post(token, [sample(before, minute, gpu_instance_id=1) for minute in (0, 59)])
    assert [row[3:] for row in recorded()] == sorted(
        [(1, before.meter_id, ms(0), ms(59)), (1, after.meter_id, ms(60), ms(90))]
    )


def test_a_sample_refused_records_nothing(a100: Device) -> None:
    elsewhere = DeviceFactory.create(node=NodeFactory.create(cluster=a100.cluster, name="other"))
    foreign = mig(elsewhere, 0)
    answer = post(token_for(a100), [sample(foreign, 0, gpu_instance_id=3)])
    assert [row["index"] for row in answer["rejected"]] == [0]
    assert recorded() == []


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"gpu_instance_id": "9"}, 'gpu_instance_id: must be an integer from 0 to 4095, not "9"'),
        ({"gpu_instance_id": -1}, "gpu_instance_id: must be an integer from 0 to 4095, not -1"),
        ({"gpu_instance_id": 4096}, "gpu_instance_id: must be an integer from 0 to 4095, not 4096"),
        ({"gpu_instance_id": True}, "gpu_instance_id: must be an integer from 0 to 4095, not true"),
        (
            {"gpu_instance_id": 9, "parent_uuid": None},
            "parent_uuid: is needed with gpu_instance_id: the MIG device's GPU",
        ),
        ({"gpu_instance_id": 9, "parent_uuid": 7}, "parent_uuid: must be a non-empty string"),
        ({"gpu_instance_id": 9, "parent_uuid": ""}, "parent_uuid: must be a non-empty string"),
    ],
)
def test_a_bad_gpu_instance_is_rejected_naming_the_field(
    a100: Device, fields: dict[str, Any], reason: str
) -> None:
    good = mig(a100, 0)
    answer = post(token_for(a100), [sample(good, 0, **fields), sample(good, 1, gpu_instance_id=9)])
    assert [(row["index"], row["reason"]) for row in answer["rejected"]] == [
        (0, f"samples[0].{reason}")
    ]
    assert answer["accepted"] == 1
    assert [row[3:] for row in recorded()] == [(9, good.meter_id, ms(1), ms(1))]


def test_a_gpu_instance_with_a_device_named_by_driver_is_rejected(a100: Device) -> None:
    answer = post(
        token_for(a100),
        [
            {
                "driver": "gpu.intel.com",
                "device": "card0",
                "ts": T0.isoformat(),
                "gpu_util": 1.0,
                "parent_uuid": a100.uuid,
                "gpu_instance_id": 1,
            }
        ],
    )
    assert answer["rejected"][0]["reason"] == (
        "samples[0].gpu_instance_id: goes with a MIG device's uuid, not with driver and device"
    )
