"""Metering in Django admin, read-only: agent tokens, samples, dirty hours, MIG spells and
usage rows are written by metering's services only. Agent tokens show their hash: the token
itself is never stored.
"""

from __future__ import annotations

from django.contrib import admin

from metering.models import (
    AgentToken,
    DirtyHour,
    MigInstance,
    Sample,
    UnknownDeviceSample,
    UsageHour,
)
from teams.admin import ReadOnlyAdmin


@admin.register(AgentToken)
class AgentTokenAdmin(ReadOnlyAdmin):
    list_display = ("cluster", "node", "created_at", "revoked_at")
    list_filter = ("cluster",)
    search_fields = ("node", "token_sha256")
    fields = ("cluster", "node", "token_sha256", "created_at", "revoked_at")


@admin.register(Sample)
class SampleAdmin(ReadOnlyAdmin):
    list_display = ("device_uuid", "ts_ms", "gpu_util", "mem_used_bytes", "node", "received_at")
    search_fields = ("device_uuid", "node")
    show_full_result_count = False


@admin.register(UnknownDeviceSample)
class UnknownDeviceSampleAdmin(SampleAdmin):
    pass


@admin.register(DirtyHour)
class DirtyHourAdmin(ReadOnlyAdmin):
    list_display = ("hour", "marked_at", "version")
    ordering = ("-hour",)


@admin.register(MigInstance)
class MigInstanceAdmin(ReadOnlyAdmin):
    """A GPU instance's spells, one device's each, in time order."""

    list_display = (
        "cluster",
        "node",
        "parent_uuid",
        "gpu_instance_id",
        "meter_id",
        "first_ms",
        "last_ms",
    )
    list_filter = ("cluster",)
    search_fields = ("node", "parent_uuid", "meter_id")
    list_select_related = ("cluster",)
    ordering = ("cluster", "node", "parent_uuid", "gpu_instance_id", "first_ms")


@admin.register(UsageHour)
class UsageHourAdmin(ReadOnlyAdmin):
    list_display = (
        "hour",
        "team",
        "namespace",
        "claim_name",
        "product_name",
        "profile",
        "allocated_gpu_ms",
        "utilised_gpu_ms",
    )
    list_filter = ("team", "product_name")
    search_fields = ("namespace", "claim_name", "device_uuid", "job", "username")
    list_select_related = ("team",)
    date_hierarchy = "hour"
    ordering = ("-hour",)
    show_full_result_count = False
