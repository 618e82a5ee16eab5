"""Claims' jobs and gangs: whose claims are followed to their owners, and the gangs their
Pods declare recorded, refreshed and ended."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import (
    Exists,
    Expression,
    OuterRef,
    Value,
)

from db.bulk import AnyOf
from inventory import dra, owners
from inventory.gangs import GangIndex, GangRef, gang_of_claim
from inventory.models import (
    Cluster,
    Gang,
    ResourceClaim,
)
from inventory.sync_state import CLAIMS_PER_FLUSH

log = logging.getLogger(__name__)


def resolve_claim_jobs(
    *, cluster: Cluster, objects: Iterable[dict[str, Any]], lookup: owners.OwnerLookup
) -> dict[str, owners.Resolution]:
    """Follow the owners of the claims among `objects` (raw JSON) through `lookup`, by claim
    uid, for `import_snapshot` and `apply_watch_event`.

    Only the claims `claims_to_follow` names are followed. Writes nothing; the caller runs it
    before its transaction, so that no database transaction waits on the API server.
    """
    return follow_claim_jobs(claims_to_follow(cluster=cluster, objects=objects), lookup=lookup)


def claims_to_follow(
    *, cluster: Cluster, objects: Iterable[dict[str, Any]]
) -> dict[str, tuple[str, Any]]:
    """The claims among `objects` whose owners are to be followed, by uid: (namespace, owner
    references). Those whose controller is a Pod, ReplicaSet or Job, and not those already
    recorded beyond it for the same owner references: their owners are not read again."""
    candidates: dict[str, tuple[str, Any]] = {}
    for obj in objects:
        identity = dra.object_identity(obj)
        if identity is None or identity[0] != "ResourceClaim":
            continue
        metadata = obj["metadata"]
        references = metadata.get("ownerReferences")
        if owners.needs_lookup(references):
            candidates[identity[1]] = (metadata.get("namespace") or "default", references)
    keys = list(candidates)
    for start in range(0, len(keys), CLAIMS_PER_FLUSH):
        for uid, references, job in ResourceClaim.objects.filter(
            AnyOf("uid", keys[start : start + CLAIMS_PER_FLUSH]), cluster=cluster
        ).values_list("uid", "owner_references", "job"):
            if references == candidates[uid][1] and job not in ("", owners.own_job(references)):
                del candidates[uid]
    return candidates


def follow_claim_jobs(
    candidates: Mapping[str, tuple[str, Any]], *, lookup: owners.OwnerLookup
) -> dict[str, owners.Resolution]:
    """The job of each claim of `claims_to_follow`, by uid, read through `lookup`."""
    return {
        uid: owners.resolve_job(
            namespace=namespace,
            owner_references=references,
            lookup=lookup,
            creator_labels=settings.TALLY_CREATED_BY_LABELS,
        )
        for uid, (namespace, references) in candidates.items()
    }


def record_claim_gangs(
    *, cluster: Cluster, gangs: Mapping[str, GangRef | None], at: datetime
) -> None:
    """Point the claims `gangs` names (by uid) at their gangs, created or refreshed at `at`.

    None (the claim's Pod declares no gang, or could not be read) leaves a claim as it was. A
    gang seen here has a live member, so it is open again if it had ended. Claims not yet
    written are skipped: run it after the claims are.
    """
    record_claim_gangs_seen(
        cluster=cluster, found={uid: (ref, at) for uid, ref in gangs.items() if ref is not None}
    )


def record_claim_gangs_seen(
    *, cluster: Cluster, found: Mapping[str, tuple[GangRef, datetime]]
) -> dict[str, int]:
    """`record_claim_gangs`, each claim (by uid, in the order of `found`) seen at its own time:
    a gang is first seen at its first claim's, and last seen as its last claim's says. Returns
    the gang of each claim recorded (by uid; claims not written are left out)."""
    recorded: dict[str, int] = {}
    uids = list(found)
    for start in range(0, len(uids), CLAIMS_PER_FLUSH):
        batch = uids[start : start + CLAIMS_PER_FLUSH]
        claims = {
            uid: (pk, namespace, gang_id)
            for pk, uid, namespace, gang_id in ResourceClaim.objects.filter(
                AnyOf("uid", batch), cluster=cluster
            ).values_list("pk", "uid", "namespace", "gang_id")
        }
        seen: dict[tuple[str, str], _GangSeen] = {}
        for uid in batch:
            if uid not in claims:
                continue
            ref, at = found[uid]
            key = (claims[uid][1], ref.key)
            first = seen[key].first_seen if key in seen else at
            seen[key] = _GangSeen(ref=ref, first_seen=first, last_seen=at)
        gang_ids = _upsert_gangs(cluster=cluster, seen=seen)
        moved: dict[int, list[int]] = defaultdict(list)
        for uid, (pk, namespace, gang_id) in claims.items():
            wanted = recorded[uid] = gang_ids[(namespace, found[uid][0].key)]
            if gang_id != wanted:
                moved[wanted].append(pk)
        for gang_id, claim_ids in moved.items():
            ResourceClaim.objects.filter(AnyOf("pk", claim_ids)).update(gang_id=gang_id)
    return recorded


def record_gang(*, cluster: Cluster, namespace: str, ref: GangRef, at: datetime) -> Gang:
    """The gang `ref` names in `namespace`, created or refreshed (source, size) at `at`.

    For whoever learns of a gang before the sync does (the admission webhook). Concurrent
    calls for one gang leave one row: an upsert on its unique key.
    """
    seen = _GangSeen(ref=ref, first_seen=at, last_seen=at)
    gang_ids = _upsert_gangs(cluster=cluster, seen={(namespace, ref.key): seen})
    return Gang.objects.get(pk=gang_ids[(namespace, ref.key)])


def end_gangs(*, cluster: Cluster, at: datetime, gang_ids: Collection[int] | None = None) -> int:
    """End, at `at`, the open gangs of `cluster` (of `gang_ids`, when given) whose member
    claims are all released; how many. A gang no claim has joined yet (recorded by the webhook
    before the sync saw its first member) has not started, so it does not end here."""
    return end_gangs_at(cluster=cluster, ended_at=Value(at), gang_ids=gang_ids)


def end_gangs_at(
    *, cluster: Cluster, ended_at: Expression, gang_ids: Collection[int] | None
) -> int:
    """`end_gangs`, each gang ending at what `ended_at` gives it."""
    member = ResourceClaim.objects.filter(gang=OuterRef("pk"))
    gangs = Gang.objects.filter(Exists(member), cluster=cluster, ended_at__isnull=True)
    if gang_ids is not None:
        gangs = gangs.filter(AnyOf("pk", gang_ids))
    return gangs.exclude(Exists(member.filter(released_at__isnull=True))).update(ended_at=ended_at)


def gangs_of(cluster: Cluster, claim_uids: Collection[str]) -> dict[str, int]:
    """The gang each of the claims `claim_uids` is stored in, by uid (none: left out)."""
    if not claim_uids:
        return {}
    return dict(
        ResourceClaim.objects.filter(
            AnyOf("uid", claim_uids), cluster=cluster, gang__isnull=False
        ).values_list("uid", "gang_id")
    )


@dataclass(frozen=True)
class _GangSeen:
    """A gang as its claims last declared it, and when it was first and last seen."""

    ref: GangRef
    first_seen: datetime
    last_seen: datetime


def _upsert_gangs(
    *, cluster: Cluster, seen: Mapping[tuple[str, str], _GangSeen]
) -> dict[tuple[str, str], int]:
    """The ids of the gangs `seen` names by (namespace, key), created or refreshed."""
    rows = [
        Gang(
            cluster=cluster,
            namespace=namespace,
            key=key,
            source=gang.ref.source,
            size=gang.ref.size,
            first_seen=gang.first_seen,
            last_seen=gang.last_seen,
            ended_at=None,
        )
        for (namespace, key), gang in seen.items()
    ]
    # INSERT ... ON CONFLICT DO UPDATE: the sync and the webhook may write one gang at once.
    Gang.objects.bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=["cluster", "namespace", "key"],
        update_fields=["source", "size", "last_seen", "ended_at"],
        batch_size=1000,
    )
    return {(row.namespace, row.key): row.pk for row in rows}


def attribute_gangs(*, cluster: Cluster, index: GangIndex, at: datetime) -> None:
    """Give the present claims in the index's namespaces the gangs their Pods there declare."""
    if not index:
        return
    found: dict[str, GangRef | None] = {}
    for uid, namespace, references in ResourceClaim.objects.filter(
        cluster=cluster, released_at__isnull=True, namespace__in=index.namespaces
    ).values_list("uid", "namespace", "owner_references"):
        claim = {"metadata": {"namespace": namespace, "ownerReferences": references}}
        found[uid] = gang_of_claim(claim, index)
    record_claim_gangs(cluster=cluster, gangs=found, at=at)
