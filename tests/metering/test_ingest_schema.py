"""The ingest payload's schema is the one source: the JSON Schema the docs show is the one
pydantic generates from `metering.ingest.schema`, its bounds are the ones ingest enforces, and
a sample breaking any bound it states is rejected naming that field, with today's message."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metering import ingest
from metering.ingest.rows import MAX_BIGINT, MAX_GPU_INSTANCE_ID, MAX_UUID_LENGTH
from metering.ingest.schema import json_schema, json_schema_text

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "ingest.md"
NOW = datetime(2026, 3, 2, 12, tzinfo=UTC)
TS = "2026-03-02T11:59:00Z"


def test_the_docs_show_the_schema_the_code_declares() -> None:
    page = DOCS.read_text()
    shown = re.search(r"```json\n(.*?)\n```", page, re.S)
    assert shown is not None, "docs/reference/ingest.md has no ```json block"
    assert shown.group(1) == json_schema_text(), (
        "docs/reference/ingest.md's schema is stale; paste json_schema_text() into it"
    )
    assert "metering/ingest/schema.py" in page


def _sample_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json_schema()["$defs"]["Sample"]
    return schema


def _bound(field: str, key: str) -> Any:
    (branch,) = [b for b in _sample_schema()["properties"][field]["anyOf"] if b["type"] != "null"]
    return branch[key]


def test_the_schema_states_the_bounds_ingest_has_always_enforced() -> None:
    assert _bound("uuid", "maxLength") == MAX_UUID_LENGTH
    assert _bound("mem_used_bytes", "maximum") == MAX_BIGINT
    assert _bound("gpu_util", "maximum") == 100
    assert _bound("gpu_instance_id", "maximum") == MAX_GPU_INSTANCE_ID
    assert _sample_schema()["required"] == ["ts"]


# (field, a value breaking a bound the schema states, the reason ingest gives)
BROKEN = [
    ("uuid", "x" * (MAX_UUID_LENGTH + 1), "is not printable ASCII of at most 128 characters"),
    ("uuid", "", "must be a non-empty string (or give driver and device)"),
    ("uuid", "GPU-\t1", "is not printable ASCII"),
    ("gpu_util", 100.5, "100.5 is not between 0 and 100"),
    ("gpu_util", -1, "-1 is not between 0 and 100"),
    ("gpu_util", "50", 'must be a number or null, not "50"'),
    ("gpu_util", True, "must be a number or null, not true"),
    ("mem_used_bytes", MAX_BIGINT + 1, "must be an integer from 0 to 2^63-1"),
    ("mem_used_bytes", 1.5, "must be an integer from 0 to 2^63-1, not 1.5"),
    ("processes", [1], "must be a list of objects"),
    ("processes", {}, "must be a list of objects"),
    ("covered_seconds", 0, "must be more than 0 and at most"),
    ("covered_seconds", "5", 'must be a number of seconds, not "5"'),
    ("gpu_instance_id", MAX_GPU_INSTANCE_ID + 1, "must be an integer from 0 to 4095, not 4096"),
    ("ts", 5, "must be an ISO 8601 string with a timezone"),
]


@pytest.mark.parametrize(("field", "value", "reason"), BROKEN)
def test_a_value_the_schema_refuses_is_rejected_naming_its_field(
    field: str, value: Any, reason: str
) -> None:
    sample = {"uuid": "GPU-1", "ts": TS, field: value}
    if field == "gpu_instance_id":
        sample["parent_uuid"] = "GPU-0"
    valid, rejected = ingest.validate_samples([sample], now=NOW)
    assert valid == []
    assert rejected[0]["reason"].startswith(f"samples[0].{field}: "), rejected
    assert reason in rejected[0]["reason"]
    assert rejected[0]["label"] == field


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
FIELDS = ["uuid", "ts", "gpu_util", "mem_used_bytes", "processes", "covered_seconds"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4))
def test_a_batch_and_its_samples_one_by_one_agree(sample: dict[str, Any]) -> None:
    """The batch is validated in one call of the schema, a file's line (`check_sample`) on its
    own: the same sample gets the same verdict and message, in a batch among valid ones or
    alone, and nothing but `InvalidSample` comes out of either."""
    good = {"uuid": "GPU-1", "ts": TS}
    valid, rejected = ingest.validate_samples([good, sample, good], now=NOW)
    try:
        alone = ingest.check_sample(sample, window=ingest.sample_window(NOW))
    except ingest.InvalidSample as exc:
        assert [r["index"] for r in rejected] == [1]
        assert rejected[0]["reason"] == f"samples[1].{exc}"
        assert len(valid) == 2
    else:
        assert rejected == []
        assert valid[1] == alone
    assert json.dumps([r["reason"] for r in rejected])  # plain text, for the JSON answer


PLAIN: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {
        "uuid": st.sampled_from(["GPU-1", "GPU-2", "GPU-1::gi3", "GPU-1::gi9999", "MIG-7"]),
        "ts": st.sampled_from(
            [TS, "2026-03-01T10:00:00.123456+01:00", "1999-01-01T00:00:00Z", "2026-03-01 10:00"]
        ),
    },
    optional={
        "gpu_util": st.none() | st.integers(0, 100) | st.floats(0, 100),
        "mem_used_bytes": st.none() | st.integers(0, MAX_BIGINT),
        "processes": st.none()
        | st.lists(st.dictionaries(st.sampled_from(["pid", "pod_uid", "x\u0000"]), JSON)),
        "covered_seconds": st.none()
        | st.sampled_from([1, 4.0005, 0.0001, 59.9999, 10**9])
        | st.floats(0.001, 60),
        "extra": JSON,  # unknown keys are ignored
        "parent_uuid": st.sampled_from(["GPU-1", None]),  # a MIG field: checked field by field
        "node": st.none(),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(PLAIN, min_size=1, max_size=6))
def test_a_plain_batch_checked_a_field_at_a_time_agrees_with_each_sample_checked(
    samples: list[dict[str, Any]],
) -> None:
    """An agent's usual batch (samples the schema takes, each naming its device by `uuid`)
    is worked out a field at a time (`SampleChecker.plain_rows`); what it stores, or rejects
    and why, is what checking each sample on its own gives."""
    valid, rejected = ingest.validate_samples(samples, now=NOW)
    window = ingest.sample_window(NOW)
    expected_valid, expected_rejected = [], []
    for index, sample in enumerate(samples):
        try:
            expected_valid.append(ingest.check_sample(sample, window=window))
        except ingest.InvalidSample as exc:
            expected_rejected.append(f"samples[{index}].{exc}")
    assert valid == expected_valid
    assert [r["reason"] for r in rejected] == expected_rejected
