"""Reads single objects from the Kubernetes API for the sync and the webhooks: the owners of
claims (`inventory.owners`) and the objects that declare gangs (`inventory.gangs`), cached, with
pauses when the API server is in trouble; and when a claim a read left unsettled is read again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from inventory import gangs, owners
from inventory.kube import (
    CONNECT_TIMEOUT_SECONDS,
    HTTP_NOT_FOUND,
    StreamError,
    response_json,
    status_message,
)

# The sync's log keeps the name it has always had (operators filter on it).
log = logging.getLogger("inventory.kube")

# Owners and gangs of claims (see inventory.owners, inventory.gangs) -----------------------

HTTP_FORBIDDEN = 403
OWNER_READ_TIMEOUT_SECONDS = (CONNECT_TIMEOUT_SECONDS, 10)
# (connect, read) for the admission webhook's reads: well inside its deadline
# (TALLY_WEBHOOK_DEADLINE_MS, 2.5 s), so that an API server slow to answer leaves a claim
# decided alone, with a warning, rather than the CREATE failed for a webhook timeout.
WEBHOOK_READ_TIMEOUT_SECONDS = (0.5, 1.0)
# Pods a watch batch's claims read at once (`read_pods`): an API server answers reads side by
# side, where one after another each waits its round trip.
OWNER_READ_CONCURRENCY = 8
# Failed reads (not 403/404) in a row after which a reader stops asking for a while: an API
# server in trouble is not sent a GET per claim, each waiting for its timeout.
OWNER_READ_FAILURES = 3
# How long a read object (or its absence) is trusted. A Pod's labels, owners and gang do not
# change in that time, and the admission webhook, which asks per claim, then asks the API
# server once per gang and not once per member.
GANG_CACHE_SECONDS = 30.0
# Objects a reader keeps at most; the least recently used go first.
GANG_CACHE_ENTRIES = 4096
# A claim a read left unsettled is read again after this long at first, then after twice as
# long each time, up to `GANG_REREAD_MAX_SECONDS` (see `RereadSchedule`).
GANG_REREAD_SECONDS = GANG_CACHE_SECONDS
GANG_REREAD_MAX_SECONDS = 300.0
# Built-in (API group, kind) → the resource RBAC names, the API class and its read method.
# Other kinds (the custom resources that declare gangs, and ResourceClaimTemplates, whose
# version is the claim's) go through the generic object call, with their plural from
# `gangs.GANG_READS`.
OWNER_READS: dict[tuple[str, str], tuple[str, Callable[[k8s.ApiClient], Any], str]] = {
    ("", "Pod"): ("pods", k8s.CoreV1Api, "read_namespaced_pod"),
    ("apps", "ReplicaSet"): ("replicasets.apps", k8s.AppsV1Api, "read_namespaced_replica_set"),
    ("batch", "Job"): ("jobs.batch", k8s.BatchV1Api, "read_namespaced_job"),
}
# The one core kind besides Pods that the workload webhook may find as an owner.
WORKLOAD_READS: dict[tuple[str, str], tuple[str, Callable[[k8s.ApiClient], Any], str]] = {
    ("", "ReplicationController"): (
        "replicationcontrollers",
        k8s.CoreV1Api,
        "read_namespaced_replication_controller",
    ),
}


class GangReader:
    """Reads single objects (`gangs.GangLookup`) as raw JSON: Pods, their owners, the objects
    that declare gangs and the claim templates of their roles (`gangs.GANG_READS`), each
    cached `ttl_seconds`, at most `max_entries` of them; `get_fresh` reads past the cache
    (`gangs.FreshLookup`: a cached Pod that is not a claim's).

    A 404 (the object gone, or its kind not served: JobSet not installed) is cached like an
    object. A kind the API forbids is not asked again for `ttl_seconds`, nor anything after
    `OWNER_READ_FAILURES` other failures in a row. A read waits at most `request_timeout`
    (connect, read seconds): the webhook's reader is given `WEBHOOK_READ_TIMEOUT_SECONDS`.
    Never raises: what it cannot read is None, and logged. Safe to share between threads.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient,
        *,
        ttl_seconds: float = GANG_CACHE_SECONDS,
        max_entries: int = GANG_CACHE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
        request_timeout: tuple[float, float] = OWNER_READ_TIMEOUT_SECONDS,
    ) -> None:
        self._api_client = api_client
        self._request_timeout = request_timeout
        self._ttl = ttl_seconds
        self._max_entries = max(1, max_entries)
        self._clock = clock
        self._lock = threading.Lock()
        # (group, version, kind, namespace, name) → (read at, object or None)
        self._objects: OrderedDict[tuple[str, ...], tuple[float, dict[str, Any] | None]] = (
            OrderedDict()
        )
        self._forbidden: dict[tuple[str, str], float] = {}
        self._failures = 0
        self._paused_until = 0.0

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self._get(namespace, api_version, kind, name, fresh=False)

    def get_fresh(
        self, namespace: str, api_version: str, kind: str, name: str
    ) -> dict[str, Any] | None:
        """As `get`, but not from the cache (`gangs.FreshLookup`): the Pod kept is another of
        the same name. A forbidden kind and a pause after failures still hold."""
        return self._get(namespace, api_version, kind, name, fresh=True)

    def get_checked(
        self, namespace: str, api_version: str, kind: str, name: str
    ) -> dict[str, Any] | None:
        """The object of any kind served under a group and version (a built-in workload's, a
        custom resource's), or None when the API server says it is not there (404, read
        afresh: a cached 404 may be older than the object). Raises `owners.OwnerUnreadable`
        when it cannot say: a failure, a timeout, a forbidden kind, a kind it cannot name."""
        for fresh in (False, True):
            obj = self._get(namespace, api_version, kind, name, fresh=fresh, checked=True)
            if obj is not None:
                return obj
        return None

    def cached(
        self, namespace: str, api_version: str, kind: str, name: str
    ) -> tuple[bool, dict[str, Any] | None]:
        """What the reader keeps of the object, still fresh, without reading it: (whether it
        keeps an answer, the object or None for a 404). For a caller with no time left for a
        read (the admission webhook near its deadline)."""
        group = owners.api_group(api_version)
        version = api_version.rsplit("/", 1)[-1] if isinstance(api_version, str) else ""
        with self._lock:
            cached = self._objects.get((group, version, kind, namespace, name))
        if cached is None or self._clock() - cached[0] >= self._ttl:
            return False, None
        return True, cached[1]

    def said_absent(self, namespace: str, api_version: str, kind: str, name: str) -> bool:
        """Whether the API server's last answer for the object, still fresh in the cache, was
        that it is not there (404): not the same as a read that failed or was not made."""
        group = owners.api_group(api_version)
        version = api_version.rsplit("/", 1)[-1] if isinstance(api_version, str) else ""
        with self._lock:
            cached = self._objects.get((group, version, kind, namespace, name))
        return cached is not None and cached[1] is None and self._clock() - cached[0] < self._ttl

    def _get(
        self,
        namespace: str,
        api_version: str,
        kind: str,
        name: str,
        *,
        fresh: bool,
        checked: bool = False,
    ) -> dict[str, Any] | None:
        group = owners.api_group(api_version)
        version = api_version.rsplit("/", 1)[-1] if isinstance(api_version, str) else ""
        key = (group, version, kind, namespace, name)
        now = self._clock()
        with self._lock:
            cached = self._objects.get(key)
            if not fresh and cached is not None and now - cached[0] < self._ttl:
                self._objects.move_to_end(key)
                return cached[1]
            unreadable = (
                self._forbidden.get((group, kind), -self._ttl) > now - self._ttl
                or now < self._paused_until
            )
        if not unreadable:
            read, obj = self._read(group, version, kind, namespace, name, any_kind=checked)
            unreadable = not read
        if unreadable:
            if checked:
                raise owners.OwnerUnreadable(f"{kind} {namespace}/{name} could not be read")
            return None
        with self._lock:
            self._objects[key] = (now, obj)
            self._objects.move_to_end(key)
            while len(self._objects) > self._max_entries:
                self._objects.popitem(last=False)
        return obj

    def _call(
        self, group: str, version: str, kind: str, namespace: str, name: str, *, any_kind: bool
    ) -> urllib3.BaseHTTPResponse | None:
        """The API's answer; None for a kind this reader does not read (`any_kind`: every
        kind of a group, by its conventional plural, and the core ReplicationController)."""
        kwargs: dict[str, Any] = {
            "_preload_content": False,
            "_request_timeout": self._request_timeout,
        }
        reads = {**OWNER_READS, **WORKLOAD_READS} if any_kind else OWNER_READS
        if (group, kind) in reads:
            _, api, method = reads[(group, kind)]
            return getattr(api(self._api_client), method)(name, namespace, **kwargs)
        plural = gangs.GANG_READS.get((group, kind))
        if plural is None and any_kind:
            # The plural every built-in workload and the custom resources Tally knows use.
            plural = f"{kind.lower()}s"
        if plural is None or not group or not version:
            return None
        return k8s.CustomObjectsApi(self._api_client).get_namespaced_custom_object(
            group, version, namespace, plural, name, **kwargs
        )

    def _read(
        self, group: str, version: str, kind: str, namespace: str, name: str, *, any_kind: bool
    ) -> tuple[bool, dict[str, Any] | None]:
        """(whether the answer may be cached, the object); (False, None) for a kind it cannot
        read when `any_kind` (one it could not say is not there)."""
        what = f"{kind} {namespace}/{name}"
        try:
            response = self._call(group, version, kind, namespace, name, any_kind=any_kind)
            if response is None:
                return not any_kind, None
            obj = response_json(response)
        except ApiException as exc:
            if exc.status == HTTP_NOT_FOUND:
                log.info("%s is gone (or its kind is not served): nothing read from it", what)
                self._failures = 0
                return True, None
            if exc.status == HTTP_FORBIDDEN:
                with self._lock:
                    self._forbidden[(group, kind)] = self._clock()
                log.warning(
                    "cannot read %s (403: %s): %ss are not read until Tally may get %s",
                    what,
                    status_message(exc),
                    kind,
                    _resource_name(group, kind),
                )
                return False, None
            error: Exception = exc
        except (urllib3.exceptions.HTTPError, OSError, StreamError) as exc:
            error = exc
        else:
            self._failures = 0
            return True, obj
        with self._lock:
            self._failures += 1
            if self._failures >= OWNER_READ_FAILURES:
                self._paused_until = self._clock() + self._ttl
        log.warning("cannot read %s: %s: %s", what, type(error).__name__, error)
        return False, None


