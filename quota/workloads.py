"""Who made a workload: the `tally.dev/created-by` annotation the workload webhook writes.

A claim made from a ResourceClaimTemplate is created by the resource-claim controller, for a
Pod made by another controller, for a Deployment, Job or JobSet a person wrote: the claim's
own creator names nobody. So the mutating webhook on the creation of workloads (the view in
`quota.workload_views`) writes the requesting user on the workload and on every pod template
in it; the Pods made from those templates carry it, and the inventory finds it on a claim's
owners (`inventory.owners.resolve_job`).

Controllers (`TALLY_WORKLOAD_CONTROLLERS`, shell patterns on the username) act for the person
who made what they act on: they never become the creator, may copy any creator onto what they
make (a Job from a CronJob), and what they make has its templates filled from its own
annotation. But a controller copies whatever it was given: a creator is only worth what the
webhook vouched for where it was copied from. So a controller keeps or copies one only on an
object whose controller owner is of a kind the webhook records (the configured kinds: a Pod
of a ReplicaSet, a Job of a CronJob); on what it makes for anything else (an Argo Workflow, a
Katib Trial), or for nothing, a creator is not kept, and one it adds by an UPDATE is undone.
And that owner must exist: it is read from the API server (`owners`, through the claim
webhook's cached reader), and what the controller makes carries the creator the owner records,
whatever the controller sent; an owner that is not there (a made-up reference, a namesake of
another uid) or cannot be read vouches for nobody. A controller's UPDATE keeps the creator
recorded before and adds none.
Anyone else is the creator of what they create, whatever it says: a `tally.dev/created-by`
naming someone else is replaced by the requester, with a warning. An UPDATE by anyone but a
controller may not change a creator recorded before: it is put back (with a warning when
another was sent, quietly when it was left out); nor does an UPDATE add one where there was
none, since that would change a pod template and so roll a Deployment out.

Every kind whose pod templates a trusted controller turns into Pods must be among the
configured kinds (ReplicaSet, DaemonSet, ReplicationController, ControllerRevision too): one
left out could be written by anyone, and the Pods made from it would carry what they wrote.

Everything here is plain data in, a JSON Patch (RFC 6902) and warnings out: nothing raises
on what a review holds, since the webhook fails open (`failurePolicy: Ignore`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jsonpatch import JsonPointer

from inventory.owners import (
    CREATED_BY_ANNOTATION,
    OwnerLookup,
    OwnerUnreadable,
    api_group,
    controller_reference,
    is_controller,
)

# The result of one review, as `core.metrics.WEBHOOK_DECISIONS` counts it.
UNCHANGED, ANNOTATED, REPLACED = "allowed", "annotated", "replaced"

# Where each kind keeps the templates of what it makes, as paths to their annotations ("*":
# every item of a list, or every value of a mapping, there). A kind configured in
# TALLY_WORKLOAD_KINDS but not listed here is taken to have a pod template at spec.template,
# the built-in controllers' convention. A Pod has none.
POD_TEMPLATE = "spec.template.metadata.annotations"
TEMPLATE_ANNOTATIONS: dict[str, tuple[str, ...]] = {
    "Pod": (),
    "ReplicationController": (POD_TEMPLATE,),
    "apps/Deployment": (POD_TEMPLATE,),
    "apps/StatefulSet": (POD_TEMPLATE,),
    "apps/ReplicaSet": (POD_TEMPLATE,),
    "apps/DaemonSet": (POD_TEMPLATE,),
    # A StatefulSet's Pods are made from the revision its status names, not always from its
    # spec: a revision is a pod template too ("data" holds a patch replacing spec.template).
    "apps/ControllerRevision": ("data.spec.template.metadata.annotations",),
    "batch/Job": (POD_TEMPLATE,),
    # The Job's own metadata too: the owner walk reads Jobs.
    "batch/CronJob": (
        "spec.jobTemplate.metadata.annotations",
        "spec.jobTemplate.spec.template.metadata.annotations",
    ),
    "jobset.x-k8s.io/JobSet": (
        "spec.replicatedJobs.*.template.metadata.annotations",
        "spec.replicatedJobs.*.template.spec.template.metadata.annotations",
    ),
    "leaderworkerset.x-k8s.io/LeaderWorkerSet": (
        "spec.leaderWorkerTemplate.leaderTemplate.metadata.annotations",
        "spec.leaderWorkerTemplate.workerTemplate.metadata.annotations",
    ),
    "kubeflow.org/PyTorchJob": ("spec.pytorchReplicaSpecs.*.template.metadata.annotations",),
    "kubeflow.org/TFJob": ("spec.tfReplicaSpecs.*.template.metadata.annotations",),
    "kubeflow.org/MPIJob": ("spec.mpiReplicaSpecs.*.template.metadata.annotations",),
    # Kubeflow Trainer copies `spec.annotations` onto the JobSet and Jobs it makes.
    "trainer.kubeflow.org/TrainJob": ("spec.annotations",),
    "ray.io/RayCluster": (
        "spec.headGroupSpec.template.metadata.annotations",
        "spec.workerGroupSpecs.*.template.metadata.annotations",
    ),
    "ray.io/RayJob": (
        "spec.rayClusterSpec.headGroupSpec.template.metadata.annotations",
        "spec.rayClusterSpec.workerGroupSpecs.*.template.metadata.annotations",
        "spec.submitterPodTemplate.metadata.annotations",
    ),
}
# Kinds whose objects a controller makes keep their templates as made: the controller finds
# them again by comparing templates (a Deployment its ReplicaSet, a StatefulSet its revision),
# so a template the webhook changed would have it make another, and again. The Pods of such a
# ReplicaSet find the creator on the ReplicaSet's own metadata (`inventory.owners`).
KEPT_AS_MADE = frozenset({"apps/ReplicaSet", "apps/ControllerRevision"})
# Parts of a path that a patch may create when an object leaves them out; any other part
# missing means there is no template there.
_CREATABLE = frozenset({"metadata", "annotations"})
_TOP = "metadata.annotations"

Part = str | int


@dataclass(frozen=True, kw_only=True)
class Attribution:
    """What the webhook answers about one review: the patch to apply (empty: none), the
    warnings for the requester, and the result to count."""

    patch: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    result: str = UNCHANGED


@dataclass(frozen=True)
class _Place:
    """One annotations mapping of an object: its path, how many of its leading parts the
    object has (all of them: the mapping exists), and the creator written there."""

    parts: tuple[Part, ...]
    present: int
    # None: no creator there; a non-string is no creator anyone could mean.
    value: Any = field(compare=False)

    @property
    def exists(self) -> bool:
        return self.present == len(self.parts)


def kind_key(kind: Any) -> str:
    """A review's `request.kind` as TALLY_WORKLOAD_KINDS names it: "Pod", "apps/Deployment"."""
    if not isinstance(kind, dict) or not isinstance(kind.get("kind"), str):
        return ""
    group = kind.get("group")
    return f"{group}/{kind['kind']}" if isinstance(group, str) and group else kind["kind"]


