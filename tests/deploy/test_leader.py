"""The Lease-based leader election against a fake coordination.k8s.io/v1 API server."""

from __future__ import annotations

import threading

import pytest

from inventory import kube, leader
from tests.deploy.fake_api import FakeApi


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(api: FakeApi, identity: str, clock: Clock) -> leader.LeaderElector:
    return leader.LeaderElector(
        api_client=api.api_client(),
        name="tally-sync-default",
        namespace="tally",
        identity=identity,
        lease_duration=15,
        renew_deadline=10,
        retry_period=2,
        clock=clock,
    )


def test_two_electors_only_one_leads(api: FakeApi) -> None:
    clock = Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False
    clock.now += 5
    assert a.try_acquire_or_renew() is True  # renewing
    assert b.try_acquire_or_renew() is False
    lease = api.get("Lease", "tally-sync-default", "tally")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "a"
    assert lease["spec"]["leaseDurationSeconds"] == 15


def test_a_stale_write_loses_with_409(api: FakeApi) -> None:
    clock = Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    assert a.try_acquire_or_renew()
    # Both saw the same record expire; b writes first, a's write is on the old version.
    stale = api.get("Lease", "tally-sync-default", "tally")
    assert stale is not None
    clock.now += 16
    assert b.try_acquire_or_renew() is False  # b first observes the record...
    clock.now += 16
    assert b.try_acquire_or_renew() is True  # ...and takes it once unchanged for 15 s
    stale["spec"]["holderIdentity"] = "c"
    assert kube.replace_lease(api_client=api.api_client(), namespace="tally", body=stale) is None
    assert a.try_acquire_or_renew() is False


def test_the_other_takes_over_after_the_lease_duration(api: FakeApi) -> None:
    clock = Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    # a stops renewing; b waits out the lease on its own clock, from when it saw the record.
    clock.now += 14
    assert not b.try_acquire_or_renew()
    clock.now += 2
    assert b.try_acquire_or_renew()
    lease = api.get("Lease", "tally-sync-default", "tally")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "b"
    assert lease["spec"]["leaseTransitions"] == 1
    # a, back, finds itself replaced and does not lead.
    assert not a.try_acquire_or_renew()
    assert not a.is_leader  # its last renewal is older than the renew deadline


def test_release_hands_over_at_once(api: FakeApi) -> None:
    clock = Clock()
    a, b = elector(api, "a", clock), elector(api, "b", clock)
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    assert a.release()
    assert b.try_acquire_or_renew()


def test_run_leads_then_releases_on_stop(api: FakeApi) -> None:
    a = leader.LeaderElector(
        api_client=api.api_client(),
        name="tally-sync-default",
        namespace="tally",
        identity="a",
        lease_duration=3,
        renew_deadline=2,
        retry_period=0.05,
    )
    stop = threading.Event()
    started = threading.Event()

    def work(stop_leading: threading.Event) -> str:
        started.set()
        stop_leading.wait(5)
        return "done"

    result: list[str | None] = []
    thread = threading.Thread(target=lambda: result.append(a.run(stop=stop, work=work)))
    thread.start()
    assert started.wait(5)
    stop.set()
    thread.join(5)
    assert result == ["done"]
    lease = api.get("Lease", "tally-sync-default", "tally")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == ""


def test_run_stops_the_work_when_the_lease_is_taken(api: FakeApi) -> None:
    a = leader.LeaderElector(
        api_client=api.api_client(),
        name="tally-sync-default",
        namespace="tally",
        identity="a",
        lease_duration=0.6,
        renew_deadline=0.3,
        retry_period=0.05,
    )
    stop = threading.Event()
    started = threading.Event()
    stopped = threading.Event()

    def work(stop_leading: threading.Event) -> None:
        started.set()
        if stop_leading.wait(5):
            stopped.set()

    errors: list[BaseException] = []

    def run() -> None:
        try:
            a.run(stop=stop, work=work)
        except leader.LeadershipLost as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(5)
    # Someone else takes the lease (an operator, a partitioned leader's successor).
    lease = api.get("Lease", "tally-sync-default", "tally")
    assert lease is not None
    lease["spec"]["holderIdentity"] = "b"
    lease["spec"]["leaseDurationSeconds"] = 60
    api.put_object("Lease", lease)
    thread.join(5)
    assert stopped.is_set()
    assert len(errors) == 1
    stop.set()


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError):
        leader.LeaderElector(
            api_client=None,
            name="x",
            namespace="tally",
            lease_duration=10,
            renew_deadline=10,
            retry_period=2,
        )
