"""The watch reads the next batch's owners while the one before it is written (issue 22):
`kube_sync.KindSync._follow_stream`. What must hold as before: batches are written in their order,
each after the one before it committed, and a claim whose Pod was read for a batch that does
not commit is read again when the watch brings it again, so it is written with its job and gang.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from typing import Any, cast

import pytest
from django.db import OperationalError
from django.utils import timezone

from devtools.fake_kube import FakeKube
from inventory import kube, kube_owners, kube_sync, services
from inventory.dumps import iter_objects
from inventory.models import Cluster, ResourceClaim, SyncState
from tests.inventory.test_gangs import FIXTURES, Clock, claim_loop, named, serve
from tests.waits import wait_until

FIRST_CLAIM, FIRST_POD = "train-workers-0-0-x7k2p-gpus-4m8rt", "train-workers-0-0-x7k2p"
SECOND_CLAIM, SECOND_POD = "train-workers-1-0-q9m4z-gpus-p2v6d", "train-workers-1-0-q9m4z"


class ScriptedStream:
    """Stands for the watch's `_WatchReader`: hands out the given batches in turn (raises an
    exception among them, as what broke the stream), then the end of the stream (or at once
    once stopped)."""

    def __init__(self, batches: list[list[kube_sync._Received] | Exception]) -> None:
        self._batches = list(batches)
        self._stopped = threading.Event()

    def take(self, limit: int, *, wait: bool = True) -> list[kube_sync._Received]:
        if self._stopped.is_set() or not self._batches:
            return []
        batch = self._batches.pop(0)
        if isinstance(batch, Exception):
            raise batch
        return batch

    def stop(self) -> None:
        self._stopped.set()


def received(objects: list[dict[str, Any]], name: str, version: str) -> kube_sync._Received:
    """The claim's ADDED event as the watch delivers it (a fresh object each delivery)."""
    obj = copy.deepcopy(named(objects, name))
    obj["metadata"]["resourceVersion"] = version
    return kube_sync._Received({"type": "ADDED", "object": obj}, timezone.now())


def follow(loop: kube_sync.KindSync, batches: list[list[kube_sync._Received] | Exception]) -> None:
    """One watch request that brings `batches`, as `KindSync.watch` follows it."""
    loop._owner_reader = kube_owners.OwnerReader(loop._api_client)  # a reader per watch request
    loop._follow_stream(cast(kube_sync._WatchReader, ScriptedStream(batches)), threading.Event())


def pod_reads(fake: FakeKube, pod: str) -> int:
    return len([r for r in fake.reads("Pod") if r.read and r.read[2] == pod])


def wait_for_second_pod_read(fake: FakeKube) -> None:
    """Until the second batch's Pod has been read (at most 10 s)."""
    wait_until(
        lambda: pod_reads(fake, SECOND_POD) == 1, "the second batch's Pod read", seconds=10.0
    )


def stored_version(cluster: Cluster) -> str:
    """The claims' resourceVersion the sync has stored ("" before its first batch)."""
    state = SyncState.objects.filter(cluster=cluster, kind="ResourceClaim").first()
    return state.resource_version if state is not None else ""


def stored(cluster: Cluster) -> dict[str, tuple[str, str | None]]:
    return {
        claim.name: (claim.job, claim.gang.key if claim.gang else None)
        for claim in ResourceClaim.objects.filter(cluster=cluster).select_related("gang")
    }


@pytest.fixture
def objects(fake: FakeKube) -> list[dict[str, Any]]:
    """The JobSet fixture served: two claims, each of its own Pod, in the JobSet's gang."""
    found = list(iter_objects(FIXTURES / "jobset.yaml"))
    serve(fake, found)
    return found


@pytest.fixture
def expected(
    fake: FakeKube, objects: list[dict[str, Any]], api_client: Any
) -> Iterator[dict[str, Any]]:
    """What the two claims are stored as when each batch is read and written in turn."""
    other = services.get_cluster("control")
    loop = claim_loop(api_client, other, Clock())
    loop._apply([services.WatchEvent("ADDED", named(objects, FIRST_CLAIM), timezone.now())], "5")
    loop._apply([services.WatchEvent("ADDED", named(objects, SECOND_CLAIM), timezone.now())], "6")
    found = stored(other)
    assert found[FIRST_CLAIM][1] == found[SECOND_CLAIM][1] == "JobSet/train"
    fake.requests.clear()  # the test counts its own reads
    yield found