def read_pods(reader: GangReader, claims: list[dict[str, Any]]) -> None:
    """Read the Pods of `claims` into `reader`'s cache, `OWNER_READ_CONCURRENCY` at a time:
    the API server answers them side by side, and the claims' owners and gangs, followed one
    claim after another, then find their Pods there. Never raises (see `GangReader`)."""
    pods = {where for claim in claims if (where := gangs.claim_pod(claim)) is not None}
    if len(pods) < 2:
        return
    with ThreadPoolExecutor(
        max_workers=min(OWNER_READ_CONCURRENCY, len(pods)), thread_name_prefix="owner-read"
    ) as pool:
        list(pool.map(lambda pod: reader.get(pod[0], gangs.POD_API_VERSION, "Pod", pod[1]), pods))


class RereadSchedule:
    """When the Pod of a claim is read again, once a read left the claim unsettled: its Pod
    unreadable (gone, forbidden, the API server failing), so its job not followed beyond it,
    or the object the Pod names as its gang's not readable yet (`gangs.GangRead`). A Pod that
    declares no gang is settled: its gang is not declared later, so it waits as long as one
    in a gang (each claim of a gangless Pod read every 30 s at first cost a 100,000-GPU fleet
    most of its Pod reads).

    Such a claim is due again `first_seconds` after the read, then each read that leaves it
    unsettled again doubles the wait, up to `max_seconds`; a claim with a new controller (a Pod
    recreated under the same name has a new uid) starts over, as does one this process has
    not read. A claim settled (in a gang, or its Pod in none) waits `max_seconds`: only a
    claim whose job ends at its own Pod is followed again then (`gang_sync.claims_to_follow`).

    The read happens at the claim's next event or list once due, so a gang declared N after
    the claim was first read is found at its first event once N + min(N + first_seconds,
    max_seconds) have passed (30 s, 5 minutes: within 1 minute and 30 s for a gang 1 minute
    late, 15 minutes for one 10 minutes late), where a fixed wait of `first_seconds` read
    every claim of no gang twice a minute, however long it had been in none.

    Claims not read for twice `max_seconds` are forgotten once there are many (the next read
    starts over at `first_seconds`); a deleted claim at once (`forget`).
    """

    def __init__(
        self,
        *,
        first_seconds: float = GANG_REREAD_SECONDS,
        max_seconds: float = GANG_REREAD_MAX_SECONDS,
    ) -> None:
        self._first = first_seconds
        self._max = max(first_seconds, max_seconds)
        # claim uid → (its controller when read, read at, wait, whether that read settled it)
        self._claims: dict[str, tuple[tuple[str, ...] | None, float, float, bool]] = {}
        self._prune_at = GANG_CACHE_ENTRIES

    def due(self, claim: dict[str, Any], now: float) -> bool:
        """Whether `claim`'s Pod is to be read at `now`."""
        metadata = claim.get("metadata") or {}
        uid = metadata.get("uid")
        entry = self._claims.get(uid) if isinstance(uid, str) else None
        if entry is None:
            return True
        owner, read_at, wait, _ = entry
        return owner != _controller_key(metadata) or now - read_at >= wait

    def read(self, claim: dict[str, Any], now: float, *, settled: bool) -> None:
        """`claim`'s Pod was read at `now`; `settled`: what it found needs no other read."""
        metadata = claim.get("metadata") or {}
        uid = metadata.get("uid")
        if not isinstance(uid, str):
            return
        owner = _controller_key(metadata)
        entry = self._claims.get(uid)
        if settled:
            wait = self._max
        elif entry is not None and entry[0] == owner and not entry[3]:
            wait = min(2 * entry[2], self._max)
        else:
            wait = self._first
        self._claims[uid] = (owner, now, wait, settled)
        if len(self._claims) > self._prune_at:
            self._claims = {
                key: value for key, value in self._claims.items() if now - value[1] < 2 * self._max
            }
            self._prune_at = max(GANG_CACHE_ENTRIES, 2 * len(self._claims))

    def forget(self, uid: str) -> None:
        self._claims.pop(uid, None)


