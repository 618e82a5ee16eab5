"""The gang of a claim: the pods that must run together, as the cluster declares them.

Admitting one claim of a multi-pod job alone can leave half a job holding devices while the
other half waits (issue 20). Which pods belong together, and how many must run at once, is
declared by the object that made them or by the scheduler's own API; this module reads it
from a Pod and those objects, never guessing from names:

- the Workload API (KEP-4671, `scheduling.k8s.io`): a Pod's `spec.workloadRef` names a
  v1alpha1 `Workload` and one of its `spec.podGroups[]`, whose `policy.gang.minCount` is the
  gang (`podGroupReplicaKey` splits it into independent copies); from Kubernetes 1.36
  (KEP-5832) a Pod's `spec.schedulingGroup.podGroupName` names a standalone `PodGroup`
  (v1alpha2, v1beta1 from 1.37) with `spec.schedulingPolicy.gang.minCount`;
- JobSet (`jobset.x-k8s.io/v1alpha2`): the Pod label `jobset.sigs.k8s.io/jobset-name`
  (api/jobset/v1alpha2/jobset_types.go) and the Pod's controller, a `batch` Job the JobSet
  makes (`<jobset>-<replicated job>-<index>`, the controller's GenJobName), which gives its
  role; the whole JobSet is one gang of, per replicated job, `replicas` Jobs of
  `parallelism` Pods;
- LeaderWorkerSet (`leaderworkerset.x-k8s.io/v1`): labels `leaderworkerset.sigs.k8s.io/name`,
  `.../group-index` and `.../worker-index` (0: the leader), annotation `.../size` (the LWS
  "Labels, Annotations and Environment Variables" reference); each group (a leader and its
  workers, `spec.leaderWorkerTemplate.size` Pods) is one gang;
- Kueue plain pod groups: label `kueue.x-k8s.io/pod-group-name` and annotation
  `kueue.x-k8s.io/pod-group-total-count` (Kueue's "Labels and Annotations" reference);
- Volcano: annotation `scheduling.k8s.io/group-name` or `scheduling.volcano.sh/group-name`
  (volcano.sh/apis scheduling/v1beta1 labels.go) naming a `scheduling.volcano.sh/v1beta1`
  `PodGroup`, whose `spec.minMember` is the gang;
- the Kubeflow training operators (`kubeflow.org`: PyTorchJob, TFJob, MPIJob, XGBoostJob,
  PaddleJob, JAXJob): the Pod's controller reference, else the labels
  `training.kubeflow.org/job-name` and `training.kubeflow.org/operator-name`
  (kubeflow/common constants.go); the gang is `spec.runPolicy.schedulingPolicy.minAvailable`,
  else every replica of `spec.<kind>ReplicaSpecs`.

Who may declare a gang. Pod labels, annotations and spec are written by whoever creates the
Pod. A JobSet member must be a Pod made by one of the JobSet's Jobs (its controller reference,
which the Job controller writes), and a Pod a training job controls is in that job's gang
whatever its labels: labels alone do not put a Pod made by hand in another job's gang, to draw
that gang's hold. The other sources are self-declared, as the schedulers that act on them
trust them: the Workload API's references, LeaderWorkerSet's labels and size annotation,
Kueue's group label and count, Volcano's group annotation and the training operators' labels
(for a Pod no training job controls). Anyone who may create Pods in a namespace can join or
make such a gang there; gangs are per namespace, so that reaches only the namespace's own.

Objects come from a `GangLookup`: the API server (`inventory.kube_owners.GangReader`, cached;
it lives there because only the `inventory.kube*` modules talk to the API; it also reads the
ResourceClaimTemplates of a gang's roles, `GANG_READS`) or the objects of a dump (`GangIndex`).
Everything read is untrusted: a field of the wrong type, a count that is negative, zero or
absurd (over `MAX_GANG_SIZE`), a name no API server would accept, or a loop gives no gang
(None) rather than an exception, so a claim without a trustworthy gang is decided alone.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from inventory.owners import api_group, string_entries

SOURCES = ("workload", "jobset", "leaderworkerset", "kueue", "volcano", "kubeflow")
# As `Gang.key`: a kind (63) and a name (253), with room for a pod group and replica key.
GANG_KEY_MAX_LENGTH = 320
# More pods than any cluster runs (Kubernetes is tested to 150,000): a count above it is
# garbage, and holding devices for it would block a team for nothing.
MAX_GANG_SIZE = 1_000_000
# A DNS subdomain (object names) is at most 253 characters, a label value at most 63.
NAME_MAX_LENGTH = 253
LABEL_VALUE_MAX_LENGTH = 63
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")

POD_API_VERSION = "v1"
# KEP-4671 / KEP-5832, scheduling.k8s.io.
WORKLOAD_API_VERSION = "scheduling.k8s.io/v1alpha1"
POD_GROUP_API_VERSIONS = ("scheduling.k8s.io/v1beta1", "scheduling.k8s.io/v1alpha2")
# JobSet, api/jobset/v1alpha2/jobset_types.go.
JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
# LeaderWorkerSet, site/content/en/docs/reference/labels-annotations-and-environment-variables.
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
# Kueue, site/content/en/docs/reference/labels-and-annotations.md (plain pod groups).
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
# Volcano, volcano.sh/apis pkg/apis/scheduling/v1beta1/labels.go: KubeGroupNameAnnotationKey
# and VolcanoGroupNameAnnotationKey.
VOLCANO_API_VERSION = "scheduling.volcano.sh/v1beta1"
VOLCANO_GROUP_ANNOTATIONS = ("scheduling.k8s.io/group-name", "scheduling.volcano.sh/group-name")
# Kubeflow, kubeflow/common pkg/apis/common/v1/constants.go.
KUBEFLOW_GROUP = "kubeflow.org"
KUBEFLOW_API_VERSION = "kubeflow.org/v1"
KUBEFLOW_JOB_NAME_LABEL = "training.kubeflow.org/job-name"
KUBEFLOW_OPERATOR_LABEL = "training.kubeflow.org/operator-name"
KUBEFLOW_REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
# Kind → the spec field holding its replica specs (the operators' *_types.go json tags).
KUBEFLOW_REPLICA_SPECS = {
    "PyTorchJob": "pytorchReplicaSpecs",
    "TFJob": "tfReplicaSpecs",
    "MPIJob": "mpiReplicaSpecs",
    "XGBoostJob": "xgbReplicaSpecs",
    "PaddleJob": "paddleReplicaSpecs",
    "JAXJob": "jaxReplicaSpecs",
}
# The operator-name label each controller writes ("pytorchjob-controller", ...).
KUBEFLOW_OPERATORS = {f"{kind.lower()}-controller": kind for kind in KUBEFLOW_REPLICA_SPECS}

# (API group, kind) → plural, for reading them: the kinds a gang is declared by, besides Pods.
GANG_KINDS: dict[tuple[str, str], str] = {
    ("scheduling.k8s.io", "Workload"): "workloads",
    ("scheduling.k8s.io", "PodGroup"): "podgroups",
    ("jobset.x-k8s.io", "JobSet"): "jobsets",
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"): "leaderworkersets",
    ("scheduling.volcano.sh", "PodGroup"): "podgroups",
    **{(KUBEFLOW_GROUP, kind): f"{kind.lower()}s" for kind in KUBEFLOW_REPLICA_SPECS},
}
# The kind a gang's pods make their claims from (`GangRole.claim_templates`): read, where the
# cluster lets Tally, to weigh what the whole gang takes rather than this claim's demand times
# the gang's size.
CLAIM_TEMPLATE_KIND = ("resource.k8s.io", "ResourceClaimTemplate")
# Every kind read one object at a time to find a gang and what it takes, besides Pods and their
# owners: what the API reader reads and what the deployment's RBAC must let it get.
GANG_READS: dict[tuple[str, str], str] = {
    **GANG_KINDS,
    CLAIM_TEMPLATE_KIND: "resourceclaimtemplates",
}


@dataclass(frozen=True)
class GangRole:
    """One role of a gang: a replicated job, a replica type, the leader or the workers."""

    name: str  # "" when the gang has one role
    pods: int  # pods of this role the gang needs at once (≥ 1)
    claim_templates: tuple[str, ...]  # ResourceClaimTemplates each such pod uses; () unknown


@dataclass(frozen=True)
class GangRef:
    """A gang as its declaring object says.

    `key` is unique in the namespace ("JobSet/train", "LeaderWorkerSet/lws#0"), at most
    `GANG_KEY_MAX_LENGTH` characters. `size` (1..`MAX_GANG_SIZE`) pods must run together.
    `roles`, when the source says them, add up to `size` pods; () when it gives only a size.
    `role` is the role of the Pod asked about ("" unknown or single-role).
    """

    source: str
    key: str
    size: int
    roles: tuple[GangRole, ...]
    role: str


class GangLookup(Protocol):
    """Where Pods and the objects that declare gangs are read from."""

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        """The object as JSON; None when it is not there or cannot be read."""
        ...


@runtime_checkable
class FreshLookup(GangLookup, Protocol):
    """A lookup that keeps what it read (`inventory.kube_owners.GangReader`) and can read again."""

    def get_fresh(
        self, namespace: str, api_version: str, kind: str, name: str
    ) -> dict[str, Any] | None:
        """As `get`, read from the source again whatever was kept of the object."""
        ...


# Untrusted JSON ----------------------------------------------------------------------------


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _at(obj: Any, *path: str) -> Any:
    """`obj[path[0]][path[1]]...`, or None where a step is missing or not an object."""
    for step in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(step)
    return obj


def _name(value: Any) -> str | None:
    """`value` if it is a name an API server accepts (a DNS subdomain), else None."""
    if isinstance(value, str) and len(value) <= NAME_MAX_LENGTH and _NAME.fullmatch(value):
        return value
    return None


def _label_value(value: Any) -> str | None:
    """`value` if it is a non-empty label value (which most names here also are), else None."""
    if (
        isinstance(value, str)
        and len(value) <= LABEL_VALUE_MAX_LENGTH
        and _LABEL_VALUE.fullmatch(value)
    ):
        return value
    return None


def _count(value: Any, *, default: int | None = None, minimum: int = 1) -> int | None:
    """A count from JSON (an integer, not a bool) within [minimum, MAX_GANG_SIZE]; `default`
    when absent; None when it is anything else."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if minimum <= value <= MAX_GANG_SIZE else None