def owner_key(obj: dict[str, Any]) -> str:
    """The kind of `obj`'s controller owner as TALLY_WORKLOAD_KINDS names it; "" for none."""
    metadata = obj.get("metadata")
    reference = controller_reference(metadata.get("ownerReferences") if metadata else None)
    if reference is None:
        return ""
    group = api_group(reference.get("apiVersion"))
    return f"{group}/{reference['kind']}" if group else reference["kind"]


def attribute(
    *,
    request: dict[str, Any],
    kinds: Collection[str],
    controllers: Iterable[str],
    owners: OwnerLookup | None = None,
) -> Attribution:
    """The creator annotations a review's object needs (see the module's docstring).

    Only CREATEs and UPDATEs of `kinds` (not of their subresources) are touched. Never
    raises on what `request` holds: what cannot be read is a warning and no patch. `owners`
    reads the controller owner of what a controller creates (None: Tally reads no API
    server, and a controller's creator is trusted by its owner's kind alone).
    """
    operation = request.get("operation")
    key = kind_key(request.get("kind"))
    if operation not in ("CREATE", "UPDATE") or key not in kinds or request.get("subResource"):
        return Attribution()
    obj = request.get("object")
    if not isinstance(obj, dict):
        return _unreadable("request.object is not an object")
    if obj.get("metadata") is not None and not isinstance(obj["metadata"], dict):
        return _unreadable("request.object.metadata is not a mapping")
    user_info = request.get("userInfo")
    username = user_info.get("username") if isinstance(user_info, dict) else None
    if not isinstance(username, str) or not username:
        return _unreadable("request.userInfo.username is missing")
    paths = (_TOP, *TEMPLATE_ANNOTATIONS.get(key, (POD_TEMPLATE,)))
    places = [place for path in paths for place in _places(obj, path)]
    malformed = [place for place in places if place.present < 0]
    if malformed:
        where = _dotted(malformed[0].parts)
        return _unreadable(f"request.object.{where} is not a mapping")
    top = places[0]
    sent_old = request.get("oldObject")
    old: dict[str, Any] = sent_old if isinstance(sent_old, dict) else {}
    if is_controller(username, controllers):
        owner = owner_key(obj)
        if owner not in kinds:
            # Copied from an object the webhook never saw, which anyone could have written.
            return _unvouched(places, old, operation=operation, username=username, owner=owner)
        if operation == "UPDATE":
            # A controller keeps what was recorded; it adds none and changes none.
            return _controller_update(places, old, username=username)
        if owners is not None:
            creator = _owners_creator(obj, owners, namespace=request.get("namespace"))
            if isinstance(creator, _NoOwner):
                return _unowned(places, username=username, why=creator.why)
            return _owners_creator_carried(
                [top] if key in KEPT_AS_MADE else places, creator=creator, username=username
            )
        if key in KEPT_AS_MADE or not isinstance(top.value, str) or not top.value:
            return Attribution()
        # What a controller makes carries its own creator into its templates.
        wanted: dict[_Place, str | None] = {
            place: top.value for place in places if place.value is None
        }
        return _patched(wanted, warnings=[], result=ANNOTATED)
    if operation == "CREATE":
        wanted = {place: username for place in places if place.value != username}
        forged = sorted({str(p.value) for p in wanted if p.value not in (None, "")})
        warnings = [
            f"{CREATED_BY_ANNOTATION} names the user who creates the object: set to "
            f"{username!r}, not {claimed!r}"
            for claimed in forged
        ]
        return _patched(wanted, warnings=warnings, result=REPLACED if forged else ANNOTATED)
    wanted = _kept_on_update(places, old, written_by=username)
    # Left out (a server-side apply drops what the webhook added for its field manager): put
    # back quietly. Changed: said, and counted as replaced.
    changed = [place for place in wanted if place.value not in (None, "")]
    warnings = (
        [f"{CREATED_BY_ANNOTATION} is recorded by Tally: the value sent was not kept"]
        if changed
        else []
    )
    return _patched(wanted, warnings=warnings, result=REPLACED if changed else ANNOTATED)