def _controller_key(metadata: dict[str, Any]) -> tuple[str, ...] | None:
    """What names a claim's controller for good: its kind, name and uid."""
    reference = owners.controller_reference(metadata.get("ownerReferences"))
    if reference is None:
        return None
    return (str(reference["kind"]), str(reference["name"]), str(reference.get("uid") or ""))


def _resource_name(group: str, kind: str) -> str:
    """The resource RBAC names for `kind` ("replicasets.apps", "jobsets.jobset.x-k8s.io")."""
    if (group, kind) in OWNER_READS:
        return OWNER_READS[(group, kind)][0]
    return f"{gangs.GANG_READS.get((group, kind), kind.lower() + 's')}.{group}".rstrip(".")


class WorkloadOwnerReader:
    """Reads the controller owner of a workload for the workload webhook
    (`quota.workloads.OwnerCheck`) through a `GangReader` (its cache, timeouts and pauses):
    the owner, None when the API server says it is not there, `owners.OwnerUnreadable` when
    it cannot say."""

    def __init__(self, objects: GangReader) -> None:
        self.objects = objects

    def owner(self, namespace: str, reference: owners.OwnerReference) -> owners.Owner | None:
        obj = self.objects.get_checked(
            namespace,
            str(reference.get("apiVersion") or ""),
            str(reference["kind"]),
            str(reference["name"]),
        )
        return owners.Owner.of(obj) if obj is not None else None


