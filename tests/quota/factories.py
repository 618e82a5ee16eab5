"""factory_boy factories for quota: teams, their namespaces, members and rules, reservations.

    rule = QuotaRuleFactory.create(team__slug="vision", limit=8)
    ReservationFactory.create(team=rule.team)      # a live reservation of that team

`DeviceClassFactory` gives the inventory a present DeviceClass, which the policy checks against.
"""

from __future__ import annotations

from decimal import Decimal

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from inventory.models import DeviceClass
from quota.models import Mode, QuotaRule, Reservation, Unit
from teams.models import Membership, Role, Team, TeamNamespace
from tests.factories import GPU_DRIVER, ClusterFactory


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ("username",)

    username = factory.Sequence(lambda n: f"user-{n}")


class TeamFactory(factory.django.DjangoModelFactory[Team]):
    class Meta:
        model = Team
        django_get_or_create = ("slug",)

    slug = factory.Sequence(lambda n: f"team-{n}")
    name = factory.LazyAttribute(lambda team: team.slug.title())


class TeamNamespaceFactory(factory.django.DjangoModelFactory[TeamNamespace]):
    class Meta:
        model = TeamNamespace

    team = factory.SubFactory(TeamFactory)
    namespace = factory.Sequence(lambda n: f"ns-{n}")


class MembershipFactory(factory.django.DjangoModelFactory[Membership]):
    class Meta:
        model = Membership

    team = factory.SubFactory(TeamFactory)
    user = factory.SubFactory(UserFactory)
    role = Role.MEMBER


class QuotaRuleFactory(factory.django.DjangoModelFactory[QuotaRule]):
    class Meta:
        model = QuotaRule

    team = factory.SubFactory(TeamFactory)
    name = factory.Sequence(lambda n: f"rule-{n}")
    device_class = GPU_DRIVER
    selector = ""
    unit = Unit.GPUS
    limit = Decimal(8)
    mode = Mode.ENFORCE


class ReservationFactory(factory.django.DjangoModelFactory[Reservation]):
    """A live (reserved) reservation of `team` for a claim in the default cluster."""

    class Meta:
        model = Reservation

    cluster = "cluster-0"
    namespace = "default"
    name = factory.Sequence(lambda n: f"claim-{n}")
    team = factory.SubFactory(TeamFactory)
    created_at = factory.LazyFunction(timezone.now)


class DeviceClassFactory(factory.django.DjangoModelFactory[DeviceClass]):
    """A present DeviceClass (default `gpu.nvidia.com`) of a cluster."""

    class Meta:
        model = DeviceClass

    cluster = factory.SubFactory(ClusterFactory, name="cluster-0")
    name = GPU_DRIVER
    api_version = "resource.k8s.io/v1"
    selectors = factory.LazyAttribute(lambda cls: [f'device.driver == "{GPU_DRIVER}"'])
    first_seen = factory.LazyFunction(timezone.now)