def _count_text(value: Any, *, minimum: int = 1) -> int | None:
    """A count written in an annotation or label ("4"): decimal digits only."""
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 7:
        return None
    return _count(int(value), minimum=minimum)


def gang_key(kind: str, name: str, suffix: str = "") -> str:
    """`Kind/name` plus `suffix`, shortened with a digest when longer than the column, so
    that two long keys still differ."""
    key = f"{kind}/{name}{suffix}"
    if len(key) <= GANG_KEY_MAX_LENGTH:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{key[: GANG_KEY_MAX_LENGTH - len(digest) - 1]}~{digest}"


def claim_templates(pod_spec: Any) -> tuple[str, ...]:
    """The ResourceClaimTemplates a pod spec's `resourceClaims` make claims from."""
    names = (
        _name(_dict(entry).get("resourceClaimTemplateName"))
        for entry in _list(_dict(pod_spec).get("resourceClaims"))
    )
    return tuple(dict.fromkeys(name for name in names if name))


def _sized(source: str, key: str, size: int | None, role: str = "") -> GangRef | None:
    """A gang of which the source gives only the size (None: no valid size, no gang)."""
    if size is None:
        return None
    return GangRef(source=source, key=key, size=size, roles=(), role=role)


def _with_roles(
    source: str, key: str, roles: Iterable[GangRole], role: str, size: int | None = None
) -> GangRef | None:
    """A gang of `roles` (with pods), its size their sum unless a smaller `size` is declared;
    the roles are kept only where they add up to the size."""
    kept = tuple(r for r in roles if r.pods > 0)
    total = sum(r.pods for r in kept)
    if size is None:
        size = total
    if not 1 <= size <= MAX_GANG_SIZE:
        return None
    return GangRef(
        source=source, key=key, size=size, roles=kept if total == size else (), role=role
    )


