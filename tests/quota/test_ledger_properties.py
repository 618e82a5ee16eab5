"""Property: whatever the interleaving of policy changes, admissions, allocations and releases,
every rule's usage equals a recount from scratch, and no admission takes an enforce rule past
its limit.

Policy changes go through `apply_policy` (with --prune), admissions through the webhook's own
service (`review_claim`), allocations and releases through the inventory's sync
(`apply_watch_event`, whose `claims_changed` signal moves the reservations), as in production.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings as django_settings
from django.db import transaction
from django.test import TestCase
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inventory import services as inventory_services
from quota import services
from quota.admission import service
from quota.admission.service import review_claim
from quota.models import Mode, QuotaRule
from quota.policy import PolicyError, apply_policy, load_policy
from tests.quota.fixtures import AT
from tests.quota.test_ledger import A100, H100, ledger_fleet_objects

TEAMS = ("a", "b")
NAMESPACES = ("ns-1", "ns-2", "ns-3")
UNOWNED = "ns-free"
RULE_NAMES = ("r1", "r2", "r3")
RULE_CLASSES = ("gpu.nvidia.com", "mig.nvidia.com", "vfio.gpu.nvidia.com", "gpu-h100.example.com")
# The classes claims ask for, and the devices (pool, name) the scheduler may give each.
H100S = [("h100-a", f"gpu-{i}") for i in range(8)]
A100S = [("a100-a", f"gpu-{i}") for i in range(2)]
MIG_1G = [("mig-a", f"gpu-0-mig-1g5gb-19-{i}") for i in range(3)]
MIGS = [*MIG_1G, ("mig-a", "gpu-0-mig-3g20gb-9-4")]
VFIO = [("vm-a", f"gpu-vfio-{i}") for i in range(2)]
DEVICES = {
    "gpu.nvidia.com": H100S + A100S,
    "gpu-h100.example.com": H100S,
    "mig.nvidia.com": MIGS,
    "mig-1g-5gb.gpu.nvidia.com": MIG_1G,
    "vfio.gpu.nvidia.com": VFIO,
    "gpu-vfio.example.com": VFIO,
}
# A memory rule's limit for each GPU rule's: so many 80 GiB GPUs.
MEMORY = {"1": "80Gi", "2": "160Gi", "3": "240Gi", "0.3": "24Gi"}
H100_ONLY = {"gpu.nvidia.com": H100S, "gpu-h100.example.com": H100S}


@dataclass(frozen=True)
class RuleDef:
    device_class: str
    selector: str
    unit: str
    limit: str
    mode: str


@dataclass
class Claim:
    namespace: str
    device_class: str
    count: int
    h100_only: bool
    uid: str
    state: str = "admitted"  # admitted (not seen by the sync), pending, allocated
    devices: list[tuple[str, str]] = field(default_factory=list)


rule_defs = st.builds(
    RuleDef,
    device_class=st.sampled_from(RULE_CLASSES),
    selector=st.sampled_from(["", H100, A100]),
    unit=st.sampled_from(["gpus", "gpus", "memory"]),
    limit=st.sampled_from(["1", "2", "3", "0.3"]),
    mode=st.sampled_from([Mode.ENFORCE.value, Mode.ENFORCE.value, Mode.WARN.value]),
)


@settings(
    max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
)
class LedgerMachine(RuleBasedStateMachine):
    """The cluster, the policy file and the claims, as a model the steps move."""

    def __init__(self) -> None:
        super().__init__()
        service.forget_caches()
        self._transaction = transaction.atomic()
        self._transaction.__enter__()  # each example rolls back to the fleet
        self.owner: dict[str, str | None] = dict.fromkeys(NAMESPACES)
        self.rules: dict[str, dict[str, RuleDef]] = {team: {} for team in TEAMS}
        self.applied = False
        self.claims: dict[str, Claim] = {}
        self.names = itertools.count()
        self.minutes = itertools.count(1)

    def teardown(self) -> None:
        transaction.set_rollback(True)
        self._transaction.__exit__(None, None, None)

    # --- The policy --------------------------------------------------------------------------

    def _policy(self) -> str:
        lines = ["teams:"]
        for team in TEAMS:
            owned = [ns for ns, owner in self.owner.items() if owner == team]
            lines += [
                f"- slug: {team}",
                f"  name: Team {team}",
                f"  namespaces: [{', '.join(owned)}]",
            ]
            lines.append("  quotas:" if self.rules[team] else "  quotas: []")
            for name, definition in sorted(self.rules[team].items()):
                lines += [f"  - name: {name}", f"    deviceClass: {definition.device_class}"]
                if definition.selector:
                    lines.append(f"    selector: '{definition.selector}'")
                limit = definition.limit if definition.unit == "gpus" else MEMORY[definition.limit]
                lines += [f"    {definition.unit}: {limit}", f"    mode: {definition.mode}"]
        return "\n".join(lines) + "\n"

    def _apply(self, undo: Any) -> None:
        """Apply the model's policy; when the database refuses it (a rule in use removed or
        its unit changed), `undo()` puts the model back."""
        try:
            apply_policy(policy=load_policy(self._policy()), prune=True, actor="machine")
        except PolicyError as exc:
            assert all("in use" in error for error in exc.errors), exc.errors
            undo()
            return
        self.applied = True

    @rule(team=st.sampled_from(TEAMS), name=st.sampled_from(RULE_NAMES), definition=rule_defs)
    def put_rule(self, team: str, name: str, definition: RuleDef) -> None:
        """Add a rule, or change one (class, selector, unit, limit, mode)."""
        before = self.rules[team].get(name)
        self.rules[team][name] = definition

        def undo() -> None:
            if before is None:
                del self.rules[team][name]
            else:
                self.rules[team][name] = before

        self._apply(undo)

    @precondition(lambda self: any(self.rules.values()))
    @rule(data=st.data())
    def remove_rule(self, data: st.DataObject) -> None:
        team, name = data.draw(
            st.sampled_from(sorted((t, n) for t in TEAMS for n in self.rules[t]))
        )
        before = self.rules[team].pop(name)
        self._apply(lambda: self.rules[team].__setitem__(name, before))

    @rule(namespace=st.sampled_from(NAMESPACES), team=st.sampled_from((*TEAMS, None)))
    def own_namespace(self, namespace: str, team: str | None) -> None:
        """Add a namespace to a team, move it to the other, or remove it (no team owns it)."""
        before = self.owner[namespace]
        self.owner[namespace] = team
        self._apply(lambda: self.owner.__setitem__(namespace, before))

    # --- Claims ------------------------------------------------------------------------------

    def _at(self) -> Any:
        return AT + timedelta(minutes=next(self.minutes))

    def _body(self, name: str, claim: Claim) -> dict[str, Any]:
        request: dict[str, Any] = {"deviceClassName": claim.device_class, "count": claim.count}
        if claim.h100_only:
            request["selectors"] = [{"cel": {"expression": H100}}]
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": claim.namespace, "uid": claim.uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
        }

    def _sync(self, event: str, name: str, claim: Claim) -> None:
        body = self._body(name, claim)
        if claim.devices:
            body["status"] = {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "gpu", "driver": "gpu.nvidia.com", "pool": p, "device": d}
                            for p, d in claim.devices
                        ]
                    }
                }
            }
        report = inventory_services.apply_watch_event(
            cluster=inventory_services.get_cluster(django_settings.TALLY_CLUSTER_NAME),
            event_type=event,
            obj=body,
            at=self._at(),
        )
        assert report.errors == []

    def _usage(self) -> dict[int, tuple[Decimal, Decimal, str]]:
        return {rule.pk: (rule.in_use, rule.limit, rule.mode) for rule in QuotaRule.objects.all()}

    claim_shapes = st.tuples(
        st.sampled_from((*NAMESPACES, UNOWNED)),
        st.sampled_from(sorted(DEVICES)),
        st.integers(min_value=1, max_value=2),
        st.booleans(),
    )

    @rule(shape=claim_shapes)
    def admit(self, shape: tuple[str, str, int, bool]) -> None:
        """A claim's CREATE through the validating webhook; admitted, the API server makes it."""
        namespace, device_class, count, h100_only = shape
        h100_only = h100_only and device_class in H100_ONLY
        name = f"claim-{next(self.names)}"
        claim = Claim(namespace, device_class, count, h100_only, uid=f"uid-{name}")
        before = self._usage()

        decision = review_claim(claim=self._body(name, claim), username="alice", at=self._at())

        after = self._usage()
        for rule_id, (in_use, limit, mode) in after.items():
            grew = in_use > before.get(rule_id, (Decimal(0),))[0]
            assert not (grew and mode == Mode.ENFORCE and in_use > limit), (
                f"admitting {name} took rule {rule_id} to {in_use}, past its limit {limit}"
            )
        if decision.allowed:
            self.claims[name] = claim

    @rule(shape=claim_shapes)
    def bypass(self, shape: tuple[str, str, int, bool]) -> None:
        """A claim made while the webhook was not called (before Tally, or while it was off),
        allocated when the sync sees it."""
        namespace, device_class, count, h100_only = shape
        name = f"claim-{next(self.names)}"
        claim = Claim(
            namespace,
            device_class,
            count,
            h100_only and device_class in H100_ONLY,
            uid=f"uid-{name}",
        )
        if self._allocate(claim):
            self.claims[name] = claim
            self._sync("ADDED", name, claim)

    def _allocate(self, claim: Claim) -> bool:
        taken = {device for other in self.claims.values() for device in other.devices}
        pool = H100_ONLY[claim.device_class] if claim.h100_only else DEVICES[claim.device_class]
        free = [device for device in pool if device not in taken]
        if len(free) < claim.count:
            return False
        claim.devices, claim.state = free[: claim.count], "allocated"
        return True

    def _pick(self, data: st.DataObject, states: tuple[str, ...]) -> str:
        return data.draw(
            st.sampled_from(sorted(n for n, c in self.claims.items() if c.state in states))
        )

    @precondition(lambda self: any(c.state == "admitted" for c in self.claims.values()))
    @rule(data=st.data())
    def see_pending(self, data: st.DataObject) -> None:
        """The sync sees an admitted claim, not yet allocated."""
        name = self._pick(data, ("admitted",))
        self.claims[name].state = "pending"
        self._sync("ADDED", name, self.claims[name])

    @precondition(lambda self: any(c.state != "allocated" for c in self.claims.values()))
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """The scheduler allocates a claim (the sync may not have seen it pending)."""
        name = self._pick(data, ("admitted", "pending"))
        claim = self.claims[name]
        if self._allocate(claim):
            self._sync("MODIFIED", name, claim)

    @precondition(lambda self: any(c.state != "admitted" for c in self.claims.values()))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        """A claim the sync has seen is deleted: its devices and quota are freed."""
        name = self._pick(data, ("pending", "allocated"))
        claim = self.claims.pop(name)
        claim.devices = []
        self._sync("DELETED", name, claim)

    @rule()
    def expire(self) -> None:
        """Reservations whose claim never appeared expire; those claims are never made."""
        services.expire_reservations(now=self._at() + timedelta(days=1))
        for name in [n for n, c in self.claims.items() if c.state == "admitted"]:
            del self.claims[name]

    # --- What must always hold ---------------------------------------------------------------

    @invariant()
    def usage_is_a_recount_from_scratch(self) -> None:
        drifted = [u.describe() for u in services.reconcile_usage(at=AT, fix=False) if u.drifted]
        assert drifted == []


# The machine's unittest case, on Django's test database: each example rolls back to the fleet
# imported once for the class. Not a test of its own (`__test__`): run alone, outside Django's
# test case, it would touch the database without one.
MachineTestCase: Any = LedgerMachine.TestCase
MachineTestCase.__test__ = False


class TestLedger(MachineTestCase, TestCase):
    __test__ = True

    @classmethod
    def setUpTestData(cls) -> None:
        report = inventory_services.import_snapshot(
            cluster=inventory_services.get_cluster(django_settings.TALLY_CLUSTER_NAME),
            objects=ledger_fleet_objects(),
            at=AT,
        )
        assert report.errors == []
