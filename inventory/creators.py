"""Who created a claim, and the object it was made for, as the admission webhook saw them: the
inventory keeps them on the claim, and its allocations that charge nobody yet take them. The
webhook's app (quota) learns them and hands them here (`record_claim_creator`): the inventory's
rows are written by the inventory's code only."""

from __future__ import annotations

from inventory.models import Allocation, ResourceClaim


def record_claim_creator(*, claim: ResourceClaim, created_by: str, admitted_job: str) -> bool:
    """Make `claim` (as loaded: its `created_by` and `admitted_job` read) record `created_by`
    and `admitted_job`, so that billing reads them from the inventory; and charge its
    allocations the sync wrote before this reached the claim to them: filled once, where
    still empty, never overwritten. Writes nothing when the claim records them already.
    Returns whether it wrote."""
    if (claim.created_by, claim.admitted_job) == (created_by, admitted_job):
        return False
    ResourceClaim.objects.filter(pk=claim.pk).update(
        created_by=created_by, admitted_job=admitted_job
    )
    if created_by:
        Allocation.objects.filter(claim=claim, username="").update(username=created_by)
    if admitted_job:
        Allocation.objects.filter(claim=claim, job="").update(job=admitted_job)
    return True