# The Pod and its claim --------------------------------------------------------------------


def claim_pod(claim: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, pod name) of a claim made from a template: its controller is a Pod."""
    if not isinstance(claim, Mapping):
        return None
    metadata = _dict(claim.get("metadata"))
    for reference in _list(metadata.get("ownerReferences")):
        reference = _dict(reference)
        if (
            reference.get("controller") is True
            and reference.get("kind") == "Pod"
            and reference.get("apiVersion") == POD_API_VERSION
        ):
            name = _name(reference.get("name"))
            namespace = _name(metadata.get("namespace") or "default")
            return (namespace, name) if name and namespace else None
    return None


def gang_of_claim(claim: Mapping[str, Any], lookup: GangLookup) -> GangRef | None:
    """The gang of the Pod a template's claim was made for, read through `lookup`; None for a
    claim made by hand, a Pod gone (or a namesake made after it), or a Pod in no gang.

    A Pod kept by a `FreshLookup` that is not the claim's (another Pod of the same name, as a
    LeaderWorkerSet group or a StatefulSet makes on a restart) is read again.
    """
    return read_gang_of_claim(claim, lookup).gang


@dataclass(frozen=True)
class GangRead:
    """What reading a claim's gang found (`read_gang_of_claim`)."""

    gang: GangRef | None
    # Whether a later read can find nothing this one did not: a gang was found, or the
    # claim's Pod was read and declares none whose object was missing. Not settled: the Pod
    # could not be read (gone, a namesake, the API server failing), or the object it names
    # as its gang's (a PodGroup, a JobSet, ...) could not be read (made after its Pods).
    settled: bool


