"""Leader election through a coordination.k8s.io/v1 Lease, so that one syncer writes at a time.

The algorithm of client-go's leaderelection, small:

- A candidate reads the Lease. It may take it when there is none (create), when it holds it
  already (renew), when the holder released it (empty `holderIdentity`), or when the record
  has not changed for `leaseDurationSeconds` as measured on this candidate's own monotonic
  clock since it first saw that record, so clock skew between nodes does not matter.
- Every write is conditional: create fails with 409 when another candidate created first,
  and replace carries the `resourceVersion` that was read, so of two candidates racing for
  the same record exactly one wins; the loser sees 409 and stays a candidate.
- The leader renews every `retry_period`. When it has not managed to renew for
  `renew_deadline` (shorter than the lease duration), it stops its work before anyone else
  can take the lease, and the process exits so that it starts over as a candidate.
- On a clean stop the leader releases the Lease (empty holder), and a standby takes over at
  its next try instead of waiting out the lease.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from inventory import kube

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

T = TypeVar("T")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class LeadershipLost(kube.KubeError):
    """The lease could not be renewed in time; the work was stopped."""


def _micro_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default_identity() -> str:
    """The pod's name (POD_NAME from the downward API), else the host name, plus the pid."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{os.getpid()}"


def default_namespace() -> str:
    """POD_NAMESPACE, else the service account's namespace, else `default`."""
    namespace = os.environ.get("POD_NAMESPACE")
    if namespace:
        return namespace
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class LeaderElector:
    """One candidate for the Lease `namespace/name`."""

    def __init__(
        self,
        *,
        api_client: ApiClient,
        name: str,
        namespace: str | None = None,
        identity: str | None = None,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry_period < renew_deadline < lease_duration")
        self.api_client = api_client
        self.name = name
        self.namespace = namespace or default_namespace()
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.clock = clock
        # The record last seen (holder, renewTime, ...) and when, by our own clock.
        self._observed_spec: dict[str, Any] | None = None
        self._observed_at = 0.0
        self._last_renewed: float | None = None

    # One attempt ---------------------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One conditional read-and-write; True when this candidate holds the lease after it."""
        now = datetime.now(UTC)
        lease = kube.read_lease(
            api_client=self.api_client, namespace=self.namespace, name=self.name
        )
        if lease is None:
            created = kube.create_lease(
                api_client=self.api_client,
                namespace=self.namespace,
                body={
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, acquired=True, transitions=0),
                },
            )
            return self._won(created)
        spec = lease.get("spec") or {}
        self._observe(spec)
        holder = spec.get("holderIdentity") or ""
        is_leader = holder == self.identity
        if holder and not is_leader and not self._expired():
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        new_spec = (
            {**spec, **self._spec(now, acquired=False, transitions=transitions)}
            if is_leader
            else self._spec(now, acquired=True, transitions=transitions + 1)
        )
        replaced = kube.replace_lease(
            api_client=self.api_client,
            namespace=self.namespace,
            body={**lease, "spec": new_spec},
        )
        return self._won(replaced)

    def release(self) -> bool:
        """Give the lease up if this candidate holds it, so a standby need not wait it out."""
        lease = kube.read_lease(
            api_client=self.api_client, namespace=self.namespace, name=self.name
        )
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return False
        spec = {
            **lease["spec"],
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "renewTime": _micro_time(datetime.now(UTC)),
        }
        released = kube.replace_lease(
            api_client=self.api_client, namespace=self.namespace, body={**lease, "spec": spec}
        )
        self._last_renewed = None
        return released is not None

    @property
    def is_leader(self) -> bool:
        """Whether the last successful renewal is recent enough to act on."""
        return (
            self._last_renewed is not None
            and self.clock() - self._last_renewed < self.renew_deadline
        )

    def _spec(self, now: datetime, *, acquired: bool, transitions: int) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.lease_duration)),
            "renewTime": _micro_time(now),
            "leaseTransitions": transitions,
        }
        if acquired:
            spec["acquireTime"] = _micro_time(now)
        return spec

    def _observe(self, spec: dict[str, Any]) -> None:
        if spec != self._observed_spec:
            self._observed_spec = dict(spec)
            self._observed_at = self.clock()

    def _expired(self) -> bool:
        duration = float((self._observed_spec or {}).get("leaseDurationSeconds") or 0)
        return self.clock() >= self._observed_at + duration

    def _won(self, lease: dict[str, Any] | None) -> bool:
        if lease is None:
            return False  # another candidate wrote first (409)
        self._observe(lease.get("spec") or {})
        self._last_renewed = self.clock()
        return True

    # The loop ------------------------------------------------------------------------------

    def _attempt(self) -> bool:
        try:
            return self.try_acquire_or_renew()
        except kube.TRANSIENT_ERRORS as exc:
            log.warning("lease %s/%s: %s: %s", self.namespace, self.name, type(exc).__name__, exc)
            return False

    def acquire(self, stop: threading.Event) -> bool:
        """Try every `retry_period` until this candidate leads (True) or `stop` is set."""
        while not stop.is_set():
            if self._attempt():
                log.info("lease %s/%s: %s leads", self.namespace, self.name, self.identity)
                return True
            stop.wait(self.retry_period)
        return False

    def renew_until_lost(self, done: threading.Event, stop: threading.Event) -> bool:
        """Renew every `retry_period` until `done` or `stop` is set (False), or until renewing
        has failed for `renew_deadline` (True: leadership lost)."""
        while not done.wait(self.retry_period):
            if stop.is_set():
                return False
            if not self._attempt() and not self.is_leader:
                log.error(
                    "lease %s/%s: not renewed for %ss; %s stops leading",
                    self.namespace,
                    self.name,
                    self.renew_deadline,
                    self.identity,
                )
                return True
        return False

    def run(self, *, stop: threading.Event, work: Callable[[threading.Event], T]) -> T | None:
        """Wait to lead, then run `work(stop_leading)`; None if `stop` was set before leading.

        `stop_leading` is set within `retry_period` of `stop`, or when the lease is lost, and
        `work` must return soon after. A lost lease raises `LeadershipLost` once `work` has
        returned; otherwise the lease is released, so a standby takes over at once.
        """
        if not self.acquire(stop):
            return None
        stop_leading = threading.Event()
        lost = threading.Event()

        def keep_leading() -> None:
            if self.renew_until_lost(stop_leading, stop):
                lost.set()
            stop_leading.set()

        renewer = threading.Thread(target=keep_leading, name="lease-renew", daemon=True)
        renewer.start()
        try:
            result = work(stop_leading)
        finally:
            stop_leading.set()
            renewer.join()
            if not lost.is_set():
                try:
                    self.release()
                except kube.TRANSIENT_ERRORS as exc:
                    log.warning("lease %s/%s: not released: %s", self.namespace, self.name, exc)
        if lost.is_set():
            raise LeadershipLost(f"lost the lease {self.namespace}/{self.name}")
        return result


def lead(
    *, api_client: ApiClient, name: str, stop: threading.Event, work: Callable[[threading.Event], T]
) -> T | None:
    """Run `work` only while this process holds the Lease `name` (see `LeaderElector.run`)."""
    return LeaderElector(api_client=api_client, name=name).run(stop=stop, work=work)