class OwnerReader:
    """Reads the owners of claims (`owners.OwnerLookup`) for one list or one watch request.

    Each object is read once, by uid, however many claims it owns, through `objects` (a
    `GangReader`), which then also serves the claims' gangs without reading their Pods again.
    Never raises: what it cannot read leaves a claim's job at the last owner known.
    """

    def __init__(self, api_client: k8s.ApiClient, objects: GangReader | None = None) -> None:
        self.objects = objects if objects is not None else GangReader(api_client)
        self._owners: dict[tuple[str, ...], owners.Owner | None] = {}

    def owner(self, namespace: str, reference: owners.OwnerReference) -> owners.Owner | None:
        api_version = str(reference.get("apiVersion") or "")
        kind, name = str(reference["kind"]), str(reference["name"])
        key = (str(reference.get("uid") or ""), api_version, kind, namespace, name)
        if key not in self._owners:
            obj = self.objects.get(namespace, api_version, kind, name)
            self._owners[key] = owners.Owner.of(obj) if obj is not None else self._absent(key)
        return self._owners[key]

    def _absent(self, key: tuple[str, ...]) -> owners.Owner | None:
        """An owner not read: `owners.GONE` when the API server said it is not there (the 404
        the read just cached), None when it could not say (forbidden, failing, paused)."""
        _, api_version, kind, namespace, name = key
        return owners.GONE if self.objects.said_absent(namespace, api_version, kind, name) else None