@dataclass(frozen=True)
class _NoOwner:
    """A controller's object whose controller owner is not there, or could not be read."""

    why: str


def _owners_creator(obj: dict[str, Any], owners: OwnerLookup, *, namespace: Any) -> str | _NoOwner:
    """The creator the controller owner of `obj` records ("" for none), read through
    `owners` in the review's `namespace` (owner references are namespace-local): what a
    controller may carry onto what it makes. `_NoOwner` when the owner is not there (never
    was, or another object of its name: a different uid) or cannot be read; the annotation
    the controller sent is then nobody's word."""
    metadata = obj.get("metadata") or {}
    reference = controller_reference(metadata.get("ownerReferences"))
    assert reference is not None  # its kind is among the configured ones
    where = namespace or metadata.get("namespace")
    what = f"{reference['kind']} {where}/{reference['name']}"
    try:
        found = owners.owner(str(where or "default"), reference)
    except OwnerUnreadable:
        return _NoOwner(f"its owner {what} could not be read")
    if found is None or (found.uid and reference.get("uid") not in (None, "", found.uid)):
        return _NoOwner(f"its owner {what} does not exist")
    return found.created_by


def _owners_creator_carried(places: list[_Place], *, creator: str, username: str) -> Attribution:
    """A controller's new object carries the creator its owner records (`creator`, "" for
    none: then none) at `places`: one it sent that differs is replaced, with a warning."""
    wanted: dict[_Place, str | None] = {
        place: creator or None for place in places if place.value != (creator or None)
    }
    forged = sorted({str(place.value) for place in wanted if place.value not in (None, "")})
    warnings = [
        f"{CREATED_BY_ANNOTATION} is the creator the owner records: set to {creator!r}, "
        f"not {claimed!r} as {username} sent"
        for claimed in forged
    ]
    return _patched(wanted, warnings=warnings, result=REPLACED if forged else ANNOTATED)


def _unowned(places: list[_Place], *, username: str, why: str) -> Attribution:
    """A controller's new object whose owner is not there or could not be read: no creator
    it brings is kept."""
    wanted: dict[_Place, str | None] = {p: None for p in places if p.value is not None}
    if not wanted:
        return Attribution()
    warning = (
        f"{CREATED_BY_ANNOTATION} was not kept: {username} made this object, but {why}, so "
        "it cannot vouch for the creator it copied"
    )
    return _patched(wanted, warnings=[warning], result=REPLACED)


def _controller_update(places: list[_Place], old: dict[str, Any], *, username: str) -> Attribution:
    """A controller's UPDATE: a creator recorded before stays, none is added."""
    wanted = _kept_on_update(places, old, written_by=None)
    if not wanted:
        return Attribution()
    warning = (
        f"{CREATED_BY_ANNOTATION} is recorded by Tally: {username} may not change it, the "
        "value sent was not kept"
    )
    return _patched(wanted, warnings=[warning], result=REPLACED)


