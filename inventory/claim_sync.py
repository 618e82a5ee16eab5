"""The claim side of a sync writer: claims and their allocations are written, charged,
attributed, linked to their devices and released."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any, TypeVar

from django.conf import settings
from django.db.models import (
    Q,
)

from db.bulk import AnyOf, AnyRowOf, update_instances, update_rows
from db.copy import insert_values
from inventory import dra, owners
from inventory.attribution import (
    allocation_attribution,
    fill_allocation_attribution,
    refine_allocation_jobs,
)
from inventory.capacity import CapacityError, consumed_fraction
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceKind,
    ResourceClaim,
)
from inventory.signals import claims_changed, usage_closed_until
from inventory.sync_state import ClaimChanges, NewAllocation, WriterState, device_key

log = logging.getLogger(__name__)

# Allocations stored (instances) or about to be (`NewAllocation`): `_link` takes either.
AllocationT = TypeVar("AllocationT", Allocation, NewAllocation)


class ClaimWriter(WriterState):
    """Writes claims and their allocations."""

    def _charge_from_taking(self, allocations: list[AllocationT]) -> list[AllocationT]:
        """Move the start of allocations of devices taken only now from another cluster
        (`retaken`) to when they were taken: the hours before were the other cluster's, its
        allocations billed them. Returns the allocations moved."""
        moved = []
        for allocation in allocations:
            taken = self.retaken.get(device_key(allocation))
            if taken is not None and allocation.start < taken:
                allocation.start = taken
                moved.append(allocation)
        return moved

    # Claims and their allocations.

    def _write_claims(self) -> None:
        if not self.claims:
            return
        by_key = {parsed.key: parsed for parsed in self.claims}
        self.claims = []
        existing = {
            claim.uid: claim
            for claim in ResourceClaim.objects.filter(AnyOf("uid", by_key), cluster=self.cluster)
        }
        # The open allocations' ids by claim and key: only which are still held is decided
        # here, so their other columns (JSON, decimals, times) are not read and decoded.
        open_allocations: dict[int, dict[tuple[str, ...], int]] = defaultdict(dict)
        for pk, claim_id, *key in Allocation.objects.filter(
            AnyOf("claim_id", [c.pk for c in existing.values()]), end__isnull=True
        ).values_list("pk", "claim_id", *_ALLOCATION_KEY_FIELDS):
            open_allocations[claim_id][tuple(key)] = pk
        claims_to_create = []
        # Changed claims, by the columns that changed: only those are written (quota records
        # `created_by` too, for claims the webhook saw).
        claims_to_update: dict[tuple[str, ...], list[ResourceClaim]] = defaultdict(list)
        refined: dict[int, tuple[str, str]] = {}
        jobs: dict[str, str] = {}
        creators: dict[str, str] = {}
        for key, parsed in by_key.items():
            claim = existing.get(key)
            jobs[key] = self._job(parsed, claim)
            fields = _claim_fields(parsed, job=jobs[key])
            creators[key] = owners.claim_creator(
                recorded=claim.created_by if claim is not None else "",
                owner_references=parsed.owner_references,
                labels=parsed.labels,
                resolution=self.jobs.get(key),
                creator_labels=settings.TALLY_CREATED_BY_LABELS,
                controllers=settings.TALLY_WORKLOAD_CONTROLLERS,
            )
            if creators[key]:
                fields["created_by"] = creators[key]
            if claim is None:
                # Rows, not instances: an import makes 30,000 of them.
                claims_to_create.append(
                    {
                        "cluster_id": self.cluster.pk,
                        "uid": key,
                        "first_seen": self._stamp("ResourceClaim", key),
                        **fields,
                    }
                )
            elif changed := [
                *(attr for attr, value in fields.items() if getattr(claim, attr) != value),
                *(("released_at",) if claim.released_at is not None else ()),
            ]:
                self.report.updated["ResourceClaim"] += 1
                if claim.owner_references == parsed.owner_references:
                    refined[claim.pk] = (claim.job, fields["job"])
                for attr, value in fields.items():
                    setattr(claim, attr, value)
                claim.released_at = None
                claims_to_update[tuple(changed)].append(claim)
        for columns, changed_claims in claims_to_update.items():
            update_instances(ResourceClaim, changed_claims, columns)
        refine_allocation_jobs(refined)
        insert_values(ResourceClaim, claims_to_create)
        self.report.created["ResourceClaim"] += len(claims_to_create)
        # The ids of the claims read above are known; only those just created are read.
        claim_ids = {uid: claim.pk for uid, claim in existing.items()}
        if claims_to_create:
            claim_ids.update(
                ResourceClaim.objects.filter(
                    AnyOf("uid", [claim["uid"] for claim in claims_to_create]), cluster=self.cluster
                ).values_list("uid", "pk")
            )
        self.claims_written.update(claim_ids.values())
        new_allocations: list[NewAllocation] = []
        ended: dict[int, datetime] = {}
        for key, parsed in by_key.items():
            claim_id = claim_ids[key]
            at = self._stamp("ResourceClaim", key)
            current = open_allocations.get(claim_id, {})
            # Who is charged, fixed now (see `Allocation`; the team is per hour). The webhook's
            # record of who created a claim seen for the first time reaches it just after
            # this, through quota's handler of `claims_changed`, which fills it in.
            stored = existing.get(key)
            charged = allocation_attribution(
                job=jobs[key],
                admitted_job=stored.admitted_job if stored else "",
                creator=creators[key],
            )
            start = min(parsed.allocated_at, at) if parsed.allocated_at else at
            for result in parsed.results:
                if result.admin_access:
                    continue  # admin access observes a device; it does not hold it
                result_key = (
                    result.request,
                    result.driver,
                    result.pool,
                    result.device,
                    result.share_id,
                )
                if current.pop(result_key, None) is None:
                    new_allocations.append(
                        NewAllocation(
                            cluster_id=self.cluster.pk,
                            claim_id=claim_id,
                            request=result.request,
                            driver=result.driver,
                            pool=result.pool,
                            device_name=result.device,
                            share_id=result.share_id,
                            consumed_capacity=result.consumed_capacity,
                            start=self._charged_start(start),
                            **charged,
                        )
                    )
            ended.update((allocation_id, at) for allocation_id in current.values())
        self._end_allocations(ended)
        self._charge_from_taking(self._link(new_allocations))
        insert_values(Allocation, [allocation.__dict__ for allocation in new_allocations])
        self.report.created["Allocation"] += len(new_allocations)
        # Usage changes from a new allocation's start and from an ended one's end (`at`); a
        # claim changed in nothing else (labels, status, resourceVersion) changes none.
        claim_times = {claim_ids[key]: self._stamp("ResourceClaim", key) for key in by_key}
        spans = [
            (allocation.start, claim_times[allocation.claim_id]) for allocation in new_allocations
        ]
        spans.extend((at, at) for at in sorted(set(ended.values())))
        reattributed = [pk for pk, (before, after) in refined.items() if before != after]
        self._claims_changed(list(claim_ids.values()), spans=spans, reattributed=reattributed)

    def _charged_start(self, start: datetime) -> datetime:
        """When an allocation that the cluster says began at `start` is charged from: where
        it began before the cluster's first sync, from the first sync, or from the end of the
        last closed billing period where that is later. A first import of a running cluster
        holds claims allocated months ago; their hours before Tally knew the cluster were
        never measured, and billing them would rewrite closed periods (late-data adjustments
        from one command)."""
        if start >= self.first_synced_at:
            return start
        if self.charge_floor is None:
            answers: list[datetime] = []
            for _, answer in usage_closed_until.send(sender=Cluster):
                value: object = answer
                if isinstance(value, datetime):
                    answers.append(value)
            closed_until = max(answers, default=None)
            self.charge_floor = (
                (closed_until, "the start of the oldest open billing period")
                if closed_until is not None and closed_until > self.first_synced_at
                else (self.first_synced_at, "the cluster's first sync")
            )
        floor, why = self.charge_floor
        if start >= floor:
            return start
        report = self.report
        report.charged_later += 1
        report.earliest_start = min(report.earliest_start or start, start)
        report.charged_from, report.charged_from_why = floor, why
        return floor

    def _job(self, parsed: dra.ParsedClaim, stored: ResourceClaim | None) -> str:
        """The claim's job: as the caller followed its owners, else as recorded before for the
        same owner references (the sync does not follow those again), else its controller."""
        same_owners = stored is not None and stored.owner_references == parsed.owner_references
        recorded = stored.job if stored is not None and same_owners else ""
        resolution = self.jobs.get(parsed.key)
        if resolution is not None:
            return resolution.over(recorded)
        return recorded or owners.own_job(parsed.owner_references)

    def attribute_claims(self, owner_index: owners.OwnerIndex) -> None:
        """Take the present claims in the index's namespaces as far as its owners lead."""
        if not owner_index:
            return
        changed = []
        refined: dict[int, tuple[str, str]] = {}
        # Claims that name nobody yet, and the person their owners name (a dump's Pods may
        # come after its claims: the claims were written before their owners were known).
        creators: dict[int, str] = {}
        for claim in ResourceClaim.objects.filter(
            cluster=self.cluster, released_at__isnull=True, namespace__in=owner_index.namespaces
        ).only("pk", "namespace", "owner_references", "job", "created_by"):
            resolution = owners.resolve_job(
                namespace=claim.namespace,
                owner_references=claim.owner_references,
                lookup=owner_index,
                creator_labels=settings.TALLY_CREATED_BY_LABELS,
            )
            job = resolution.over(claim.job)
            creator = "" if claim.created_by else resolution.created_by
            if job == claim.job and not creator:
                continue
            if job != claim.job:
                refined[claim.pk] = (claim.job, job)
                claim.job = job
            if creator:
                creators[claim.pk] = creator
                claim.created_by = creator
            changed.append(claim)
        update_instances(ResourceClaim, changed, ["job", "created_by"])
        refine_allocation_jobs(refined)
        fill_allocation_attribution(creators)
        # Claims written by this snapshot were counted and signalled already.
        others = [claim.pk for claim in changed if claim.pk not in self.claims_written]
        self.report.updated["ResourceClaim"] += len(others)
        if refined or creators:
            # Those written by this snapshot are reattributed only now: all their hours too.
            self._claims_changed(others, spans=[], reattributed=list({*refined, *creators}))

    def _claims_changed(
        self,
        claim_ids: list[int],
        *,
        spans: list[tuple[datetime, datetime]],
        reattributed: list[int],
    ) -> None:
        """Send `claims_changed` (see `inventory.signals`) for these claims; batched, keep it
        for `send_claims_changed`."""
        if self.pending is not None:
            self.pending.claim_ids.update(dict.fromkeys(claim_ids))
            self.pending.spans.extend(spans)
            self.pending.reattributed.update(dict.fromkeys(reattributed))
            return
        self._send_claims_changed(claim_ids, spans=spans, reattributed=reattributed)

    def send_claims_changed(self, *, at: datetime) -> None:
        """Send the one `claims_changed`, as of `at`, of what a batched writer wrote so far,
        if anything."""
        if self.pending is None or not self.pending.claim_ids:
            return
        pending, self.pending = self.pending, ClaimChanges()
        self._send_claims_changed(
            list(pending.claim_ids),
            spans=pending.spans,
            reattributed=list(pending.reattributed),
            at=at,
        )

    def _send_claims_changed(
        self,
        claim_ids: list[int],
        *,
        spans: list[tuple[datetime, datetime]],
        reattributed: list[int],
        at: datetime | None = None,
    ) -> None:
        unfilled = {
            pk: (username, job)
            for pk, username, job in Allocation.objects.filter(
                Q(username="") | Q(job=""), AnyOf("claim_id", claim_ids)
            ).values_list("pk", "username", "job")
        }
        claims_changed.send(
            sender=ResourceClaim,
            cluster=self.cluster,
            claim_ids=claim_ids,
            at=at or self.at,
            spans=spans,
            reattributed=reattributed,
            unfilled=unfilled,
        )

    def _end_allocations(self, ends: Mapping[int, datetime]) -> None:
        """End the allocations `ends` names (by id), each at its time there."""
        self.report.gone["Allocation"] += update_rows(
            Allocation, ["end"], ends.items(), where_null=["end"]
        )

    def _link(self, allocations: list[AllocationT]) -> list[AllocationT]:
        """Tie each allocation to its present device, where it is known, and fix what the
        allocation is metered and counted by from the device as it is now (see `Allocation`);
        returns the allocations linked. A device's capacity is read only for the few that
        consumed part of it."""
        wanted = {(a.driver, a.pool, a.device_name) for a in allocations}
        if not wanted:
            return []
        devices = {
            (row["driver"], row["pool"], row["name"]): row
            for row in Device.objects.filter(
                AnyRowOf(("driver", "pool", "name"), wanted),
                cluster=self.cluster,
                gone_at__isnull=True,
            ).values("pk", "driver", "pool", "name", *_METERED_DEVICE_FIELDS)
            if (row["driver"], row["pool"], row["name"]) in wanted
        }
        consuming = {
            devices[key]["pk"]
            for allocation in allocations
            if allocation.consumed_capacity and (key := device_key(allocation)) in devices
        }
        capacities = dict(
            Device.objects.filter(AnyOf("pk", consuming)).values_list("pk", "capacity")
            if consuming
            else ()
        )
        linked = []
        for allocation in allocations:
            device = devices.get(device_key(allocation))
            if device is None:
                continue
            allocation.device_id = device["pk"]
            for attr, value in allocation_metering(
                device=device,
                capacity=capacities.get(device["pk"], {}),
                consumed_capacity=allocation.consumed_capacity,
            ).items():
                setattr(allocation, attr, value)
            linked.append(allocation)
        return linked

    def _link_allocations(self, pools: list[tuple[str, str]]) -> None:
        """Tie open allocations seen before their device to the device, once it is known: they
        take their metering facts from it then."""
        wanted = set(pools)
        unlinked = [
            allocation
            for allocation in Allocation.objects.filter(
                AnyRowOf(("driver", "pool"), pools),
                cluster=self.cluster,
                device__isnull=True,
                end__isnull=True,
            ).only("pk", "claim_id", "start", "driver", "pool", "device_name", "consumed_capacity")
            if (allocation.driver, allocation.pool) in wanted
        ]
        linked = self._link(unlinked)
        update_instances(Allocation, linked, ["device", *METERING_FIELDS])
        update_instances(Allocation, self._charge_from_taking(linked), ["start"])
        if linked:
            # Metered from now on, from their start: all their hours so far change.
            self._claims_changed(
                sorted({allocation.claim_id for allocation in linked}),
                spans=[
                    (allocation.start, self._stamp("Pool", allocation.driver, allocation.pool))
                    for allocation in linked
                ],
                reattributed=[],
            )

    def _release_deleted_claims(self) -> None:
        if not self.deleted_claims:
            return
        keys, self.deleted_claims = self.deleted_claims, []
        self._release_claims(
            {
                pk: self._stamp("ResourceClaim", uid)
                for pk, uid in ResourceClaim.objects.filter(
                    AnyOf("uid", keys), cluster=self.cluster, released_at__isnull=True
                ).values_list("pk", "uid")
            }
        )

    def _release_claims(self, released: Mapping[int, datetime]) -> None:
        """Release the claims `released` names (by id), each at its time there."""
        if not released:
            return
        ending = dict(
            Allocation.objects.filter(AnyOf("claim_id", released), end__isnull=True).values_list(
                "pk", "claim_id"
            )
        )
        self._end_allocations({pk: released[claim_id] for pk, claim_id in ending.items()})
        self.report.gone["ResourceClaim"] += update_rows(
            ResourceClaim, ["released_at"], released.items(), where_null=["released_at"]
        )
        # Usage changes from the hour the allocations ended in (`at`), not before.
        spans = [(at, at) for at in sorted({released[claim_id] for claim_id in ending.values()})]
        self._claims_changed(list(released), spans=spans, reattributed=[])


