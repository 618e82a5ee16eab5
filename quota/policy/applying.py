"""Applying the policy file: `apply_policy` makes the database match a `Policy` in one
transaction, every change audited, through the services that own each row (`quota.rules`,
`quota.services`, `teams.ownership`, `billing.services`, `inventory.version_policy`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from django.contrib.auth import get_user_model
from django.db import IntegrityError, models, transaction
from django.db.models import ProtectedError, RestrictedError
from django.utils import timezone

from billing.models import RateCard
from billing.rates import (
    ClosedPeriod,
    closed_periods,
    open_since,
    rate_change_error,
)
from billing.services import delete_rate_card, save_rate_card
from inventory.models import Device, DeviceKind, DriverProfile
from inventory.models import Unit as DeviceUnit
from inventory.version_policy import (
    VersionPolicy,
    apply_version_policy,
    version_policy_effects,
)
from inventory.versions import version_matrix
from quota.models import (
    Budget,
    GangPolicy,
    NarrowingPolicy,
    QuotaRule,
    Reservation,
    ReservationState,
)
from quota.policy.specs import (
    ApplyReport,
    BudgetSpec,
    Policy,
    PolicyError,
    RateKey,
    RateSpec,
    SsoGroupSpec,
    TeamSpec,
)
from quota.rules import RuleValues, save_rule, unit_change_error
from quota.services import lock_usage, recount_usage, set_budget
from teams import audit
from teams.models import (
    IdleAlertPolicy,
    Membership,
    SsoGroupRole,
    Team,
    TeamNamespace,
)
from teams.ownership import assign_namespace, release_namespace

_Model = TypeVar("_Model", bound=models.Model)


@dataclass
class _State:
    """The teams, namespaces, memberships, rules, budgets and rate cards as stored; rules and
    rate cards locked for this transaction, and the billing periods while rates are applied."""

    teams: dict[str, Team]
    namespaces: dict[str, TeamNamespace]
    memberships: dict[int, dict[str, Membership]]
    rules: dict[int, dict[str, QuotaRule]]
    budgets: dict[int, Budget]
    rate_cards: dict[RateKey, RateCard]
    closed_periods: list[ClosedPeriod]
    driver_profiles: dict[str, DriverProfile] = field(default_factory=dict)
    gang_policies: dict[int, GangPolicy] = field(default_factory=dict)
    narrowing_policies: dict[int, NarrowingPolicy] = field(default_factory=dict)
    idle_alert_policies: dict[int, IdleAlertPolicy] = field(default_factory=dict)

    @classmethod
    def load(cls, *, lock_periods: bool) -> _State:
        lock_usage(team_ids=())  # first: no other change of usage or ownership meanwhile
        teams = {team.slug: team for team in Team.objects.all()}
        by_id = {team.pk: team for team in teams.values()}
        namespaces = {}
        for namespace in TeamNamespace.objects.all():
            namespace.team = by_id[namespace.team_id]
            namespaces[namespace.namespace] = namespace
        memberships: dict[int, dict[str, Membership]] = defaultdict(dict)
        for membership in Membership.objects.select_related("user"):
            membership.team = by_id[membership.team_id]
            memberships[membership.team_id][membership.user.get_username()] = membership
        rules: dict[int, dict[str, QuotaRule]] = defaultdict(dict)
        # Locked (with the usage lock, before anything is written) so that the checks on
        # `in_use` hold until the deletes and unit changes commit, and the recount after them
        # sees no other change of usage.
        for rule in lock_usage(team_ids=by_id):
            rule.team = by_id[rule.team_id]
            rules[rule.team_id][rule.name] = rule
        budgets = {}
        for budget in Budget.objects.all():
            budget.team = by_id[budget.team_id]
            budgets[budget.team_id] = budget
        gang_policies = {}
        for gang_policy in GangPolicy.objects.all():
            gang_policy.team = by_id[gang_policy.team_id]
            gang_policies[gang_policy.team_id] = gang_policy
        narrowing_policies = {}
        for narrowing_policy in NarrowingPolicy.objects.all():
            narrowing_policy.team = by_id[narrowing_policy.team_id]
            narrowing_policies[narrowing_policy.team_id] = narrowing_policy
        idle_alert_policies = {}
        for idle_alert_policy in IdleAlertPolicy.objects.all():
            idle_alert_policy.team = by_id[idle_alert_policy.team_id]
            idle_alert_policies[idle_alert_policy.team_id] = idle_alert_policy
        # Periods (and the rate cards' writers' lock) before the cards, in the order
        # `billing.services` takes them.
        closed = closed_periods(lock=lock_periods)
        rate_cards = {_rate_key(card): card for card in RateCard.objects.select_for_update()}
        driver_profiles = {row.driver: row for row in DriverProfile.objects.select_for_update()}
        return cls(
            teams=teams,
            namespaces=namespaces,
            memberships=memberships,
            rules=rules,
            budgets=budgets,
            rate_cards=rate_cards,
            closed_periods=closed,
            driver_profiles=driver_profiles,
            gang_policies=gang_policies,
            narrowing_policies=narrowing_policies,
            idle_alert_policies=idle_alert_policies,
        )

    def undeclared_teams(self, policy: Policy) -> list[Team]:
        declared = {spec.slug for spec in policy.teams}
        return [team for slug, team in sorted(self.teams.items()) if slug not in declared]


def apply_policy(
    *,
    policy: Policy,
    prune: bool,
    actor: str,
    dry_run: bool = False,
    force: bool = False,
    at: datetime | None = None,
) -> ApplyReport:
    """Make the teams, namespaces, memberships, rules, budgets and (when the file has `rates`,
    `drivers`, `versions` or `sso`) rate cards, driver profiles, version baselines and single
    sign-on group roles in the database match `policy`. Memberships a sign-in gave
    (`teams.sso`) are never pruned: the next sign-in is theirs to take.

    Guarantees: all or nothing, in one transaction; every create, update and delete is audited
    as `actor`; applying the same policy again changes nothing; without `prune` nothing is
    deleted, with it whatever the file does not declare is, except a team with reservations
    or a rule with capacity in use, which are reported as errors (`PolicyError`, nothing
    applied). The usage of every team whose rules or namespaces changed is recounted from the
    ledger in the same transaction (`quota.services.recount_usage`, the only writer of
    `QuotaRule.in_use` here: claims already allocated in a namespace a team now owns are
    adopted), each change of a rule's usage noted in the report. No closed billing period
    would be priced differently afterwards: a rate card that reaches into one keeps its
    price, idle factor and days there, and is not deleted; a new one may not reach into one
    (errors again). A `versions` section is reported by what it does (the nodes each baseline
    judges, its outliers, what matches nothing: `inventory.version_policy.version_policy_effects`);
    one that would make more than half of a model's nodes in a cluster outliers is an error
    unless `force`. A dry run reports the same changes and rolls them back.

    `at` (default now) is the moment the changes are made as of: a namespace changes owner
    from its hour, usage is recounted as of it, and the audit entries are dated it. For
    history laid down after the fact, in time order (the demo, `manage.py load_demo`).
    """
    report = ApplyReport(dry_run=dry_run, notes=list(policy.notes))
    moment = timezone.now() if at is None else at
    with transaction.atomic(), audit.dated(moment):
        state = _State.load(lock_periods=policy.rates is not None)
        errors = _conflicts(policy=policy, state=state, prune=prune)
        if errors:
            raise PolicyError(errors)
        applier = _Applier(state=state, actor=actor, report=report, force=force, at=moment)
        try:
            applier.apply(policy=policy, prune=prune)
        except (ProtectedError, RestrictedError) as exc:
            # Held further down a cascade than `_undeletable_teams` looks.
            raise PolicyError([f"not deleted: {exc.args[0]}"]) from exc
        for usage in recount_usage(teams=applier.recount, at=moment):
            if usage.stored != usage.recounted:
                report.notes.append(
                    f"usage of quota rule {usage.rule} recounted: "
                    f"{usage.stored.normalize():f} → {usage.recounted.normalize():f}"
                )
        if dry_run:
            transaction.set_rollback(True)
    return report


def _conflicts(*, policy: Policy, state: _State, prune: bool) -> list[str]:
    """What in the database stops the policy from being applied as asked."""
    errors = []
    declared = {spec.slug for spec in policy.teams}
    for spec in policy.teams:
        for index, namespace in enumerate(spec.namespaces):
            owner = state.namespaces.get(namespace)
            if owner is not None and owner.team.slug not in declared and not prune:
                errors.append(
                    f"{spec.path}.namespaces[{index}]: namespace {namespace!r} is owned by team "
                    f"{owner.team.slug!r}, which the file does not declare "
                    "(declare that team, or remove it with --prune)"
                )
        team = state.teams.get(spec.slug)
        rules = state.rules.get(team.pk, {}) if team is not None else {}
        for rule_spec in spec.rules:
            error = unit_change_error(stored=rules.get(rule_spec.name), unit=rule_spec.unit)
            if error is not None:
                errors.append(f"{rule_spec.path}: {error}")
        if prune:
            declared_rules = {rule_spec.name for rule_spec in spec.rules}
            for name, rule in sorted(rules.items()):
                if name not in declared_rules and rule.in_use > 0:
                    errors.append(
                        f"{spec.path}.quotas: rule {name!r} is not declared but has "
                        f"{rule.in_use} in use; a rule in use is never deleted"
                    )
    if prune:
        errors.extend(_undeletable_teams(state.undeclared_teams(policy)))
    return errors + _closed_period_conflicts(policy=policy, state=state, prune=prune)


def _closed_period_conflicts(*, policy: Policy, state: _State, prune: bool) -> list[str]:
    """Rate cards whose change, creation or deletion would price a closed period differently."""
    if policy.rates is None or not state.closed_periods:
        return []
    errors = []
    for spec in policy.rates:
        error = rate_change_error(
            before=state.rate_cards.get(spec.key), after=spec, periods=state.closed_periods
        )
        if error:
            errors.append(f"{spec.path}: {error}")
    if prune:
        declared = {spec.key for spec in policy.rates}
        for key, card in sorted(state.rate_cards.items()):
            if key not in declared:
                error = rate_change_error(before=card, after=None, periods=state.closed_periods)
                if error:
                    errors.append(f"rates: not declared, but {error}")
    return errors


def _rate_key(card: RateCard) -> RateKey:
    return (card.product_name, card.profile, card.currency, card.valid_from)


def _undeletable_teams(teams: list[Team]) -> list[str]:
    """Teams that rows elsewhere keep (PROTECT or RESTRICT): reservations, statements, usage."""
    errors = []
    for team in teams:
        held = []
        for relation in Team._meta.related_objects:
            if relation.on_delete not in (models.PROTECT, models.RESTRICT):
                continue
            model = relation.related_model
            assert not isinstance(model, str)  # resolved once apps are loaded
            rows = model._default_manager.filter(**{relation.field.name: team})
            count = rows.count()
            if not count:
                continue
            meta = model._meta
            label = f"{count} {meta.verbose_name if count == 1 else meta.verbose_name_plural}"
            if model is Reservation:
                label += f" ({rows.exclude(state=ReservationState.RELEASED).count()} live)"
            held.append(label)
        if held:
            errors.append(
                f"teams: team {team.slug!r} is not declared but has {', '.join(held)}, "
                "which keep their team; it is not deleted"
            )
    return errors


class _Applier:
    """The writes of one `apply_policy`, each audited and reported."""

    def __init__(
        self, *, state: _State, actor: str, report: ApplyReport, force: bool, at: datetime
    ) -> None:
        self.force = force
        self.at = at
        self.state = state
        self.actor = actor
        self.report = report
        # Teams whose rules or namespaces changed: their usage is recounted.
        self.recount: set[int] = set()
        # Where the open billing periods begin (`billing.rates.open_since`), read once, with
        # the periods locked, when a namespace gets its first owner; None: not read yet.
        self._open_since: tuple[datetime | None] | None = None
        # Model -> the unit its rate cards price an hour of (`_rate_name`); None: not read yet.
        self._product_units: dict[str, str] | None = None

    def apply(self, *, policy: Policy, prune: bool) -> None:
        users = self._users(policy.teams)
        teams = [(spec, self._team(spec)) for spec in policy.teams]
        for spec, team in teams:
            for namespace in spec.namespaces:
                self._namespace(team, namespace)
            self._memberships(spec, team, users)
            self._rules(spec, team)
            if spec.budget is not None:
                self._budget(spec.budget, team)
            if spec.gangs is not None:
                _, changed = self._put(
                    self.state.gang_policies.get(team.pk),
                    GangPolicy,
                    identity={"team": team},
                    values={"mode": spec.gangs},
                )
                if changed:
                    self.recount.add(team.pk)  # gangs: off releases the team's gang holds
            if spec.narrow_to_fit is not None:
                self._put(
                    self.state.narrowing_policies.get(team.pk),
                    NarrowingPolicy,
                    identity={"team": team},
                    values={"narrow_to_fit": spec.narrow_to_fit},
                )
            if spec.idle_alert is not None:
                self._put(
                    self.state.idle_alert_policies.get(team.pk),
                    IdleAlertPolicy,
                    identity={"team": team},
                    values={
                        "below_percent": spec.idle_alert.below_percent,
                        "for_hours": spec.idle_alert.for_hours,
                        "enabled": spec.idle_alert.enabled,
                    },
                )
        for rate_spec in policy.rates or ():
            self._rate(rate_spec)
        for driver, profile_spec in (policy.drivers or {}).items():
            self._put(
                self.state.driver_profiles.get(driver),
                DriverProfile,
                identity={"driver": driver},
                values={"spec": profile_spec, "source": "policy"},
            )
        if policy.drivers is None and prune and self._policy_profiles():
            self.report.notes.append(
                "drivers: not declared, so the driver profiles are not this file's: "
                "--prune keeps them"
            )
        if policy.versions is not None:
            self._versions(policy.versions, prune=prune)
        if policy.sso_groups is not None:
            self._sso_groups(policy.sso_groups, {spec.slug: team for spec, team in teams}, prune)
        if policy.rates is None and prune and self.state.rate_cards:
            self.report.notes.append(
                "rates: not declared, so the rate cards are not this file's: --prune keeps them"
            )
        for obj in self._undeclared(policy, teams):
            if prune:
                self._delete(obj)
            else:
                self.report.notes.append(
                    f"kept {obj._meta.verbose_name} {obj}: not declared (--prune "
                    f"{'releases' if isinstance(obj, TeamNamespace) else 'deletes'} it)"
                )

    def _versions(self, specs: VersionPolicy, *, prune: bool) -> None:
        before = version_matrix()
        changes = apply_version_policy(specs=specs, actor=self.actor, prune=prune)
        for entry in changes.entries:
            self.report.add_entry(entry)
        self.report.notes.extend(changes.notes)
        effects = version_policy_effects(
            specs=specs, rows=changes.rows, before=before, after=version_matrix()
        )
        errors = effects.errors + ([] if self.force else effects.refusals)
        if errors:
            raise PolicyError(errors)
        self.report.notes += effects.lines + effects.warnings
        self.report.notes += [f"forced: {refusal}" for refusal in effects.refusals]

    def _undeclared(self, policy: Policy, teams: list[tuple[TeamSpec, Team]]) -> list[models.Model]:
        """What the database holds and the file does not declare; teams last."""
        undeclared: list[models.Model] = []
        for spec, team in teams:
            roles = spec.roles()
            rule_names = {rule_spec.name for rule_spec in spec.rules}
            memberships = self.state.memberships.get(team.pk, {})
            undeclared += [
                membership
                for name, membership in memberships.items()
                if name not in roles and not membership.granted_by_sso  # the sign-ins' to take
            ]
            rules = self.state.rules.get(team.pk, {})
            undeclared += [rule for name, rule in rules.items() if name not in rule_names]
            budget = self.state.budgets.get(team.pk)
            if spec.budget is None and budget is not None:
                undeclared.append(budget)
            gang_policy = self.state.gang_policies.get(team.pk)
            if spec.gangs is None and gang_policy is not None:
                undeclared.append(gang_policy)  # deleted: the team's gangs are enforced
            narrowing_policy = self.state.narrowing_policies.get(team.pk)
            if spec.narrow_to_fit is None and narrowing_policy is not None:
                undeclared.append(narrowing_policy)  # deleted: the team's claims are not narrowed
            idle_alert_policy = self.state.idle_alert_policies.get(team.pk)
            if spec.idle_alert is None and idle_alert_policy is not None:
                undeclared.append(idle_alert_policy)  # deleted: the default rule applies
        declared_slugs = {spec.slug for spec in policy.teams}
        declared_namespaces = {name for spec in policy.teams for name in spec.namespaces}
        undeclared += [
            namespace
            for name, namespace in sorted(self.state.namespaces.items())
            if name not in declared_namespaces and namespace.team.slug in declared_slugs
        ]
        if policy.rates is not None:
            declared_rates = {rate_spec.key for rate_spec in policy.rates}
            undeclared += [
                card
                for key, card in sorted(self.state.rate_cards.items())
                if key not in declared_rates
            ]
        if policy.drivers is not None:
            undeclared += [
                row for row in self._policy_profiles() if row.driver not in policy.drivers
            ]
        return undeclared + list(self.state.undeclared_teams(policy))

    def _sso_groups(
        self, specs: tuple[SsoGroupSpec, ...], teams: dict[str, Team], prune: bool
    ) -> None:
        """Make the stored `sso.groups` lines match the file's; lines it no longer has are
        deleted with `prune` (the role is then taken at each user's next sign-in), else noted."""
        stored = {
            (row.group, row.role, row.team.slug if row.team else ""): row
            for row in SsoGroupRole.objects.select_related("team").select_for_update(of=("self",))
        }
        for spec in specs:
            if spec.key not in stored:
                team = teams[spec.team] if spec.team is not None else None
                row = SsoGroupRole(group=spec.group, role=spec.role, team=team)
                self.report.add_entry(audit.create(actor=self.actor, obj=row))
        declared = {spec.key for spec in specs}
        for key, row in sorted(stored.items()):
            if key in declared:
                continue
            if prune:
                self._delete(row)
            else:
                self.report.notes.append(
                    f"kept SSO group role {row}: not declared (--prune deletes it)"
                )

    def _policy_profiles(self) -> list[DriverProfile]:
        """The stored driver profiles a policy file wrote; those written by hand are not its."""
        return [
            row for _, row in sorted(self.state.driver_profiles.items()) if row.source == "policy"
        ]

    def _users(self, teams: Iterable[TeamSpec]) -> dict[str, Any]:
        """The users the teams name, by username; missing ones created, password unusable.

        Each named user's row is locked (in id order) and their memberships read again under
        the lock, which a sign-in holds too (`teams.sso.apply_sso_groups`): a membership a
        sign-in gave after this transaction read the state is seen, and made the file's,
        rather than inserted twice (a unique violation that failed the whole apply); a sign-in
        meanwhile waits for this transaction. A user a sign-in creates at the same moment is
        taken as found, not created twice.
        """
        user_model = get_user_model()
        name_field = user_model.USERNAME_FIELD
        named = {f"{name_field}__in": sorted({name for spec in teams for name in spec.roles()})}
        found = set(user_model._default_manager.filter(**named).values_list(name_field, flat=True))
        for username in named[f"{name_field}__in"]:
            if username in found:
                continue
            user = user_model(**{name_field: username})
            user.set_unusable_password()
            try:
                with transaction.atomic():  # a savepoint: a sign-in may create them meanwhile
                    user.save()
            except IntegrityError:
                if not user_model._default_manager.filter(**{name_field: username}).exists():
                    raise
                continue  # a sign-in created them first: locked and read below
            self.report.add(action="created", object_type="user", line=f"created user {username}")
        users = {
            user.get_username(): user
            for user in user_model._default_manager.select_for_update()
            .filter(**named)
            .order_by("pk")
        }
        teams_by_id = {team.pk: team for team in self.state.teams.values()}
        users_by_id = {user.pk: user for user in users.values()}
        for held in self.state.memberships.values():
            for username in users.keys() & held.keys():
                del held[username]
        for membership in Membership.objects.filter(user__in=users.values()):
            if (team := teams_by_id.get(membership.team_id)) is None:
                continue  # a team made since the state was read: not this file's to change
            membership.user = users_by_id[membership.user_id]
            membership.team = team
            self.state.memberships[team.pk][membership.user.get_username()] = membership
        return users

    def _team(self, spec: TeamSpec) -> Team:
        team, _ = self._put(
            self.state.teams.get(spec.slug),
            Team,
            identity={"slug": spec.slug},
            values={"name": spec.name, "cost_centre": spec.cost_centre},
        )
        self.state.teams[spec.slug] = team
        return team

    def _namespace(self, team: Team, name: str) -> None:
        """`team` owns the namespace from this hour (`teams.ownership`: dated, so the hours
        before stay charged to whoever owned them; a first owner takes its hours in the open
        periods). Moved from another team, the namespace is never unowned in between."""
        current = self.state.namespaces.get(name)
        if current is not None and current.team_id == team.pk:
            return
        self.recount |= {team.pk} if current is None else {current.team_id, team.pk}
        if self._open_since is None:
            self._open_since = (open_since(lock=True),)
        ownership, entries = assign_namespace(
            namespace=name,
            team=team,
            actor=self.actor,
            at=self.at,
            open_since=self._open_since[0],
        )
        for entry in entries:
            self.report.add_entry(entry)
        ownership.team = team
        self.state.namespaces[name] = ownership

    def _memberships(self, spec: TeamSpec, team: Team, users: dict[str, Any]) -> None:
        current = self.state.memberships.get(team.pk, {})
        for username, role in spec.roles().items():
            self._put(
                current.get(username),
                Membership,
                identity={"team": team, "user": users[username]},
                values={"role": role, "granted_by_sso": False},
            )

    def _rules(self, spec: TeamSpec, team: Team) -> None:
        current = self.state.rules.get(team.pk, {})
        for rule_spec in spec.rules:
            # Through the one service every rule is saved by (the admin's too); the team's
            # usage is recounted once, after its namespaces moved (`apply_policy`).
            saved = save_rule(
                team=team,
                stored=current.get(rule_spec.name),
                values=RuleValues(
                    name=rule_spec.name,
                    device_class=rule_spec.device_class,
                    selector=rule_spec.selector,
                    unit=rule_spec.unit,
                    limit=rule_spec.limit,
                    mode=rule_spec.mode,
                ),
                actor=self.actor,
                recount=False,
            )
            if saved.entry is not None:
                self.report.add_entry(saved.entry)
                self.recount.add(team.pk)

    def _budget(self, spec: BudgetSpec, team: Team) -> None:
        _, entry = set_budget(
            team=team, gpu_hours=spec.gpu_hours, mode=spec.mode, unit=spec.unit, actor=self.actor
        )
        if entry is not None:
            self.report.add_entry(entry)

    def _rate(self, spec: RateSpec) -> None:
        product_name, profile, currency, valid_from = spec.key
        saved = save_rate_card(
            card=self.state.rate_cards.get(spec.key),
            values={
                "product_name": product_name,
                "profile": profile,
                "currency": currency,
                "valid_from": valid_from,
                "valid_until": spec.valid_until,
                "per_gpu_hour": spec.per_gpu_hour,
                "idle_factor": spec.idle_factor,
            },
            actor=self.actor,
            closed=self.state.closed_periods,
            # `_check_overlaps` checked the declared cards whole, the stored ones are replaced.
            check_overlap=False,
        )
        if saved.entry is not None:
            self.report.add_entry(saved.entry, name=self._rate_name(saved.card))
        self.state.rate_cards[spec.key] = saved.card

    def _rate_name(self, card: RateCard) -> str:
        """The card priced per hour of its model's unit (`USD/TPU chip-hour`): the unit of the
        model's accelerators in the inventory, "accelerator" when they differ, GPU when none
        is known yet. Read in one query, when the first rate card changes."""
        if self._product_units is None:
            found: dict[str, set[str]] = defaultdict(set)
            for product_name, unit in (
                Device.objects.exclude(kind=DeviceKind.OTHER)
                .exclude(product_name="")
                .values_list("product_name", "unit")
                .distinct()
            ):
                found[product_name].add(unit)
            self._product_units = {
                product: units.pop() if len(units) == 1 else DeviceUnit.ACCELERATOR
                for product, units in found.items()
            }
        return card.describe(self._product_units.get(card.product_name, DeviceUnit.GPU))

    def _put(
        self,
        obj: _Model | None,
        model: type[_Model],
        *,
        identity: dict[str, Any],
        values: dict[str, Any],
    ) -> tuple[_Model, bool]:
        """Create `model(**identity, **values)` when `obj` (the stored one) is None, else set
        `values` on it and save what changed; audited either way. Returns the object and
        whether anything was written."""
        if obj is None:
            obj = model(**identity, **values)
            self.report.add_entry(audit.create(actor=self.actor, obj=obj))
            return obj, True
        before = audit.snapshot(obj)
        for name, value in values.items():
            setattr(obj, name, value)
        return obj, self._update(obj, before)

    def _update(self, obj: models.Model, before: dict[str, Any]) -> bool:
        entry = audit.update(actor=self.actor, obj=obj, before=before)
        if entry is not None:
            self.report.add_entry(entry)
        return entry is not None

    def _delete(self, obj: models.Model) -> None:
        if isinstance(obj, TeamNamespace):
            self.recount.add(obj.team_id)  # its claims count for no team now
            # Released, not deleted: the hours it owned stay its own.
            for entry in release_namespace(ownership=obj, actor=self.actor, at=self.at):
                self.report.add_entry(entry)
            return
        entries = []
        # The cascade would delete a team's budget unaudited.
        if isinstance(obj, Team) and (budget := self.state.budgets.get(obj.pk)) is not None:
            entries += audit.delete(actor=self.actor, obj=budget)
        if isinstance(obj, RateCard):
            entry = delete_rate_card(card=obj, actor=self.actor, closed=self.state.closed_periods)
            self.report.add_entry(entry, name=self._rate_name(obj))
        else:
            entries += audit.delete(actor=self.actor, obj=obj)
        for entry in entries:
            self.report.add_entry(entry)