def _kept_on_update(
    places: list[_Place], old: dict[str, Any], *, written_by: str | None
) -> dict[_Place, str | None]:
    """What an UPDATE's creators become: one recorded before stays; one written now names
    `written_by`, or is removed when nobody can be named (None)."""
    wanted: dict[_Place, str | None] = {}
    for place in places:
        before = _value_at(old, place.parts)
        if place.value == before:
            continue
        if isinstance(before, str) and before:
            wanted[place] = before
        elif written_by is None:
            if place.value is not None:
                wanted[place] = None
        elif place.value != written_by:
            wanted[place] = written_by
    return wanted


def _unvouched(
    places: list[_Place], old: dict[str, Any], *, operation: str, username: str, owner: str
) -> Attribution:
    """A controller's request for an object whose controller owner the webhook does not
    record (`owner`, "" for none): no creator it brings is kept, one recorded before stays."""
    if operation == "CREATE":
        wanted: dict[_Place, str | None] = {
            place: None for place in places if place.value is not None
        }
    else:
        wanted = _kept_on_update(places, old, written_by=None)
    if not wanted:
        return Attribution()
    made_for = f"a kind Tally does not record ({owner})" if owner else "no owner"
    warning = (
        f"{CREATED_BY_ANNOTATION} was not kept: {username} made this object for {made_for}, "
        "so it cannot vouch for the creator it copied"
    )
    return _patched(wanted, warnings=[warning], result=REPLACED)


def _unreadable(problem: str) -> Attribution:
    return Attribution(warnings=[f"Tally did not record who created this object: {problem}"])


def _patched(wanted: dict[_Place, str | None], *, warnings: list[str], result: str) -> Attribution:
    if not wanted:
        return Attribution(warnings=warnings)
    return Attribution(
        patch=[_set(place, value) for place, value in wanted.items()],
        warnings=warnings,
        result=result,
    )


def _set(place: _Place, value: str | None) -> dict[str, Any]:
    """The operation that writes `value` as the creator at `place` (None: removes the one
    there): into the mapping when it exists, else as the first missing part, holding the rest
    ("add" replaces a null)."""
    if value is None:
        path = JsonPointer.from_parts([*place.parts, CREATED_BY_ANNOTATION]).path
        return {"op": "remove", "path": path}
    if place.exists:
        parts: tuple[Part, ...] = (*place.parts, CREATED_BY_ANNOTATION)
        written: Any = value
    else:
        parts = place.parts[: place.present + 1]
        written = {CREATED_BY_ANNOTATION: value}
        for part in reversed(place.parts[place.present + 1 :]):
            written = {part: written}
    return {"op": "add", "path": JsonPointer.from_parts(parts).path, "value": written}


def _places(obj: dict[str, Any], path: str) -> Iterator[_Place]:
    """The annotations mappings `path` names in `obj`. A place whose metadata or annotations
    are there but no mapping has `present` -1 (the object is malformed)."""
    steps = path.split(".")

    def walk(node: Any, index: int, parts: tuple[Part, ...]) -> Iterator[_Place]:
        if index == len(steps):
            # A mapping: the last step, "annotations", was checked on the way in.
            yield _Place(parts, len(parts), _creator(node))
            return
        step = steps[index]
        if step == "*":
            if isinstance(node, list):
                for position, item in enumerate(node):
                    yield from walk(item, index + 1, (*parts, position))
            elif isinstance(node, dict):
                for name, item in node.items():
                    yield from walk(item, index + 1, (*parts, name))
            return
        child = node.get(step) if isinstance(node, dict) else None
        if child is None:
            if isinstance(node, dict) and all(s in _CREATABLE for s in steps[index:]):
                yield _Place((*parts, *steps[index:]), len(parts), None)
            return
        if step in _CREATABLE and not isinstance(child, dict):
            yield _Place((*parts, step), -1, None)
            return
        yield from walk(child, index + 1, (*parts, step))

    yield from walk(obj, 0, ())


def _creator(annotations: dict[str, Any]) -> Any:
    return annotations.get(CREATED_BY_ANNOTATION)


def _value_at(obj: Any, parts: tuple[Part, ...]) -> Any:
    """The creator in the annotations at `parts` of `obj` (an UPDATE's old object), or None."""
    node = obj
    for part in parts:
        if isinstance(node, dict) and isinstance(part, str):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return None
    return _creator(node) if isinstance(node, dict) else None


def _dotted(parts: tuple[Part, ...]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts)[1:]