def _claim_fields(parsed: dra.ParsedClaim, *, job: str) -> dict[str, Any]:
    return {
        "namespace": parsed.namespace,
        "name": parsed.name,
        "api_version": parsed.api_version,
        "labels": parsed.labels,
        "annotations": parsed.annotations,
        "owner_references": parsed.owner_references,
        "job": job,
        "spec": parsed.spec,
        "status": parsed.status,
        "resource_version": parsed.resource_version,
        "created_at": parsed.created_at,
    }


# What an allocation is metered and counted by (`Allocation`), and the device columns they come
# from besides its capacity.
METERING_FIELDS = ("meter_id", "unit", "product_name", "profile", "device_share", "gpu_share")
_METERED_DEVICE_FIELDS = ("meter_id", "unit", "product_name", "profile", "gpu_share", "kind")
_MILLIONTH = Decimal("0.000001")


def allocation_metering(
    *, device: Mapping[str, Any], capacity: Mapping[str, Any], consumed_capacity: Mapping[str, Any]
) -> dict[str, Any]:
    """The `METERING_FIELDS` of an allocation of `device` (its driver and the columns named in
    `_METERED_DEVICE_FIELDS`, by name) that consumed `consumed_capacity` of the device's
    `capacity`: the facts the allocation keeps from when it starts.

    A consumable share (KEP-5075) holds the largest fraction of any capacity it consumed, to the
    millionth; a capacity published with a value that is no quantity holds the whole device,
    as a share that names no capacity does: the allocation still holds it. A device that is not
    an accelerator holds no share."""
    device_share = Decimal(device["gpu_share"])
    share = device_share if device["kind"] != DeviceKind.OTHER else Decimal(0)
    if consumed_capacity:
        try:
            fraction = consumed_fraction(capacity, consumed_capacity, device["driver"])
        except CapacityError:
            fraction = Decimal(1)
        share = (share * fraction).quantize(_MILLIONTH, ROUND_HALF_EVEN)
    return {
        "meter_id": device["meter_id"],
        "unit": device["unit"],
        "product_name": device["product_name"],
        "profile": device["profile"],
        "device_share": device_share,
        "gpu_share": share,
    }


# What tells an allocation of a claim from its others: one per result of its allocation.
_ALLOCATION_KEY_FIELDS = ("request", "driver", "pool", "device_name", "share_id")