@pytest.mark.django_db(transaction=True)
def test_the_next_batch_is_read_while_one_is_written_and_written_after_it(
    fake: FakeKube,
    api_client: Any,
    cluster: Cluster,
    objects: list[dict[str, Any]],
    expected: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    apply = services.apply_watch_events
    written: list[tuple[list[str], str]] = []

    def watching(**kwargs: Any) -> services.SyncReport:
        names = [event.obj["metadata"]["name"] for event in kwargs["events"]]
        if names == [FIRST_CLAIM]:
            # The second batch's Pod is read while the first is written, not after it.
            wait_for_second_pod_read(fake)
        written.append((names, stored_version(cluster)))
        return apply(**kwargs)

    monkeypatch.setattr(services, "apply_watch_events", watching)
    loop = claim_loop(api_client, cluster, Clock())
    follow(
        loop,
        [
            [received(objects, FIRST_CLAIM, "5")],
            [received(objects, SECOND_CLAIM, "6")],
            # Arrives while the first is written, after the second was taken: it joins the
            # second, as it would have joined a batch taken once the first had committed.
            [received(objects, FIRST_CLAIM, "7")],
        ],
    )

    # In their order, each after the one before it committed its resourceVersion.
    assert written == [([FIRST_CLAIM], ""), ([SECOND_CLAIM, FIRST_CLAIM], "5")]
    assert stored_version(cluster) == "7"
    assert stored(cluster) == expected
    assert (pod_reads(fake, FIRST_POD), pod_reads(fake, SECOND_POD)) == (1, 1)


@pytest.mark.django_db(transaction=True)
def test_a_batch_read_while_the_one_before_it_failed_is_read_again_when_it_comes_again(
    fake: FakeKube,
    api_client: Any,
    cluster: Cluster,
    objects: list[dict[str, Any]],
    expected: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The database fails while the first batch is written, after the second batch's Pod was
    read for it. The watch resumes from the stored resourceVersion and brings both again: the
    second claim's Pod is not due by the schedule, but it was read for a batch that never
    committed, so it is read again, and the claim stored with its job and gang."""
    apply = services.apply_watch_events
    calls: list[int] = []

    def failing_once(**kwargs: Any) -> services.SyncReport:
        calls.append(len(kwargs["events"]))
        if len(calls) == 1:
            wait_for_second_pod_read(fake)
            raise OperationalError("the server closed the connection unexpectedly")
        return apply(**kwargs)

    monkeypatch.setattr(services, "apply_watch_events", failing_once)
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    with pytest.raises(OperationalError):
        follow(
            loop, [[received(objects, FIRST_CLAIM, "5")], [received(objects, SECOND_CLAIM, "6")]]
        )
    assert not ResourceClaim.objects.filter(cluster=cluster).exists()
    assert stored_version(cluster) == ""

    clock.now += 0.05  # the backoff's pause, then the watch from the stored resourceVersion
    follow(loop, [[received(objects, FIRST_CLAIM, "5"), received(objects, SECOND_CLAIM, "6")]])

    assert stored(cluster) == expected
    assert (pod_reads(fake, FIRST_POD), pod_reads(fake, SECOND_POD)) == (2, 2)


@pytest.mark.django_db(transaction=True)
def test_a_batch_prepared_when_the_sync_stops_is_read_again_when_it_comes_again(
    fake: FakeKube, api_client: Any, cluster: Cluster, objects: list[dict[str, Any]]
) -> None:
    """Stopped while the second batch was prepared: it is not written, and what was read
    for it is forgotten, as for a batch that failed."""
    clock = Clock()
    loop = claim_loop(api_client, cluster, clock)
    stop = threading.Event()
    apply = services.apply_watch_events

    def stopping(**kwargs: Any) -> services.SyncReport:
        wait_for_second_pod_read(fake)
        stop.set()
        return apply(**kwargs)

    loop._owner_reader = kube_owners.OwnerReader(api_client)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(services, "apply_watch_events", stopping)
        stream = ScriptedStream(
            [[received(objects, FIRST_CLAIM, "5")], [received(objects, SECOND_CLAIM, "6")]]
        )
        loop._follow_stream(cast(kube_sync._WatchReader, stream), stop)

    assert set(stored(cluster)) == {FIRST_CLAIM}
    assert stored_version(cluster) == "5"
    follow(loop, [[received(objects, SECOND_CLAIM, "6")]])
    assert stored(cluster)[SECOND_CLAIM][1] == "JobSet/train"
    assert pod_reads(fake, SECOND_POD) == 2


@pytest.mark.django_db(transaction=True)
def test_a_stream_broken_after_a_batch_was_prepared_is_raised_once_it_is_written(
    api_client: Any, cluster: Cluster, objects: list[dict[str, Any]]
) -> None:
    loop = claim_loop(api_client, cluster, Clock())
    broken = kube.StreamError("a watch event is not JSON")
    with pytest.raises(kube.StreamError):
        follow(
            loop,
            [
                [received(objects, FIRST_CLAIM, "5")],
                [received(objects, SECOND_CLAIM, "6")],
                broken,
            ],
        )
    assert stored_version(cluster) == "6"
    assert set(stored(cluster)) == {FIRST_CLAIM, SECOND_CLAIM}