def read_gang_of_claim(claim: Mapping[str, Any], lookup: GangLookup) -> GangRead:
    """`gang_of_claim`, and whether another read later could find more (`GangRead`)."""
    where = claim_pod(claim)
    if where is None:
        return GangRead(gang=None, settled=True)
    wanted_uid = next(
        (
            _dict(reference).get("uid")
            for reference in _list(_dict(claim.get("metadata")).get("ownerReferences"))
            if _dict(reference).get("kind") == "Pod" and _dict(reference).get("controller")
        ),
        None,
    )
    pod = lookup.get(where[0], POD_API_VERSION, "Pod", where[1])
    if _is_other_pod(pod, wanted_uid) and isinstance(lookup, FreshLookup):
        pod = lookup.get_fresh(where[0], POD_API_VERSION, "Pod", where[1])
    if not isinstance(pod, dict) or _is_other_pod(pod, wanted_uid):
        return GangRead(gang=None, settled=False)
    watched = _MissesWatched(lookup)
    found = gang_of_pod(pod, watched)
    return GangRead(gang=found, settled=found is not None or not watched.missed)


class _MissesWatched:
    """A `GangLookup` through another that remembers the objects asked for that were not
    there (or could not be read) in any API version asked: a PodGroup is asked for in each
    version the scheduler has served, and a cluster serves one."""

    def __init__(self, lookup: GangLookup) -> None:
        self._lookup = lookup
        self._missing: set[tuple[str, str, str]] = set()
        self._found: set[tuple[str, str, str]] = set()

    @property
    def missed(self) -> bool:
        return bool(self._missing - self._found)

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        found = self._lookup.get(namespace, api_version, kind, name)
        key = (api_group(api_version), kind, name)
        (self._found if isinstance(found, dict) else self._missing).add(key)
        return found


def _is_other_pod(pod: Any, wanted_uid: Any) -> bool:
    """Whether `pod` is a Pod whose uid is not `wanted_uid` (either unknown: it is not)."""
    uid = _dict(_dict(pod).get("metadata")).get("uid")
    return bool(wanted_uid and uid and wanted_uid != uid)


