"""Who an allocation's hours are charged to: its job, its person and its team, in one place.

- The **job** (the claim's owning workload, "Kind/name") and the **person** (who created it)
  are fixed on the allocation when it starts (`allocation_attribution`): the job the sync
  followed the claim's owners to, else the one the admission webhook saw; the person the
  claim's owners name (`inventory.owners.claim_creator`). Later knowledge only names the same
  workload better (`refine_allocation_jobs`) or fills in what was still empty
  (`fill_allocation_attribution`: the sync's owners read after a dump's claims;
  `fill_claim_attribution`: quota's record of who created the claim, which reaches it just
  after the sync wrote it); it never overwrites a person or a job that was known.
- The **team** is not kept on the allocation: each part of it is charged to the team that
  owned the claim's namespace over that part (`charge_by_team`, from the dated ownership of
  `teams.ownership`), so that a later move or release never changes who paid for an hour.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Protocol, Self, TypeVar

from db.bulk import AnyOf, update_instances
from inventory.models import Allocation
from teams.ownership import owned_spans


def allocation_attribution(*, job: str, admitted_job: str, creator: str) -> dict[str, str]:
    """The job and person a new allocation of a claim is charged to, fixed when it starts:
    `job` (the claim's, as the sync resolved it), else `admitted_job` (as the admission
    webhook saw it), and `creator` (who the claim's owners say made it; "" for nobody yet)."""
    return {"job": job or admitted_job, "username": creator}


def refine_allocation_jobs(refined: Mapping[int, tuple[str, str]]) -> None:
    """Per claim id, (job before, job now): the claim's allocations charged to the job before
    are charged to the job now. The sync follows a claim's owners further as it learns them
    (`Pod/web-5d9f-x`, then `Deployment/web`), for the same owner references: the same
    workload, named better. An allocation charged to anything else keeps it."""
    refined = {claim_id: jobs for claim_id, jobs in refined.items() if jobs[0] != jobs[1]}
    if not refined:
        return
    changed = []
    for allocation in Allocation.objects.filter(AnyOf("claim_id", refined)).only(
        "pk", "claim", "job"
    ):
        before, after = refined[allocation.claim_id]
        if allocation.job == before:
            allocation.job = after
            changed.append(allocation)
    update_instances(Allocation, changed, ["job"])


def fill_allocation_attribution(
    people: Mapping[int, str], *, jobs: Mapping[int, str] | None = None
) -> None:
    """Per claim id, the person (`people`) and the job (`jobs`) to charge its allocations that
    name none yet: filled once, where still empty, never overwritten (an allocation that names
    someone keeps it: fixed when it started). Empty values fill nothing."""
    people = {claim_id: person for claim_id, person in people.items() if person}
    jobs = {claim_id: job for claim_id, job in (jobs or {}).items() if job}
    for column, values in (("username", people), ("job", jobs)):
        if not values:
            continue
        changed = []
        for allocation in Allocation.objects.filter(AnyOf("claim_id", values), **{column: ""}).only(
            "pk", "claim", column
        ):
            setattr(allocation, column, values[allocation.claim_id])
            changed.append(allocation)
        update_instances(Allocation, changed, [column])


def fill_claim_attribution(claim_id: int, *, person: str, job: str) -> None:
    """`fill_allocation_attribution` for one claim, one UPDATE per value given: quota's record
    of who created the claim and the object it was made for, which reaches the claim just
    after the sync wrote its allocations."""
    if person:
        Allocation.objects.filter(claim_id=claim_id, username="").update(username=person)
    if job:
        Allocation.objects.filter(claim_id=claim_id, job="").update(job=job)


class Charged(Protocol):
    """A part of an allocation, in milliseconds since the epoch, charged to `team_id`."""

    @property
    def claim_namespace(self) -> str: ...

    @property
    def start_ms(self) -> int: ...

    @property
    def end_ms(self) -> int: ...

    @property
    def team_id(self) -> int | None: ...

    def _replace(
        self, *, start_ms: int = ..., end_ms: int = ..., team_id: int | None = ...
    ) -> Self: ...


ChargedT = TypeVar("ChargedT", bound=Charged)


def charge_by_team(
    parts: Iterable[ChargedT], *, start: datetime, end: datetime, ms: Callable[[datetime], int]
) -> list[ChargedT]:
    """`parts` cut where their namespace changed owner within `[start, end)`, each piece
    charged to the team that owned the namespace over it (None where no team did); `ms` turns
    an ownership bound into the parts' milliseconds. Owners change at hour starts, so no hour
    is cut."""
    parts = list(parts)
    spans = owned_spans(namespaces={part.claim_namespace for part in parts}, start=start, end=end)
    charged = []
    for part in parts:
        at = part.start_ms
        for span in spans.get(part.claim_namespace, ()):
            span_start = part.start_ms if span.start is None else ms(span.start)
            span_end = part.end_ms if span.end is None else ms(span.end)
            piece_start, piece_end = max(at, span_start), min(part.end_ms, span_end)
            if piece_end <= piece_start:
                continue
            if piece_start > at:
                charged.append(part._replace(start_ms=at, end_ms=piece_start))
            charged.append(
                part._replace(start_ms=piece_start, end_ms=piece_end, team_id=span.team_id)
            )
            at = piece_end
        if at < part.end_ms:
            charged.append(part._replace(start_ms=at))
    return charged
