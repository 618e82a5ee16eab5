"""The job a claim belongs to: its controller owner, followed up to the workload behind it.

A claim made from a ResourceClaimTemplate is created by the resource-claim controller and
owned by its Pod, and a Pod is rarely what anyone asks usage for: its own controller is
followed (a ReplicaSet to its Deployment, a Job to its CronJob or JobSet) as far as the owners
can be read. Where they cannot (no API server, a Pod already gone, no permission), the job
stays at the last owner known, never less than the claim's own controller.

The owners come from an `OwnerLookup`: the API server (`inventory.kube_owners.OwnerReader`) or the
objects of a dump (`OwnerIndex`). A job is written "Kind/name", as usage rows hold it; owner
references are namespace-local, so it is the claim's namespace that places it.

The same walk says who made the claim's workload: the `tally.dev/created-by` annotation the
workload webhook (`quota.workloads`) writes on workloads and their pod templates, of the
nearest owner that has one, else a label naming a person (for workloads made before Tally).
A claim made from a template is created by a controller, so its own creator names nobody,
and its annotations and labels are the template's, which are anyone's word; `claim_creator`
decides between what the claim webhook recorded and what the walk found. An annotation is
trusted only on the kinds the workload webhook intercepts, which Pods, ReplicaSets and Jobs
(`FOLLOWED_KINDS`) must be among (`TALLY_WORKLOAD_KINDS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Protocol

OwnerReference = dict[str, Any]

# Kinds whose controller is followed, as (API group, kind): the Pod a template's claim belongs
# to, and the objects built-in workloads put between a Pod and what a user wrote. Anything
# else (Deployment, StatefulSet, CronJob, a custom resource) is the job.
FOLLOWED_KINDS = frozenset({("", "Pod"), ("apps", "ReplicaSet"), ("batch", "Job")})
# Owners read for one claim at most: Pod → ReplicaSet → Deployment reads two, as does
# Pod → Job → CronJob; the bound only stops a loop of owner references (nothing forbids one).
MAX_STEPS = 4
# As `billing.UsageHour.job`: a kind (63) and a name (253).
JOB_MAX_LENGTH = 320
# Written by the workload webhook (quota.workloads) on a workload and its pod templates.
CREATED_BY_ANNOTATION = "tally.dev/created-by"


@dataclass(frozen=True)
class Owner:
    """What the job needs of an owning object: its uid and its own controller reference; and
    what its creator needs: its `tally.dev/created-by` annotation and its labels."""

    uid: str
    controller: OwnerReference | None
    created_by: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Owner:
        metadata = obj.get("metadata")
        metadata = metadata if isinstance(metadata, dict) else {}
        uid = metadata.get("uid")
        return cls(
            uid=uid if isinstance(uid, str) else "",
            controller=controller_reference(metadata.get("ownerReferences")),
            created_by=annotated_creator(metadata.get("annotations")),
            labels=string_entries(metadata.get("labels")),
        )


# What a lookup answers for an owner the API server says is not there (404, read afresh): a
# controller reference to nothing. A controller names itself on what it makes, so one that
# names an object that does not exist is made up (issue 40: a controller's service account
# creating a Pod "owned" by a Job that never was, with another person's `created-by`), and
# nothing below it vouches for anyone.
GONE = Owner(uid="", controller=None)


class OwnerUnreadable(Exception):
    """An owner that could not be read: whether it exists is not known (not: it is not there)."""


class OwnerLookup(Protocol):
    """Where the owners of claims are read from."""

    def owner(self, namespace: str, reference: OwnerReference) -> Owner | None:
        """The object `reference` names in `namespace`; None when it cannot be read."""
        ...


@dataclass(frozen=True)
class Resolution:
    """How far a claim's owners were followed: the jobs met, the claim's own controller first,
    and whether the last is as far as they lead (False: an owner could not be read)."""

    chain: tuple[str, ...]
    complete: bool
    # Who made the workload, as the owners read say (see `resolve_job`): the nearest
    # `tally.dev/created-by` annotation, and the fallback the labels give; "" for none.
    annotated_by: str = ""
    labelled_by: str = ""

    @property
    def created_by(self) -> str:
        return self.annotated_by or self.labelled_by

    @property
    def job(self) -> str:
        return self.chain[-1] if self.chain else ""

    def over(self, recorded: str) -> str:
        """The job to record, given the one `recorded` for the same owner references: an
        owner that could not be read now (a Pod since deleted) does not undo one read before.
        """
        if self.complete or not recorded or recorded in self.chain[:-1]:
            return self.job
        return recorded


def api_group(api_version: Any) -> str:
    """The group of an apiVersion: "apps" for "apps/v1", "" for the core "v1"."""
    if not isinstance(api_version, str) or "/" not in api_version:
        return ""
    return api_version.rsplit("/", 1)[0]


def controller_reference(owner_references: Any) -> OwnerReference | None:
    """The owner reference marked `controller` (the API allows one), if it names an object."""
    for reference in owner_references if isinstance(owner_references, list) else ():
        if (
            isinstance(reference, dict)
            and reference.get("controller") is True
            and isinstance(reference.get("kind"), str)
            and isinstance(reference.get("name"), str)
            and reference["kind"]
            and reference["name"]
        ):
            return reference
    return None


def job_of(reference: OwnerReference | None) -> str:
    """The job an owner reference names, "Kind/name"; "" for none."""
    if reference is None:
        return ""
    return f"{reference['kind']}/{reference['name']}"[:JOB_MAX_LENGTH]


def own_job(owner_references: Any) -> str:
    """The job a claim's own owner references give, before any owner is read."""
    return job_of(controller_reference(owner_references))