def gang_of_pod(pod: Mapping[str, Any], lookup: GangLookup) -> GangRef | None:
    """The gang `pod` belongs to, from the first source that declares one.

    The scheduler's own API first (it is what actually gangs the Pods), then the workload
    controllers that know roles (JobSet, LeaderWorkerSet, the training operators), then the
    schedulers that know only a count (Volcano, Kueue). A source whose object cannot be read
    gives way to the next.
    """
    if not isinstance(pod, Mapping):
        return None
    metadata = _dict(pod.get("metadata"))
    namespace = _name(metadata.get("namespace") or "default")
    if namespace is None:
        return None
    context = _Pod(
        namespace=namespace,
        labels=string_entries(metadata.get("labels")),
        annotations=string_entries(metadata.get("annotations")),
        owner_references=_list(metadata.get("ownerReferences")),
        spec=_dict(pod.get("spec")),
        lookup=lookup,
    )
    # Each source reads a fixed path into the objects, so a loop in one is never followed.
    for source in _SOURCES:
        found = source(context)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class _Pod:
    """What the sources read of a Pod, checked for type, and where they read the rest."""

    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    owner_references: list[Any]
    spec: dict[str, Any]
    lookup: GangLookup

    def read(self, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        obj = self.lookup.get(self.namespace, api_version, kind, name)
        return obj if isinstance(obj, dict) else None

    def controller(self) -> dict[str, Any] | None:
        for reference in self.owner_references:
            if isinstance(reference, dict) and reference.get("controller") is True:
                return reference
        return None


# Sources ----------------------------------------------------------------------------------


def _from_pod_group(pod: _Pod) -> GangRef | None:
    """KEP-5832: `spec.schedulingGroup.podGroupName` → PodGroup `schedulingPolicy.gang`."""
    name = _name(_at(pod.spec, "schedulingGroup", "podGroupName"))
    if name is None:
        return None
    for api_version in POD_GROUP_API_VERSIONS:
        group = pod.read(api_version, "PodGroup", name)
        if group is not None:
            size = _count(_at(group, "spec", "schedulingPolicy", "gang", "minCount"))
            if size is None:
                return None  # a basic policy, or a count that is no count: no gang
            return _sized("workload", gang_key("PodGroup", name), size)
    return None


def _from_workload(pod: _Pod) -> GangRef | None:
    """KEP-4671: `spec.workloadRef` → Workload `spec.podGroups[name].policy.gang.minCount`."""
    reference = _dict(pod.spec.get("workloadRef"))
    name = _name(reference.get("name"))
    group_name = _label_value(reference.get("podGroup"))
    if name is None or group_name is None:
        return None
    replica_key = reference.get("podGroupReplicaKey")
    if replica_key not in (None, "") and _label_value(replica_key) is None:
        return None
    workload = pod.read(WORKLOAD_API_VERSION, "Workload", name)
    if workload is None:
        return None
    group = next(
        (
            g
            for g in _list(_at(workload, "spec", "podGroups"))
            if isinstance(g, dict) and g.get("name") == group_name
        ),
        None,
    )
    size = _count(_at(group, "policy", "gang", "minCount"))
    if size is None:
        return None
    suffix = f"/{group_name}" + (f"#{replica_key}" if replica_key else "")
    return _sized("workload", gang_key("Workload", name, suffix), size)


def _job_pods(job_spec: Any) -> int | None:
    """Pods a Job runs at once: `parallelism` (default 1), no more than `completions`."""
    spec = _dict(job_spec)
    parallelism = _count(spec.get("parallelism"), default=1, minimum=0)
    completions = _count(spec.get("completions"), default=None, minimum=0)
    if parallelism is None or ("completions" in spec and completions is None):
        return None
    return parallelism if completions is None else min(parallelism, completions)


def _jobset_job(pod: _Pod) -> str | None:
    """The name of the `batch` Job that controls `pod`, else None."""
    reference = pod.controller()
    if reference is None or reference.get("kind") != "Job":
        return None
    if api_group(reference.get("apiVersion")) != "batch":
        return None
    return _name(reference.get("name"))


def _job_index(job: str, prefix: str) -> int | None:
    """`index` where `job` is `prefix` + `index` as Go's %d writes it, else None."""
    if not job.startswith(prefix):
        return None
    index = _count_text(job[len(prefix) :], minimum=0)
    return index if index is not None and job[len(prefix) :] == str(index) else None


def _from_jobset(pod: _Pod) -> GangRef | None:
    """The JobSet whose label the Pod carries, if one of its Jobs made the Pod: the Pod's
    role is the replicated job of that Job (`<jobset>-<replicated job>-<index>`, index below
    its replicas)."""
    name = _name(pod.labels.get(JOBSET_NAME_LABEL))
    job = _jobset_job(pod)
    if name is None or job is None:
        return None  # labels alone: a Pod made by hand, in no JobSet's gang
    jobset = pod.read(JOBSET_API_VERSION, "JobSet", name)
    if jobset is None:
        return None
    own_role: str | None = None  # the replicated job one of whose Jobs is `job`
    roles: list[GangRole] = []
    for replicated in _list(_at(jobset, "spec", "replicatedJobs")):
        replicated = _dict(replicated)
        role = _label_value(replicated.get("name"))
        replicas = _count(replicated.get("replicas"), default=1, minimum=0)
        per_job = _job_pods(_at(replicated, "template", "spec"))
        if role is None or replicas is None or per_job is None:
            return None  # one replicated job unreadable: the gang's size is unknown
        pods = replicas * per_job
        if pods > MAX_GANG_SIZE:
            return None
        index = _job_index(job, f"{name}-{role}-")
        if index is not None and index < replicas:
            own_role = role  # one at most: the index is what follows the last "-"
        roles.append(
            GangRole(
                name=role,
                pods=pods,
                claim_templates=claim_templates(
                    _at(replicated, "template", "spec", "template", "spec")
                ),
            )
        )
    if own_role is None:
        return None  # not made by a Job of this JobSet (as it is now)
    return _with_roles("jobset", gang_key("JobSet", name), roles, own_role)


def _from_leader_worker_set(pod: _Pod) -> GangRef | None:
    name = _name(pod.labels.get(LWS_NAME_LABEL))
    group_index = _count_text(pod.labels.get(LWS_GROUP_INDEX_LABEL), minimum=0)
    if name is None or group_index is None:
        return None  # without its group, a pod's gang cannot be told from the others'
    worker_index = _count_text(pod.labels.get(LWS_WORKER_INDEX_LABEL), minimum=0)
    own_role = "" if worker_index is None else "leader" if worker_index == 0 else "worker"
    key = gang_key("LeaderWorkerSet", name, f"#{group_index}")
    lws = pod.read(LWS_API_VERSION, "LeaderWorkerSet", name)
    if lws is None:
        # The LWS pod webhook writes the group size on every pod: the size, without roles.
        size = _count_text(pod.annotations.get(LWS_SIZE_ANNOTATION))
        return _sized("leaderworkerset", key, size, own_role)
    template = _dict(_at(lws, "spec", "leaderWorkerTemplate"))
    size = _count(template.get("size"), default=1)
    if size is None:
        return None
    worker_spec = _at(template, "workerTemplate", "spec")
    leader_spec = _at(template, "leaderTemplate", "spec") or worker_spec  # optional: workers'
    roles = [
        GangRole(name="leader", pods=1, claim_templates=claim_templates(leader_spec)),
        GangRole(name="worker", pods=size - 1, claim_templates=claim_templates(worker_spec)),
    ]
    return _with_roles("leaderworkerset", key, roles, own_role)


def _kubeflow_job(pod: _Pod) -> tuple[str, str, str] | None:
    """(apiVersion, kind, name) of the training job that made `pod`: its controller, else
    the operator's labels (the v1 API)."""
    reference = pod.controller()
    if reference is not None and api_group(reference.get("apiVersion")) == KUBEFLOW_GROUP:
        api_version, kind, name = (
            reference["apiVersion"],
            reference.get("kind"),
            reference.get("name"),
        )
    else:
        api_version = KUBEFLOW_API_VERSION
        kind = KUBEFLOW_OPERATORS.get(pod.labels.get(KUBEFLOW_OPERATOR_LABEL, ""))
        name = pod.labels.get(KUBEFLOW_JOB_NAME_LABEL)
    name = _name(name)
    if kind not in KUBEFLOW_REPLICA_SPECS or name is None:
        return None
    return api_version, str(kind), name


def _from_kubeflow(pod: _Pod) -> GangRef | None:
    found = _kubeflow_job(pod)
    if found is None:
        return None
    api_version, kind, name = found
    job = pod.read(api_version, kind, name)
    if job is None:
        return None
    roles: list[GangRole] = []
    for replica_type, replica_spec in _dict(_at(job, "spec", KUBEFLOW_REPLICA_SPECS[kind])).items():
        replicas = _count(_dict(replica_spec).get("replicas"), default=1, minimum=0)
        role = _label_value(replica_type)
        if replicas is None or role is None:
            return None
        roles.append(
            GangRole(
                name=role.lower(),
                pods=replicas,
                claim_templates=claim_templates(_at(replica_spec, "template", "spec")),
            )
        )
    policy = _at(job, "spec", "runPolicy", "schedulingPolicy")
    min_available = _dict(policy).get("minAvailable")
    size = _count(min_available) if min_available is not None else None
    if min_available is not None and size is None:
        return None
    if size is not None and size > sum(r.pods for r in roles):
        size = None  # more than the job runs: the replicas are the gang
    own_role = pod.labels.get(KUBEFLOW_REPLICA_TYPE_LABEL, "").lower()
    return _with_roles("kubeflow", gang_key(kind, name), roles, own_role, size)


def _from_volcano(pod: _Pod) -> GangRef | None:
    name = next(
        (n for key in VOLCANO_GROUP_ANNOTATIONS if (n := _name(pod.annotations.get(key)))), None
    )
    if name is None:
        return None
    group = pod.read(VOLCANO_API_VERSION, "PodGroup", name)
    size = _count(_at(group, "spec", "minMember"))
    if size is None:
        return None
    return _sized("volcano", gang_key("PodGroup.scheduling.volcano.sh", name), size)


def _from_kueue(pod: _Pod) -> GangRef | None:
    name = _label_value(pod.labels.get(KUEUE_POD_GROUP_LABEL))
    size = _count_text(pod.annotations.get(KUEUE_TOTAL_COUNT_ANNOTATION))
    if name is None or size is None:
        return None
    return _sized("kueue", gang_key("PodGroup.kueue.x-k8s.io", name), size)


_SOURCES: tuple[Callable[[_Pod], GangRef | None], ...] = (
    _from_pod_group,
    _from_workload,
    _from_jobset,
    _from_leader_worker_set,
    _from_kubeflow,
    _from_volcano,
    _from_kueue,
)


# A dump -----------------------------------------------------------------------------------


def _slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """What the gang of a Pod is read from: a dump of thousands of Pods keeps only this."""
    metadata = _dict(pod.get("metadata"))
    spec = _dict(pod.get("spec"))
    return {
        "apiVersion": pod.get("apiVersion"),
        "kind": "Pod",
        "metadata": {
            key: metadata[key]
            for key in ("name", "namespace", "uid", "labels", "annotations", "ownerReferences")
            if key in metadata
        },
        "spec": {
            key: spec[key]
            for key in ("workloadRef", "schedulingGroup", "resourceClaims")
            if key in spec
        },
    }


class GangIndex:
    """The Pods and gang-declaring objects of a dump, as a `GangLookup`.

    Objects are found by API group, kind, namespace and name, whatever version the dump holds
    (the versions of one kind read alike here).
    """

    def __init__(self) -> None:
        self._objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    @property
    def namespaces(self) -> set[str]:
        return {namespace for _, _, namespace, _ in self._objects}

    def add(self, obj: Any) -> bool:
        """Keep `obj` if it is a Pod or a kind that declares gangs; whether it was."""
        if not isinstance(obj, dict):
            return False
        metadata = _dict(obj.get("metadata"))
        group, kind = api_group(obj.get("apiVersion")), obj.get("kind")
        name = _name(metadata.get("name"))
        namespace = _name(metadata.get("namespace") or "default")
        if name is None or namespace is None or not isinstance(kind, str):
            return False
        if (group, kind) == ("", "Pod"):
            obj = _slim_pod(obj)
        elif (group, kind) not in GANG_KINDS:
            return False
        self._objects[(group, kind, namespace, name)] = obj
        return True

    def get(self, namespace: str, api_version: str, kind: str, name: str) -> dict[str, Any] | None:
        return self._objects.get((api_group(api_version), kind, namespace, name))
