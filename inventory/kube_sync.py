"""List + watch DRA objects from the Kubernetes API into the inventory (see `inventory.kube`).

Each kind (Node, DeviceClass, ResourceSlice, ResourceClaim) has its own loop: a paged LIST
imported whole with `services.import_snapshot`, then a WATCH from the list's resourceVersion.
The watch is read in a thread of its own (`_WatchReader`); the loop takes all the events that
have arrived (up to `WATCH_BATCH_EVENTS`), never waiting for more, and applies them in one
transaction with `services.apply_watch_events`: a lone event is applied at once, and a
stream faster than one transaction an event is applied in batches that grow with it. The
resourceVersion reached is kept in `SyncState`, in the batch's transaction, so a restarted
process resumes its watches without listing again, exactly after the last batch applied.

Objects stay raw JSON (camelCase, unknown fields kept), never the client's generated models:
the services read fields the client may not know yet, and keep what they do not read.

A claim's job is found by reading its owners (a Pod, its ReplicaSet or Job, see
`inventory.owners`) with `OwnerReader`, before the transaction that writes the claim, once per
claim in a batch; its gang (`inventory.gangs`) from the same Pod, read once, and the object
that declares the gang, through the reader's `GangReader`. A watch reads them for the next
batch while the one before it is written (`KindSync._follow_stream`). A claim such a read left
unsettled (in no gang, its Pod gone) is read again on a later list or event when
`RereadSchedule` says: 30 s later, then twice as long each time, up to 5 minutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import tenacity
import urllib3
from django.conf import settings
from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    connection,
    transaction,
)
from django.db.models import F
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from core import metrics
from db.bulk import AnyOf
from inventory import gang_sync, gangs, owners, services
from inventory.kube import (
    CONNECT_TIMEOUT_SECONDS,
    LIST_READ_TIMEOUT_SECONDS,
    TRANSIENT_ERRORS,
    Backoff,
    KubeError,
    StreamError,
    decode_json,
    status_message,
)
from inventory.kube_owners import OwnerReader, RereadSchedule, read_pods
from inventory.models import Cluster, ResourceClaim, SyncState

# The sync's log keeps the name it has always had (operators filter on it).
log = logging.getLogger("inventory.kube")

HTTP_GONE = 410
# A watch may stay silent for its whole timeoutSeconds; only a read stalled well past that
# means the connection died without the server closing it.
WATCH_READ_GRACE_SECONDS = 30
# How often a paged LIST starts over when its continue token expired between pages.
LIST_ATTEMPTS = 3
# Claims asked about in one query (a list of 100,000 claims is not one `IN`).
CLAIMS_PER_QUERY = 1000
# Watch events applied in one transaction at most. A batch is what has arrived while the last
# one was applied: its size follows the stream's rate, and bounds the transaction.
WATCH_BATCH_EVENTS = 500
# Events read ahead of the one applied, at most: past that the reader waits, and the API
# server's stream with it.
WATCH_READ_AHEAD = 4 * WATCH_BATCH_EVENTS
JOIN_TIMEOUT_SECONDS = 10
# How often a `take` waiting for the next event looks whether its reader was stopped.
TAKE_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class Resource:
    """A kind the sync follows, and the client call that lists (and watches) it."""

    kind: str
    api_version: str
    api: Callable[[k8s.ApiClient], Any]
    list_method: str

    def list_call(self, api_client: k8s.ApiClient) -> Callable[..., Any]:
        return getattr(self.api(api_client), self.list_method)


# In dependency order: a `--once` run imports nodes before the slices whose devices they host,
# and slices before the claims allocated from them.
RESOURCES: dict[str, Resource] = {
    resource.kind: resource
    for resource in (
        Resource("Node", "v1", k8s.CoreV1Api, "list_node"),
        Resource("DeviceClass", "resource.k8s.io/v1", k8s.ResourceV1Api, "list_device_class"),
        Resource("ResourceSlice", "resource.k8s.io/v1", k8s.ResourceV1Api, "list_resource_slice"),
        Resource(
            "ResourceClaim",
            "resource.k8s.io/v1",
            k8s.ResourceV1Api,
            "list_resource_claim_for_all_namespaces",
        ),
    )
}


class ResourceExpired(Exception):
    """410 Gone: the server no longer holds the resourceVersion or continue token asked for."""


def sync(
    *,
    api_client: k8s.ApiClient,
    cluster: Cluster,
    kinds: Iterable[str] = RESOURCES,
    once: bool = False,
    stop: threading.Event | None = None,
    backoff: Backoff | None = None,
) -> dict[str, services.SyncReport]:
    """Sync `kinds` of `cluster` and return the report of each kind's last full list.

    With `once`, list and import each kind in turn and return; a kind that cannot be listed is
    logged and the others still run, then `KubeError` names the failed kinds. Otherwise run one
    list + watch loop per kind, each in its own thread, until `stop` is set; a loop never
    ends on a failure, it logs it and retries.
    """
    wanted = set(kinds)
    unknown = wanted - RESOURCES.keys()
    if unknown:
        raise KubeError(
            f"unknown kind(s) {', '.join(sorted(unknown))}; known: {', '.join(RESOURCES)}"
        )
    loops = [
        KindSync(api_client=api_client, cluster=cluster, resource=resource, backoff=backoff)
        for kind, resource in RESOURCES.items()
        if kind in wanted
    ]
    if once:
        failed = [loop.kind for loop in loops if not loop.relist_once()]
        if failed:
            raise KubeError(f"could not list {', '.join(failed)} (see the log)")
    else:
        _run_concurrently(loops, stop or threading.Event())
    return {loop.kind: loop.last_report for loop in loops if loop.last_report is not None}


def _run_concurrently(loops: list[KindSync], stop: threading.Event) -> None:
    threads = [
        threading.Thread(target=loop.run, args=(stop,), name=f"sync-{loop.kind}", daemon=True)
        for loop in loops
    ]
    for thread in threads:
        thread.start()
    try:
        stop.wait()
    finally:
        stop.set()
        for loop in loops:
            loop.interrupt()
        for thread in threads:
            thread.join(JOIN_TIMEOUT_SECONDS)
            if thread.is_alive():
                log.error("%s did not stop within %ss", thread.name, JOIN_TIMEOUT_SECONDS)


class KindSync:
    """The list + watch loop of one kind in one cluster, recording progress in `SyncState`."""

    def __init__(
        self,
        *,
        api_client: k8s.ApiClient,
        cluster: Cluster,
        resource: Resource,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kind = resource.kind
        self.resource = resource
        self.cluster = cluster
        self.backoff = backoff or Backoff()
        self.last_report: services.SyncReport | None = None
        self.resource_version = ""
        # Whether `resource_version` was read from `SyncState` (once, when the loop starts).
        self._resumed = False
        # Whether the current attempt applied an event: a failure after one is resumed at once.
        self._progressed = False
        self._list = resource.list_call(api_client)
        self._api_client = api_client
        # Owners read during the current watch request; a list reads its own afresh.
        self._owner_reader = OwnerReader(api_client)
        # When the Pods of claims a read left unsettled are read again (see `_follow_owners`).
        self._clock = clock
        self._rereads = RereadSchedule()
        self._state_id: int | None = None
        self._response: urllib3.BaseHTTPResponse | None = None
        self._response_lock = threading.Lock()

    # The loop -----------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """List if needed, then watch, until `stop` is set. Never raises."""
        retrying = tenacity.Retrying(
            wait=self.backoff.wait(),
            stop=tenacity.stop_when_event_set(stop),
            sleep=tenacity.sleep_using_event(stop),
            before_sleep=self._before_retry,
            retry_error_callback=lambda _: None,  # stopped: give up quietly
        )
        try:
            while not stop.is_set():
                # One call per streak of failures: it returns once an attempt got somewhere,
                # so the backoff starts again from its first step after each success.
                retrying(self._follow, stop)
        finally:
            # Each thread has its own database connection; do not leave it to the server.
            connection.close()

    def _follow(self, stop: threading.Event) -> None:
        """One attempt: list when there is no resourceVersion to watch from, then watch until
        the server ends the watch. Raises what failed before anything was applied."""
        if stop.is_set():
            return  # stopped during the pause before this attempt
        self._progressed = False
        listed = False
        try:
            if not self._resumed:
                # A restart picks the watch up where the last process left it.
                self.resource_version = self._stored_resource_version()
                self._resumed = True
            if not self.resource_version:
                self.relist()
                listed = True
            self.watch(stop)
        except ResourceExpired as exc:
            log.info("%s: %s; listing again", self.kind, exc)
            self.resource_version = ""
            if listed and not self._progressed:
                raise  # expired at once after a fresh list: pause rather than list in a loop
        except Exception as exc:
            if stop.is_set() or not self._progressed:
                raise
            # The watch got somewhere before it failed: resume at once; the backoff is for
            # failures in a row.
            self._after_failure(exc, 0.0)

    def _before_retry(self, retry_state: tenacity.RetryCallState) -> None:
        assert retry_state.outcome is not None
        error = retry_state.outcome.exception()
        assert error is not None
        self._after_failure(error, retry_state.upcoming_sleep)

    def _after_failure(self, exc: BaseException, delay: float) -> None:
        resume = (
            f"resuming the watch from resourceVersion {self.resource_version}"
            if self.resource_version
            else "listing again"
        )
        if isinstance(exc, (*TRANSIENT_ERRORS, ResourceExpired)):
            log.warning(
                "%s: %s: %s; %s in %.2fs", self.kind, type(exc).__name__, exc, resume, delay
            )
        else:
            log.error("%s: unexpected failure; %s in %.2fs", self.kind, resume, delay, exc_info=exc)
        # A connection the failure broke is replaced before the next attempt.
        close_old_connections()

    def relist_once(self) -> bool:
        """One list + import for `--once`; False (and logged) when it failed."""
        try:
            self.relist()
        except Exception as exc:
            log.error("%s: cannot list: %s: %s", self.kind, type(exc).__name__, exc, exc_info=exc)
            return False
        return True

    def interrupt(self) -> None:
        """Cut the current watch short, from another thread, so that `stop` is seen at once."""
        with self._response_lock:
            if self._response is not None:
                # ValueError/OSError: already closed, so the loop is not reading from it.
                with contextlib.suppress(ValueError, OSError):
                    self._response.shutdown()

    # LIST ---------------------------------------------------------------------------------

    def relist(self) -> None:
        """List every object of the kind and import them as a full snapshot."""
        items, resource_version = self._list_all()
        jobs, claim_gangs = self._follow_owners(items, OwnerReader(self._api_client))
        at = timezone.now()
        with self._reread_unless_committed(items), transaction.atomic():
            report = services.import_snapshot(
                cluster=self.cluster,
                objects=items,
                at=at,
                kinds=[self.kind],
                jobs=jobs,
                gangs=claim_gangs,
            )
            SyncState.objects.filter(pk=self._state()).update(
                resource_version=resource_version,
                last_relist_at=at,
                relists=F("relists") + 1,
            )
        self.resource_version = resource_version
        self.last_report = report
        metrics.SYNC_RELISTS.labels(kind=self.kind).inc()
        log.info(
            "%s: listed %d at resourceVersion %s (created %d, updated %d, gone %d, rejected %d)",
            self.kind,
            len(items),
            resource_version,
            report.created.get(self.kind, 0),
            report.updated.get(self.kind, 0),
            report.gone.get(self.kind, 0),
            len(report.errors),
        )
        self._log_rejected(report)

    def _list_all(self) -> tuple[list[dict[str, Any]], str]:
        for attempt in range(1, LIST_ATTEMPTS + 1):
            try:
                return self._list_pages()
            except ResourceExpired as exc:
                # The continue token outlived the server's history: a consistent list has to
                # start over from the first page.
                log.info("%s: %s; list attempt %d of %d", self.kind, exc, attempt, LIST_ATTEMPTS)
        raise StreamError(f"the list expired between pages {LIST_ATTEMPTS} times in a row")

    def _list_pages(self) -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        continue_token: str | None = None
        while True:
            response = self._call(
                limit=settings.TALLY_SYNC_PAGE_SIZE,
                _continue=continue_token,
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, LIST_READ_TIMEOUT_SECONDS),
            )
            try:
                page = decode_json(response.data)
            except ValueError as exc:
                raise StreamError(f"the list answer is not JSON: {exc}") from exc
            finally:
                response.release_conn()
            items.extend(self._with_kind(item) for item in page.get("items") or ())
            metadata = page.get("metadata") or {}
            continue_token = metadata.get("continue")
            if not continue_token:
                return items, str(metadata.get("resourceVersion") or "")

    # WATCH --------------------------------------------------------------------------------

    def watch(self, stop: threading.Event) -> None:
        """Apply the events of one watch from `resource_version`, until the server ends it."""
        timeout = settings.TALLY_SYNC_WATCH_TIMEOUT_SECONDS
        response = self._call(
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(CONNECT_TIMEOUT_SECONDS, timeout + WATCH_READ_GRACE_SECONDS),
        )
        with self._response_lock:
            self._response = response
        self._owner_reader = OwnerReader(self._api_client)
        reader = _WatchReader(response, self.kind)
        try:
            if stop.is_set():
                return  # stopped while connecting: `interrupt` found nothing to cut
            reader.start()
            self._follow_stream(reader, stop)
        finally:
            with self._response_lock:
                self._response = None
            # Cut a read in progress, so that the reader sees the end at once.
            with contextlib.suppress(ValueError, OSError):
                response.shutdown()
            reader.close()
            response.close()
            response.release_conn()

    def _follow_stream(self, reader: _WatchReader, stop: threading.Event) -> None:
        """Apply the stream's batches in order, each in a transaction of its own, until the
        stream ends or `stop` is set.

        Claims: while one batch is written, the next is taken from the stream and its claims'
        owners and gangs read (`_prepare`) in a thread of its own, so that the API server
        answers those reads while PostgreSQL takes the writes; once the batch before it has
        committed, the events that arrived meanwhile join it (read then, the few of them), so
        a batch holds what arrived while the one before it was written, as when each was read
        and written in turn. Other kinds have nothing to read: each batch is taken once the
        one before it has committed.

        A batch is written only after the one before it committed. A claim whose Pod was read
        for a batch that is not committed (the write before it or its own failed, or `stop`)
        is read again when the watch brings it again (`_forget_reads`), as `_apply` does."""
        ahead = self.kind == "ResourceClaim"
        preparer = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prepare-{self.kind}")
            if ahead
            else None
        )
        try:
            ready = self._prepare(reader.take(WATCH_BATCH_EVENTS))
            while not ready.ended and not stop.is_set():
                upcoming = preparer.submit(self._take_and_prepare, reader) if preparer else None
                try:
                    self._commit(ready)
                except BaseException:
                    if upcoming is not None:
                        # The next batch is not written now either: its preparing is told to
                        # take nothing more (it may be waiting for events), and what it read
                        # forgotten. A preparing that failed read no Pod: its database
                        # queries come first.
                        reader.stop()
                        with contextlib.suppress(Exception):
                            self._forget_reads(upcoming.result())
                    self._forget_reads(ready)
                    raise
                if upcoming is None:
                    ready = self._take_and_prepare(reader)
                    continue
                ready = upcoming.result()
                room = WATCH_BATCH_EVENTS - len(ready.events)
                if not ready.ended and ready.error is None and room > 0:
                    try:
                        arrived = reader.take(room, wait=False)
                    except Exception as exc:  # what broke the stream: raised once it is written
                        ready = dataclasses.replace(ready, error=exc)
                    else:
                        if arrived:
                            ready = ready.joined(self._prepare(arrived))
            self._forget_reads(ready)  # stopped with a batch prepared: not written
        finally:
            if preparer is not None:
                # Nothing runs in the preparer by now. Its database connection is closed in
                # its thread, as each loop closes its own.
                preparer.submit(_close_connection)
                preparer.shutdown(wait=True)

    def _take_and_prepare(self, reader: _WatchReader) -> _Prepared:
        return self._prepare(reader.take(WATCH_BATCH_EVENTS))

    def _prepare(self, batch: list[_Received]) -> _Prepared:
        """A batch as read, ready to write: its events (claims with their jobs and gangs,
        `_with_owners`) and the last resourceVersion it brings (a bookmark's too). An ERROR
        event ends it: the events before it are written, then its error raised. An empty
        batch is the end of the stream."""
        events: list[services.WatchEvent] = []
        resource_version = ""
        error: Exception | None = None
        for received in batch:
            event_type = received.event.get("type")
            obj = received.event.get("object")
            if not isinstance(obj, dict):
                log.warning("%s: %s event without an object; skipped", self.kind, event_type)
                continue
            if event_type == "ERROR":
                message = f"{obj.get('reason', '')}: {obj.get('message', '')}"
                if obj.get("code") == HTTP_GONE:
                    error = ResourceExpired(f"watch expired ({message})")
                else:
                    error = StreamError(f"ERROR event {obj.get('code')} ({message})")
                break
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            if not version:
                log.warning(
                    "%s: %s event without a resourceVersion; skipped", self.kind, event_type
                )
            elif event_type == "BOOKMARK":
                resource_version = version
            elif event_type in services.WATCH_EVENT_TYPES:
                events.append(
                    services.WatchEvent(
                        event_type=event_type, obj=self._with_kind(obj), at=received.at
                    )
                )
                resource_version = version
            else:
                log.warning("%s: unknown watch event type %r; skipped", self.kind, event_type)
        if resource_version:
            events = self._with_owners(events)
        return _Prepared(
            events=events, resource_version=resource_version, error=error, ended=not batch
        )

    def _commit(self, prepared: _Prepared) -> None:
        """Write a prepared batch (`_write`), then raise the error that ended it, if any."""
        self._write(prepared.events, prepared.resource_version)
        if prepared.error is not None:
            raise prepared.error

    def _forget_reads(self, prepared: _Prepared) -> None:
        """Forget when the claims of a batch that is not written were read (see
        `_reread_unless_committed`)."""
        self._forget_when_read(event.obj for event in prepared.events)

    def _forget_when_read(self, objects: Iterable[dict[str, Any]]) -> None:
        """Forget when the claims among `objects` were read: each is due at its next event."""
        for obj in objects:
            if (uid := _uid(obj)) is not None:
                self._rereads.forget(uid)

    def _apply(self, events: list[services.WatchEvent], resource_version: str) -> None:
        """Follow the claims' owners (`_with_owners`), then write the events (`_write`): a
        batch prepared and written in turn."""
        if not resource_version:
            return
        events = self._with_owners(events)
        with self._reread_unless_committed(event.obj for event in events):
            self._write(events, resource_version)

    def _write(self, events: list[services.WatchEvent], resource_version: str) -> None:
        """Apply `events` and store `resource_version` (the batch's last) in one transaction:
        after a crash, or a database error here, the watch resumes exactly after the last
        batch applied. An event the services choke on is logged and skipped, the others
        applied one by one."""
        if not resource_version:
            return
        # The events and the resourceVersion they bring commit together.
        with transaction.atomic():
            try:
                with transaction.atomic():
                    report = services.apply_watch_events(cluster=self.cluster, events=events)
            except (OperationalError, InterfaceError):
                raise  # the database, not the objects: retry the batch after a pause
            except Exception as exc:
                if len(events) == 1:
                    self._skip(events[0], exc)
                else:
                    log.warning(
                        "%s: a batch of %d events could not be applied (%s: %s); applying them "
                        "one by one",
                        self.kind,
                        len(events),
                        type(exc).__name__,
                        exc,
                    )
                    for event in events:
                        self._apply_alone(event)
            else:
                self._log_rejected(report)
            state = SyncState.objects.filter(pk=self._state())
            if events:
                state.update(
                    resource_version=resource_version,
                    last_event_at=events[-1].at,
                    events_applied=F("events_applied") + len(events),
                )
            else:  # bookmarks only
                state.update(resource_version=resource_version)
        self.resource_version = resource_version
        self._progressed = True
        if not events:
            return
        metrics.SYNC_EVENTS_APPLIED.labels(kind=self.kind).inc(len(events))
        changed_at = _changed_at(events[-1].obj)
        if changed_at is not None:
            lag = (timezone.now() - changed_at).total_seconds()
            metrics.SYNC_LAG.labels(kind=self.kind).set(lag)

    @contextlib.contextmanager
    def _reread_unless_committed(self, objects: Iterable[dict[str, Any]]) -> Iterator[None]:
        """Forget when the claims among `objects` were read if what they were read for does not
        commit (the database failed): the batch comes again from the stored resourceVersion,
        and its claims, not due by the schedule, would be written without their job and gang
        until some later event of theirs."""
        try:
            yield
        except (OperationalError, InterfaceError):
            self._forget_when_read(objects)
            raise

    def _apply_alone(self, event: services.WatchEvent) -> None:
        try:
            with transaction.atomic():
                report = services.apply_watch_events(cluster=self.cluster, events=[event])
        except (OperationalError, InterfaceError):
            raise
        except Exception as exc:
            self._skip(event, exc)
        else:
            self._log_rejected(report)

    def _skip(self, event: services.WatchEvent, exc: Exception) -> None:
        # One object the services choke on must not stop the kind for good.
        log.error(
            "%s: %s %s could not be applied; skipped",
            self.kind,
            event.event_type,
            _name(event.obj),
            exc_info=exc,
        )

    def _with_owners(self, events: list[services.WatchEvent]) -> list[services.WatchEvent]:
        """The claim events with the jobs and gangs of their claims, read once a batch: each
        claim's owners are followed from its first event there, whose gang that read gives;
        its later events there with the same owners take the same job."""
        first: dict[str, dict[str, Any]] = {}
        for event in events:
            uid = _uid(event.obj)
            if uid is None:
                continue
            if event.event_type == "DELETED":
                self._rereads.forget(uid)
            else:
                first.setdefault(uid, event.obj)
        if not first:
            return events
        jobs, claim_gangs = self._follow_owners(list(first.values()), self._owner_reader)
        followed = []
        for event in events:
            metadata = event.obj.get("metadata") or {}
            uid = metadata.get("uid")
            if event.event_type == "DELETED" or uid not in first:
                followed.append(event)
                continue
            owned_alike = metadata.get("ownerReferences") == (first[uid].get("metadata") or {}).get(
                "ownerReferences"
            )
            gang = claim_gangs.pop(uid, None) if event.obj is first[uid] else None
            job = jobs.get(uid) if owned_alike else None
            followed.append(dataclasses.replace(event, job=job, gang=gang))
        return followed

    # Helpers ------------------------------------------------------------------------------

    def _follow_owners(
        self, objects: list[dict[str, Any]], reader: OwnerReader
    ) -> tuple[dict[str, owners.Resolution], dict[str, gangs.GangRef | None]]:
        """The claims' jobs, read from their owners, and the gangs of those whose Pod that
        read (by claim uid); none for other kinds. A list's claims are followed
        `WATCH_BATCH_EVENTS` at a time, so that the objects read for some are still in the
        reader's cache when they are followed.

        A claim resolved before is not followed again, so its Pod is not read again for its
        job: one read of a Pod gives both. A claim a read left unsettled (its Pod unreadable,
        or in no gang) is read again, on a later list or event, as `RereadSchedule` says: a
        gang that could not be read when the claim was first seen (a transient error, RBAC
        granted later, a PodGroup made after its Pods) is found then, and a claim of no gang,
        or whose Pod is gone, costs a read every few minutes at most.
        """
        if self.kind != "ResourceClaim":
            return {}, {}
        jobs: dict[str, owners.Resolution] = {}
        claim_gangs: dict[str, gangs.GangRef | None] = {}
        for start in range(0, len(objects), WATCH_BATCH_EVENTS):
            some_jobs, some_gangs = self._follow_some_owners(
                objects[start : start + WATCH_BATCH_EVENTS], reader
            )
            jobs.update(some_jobs)
            claim_gangs.update(some_gangs)
        return jobs, claim_gangs

    def _follow_some_owners(
        self, objects: list[dict[str, Any]], reader: OwnerReader
    ) -> tuple[dict[str, owners.Resolution], dict[str, gangs.GangRef | None]]:
        now = self._clock()
        by_uid = {uid: obj for obj in objects if (uid := _uid(obj)) is not None}
        try:
            candidates = {
                uid: candidate
                for uid, candidate in gang_sync.claims_to_follow(
                    cluster=self.cluster, objects=objects
                ).items()
                if uid not in by_uid or self._rereads.due(by_uid[uid], now)
            }
            again = self._gangless_due(objects, followed=candidates, now=now)
            read_pods(
                reader.objects,
                [obj for uid, obj in by_uid.items() if uid in candidates or uid in again],
            )
            jobs = gang_sync.follow_claim_jobs(candidates, lookup=reader)
        except (OperationalError, InterfaceError):
            raise  # the database: retried after a pause like the write it precedes
        except Exception:
            # Attribution must never hold the inventory up: the claims keep the owners known.
            log.exception("%s: could not follow the claims' owners; skipped", self.kind)
            return {}, {}
        claim_gangs: dict[str, gangs.GangRef | None] = {}
        for uid, obj in by_uid.items():
            if uid in jobs or uid in again:
                try:
                    read = gangs.read_gang_of_claim(obj, reader.objects)
                except Exception:
                    log.exception("%s: could not read the gang of %s; skipped", self.kind, uid)
                    continue
                claim_gangs[uid] = read.gang
                if gangs.claim_pod(obj) is not None:
                    self._rereads.read(obj, now, settled=read.settled)
        return jobs, claim_gangs

    def _gangless_due(
        self, objects: list[dict[str, Any]], *, followed: Iterable[str], now: float
    ) -> set[str]:
        """The uids of the claims among `objects`, not `followed` (their gang is read anyway),
        made for a Pod, stored live in no gang, and due a read (`RereadSchedule.due`)."""
        skip = set(followed)
        due = [
            uid
            for obj in objects
            if (uid := _uid(obj)) is not None
            and uid not in skip
            and gangs.claim_pod(obj) is not None
            and self._rereads.due(obj, now)
        ]
        found: set[str] = set()
        for start in range(0, len(due), CLAIMS_PER_QUERY):
            found.update(
                ResourceClaim.objects.filter(
                    AnyOf("uid", due[start : start + CLAIMS_PER_QUERY]),
                    cluster=self.cluster,
                    gang__isnull=True,
                    released_at__isnull=True,
                ).values_list("uid", flat=True)
            )
        return found

    def _call(self, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        try:
            return self._list(_preload_content=False, **kwargs)
        except ApiException as exc:
            if exc.status == HTTP_GONE:
                raise ResourceExpired(f"410 Gone ({status_message(exc)})") from exc
            raise

    def _with_kind(self, obj: dict[str, Any]) -> dict[str, Any]:
        # Items of a list (and events of some servers) leave out kind and apiVersion.
        obj["kind"] = self.kind
        obj.setdefault("apiVersion", self.resource.api_version)
        return obj

    def _state(self) -> int:
        if self._state_id is None:
            state, _ = SyncState.objects.get_or_create(cluster=self.cluster, kind=self.kind)
            self._state_id = state.pk
        return self._state_id

    def _stored_resource_version(self) -> str:
        return (
            SyncState.objects.filter(pk=self._state())
            .values_list("resource_version", flat=True)
            .get()
        )

    def _log_rejected(self, report: services.SyncReport) -> None:
        for error in report.errors:
            log.warning("%s: rejected: %s", self.kind, error)
        for note in report.notes():  # devices refused, allocation starts moved
            log.warning("%s: %s", self.kind, note)


@dataclass(frozen=True)
class _Received:
    """A watch event as decoded, and when it was read: the time it is applied at."""

    event: dict[str, Any]
    at: datetime


@dataclass(frozen=True)
class _Prepared:
    """A batch of watch events ready to write (`KindSync._prepare`)."""

    events: list[services.WatchEvent]
    # The batch's last resourceVersion; "" when it brought none (nothing to write).
    resource_version: str
    # What ended it (an ERROR event), raised once the events before it are written.
    error: Exception | None
    # The stream ended: nothing more comes from it.
    ended: bool

    def joined(self, later: _Prepared) -> _Prepared:
        """This batch and `later`, prepared after it from the events that followed it."""
        return _Prepared(
            events=[*self.events, *later.events],
            resource_version=later.resource_version or self.resource_version,
            error=later.error,
            ended=later.ended,
        )


@dataclass(frozen=True)
class _StreamEnd:
    """The end of a watch stream: the server closed it (`error` None), or what broke it."""

    error: BaseException | None


class _WatchReader:
    """Reads the events of one watch response in a thread of its own, so that the loop
    applying them finds all that have arrived meanwhile (`take`). Each is stamped with the
    time it was read. What ends the stream (a line that is no JSON, a broken connection) is
    raised by `take` once the events before it are taken."""

    def __init__(self, response: urllib3.BaseHTTPResponse, kind: str) -> None:
        self._response = response
        self._queue: queue.Queue[_Received | _StreamEnd] = queue.Queue(maxsize=WATCH_READ_AHEAD)
        self._closed = threading.Event()
        self._end: _StreamEnd | None = None
        self._thread = threading.Thread(target=self._read, name=f"watch-{kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take(self, limit: int, *, wait: bool = True) -> list[_Received]:
        """The next events, at most `limit`: waits for one (unless not `wait`: then [] when
        none has arrived), then takes those already read without waiting. [] once the server
        ended the stream, or once stopped; raises what broke it."""
        if self._end is None:
            if wait:
                item = self._first()
            else:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return []
            batch: list[_Received] = []
            while isinstance(item, _Received):
                batch.append(item)
                if len(batch) >= limit:
                    return batch
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return batch
            self._end = item
            if batch:
                return batch
        if self._end.error is not None:
            raise self._end.error
        return []

    def _first(self) -> _Received | _StreamEnd:
        """The next item, waiting for it; the end, without waiting for more, once stopped."""
        while not self._closed.is_set():
            try:
                return self._queue.get(timeout=TAKE_POLL_SECONDS)
            except queue.Empty:
                continue
        return _StreamEnd(None)

    def stop(self) -> None:
        """Take nothing more: a `take` waiting, or to come, returns []."""
        self._closed.set()

    def close(self) -> None:
        """Stop reading (the caller closes the response, which ends a read under way)."""
        self.stop()
        if self._thread.is_alive():
            self._thread.join(JOIN_TIMEOUT_SECONDS)

    def _read(self) -> None:
        end = _StreamEnd(None)
        try:
            for line in _lines(self._response):
                try:
                    event = decode_json(line)
                except ValueError as exc:
                    raise StreamError(f"a watch event is not JSON: {line[:200]!r}") from exc
                if not isinstance(event, dict):
                    raise StreamError(f"a watch event is not a JSON object: {line[:200]!r}")
                if not self._put(_Received(event, timezone.now())):
                    return
        except Exception as exc:
            end = _StreamEnd(exc)  # raised in the applying loop, after the events before it
        finally:
            self._put(end)  # whatever ended the thread: the loop must not wait for more

    def _put(self, item: _Received | _StreamEnd) -> bool:
        """Queue `item`, waiting while the queue is full; False once closed."""
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
            except queue.Full:
                continue
            return True
        return False


def _lines(response: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """The non-empty lines of a streamed response, as they arrive."""
    pending = b""
    for chunk in response.stream(amt=None, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


def _name(obj: dict[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    namespace = metadata.get("namespace")
    name = metadata.get("name", "<no name>")
    return f"{namespace}/{name}" if namespace else str(name)


def _close_connection() -> None:
    """Close the calling thread's database connection (`connection` names the caller's own
    when it is used, not when a bound method of it is taken)."""
    connection.close()


def _uid(obj: dict[str, Any]) -> str | None:
    """An object's uid, None where it has none (or not as text)."""
    uid = (obj.get("metadata") or {}).get("uid")
    return uid if isinstance(uid, str) else None


def _changed_at(obj: dict[str, Any]) -> datetime | None:
    """When the API server last changed the object, as far as its managedFields say."""
    metadata = obj.get("metadata") or {}
    times = [
        entry.get("time") for entry in metadata.get("managedFields") or [] if entry.get("time")
    ]
    stamp = max(times, default=None) or metadata.get("creationTimestamp")
    return parse_datetime(stamp) if isinstance(stamp, str) else None
