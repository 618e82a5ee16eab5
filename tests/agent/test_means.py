"""Means over a longer interval than the agent samples (`agent.means`, TALLY_AGENT_MEAN_SECONDS)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agent import runner
from agent.means import Averager
from agent.readings import GpuReading

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def reading(uuid: str, second: float, util: float | None, mem: int | None = None) -> GpuReading:
    return GpuReading(
        uuid=uuid, ts=T0 + timedelta(seconds=second), gpu_util=util, mem_used_bytes=mem
    )


def test_a_minute_of_readings_a_second_is_one_mean_per_device_covering_the_minute() -> None:
    averager = Averager(seconds=60, interval=1)
    sent = []
    for second in range(125):
        busy = 100.0 if second % 60 < 15 else 0.0  # busy the first quarter of each minute
        sent += averager.add(
            [reading("GPU-a", second, busy, mem=second), reading("GPU-b", second, None)]
        )
    # Two minutes closed; the third is still open.
    assert [(mean.sample["uuid"], mean.sample["ts"]) for mean in sent] == [
        ("GPU-a", "2026-11-30T12:00:00.000Z"),
        ("GPU-b", "2026-11-30T12:00:00.000Z"),
        ("GPU-a", "2026-11-30T12:01:00.000Z"),
        ("GPU-b", "2026-11-30T12:01:00.000Z"),
    ]
    first_a, first_b = sent[0].sample, sent[1].sample
    assert first_a["gpu_util"] == 25.0  # 15 s of 60 busy: a quarter, as the readings say
    assert first_a["covered_seconds"] == 60.0
    assert first_a["mem_used_bytes"] == 59  # the largest of the minute
    # Never measured: unmeasured, not idle.
    assert first_b["gpu_util"] is None and first_b["covered_seconds"] == 60.0
    # At shutdown, the open window goes with the time it covers: five readings, five seconds.
    rest = averager.flush()
    assert [(mean.sample["ts"], mean.sample["covered_seconds"]) for mean in rest] == [
        ("2026-11-30T12:02:00.000Z", 5.0),
        ("2026-11-30T12:02:00.000Z", 5.0),
    ]
    assert rest[0].sample["gpu_util"] == 100.0
    assert averager.flush() == []


def test_a_device_first_seen_mid_window_covers_only_from_its_first_reading() -> None:
    averager = Averager(seconds=60, interval=10)
    for second in range(30, 60, 10):
        assert averager.add([reading("GPU-a", second, 40.0)]) == []
    [mean] = averager.add([reading("GPU-a", 60, 0.0)])
    assert mean.sample["ts"] == "2026-11-30T12:00:30.000Z"
    assert (mean.sample["covered_seconds"], mean.sample["gpu_util"]) == (30.0, 40.0)


def test_readings_of_several_nodes_keep_their_node() -> None:
    averager = Averager(seconds=2, interval=1)
    for second in range(3):
        closed = averager.add(
            [
                GpuReading(uuid="GPU-a", ts=T0 + timedelta(seconds=second), gpu_util=1.0,
                           mem_used_bytes=None, node="n1"),
                GpuReading(uuid="GPU-a", ts=T0 + timedelta(seconds=second), gpu_util=3.0,
                           mem_used_bytes=None, node="n2"),
            ]
        )  # fmt: skip
    assert sorted((mean.node, mean.sample["gpu_util"]) for mean in closed) == [
        ("n1", 1.0),
        ("n2", 3.0),
    ]


def test_the_window_must_be_whole_intervals() -> None:
    with pytest.raises(ValueError, match="not a whole number of 10 s"):
        Averager(seconds=15, interval=10)


BASE = {"TALLY_URL": "http://tally:8000", "TALLY_AGENT_TOKEN": "t", "TALLY_NODE_NAME": "n1"}


@pytest.mark.parametrize(
    ("mean", "message"),
    [
        ("15", "TALLY_AGENT_MEAN_SECONDS=15 must be a whole number of"),
        ("7200", "TALLY_AGENT_MEAN_SECONDS=7200 must be at most 3600"),
        ("soon", "TALLY_AGENT_MEAN_SECONDS must be a number"),
        ("-60", "TALLY_AGENT_MEAN_SECONDS must be positive"),
    ],
)
def test_a_bad_mean_names_the_variable(mean: str, message: str) -> None:
    env = {**BASE, "TALLY_AGENT_INTERVAL_SECONDS": "10", "TALLY_AGENT_MEAN_SECONDS": mean}
    with pytest.raises(runner.ConfigError, match=message):
        runner.Config.from_env(env)


def test_means_shrink_the_default_buffer_by_their_length() -> None:
    every_second = runner.Config.from_env({**BASE, "TALLY_AGENT_INTERVAL_SECONDS": "1"})
    means = runner.Config.from_env(
        {**BASE, "TALLY_AGENT_INTERVAL_SECONDS": "1", "TALLY_AGENT_MEAN_SECONDS": "60"}
    )
    assert means.mean_seconds == 60.0 and every_second.mean_seconds is None
    assert means.buffer_samples * 60 == every_second.buffer_samples


class Readings:
    """A source whose readings come from a list, one round per read."""

    def __init__(self, rounds: list[list[GpuReading]]) -> None:
        self.rounds = rounds

    def read(self) -> list[GpuReading]:
        return self.rounds.pop(0)

    def close(self) -> None:
        pass


def test_the_sampler_queues_means_and_flushes_the_open_window() -> None:
    buffer = runner.SampleBuffer(100)
    source = Readings([[reading("GPU-a", second, 50.0)] for second in range(3)])
    sampler = runner.Sampler(source, buffer, node="n1", averager=Averager(seconds=2, interval=1))
    for _ in range(3):
        sampler.sample_once()
    assert [item.sample["covered_seconds"] for item in buffer.head(10)] == [2.0]
    sampler.flush_means()
    queued = buffer.head(10)
    assert [(item.node, item.sample["covered_seconds"]) for item in queued] == [
        ("n1", 2.0),
        ("n1", 1.0),
    ]
