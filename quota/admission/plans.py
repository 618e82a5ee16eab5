"""The plain data an admission weighs and decides with: the team's rules and usage as read
(`RuleSnapshot`), the claim's live reservation, its demand on each rule, the plan the store
reserves (or does not) and the decision the webhook answers; a gang's hold and plan besides.
No database, no connection: `quota.admission.store` fills them in, `quota.admission.decision`,
`.demand` and `.gang_weighing` work on them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from inventory import dra
from inventory.gangs import GangRef
from inventory.profiles import unit_label
from quota.admission import patches
from quota.models import GangMode, QuotaRule, Unit
from teams.models import Team

if TYPE_CHECKING:
    from quota.admission.shapes import FleetShapes

NEAR_LIMIT = Decimal("0.8")
# The resource.k8s.io versions whose ResourceClaim layout Tally reads (`dra.parse_claim_requests`):
# requests wrapped in `exactly` in v1 and v1beta2, flat in v1beta1 and v1alpha3. Any other
# (v1alpha2, classic DRA, has no `spec.devices`) is not counted: see `unread_version`.
CLAIM_VERSIONS = ("v1", "v1beta2", "v1beta1", "v1alpha3")
CLAIM_API_VERSIONS = frozenset(f"{dra.GROUP}/{version}" for version in CLAIM_VERSIONS)
# The capacities a memory rule counts, as drivers name them.
MEMORY_CAPACITIES = ("memory", "addressableMemory")
# The resource-claim controller creates claims from ResourceClaimTemplates for Pods.
CONTROLLER_USERS = ("system:serviceaccount:kube-system:", "system:kube-controller-manager")
# The annotation the mutating webhook sets on a claim it narrowed to the models that fit: the
# models kept, by request (JSON).
NARROWED_ANNOTATION = "tally.dev/narrowed-to"


@dataclass(slots=True)
class RuleSnapshot:
    """A quota rule as one admission reads it: its definition and its usage at that moment.

    A plain record rather than a `QuotaRule` instance: the webhook builds a few for every
    request, and a model instance costs several times more to make.
    """

    pk: int
    name: str
    device_class: str
    selector: str
    unit: str
    limit: Decimal
    mode: str
    in_use: Decimal


# A rule as an admission read it, or as stored (the sync's exact allocations).
Rule = RuleSnapshot | QuotaRule


@dataclass(frozen=True, kw_only=True)
class LiveReservation:
    """The live reservation found under an admitted claim's name: its team, and what says
    which claim it was made for (the claim's uid once the sync has seen it, and the digest
    of the spec admitted, `spec_digest`; "" where not known)."""

    team_id: int
    claim_uid: str
    spec_digest: str

    def made_for(
        self,
        claim: dict[str, Any],
        *,
        removed: dict[str, list[str]] | None = None,
        narrowed: Mapping[str, str] | None = None,
    ) -> bool:
        """Whether `claim` is the claim this reservation was made for: a create the API server
        (or its client) sent again. The same uid, or the same spec (as sent, or with the
        alternatives `removed` left out and the selectors `narrowed` added, by request, as the
        mutating webhook's patch stores it: `patches.spec_operations`);
        a reservation with no digest (made before digests were kept, or adopted by the sync)
        takes any claim as its, but one of another uid than the claim the sync saw.
        Another claim under the same name (one deleted and made again differently, or a
        create of a name in use) is no retry: it is weighed as new."""
        metadata = claim.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        if self.claim_uid and isinstance(uid, str) and uid:
            if uid == self.claim_uid:
                return True
            if not self.spec_digest:
                return False  # another object, and no spec kept to find it the same
        elif not self.spec_digest:
            return True
        if narrowed:
            return self.spec_digest == spec_digest(claim, removed=removed, narrowed=narrowed)
        return self.spec_digest in {spec_digest(claim), spec_digest(claim, removed=removed)}


def spec_digest(
    claim: dict[str, Any],
    *,
    removed: dict[str, list[str]] | None = None,
    narrowed: Mapping[str, str] | None = None,
) -> str:
    """A digest of `claim`'s spec, as JSON with sorted keys (so the order a client wrote it
    in does not matter), less the firstAvailable alternatives `removed` (by request) and with
    the selectors `narrowed` added (by request: the mutating webhook's patch)."""
    spec = claim.get("spec")
    if narrowed:
        spec = patches.patched_spec(claim, removed=removed or {}, narrowed=narrowed)
    elif removed and isinstance(spec, dict):
        spec = _without_alternatives(spec, removed)
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _without_alternatives(spec: dict[str, Any], removed: dict[str, list[str]]) -> dict[str, Any]:
    """`spec` with the firstAvailable alternatives `removed` (by request name) taken out, as
    the mutating webhook's patch takes them out."""
    devices = spec.get("devices")
    if not isinstance(devices, dict) or not isinstance(devices.get("requests"), list):
        return spec
    kept = []
    for request in devices["requests"]:
        name = request.get("name") if isinstance(request, dict) else None
        gone = set(removed.get(name, ())) if isinstance(name, str) else set()
        alternatives = request.get("firstAvailable") if gone else None
        if isinstance(alternatives, list):
            request = {
                **request,
                "firstAvailable": [
                    alt
                    for alt in alternatives
                    if not isinstance(alt, dict) or alt.get("name") not in gone
                ],
            }
        kept.append(request)
    return {**spec, "devices": {**devices, "requests": kept}}


@dataclass
class AdmissionState:
    """What one admission reads from the database, in one query: the namespace's team with its
    rules and their current usage, and the live reservation already made under the claim's
    name, if any (a create sent again, or another claim of the same name)."""

    team: Team | None
    rules: list[RuleSnapshot]
    live: LiveReservation | None
    # How the team's gangs are admitted (`GangMode`; a team without a policy: enforce).
    gang_mode: str = GangMode.ENFORCE.value
    # Whether the mutating webhook may narrow the team's claims to the models that fit
    # (`NarrowingPolicy`; a team without one: no).
    narrow_to_fit: bool = False
    # What the claim may draw, by rule, from its gang's live hold (`store.gang_state`): counted
    # in the rules' usage already, so only what it asks beyond that is weighed against limits.
    credit: dict[int, Decimal] = field(default_factory=dict)


@dataclass(frozen=True)
class BudgetUse:
    """A team's budget in hours of one unit, and the hours of that unit it has used in the
    period holding now."""

    hours: Decimal
    unit: str  # what the hours count (inventory.models.Unit): GPU-hours, TPU chip-hours, ...
    mode: str  # "hard" denies new claims past it; "soft" warns
    used: Decimal
    period: str  # the period's name, as the commands print it


@dataclass
class Demand:
    """What one request (or one of its alternatives) can take, per rule that limits it."""

    name: str
    amounts: dict[int, Decimal]
    devices: int
    # Said with a denial it causes: why it counts what it does (a class no device matches yet).
    note: str = ""
    # The ids of the shapes it could be given: which of them a rule that denies it binds.
    shapes: frozenset[int] = frozenset()
    # Why Tally cannot tell which rules it would count on (a class that matches no device and
    # names no driver): denied where an enforce rule binds the team, never counted 0 in silence.
    unbound: str = ""


@dataclass(frozen=True)
class Narrowing:
    """A request the mutating webhook narrowed to the models that fit (the team's
    `narrowToFit`): the selector it adds, the models that selector keeps and the quota rules
    that had no room for the request as sent."""

    selector: str
    models: tuple[str, ...]
    rules: tuple[str, ...]


@dataclass
class Decision:
    """The webhook's answer to one claim."""

    allowed: bool
    message: str = ""
    reason: str = ""
    warnings: list[str] = field(default_factory=list)
    team: Team | None = None
    # firstAvailable requests: alternatives that do not fit, by request name.
    removed: dict[str, list[str]] = field(default_factory=dict)
    # The quota rule that denied, for metrics.
    rule: str = ""
    # Requests narrowed to the models that fit (the mutating webhook), by request name.
    narrowed: dict[str, Narrowing] = field(default_factory=dict)


@dataclass
class Plan:
    """A claim weighed against its team's quota: what to reserve on each rule, or why not."""

    team: Team | None
    rules: dict[int, Rule]
    reserve: dict[int, Decimal]
    chosen: dict[str, list[str]]
    removed: dict[str, list[str]]
    warnings: list[str]
    denial: str = ""
    reason: str = ""
    rule: str = ""
    # What each rule's amounts count over every cluster's fleet ("gpu", "tpu", ...), by rule id.
    units: dict[int, str] = field(default_factory=dict)
    # What the claim may take, by rule, from its gang's hold (`AdmissionState.credit`).
    credit: dict[int, Decimal] = field(default_factory=dict)
    # Requests narrowed to the models that fit (`Narrowing`), by request name ("request", or
    # "request/alternative").
    narrowed: dict[str, Narrowing] = field(default_factory=dict)
    # What the mutating webhook narrowed in the claim the validating webhook weighs, as its
    # reservation keeps it (`Reservation.narrowed`, `decision.narrowed_in`).
    narrowed_sent: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What each request (each alternative kept) takes, and the fleet it was weighed on: what a
    # denial at reservation says of a rule that binds models the claim need not be given.
    demands: list[Demand] = field(default_factory=list)
    fleet: FleetShapes | None = None
    # The claim's gang, and what admitting it reserves for the gang (`weigh_gang`).
    gang: GangPlan | None = None

    def decision(self) -> Decision:
        """The answer this plan gives before anything is reserved."""
        if self.denial:
            return Decision(
                allowed=False,
                message=self.denial,
                reason=self.reason,
                warnings=self.warnings,
                team=self.team,
                rule=self.rule,
            )
        return Decision(
            allowed=True,
            warnings=self.warnings,
            team=self.team,
            removed=self.removed,
            narrowed=self.narrowed,
        )


@dataclass(frozen=True)
class GangState:
    """What an admission read of its claim's gang (`store.gang_state`): its live hold (the
    id, and what it holds by rule) and what the gang's members admitted already hold, by
    rule."""

    hold_id: int | None
    held: dict[int, Decimal]
    members: dict[int, Decimal]


@dataclass(frozen=True)
class Adopted:
    """Members of a gang admitted alone, before their gang could be read (not yet readable,
    the reader failing, the team's gangs off then): live reservations of the namespace with no
    gang whose claim's Pod is in the gang. Their ids, and what they hold by rule."""

    ids: tuple[int, ...] = ()
    amounts: dict[int, Decimal] = field(default_factory=dict)


@dataclass
class GangPlan:
    """How a gang member is admitted: drawing from its gang's hold (`hold_id`), changing each
    rule's usage by `counted` (none: it draws its whole share) and the hold by `counted` less
    its own share; or, the first member of a gang admitted whole, adding `counted` to each rule
    (the whole gang's demand) of which `hold` is held for the members to come; or (neither) as
    a claim alone, only recording its gang. `whole`: the rest of the gang was weighed with
    the member (its denial names the gang; a top-up is planned again if the hold's lines
    changed from `held`, as read). `adopted`: members admitted alone that this admission
    records as the gang's (`Adopted`)."""

    gang: GangRef
    hold_id: int | None = None
    counted: dict[int, Decimal] = field(default_factory=dict)
    hold: dict[int, Decimal] = field(default_factory=dict)
    whole: bool = False
    adopted: tuple[int, ...] = ()
    held: dict[int, Decimal] = field(default_factory=dict)


def claim_name(claim: dict[str, Any]) -> tuple[str, str]:
    """The claim's namespace and name (its generateName when it has no name yet)."""
    metadata = claim.get("metadata") if isinstance(claim.get("metadata"), dict) else {}
    assert isinstance(metadata, dict)
    return str(metadata.get("namespace") or "default"), str(
        metadata.get("name") or metadata.get("generateName") or ""
    )


def amount_text(value: Decimal, rule: Rule, unit: str | None) -> str:
    """An amount on a rule as messages show it: Gi of memory, or devices of `unit`."""
    if rule.unit == Unit.MEMORY:
        return f"{(value / 2**30).quantize(Decimal('0.01')).normalize():f}Gi"
    rounded = value.quantize(Decimal("0.001")).normalize()
    return f"{rounded:f} {unit_label(unit or 'gpu', plural=rounded != 1)}"
