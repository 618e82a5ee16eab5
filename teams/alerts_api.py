"""`/api/v1/alerts/`: the alerts a user may see (`teams.alerts.visible_alerts`), and snoozing
one (`POST /api/v1/alerts/{id}/snooze/ {"hours": 4}`; `0` lifts it) for the team's leads and
operators."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import django_filters
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from core.parsers import JsonParser
from teams.alerts import may_snooze, snooze_alert, visible_alerts
from teams.api import ReadOnlyModelSerializer, TallyViewSet
from teams.models import Alert, AlertKind, AlertState

# A week: longer silence is a policy change (the team's idleAlert), not a snooze.
MAX_SNOOZE_HOURS = 168


class AlertSerializer(ReadOnlyModelSerializer):
    team: serializers.SlugRelatedField[Any] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )

    class Meta:
        model = Alert
        fields = [
            "id",
            "kind",
            "key",
            "team",
            "subject",
            "description",
            "labels",
            "recipients",
            "state",
            "first_seen",
            "last_seen",
            "resolved_at",
            "snoozed_until",
            "snoozed_by",
        ]


class SnoozeSerializer(serializers.Serializer[Any]):
    hours = serializers.IntegerField(
        min_value=0,
        max_value=MAX_SNOOZE_HOURS,
        help_text=f"How long nothing is sent for the alert's key (0 lifts the snooze; at most "
        f"{MAX_SNOOZE_HOURS}).",
    )


class AlertFilterSet(django_filters.FilterSet):
    state = django_filters.ChoiceFilter(choices=AlertState.choices)
    kind = django_filters.ChoiceFilter(choices=AlertKind.choices)
    team = django_filters.CharFilter(field_name="team__slug")

    class Meta:
        model = Alert
        fields = ["state", "kind", "team"]


@extend_schema(tags=["teams"])
class AlertViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, TallyViewSet):
    """Idle-claim, stranded-gang and version-outlier alerts of your teams (operators: all),
    firing and resolved, newest first."""

    serializer_class = AlertSerializer
    filterset_class = AlertFilterSet
    parser_classes = [JsonParser]
    lookup_value_regex = r"\d+"
    ordering_fields = ("first_seen", "last_seen", "kind", "state")
    ordering = ("-last_seen", "-pk")

    def get_queryset(self) -> QuerySet[Alert]:
        return visible_alerts(user=self.request.user).select_related("team")

    @extend_schema(
        operation_id="alerts_snooze", request=SnoozeSerializer, responses={200: AlertSerializer}
    )
    @action(detail=True, methods=["post"])
    def snooze(self, request: Request, pk: str | None = None) -> Response:
        """Silence the alert's key for `hours` (the team's leads and operators); its firing
        notification waits until then, and the key firing again meanwhile stays quiet."""
        alert = self.get_object()
        if not may_snooze(user=request.user, alert=alert):
            raise PermissionDenied("Only the team's leads and operators may snooze its alerts.")
        given = SnoozeSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        hours = given.validated_data["hours"]
        until = timezone.now() + timedelta(hours=hours) if hours else None
        snoozed = snooze_alert(alert=alert, until=until, actor=request.user.get_username())
        return Response(AlertSerializer(snoozed, context=self.get_serializer_context()).data)