def is_followed(reference: OwnerReference) -> bool:
    return (api_group(reference.get("apiVersion")), reference.get("kind")) in FOLLOWED_KINDS


def needs_lookup(owner_references: Any) -> bool:
    """Whether reading owners could take a claim's job beyond its own controller."""
    reference = controller_reference(owner_references)
    return reference is not None and is_followed(reference)


def resolve_job(
    *,
    namespace: str,
    owner_references: Any,
    lookup: OwnerLookup,
    creator_labels: Sequence[str] = (),
) -> Resolution:
    """Follow a claim's controller in `namespace` through `FOLLOWED_KINDS` as `lookup` allows.

    The resolution's `created_by` is the `tally.dev/created-by` annotation of the nearest
    owner read that has one (`annotated_by`), else the value of the first of
    `creator_labels` that an owner read carries, the nearest owner's for that label
    (`labelled_by`): the list is in order of trust. Where an owner named on the way does not
    exist (`GONE`), the objects that named it vouch for nobody: the created-by is "".
    """
    reference = controller_reference(owner_references)
    chain = [job_of(reference)] if reference is not None else []
    read: list[Owner] = []
    complete = False
    for _ in range(MAX_STEPS):
        if reference is None or not is_followed(reference):
            complete = True
            break
        owner = lookup.owner(namespace, reference)
        if owner is GONE:
            read.clear()  # what names a made-up owner names no one
            break
        if owner is None or (owner.uid and reference.get("uid") not in (None, "", owner.uid)):
            # Gone, unreadable, or a namesake made after the claim's owner was deleted.
            break
        read.append(owner)
        if owner.controller is None:
            complete = True
            break
        reference = owner.controller
        chain.append(job_of(reference))
    else:
        complete = reference is None or not is_followed(reference)
    return Resolution(
        tuple(chain),
        complete=complete,
        annotated_by=next((owner.created_by for owner in read if owner.created_by), ""),
        labelled_by=labelled_creator([owner.labels for owner in read], creator_labels),
    )


def annotated_creator(annotations: Any) -> str:
    """The `tally.dev/created-by` annotation among `annotations` (a metadata's), or ""."""
    value = annotations.get(CREATED_BY_ANNOTATION) if isinstance(annotations, dict) else None
    return value.strip() if isinstance(value, str) else ""


def labelled_creator(labels: Iterable[Mapping[str, str]], creator_labels: Sequence[str]) -> str:
    """The value of the first of `creator_labels` found in `labels` (objects' labels, nearest
    first), or ""."""
    labels = list(labels)
    for key in creator_labels:
        for object_labels in labels:
            value = object_labels.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()
    return ""


def is_controller(username: str, controllers: Iterable[str]) -> bool:
    """Whether `username` is one of `controllers` (shell patterns: `system:serviceaccount:
    kube-system:*`): a controller acts for whoever made the object it acts on, so it is
    never the person to charge, and may copy any creator onto what it makes."""
    return any(fnmatchcase(username, pattern) for pattern in controllers)


def claim_creator(
    *,
    recorded: str,
    owner_references: Any,
    labels: Any,
    resolution: Resolution | None,
    creator_labels: Sequence[str],
    controllers: Iterable[str],
) -> str:
    """The person to charge for a claim, "" when nothing names one.

    First what Tally vouches for: who the claim webhook `recorded` as creating it, unless a
    controller (a claim made from a template is created by the resource-claim controller);
    then the annotation its owners carry, which the workload webhook wrote on them (the
    Pod's is the nearest). Then the labels among `creator_labels`, for workloads made before
    Tally: its owners'. The claim's own `tally.dev/created-by` is never read, nor, for a claim
    a Pod, ReplicaSet or Job owns, its own labels: no webhook writes them on a claim, and one
    made from a template copies them from the ResourceClaimTemplate, which anyone who may
    write templates could make name anyone. So a template's claim whose Pod cannot be read
    names nobody; the labels of a claim nothing owns (made by hand before Tally) still count.
    """
    if recorded and not is_controller(recorded, controllers):
        return recorded
    if resolution is not None and resolution.created_by:
        return resolution.created_by
    if needs_lookup(owner_references):
        return ""
    return labelled_creator([string_entries(labels)], creator_labels)


def string_entries(mapping: Any) -> dict[str, str]:
    """The string entries of a metadata mapping (labels), anything else left out."""
    if not isinstance(mapping, dict):
        return {}
    return {k: v for k, v in mapping.items() if isinstance(k, str) and isinstance(v, str)}


class OwnerIndex:
    """The Pods, ReplicaSets and Jobs among a dump's objects, so its claims resolve offline."""

    def __init__(self) -> None:
        self._owners: dict[tuple[str, str, str, str], Owner] = {}

    def __len__(self) -> int:
        return len(self._owners)

    @property
    def namespaces(self) -> set[str]:
        return {namespace for _, _, namespace, _ in self._owners}

    def add(self, obj: Any) -> bool:
        """Keep `obj` if it is of a followed kind; whether it was."""
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            return False
        group, kind = api_group(obj.get("apiVersion")), obj.get("kind")
        name = obj["metadata"].get("name")
        if (group, kind) not in FOLLOWED_KINDS or not isinstance(name, str) or not name:
            return False
        namespace = obj["metadata"].get("namespace") or "default"
        self._owners[(group, str(kind), namespace, name)] = Owner.of(obj)
        return True

    def owner(self, namespace: str, reference: OwnerReference) -> Owner | None:
        group = api_group(reference.get("apiVersion"))
        return self._owners.get((group, reference["kind"], namespace, reference["name"]))
