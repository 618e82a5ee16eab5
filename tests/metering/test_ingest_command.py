"""`ingest_samples` (the documented line shape, the node from the inventory, the summary of
rejections) and `create_agent_token` (only for a node the inventory knows)."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from inventory.models import Device
from metering.hours import epoch_ms
from metering.ingest import authenticate
from metering.models import AgentToken, Sample, UnknownDeviceSample
from teams.models import AuditEntry
from tests.factories import DeviceFactory, MigDeviceFactory

pytestmark = pytest.mark.django_db

T0 = (timezone.now() - timedelta(days=2)).replace(minute=0, second=0, microsecond=0)


@pytest.fixture
def gpu() -> Device:
    return DeviceFactory.create()


def node_of(device: Device) -> str:
    assert device.node is not None
    return device.node.name


def line(uuid: str, seconds: int = 0, **fields: Any) -> str:
    """A sample line in the shape the metering docs show: uuid, ts, gpu_util, mem_used_bytes."""
    at = T0 + timedelta(seconds=seconds)
    return json.dumps(
        {"uuid": uuid, "ts": at.isoformat(), "gpu_util": 50.0, "mem_used_bytes": 2**30, **fields}
    )


def ingest_file(tmp_path: Path, lines: list[str], *args: str) -> tuple[str, str, str]:
    """stdout, stderr and the CommandError ("" if none) of `ingest_samples` on `lines`."""
    file = tmp_path / "samples.jsonl"
    file.write_text("\n".join(lines) + "\n")
    out, err = StringIO(), StringIO()
    try:
        call_command("ingest_samples", str(file), *args, stdout=out, stderr=err)
    except CommandError as exc:
        return out.getvalue(), err.getvalue(), str(exc)
    return out.getvalue(), err.getvalue(), ""


# ingest_samples


def test_the_documented_line_shape_loads_under_the_inventorys_node(
    gpu: Device, tmp_path: Path
) -> None:
    mig = MigDeviceFactory.create(parent=gpu, node=None)  # where its GPU is
    out, err, error = ingest_file(tmp_path, [line(gpu.uuid), line(mig.uuid, 1)])
    assert (err, error) == ("", "")
    assert "2 accepted, 0 duplicates, 0 rejected" in out
    assert sorted(Sample.objects.values_list("device_uuid", "node", "mem_used_bytes")) == sorted(
        [(gpu.uuid, node_of(gpu), 2**30), (mig.uuid, node_of(gpu), 2**30)]
    )


def test_a_node_given_must_agree_with_the_inventory(gpu: Device, tmp_path: Path) -> None:
    lines = [line(gpu.uuid, node=node_of(gpu)), line(gpu.uuid, 1, node="elsewhere")]
    out, err, error = ingest_file(tmp_path, lines)
    assert err.splitlines() == [
        f"line 2: node: 'elsewhere', but the inventory puts device {gpu.uuid} on {node_of(gpu)!r}",
        "rejected lines by reason: node 1",
    ]
    assert error == "1 lines rejected (summarised above); the rest was loaded"
    assert "1 accepted" in out
    _, err, error = ingest_file(tmp_path, [line(gpu.uuid, 2)], "--node", "elsewhere")
    assert "but the inventory puts device" in err
    assert Sample.objects.count() == 1


def test_an_unknown_device_is_rejected_unless_its_node_is_given(
    gpu: Device, tmp_path: Path
) -> None:
    out, err, error = ingest_file(tmp_path, [line(gpu.uuid), line("GPU-unknown", 1)])
    assert err.splitlines()[0] == (
        "line 2: uuid: device GPU-unknown is not in the inventory; run sync_inventory first, "
        'or give its node (--node, or "node" on the line) to keep its samples aside until the '
        "sync learns it"
    )
    assert error.startswith("1 lines rejected")
    assert not UnknownDeviceSample.objects.exists()
    out, err, error = ingest_file(tmp_path, [line("GPU-unknown", 1)], "--node", "node-new")
    assert (err, error) == ("", "")
    assert "1 unknown devices kept aside: GPU-unknown" in out
    assert UnknownDeviceSample.objects.get().node == "node-new"


def test_rejections_are_summarised_not_listed_one_by_one(gpu: Device, tmp_path: Path) -> None:
    lines = [line(gpu.uuid, second) for second in range(3)]
    lines += [line(gpu.uuid, 10 + n, gpu_util=140) for n in range(25)]
    lines += [json.dumps({"uuid": gpu.uuid, "ts": "0001-01-01T00:00:00Z"})] * 9_000
    lines += ["{not json"] * 5
    out, err, error = ingest_file(tmp_path, lines)
    shown = err.splitlines()
    assert len(shown) == 22
    assert shown[0] == "line 4: gpu_util: 140 is not between 0 and 100"
    assert shown[19] == "line 23: gpu_util: 140 is not between 0 and 100"
    assert shown[20] == "... and 9,010 more"
    assert shown[21] == "rejected lines by reason: ts_window 9,000, gpu_util 25, json 5"
    assert error == "9030 lines rejected (summarised above); the rest was loaded"
    assert "3 accepted, 0 duplicates, 9030 rejected" in out
    assert Sample.objects.count() == 3


def test_times_outside_the_window_are_rejected(gpu: Device, tmp_path: Path) -> None:
    future = (timezone.now() + timedelta(days=400)).isoformat()
    lines = [
        json.dumps({"uuid": gpu.uuid, "ts": "0001-01-01T00:00:00+00:00", "gpu_util": 1}),
        json.dumps({"uuid": gpu.uuid, "ts": future, "gpu_util": 1}),
    ]
    _, err, error = ingest_file(tmp_path, lines)
    assert err.splitlines()[:2] == [
        'line 1: ts: "0001-01-01T00:00:00+00:00" is more than 90 days old '
        "(TALLY_INGEST_MAX_AGE_DAYS)",
        f"line 2: ts: {json.dumps(future)} is more than 5 minutes in the future "
        "(TALLY_INGEST_MAX_SKEW_SECONDS); is the sender's clock right?",
    ]
    assert error.startswith("2 lines rejected")
    assert not Sample.objects.exists()


def test_bad_lines_name_the_problem(gpu: Device, tmp_path: Path) -> None:
    lines = [
        line(gpu.uuid),
        "{not json",
        line(gpu.uuid, 1, node=7),
        line(gpu.uuid),  # a duplicate
    ]
    out, err, error = ingest_file(tmp_path, lines)
    assert err.splitlines() == [
        "line 2: not JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
        "line 3: node: must be a string, not a number",
        "rejected lines by reason: json 1, node 1",
    ]
    assert "1 accepted, 1 duplicates, 2 rejected" in out
    assert error.startswith("2 lines rejected")
    assert Sample.objects.get().ts_ms == epoch_ms(T0)


def test_the_help_documents_the_line_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        call_command("ingest_samples", "--help")
    text = capsys.readouterr().out
    assert '{"uuid": "GPU-8a1c2f4e-...", "ts": "2026-11-30T12:00:00Z", "gpu_util": 37.5,' in text
    for name in ("uuid", "ts", "gpu_util", "mem_used_bytes", "processes", "node"):
        assert f"\n  {name} " in text
    assert "TALLY_INGEST_MAX_AGE_DAYS" in text


# create_agent_token


def create_token(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("create_agent_token", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue().strip()


def test_a_token_for_a_known_node_is_printed_once(gpu: Device) -> None:
    token, warning = create_token("--node", node_of(gpu), "--cluster", gpu.cluster.name)
    stored = authenticate(token)
    assert stored is not None
    assert (stored.node, stored.cluster) == (node_of(gpu), gpu.cluster)
    assert stored.token_sha256 != token
    assert warning == ""
    assert AuditEntry.objects.get().actor == "create_agent_token"


def test_an_unknown_node_is_refused_naming_it(gpu: Device) -> None:
    with pytest.raises(CommandError) as raised:
        create_token("--node", "gpu-node-typo", "--cluster", gpu.cluster.name)
    assert str(raised.value) == (
        f"node 'gpu-node-typo' is not in the inventory of cluster {gpu.cluster.name!r}; check "
        "the name, run `python manage.py sync_inventory` first, or pass --force to issue the "
        "token anyway"
    )
    with pytest.raises(CommandError, match="Tally has never seen cluster 'nowhere'"):
        create_token("--node", node_of(gpu), "--cluster", "nowhere")
    assert not AgentToken.objects.exists()


def test_force_issues_it_with_a_warning(gpu: Device) -> None:
    token, warning = create_token("--node", "gpu-node-new", "--cluster", "east", "--force")
    assert warning == (
        "warning: node 'gpu-node-new' is not in the inventory (Tally has never seen cluster "
        "'east'); issuing the token anyway (--force)"
    )
    stored = authenticate(token)
    assert stored is not None
    assert (stored.node, stored.cluster.name) == ("gpu-node-new", "east")


def test_a_cluster_wide_token_needs_no_node(gpu: Device) -> None:
    token, warning = create_token("--node", "*", "--cluster", gpu.cluster.name)
    stored = authenticate(token)
    assert stored is not None
    assert (stored.node, warning) == ("*", "")
