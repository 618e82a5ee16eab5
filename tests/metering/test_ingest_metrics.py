"""Metric labels come from fixed sets: malformed input never adds series.

One batch of 5,000 malformed samples once made 5,000 series of
`tally_ingest_rejected_samples_total` (a reason per sample index).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client import REGISTRY, Counter

from core import metrics
from inventory.kube_sync import RESOURCES
from inventory.models import Device
from tests.factories import DeviceFactory
from tests.metering.test_ingest import issue_token

pytestmark = pytest.mark.django_db


def label_values(name: str, label: str) -> set[str]:
    """The values `label` takes among the samples of the metric family `name`."""
    return {
        sample.labels[label]
        for family in REGISTRY.collect()
        if family.name == name
        for sample in family.samples
        if label in sample.labels
    }


def malformed(index: int) -> Any:
    """A different malformed sample for each index, whatever part of it is wrong."""
    ts = timezone.now().isoformat()
    placed = {"mig_placement": {"start": 0, "size": 1}}
    kinds: list[Any] = [
        f"junk {index}",
        index,
        [index],
        {"uuid": f"GPU-\x00{index}", "ts": ts},
        {"uuid": "GPU-1", "ts": f"not a time {index}"},
        {"uuid": "GPU-1", "ts": ts, "gpu_util": 100 + index},
        {"uuid": "GPU-1", "ts": ts, "mem_used_bytes": -index - 1},
        {"uuid": "GPU-1", "ts": ts, "processes": {"pid": index}},
        {"uuid": "GPU-1", "ts": f"{1 + index % 9000:04d}-01-01T00:00:00Z"},
        {"uuid": "GPU-1", "ts": f"samples[{index}]"},
        {"uuid": "GPU-1", "ts": ts, "covered_seconds": -index},
        {"uuid": "GPU-1", "ts": ts, "mig_placement": {"start": 0, "size": 1}},  # no parent
        {"uuid": "GPU-1", "ts": ts, "parent_uuid": "GPU-p", "mig_placement": {"start": -index}},
        {"uuid": "GPU-1", "ts": ts, "parent_uuid": "GPU-p", "gpu_instance_id": -1 - index},
        {"uuid": "GPU-1", "ts": ts, "parent_uuid": "GPU-p", **placed, "mig_profile": index},
        {"uuid": "GPU-1", "ts": ts, "parent_uuid": "GPU-p", **placed, "mig_profile_id": "x"},
    ]
    return kinds[index % len(kinds)]


def post(client: Client, token: str, body: Any) -> Any:
    return client.post(
        "/ingest/samples",
        data=json.dumps(body),
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


@pytest.fixture
def gpu() -> Device:
    return DeviceFactory.create()


def test_5000_malformed_samples_count_under_the_fixed_reasons(client: Client, gpu: Device) -> None:
    assert gpu.node is not None
    token = issue_token(cluster=gpu.cluster, node=gpu.node.name)
    samples = [malformed(index) for index in range(5000)]
    answer = post(client, token, {"node": gpu.node.name, "samples": samples}).json()
    assert len(answer["rejected"]) == 5000
    reasons = label_values("tally_ingest_rejected_samples", "reason")
    assert reasons <= {*metrics.INGEST_REJECT_REASONS, metrics.OTHER}, reasons
    # Each kind of mistake under its own reason, none of them "other".
    assert {
        "sample",
        "uuid",
        "ts",
        "ts_window",
        "gpu_util",
        "mem_used_bytes",
        "processes",
        "covered_seconds",
        "parent_uuid",
        "mig_placement",
        "gpu_instance_id",
        "mig_profile",
        "mig_profile_id",
    } <= reasons
    totals = {
        sample.labels["reason"]: sample.value
        for family in REGISTRY.collect()
        if family.name == "tally_ingest_rejected_samples"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert totals.get("other", 0) == 0


def test_a_token_refusal_counts_under_its_reason(client: Client, gpu: Device) -> None:
    elsewhere = DeviceFactory.create(cluster=gpu.cluster)
    assert gpu.node is not None
    token = issue_token(cluster=gpu.cluster, node=gpu.node.name)
    before = REGISTRY.get_sample_value(
        "tally_ingest_rejected_samples_total", {"reason": "device_elsewhere"}
    )
    sample = {"uuid": elsewhere.uuid, "ts": timezone.now().isoformat(), "gpu_util": 1}
    answer = post(client, token, {"node": gpu.node.name, "samples": [sample]}).json()
    assert answer["rejected"][0]["index"] == 0
    after = REGISTRY.get_sample_value(
        "tally_ingest_rejected_samples_total", {"reason": "device_elsewhere"}
    )
    assert after == (before or 0) + 1


# Every metric this process registers, after a run of malformed input.
_ALLOWED: dict[str, dict[str, Any]] = {
    "tally_webhook_decisions": {
        "webhook": set(metrics.WEBHOOKS),
        "result": set(metrics.WEBHOOK_RESULTS),
        "rule": re.compile(r"[-a-zA-Z0-9_]{0,63}|other"),
    },
    "tally_webhook_duration_seconds": {"webhook": set(metrics.WEBHOOKS)},
    "tally_sync_lag_seconds": {"kind": set(metrics.SYNC_KINDS)},
    "tally_sync_events_applied": {"kind": set(metrics.SYNC_KINDS)},
    "tally_sync_relists": {"kind": set(metrics.SYNC_KINDS)},
    "tally_ingest_rejected_samples": {"reason": set(metrics.INGEST_REJECT_REASONS)},
}


def test_every_registered_metric_keeps_its_labels_in_their_sets(
    client: Client, gpu: Device
) -> None:
    assert gpu.node is not None
    token = issue_token(cluster=gpu.cluster, node=gpu.node.name)
    post(client, token, {"node": gpu.node.name, "samples": [malformed(i) for i in range(500)]})
    for review in ("not json", json.dumps({"kind": "AdmissionReview"}), json.dumps([1] * 3)):
        for path in ("/admission/resourceclaims", "/admission/resourceclaims/mutate"):
            client.post(path, data=review, content_type="application/json")
    # Values no caller should pass are counted as "other", never as given.
    metrics.INGEST_REJECTED.labels(reason="samples[17]").inc()
    metrics.SYNC_RELISTS.labels(kind="Pod-17").inc()
    metrics.WEBHOOK_DECISIONS.labels("validate", "maybe", "no such rule!").inc()

    seen: dict[str, set[str]] = {}
    for family in REGISTRY.collect():
        if not family.name.startswith("tally_"):
            continue
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("le", "quantile")}
            if labels:
                assert family.name in _ALLOWED, f"{family.name} has labels but no fixed set"
            for label, value in labels.items():
                seen.setdefault(f"{family.name}.{label}", set()).add(value)
                allowed = _ALLOWED[family.name][label]
                ok = (
                    allowed.fullmatch(value)
                    if isinstance(allowed, re.Pattern)
                    else (value in allowed or value == metrics.OTHER)
                )
                assert ok, f"{family.name}{{{label}={value!r}}}"
    assert "other" in seen["tally_ingest_rejected_samples.reason"]
    assert "samples[17]" not in seen["tally_ingest_rejected_samples.reason"]
    assert "Pod-17" not in seen["tally_sync_relists.kind"]
    assert "no such rule!" not in seen["tally_webhook_decisions.rule"]


def test_the_open_rule_label_is_capped() -> None:
    capped = metrics.Bounded(
        Counter,
        "tally_test_capped",
        "A test metric.",
        labels={"rule": metrics.Capped(pattern=re.compile(r"[a-z0-9]+"), most=3)},
        registry=None,
    )
    for n in range(10):
        capped.labels(rule=f"rule{n}").inc()
    values = {
        sample.labels["rule"]
        for family in capped.metric.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert values == {"rule0", "rule1", "rule2", "other"}


def test_the_sync_kinds_are_the_kinds_the_sync_follows() -> None:
    assert set(metrics.SYNC_KINDS) == set(RESOURCES)
