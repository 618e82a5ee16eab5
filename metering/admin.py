"""Metering in Django admin, read-only: agent tokens, samples, dirty hours, MIG spells and
usage rows are written by metering's services only. Agent tokens show their hash: the token
itself is never stored.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse

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
    """`billing_sample` only: the recent days, and each device's first and last sample of
    older days; the rest of an older day is compacted (`metering.compaction`) and read with
    `SELECT * FROM metering_samples(lo_ms, hi_ms)`. The changelist says so."""

    list_display = ("device_uuid", "ts_ms", "gpu_util", "mem_used_bytes", "node", "received_at")
    search_fields = ("device_uuid", "node")
    show_full_result_count = False
    note = (
        "Recent days only: the samples of days older than TALLY_SAMPLE_COMPACT_AFTER_DAYS "
        "are compacted, one row of arrays per device and day, and only each device's first "
        "and last sample of such a day is listed here. Usage, statements and reports read "
        "them all (SQL: SELECT * FROM metering_samples(lo_ms, hi_ms))."
    )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if self.note:
            extra_context = {"subtitle": self.note, **(extra_context or {})}
        return super().changelist_view(request, extra_context)


@admin.register(UnknownDeviceSample)
class UnknownDeviceSampleAdmin(SampleAdmin):
    note = ""


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
