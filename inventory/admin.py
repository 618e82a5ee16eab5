"""The inventory in Django admin, for operators.

Everything the sync writes is shown read-only, with no add or delete: Kubernetes is the source
of truth and history is never deleted. What operators set here are the version baselines
(per cluster, and per model or architecture), the documented deviations from them and the
driver profiles that say how to read a DRA driver's devices, every write audited. Big tables
skip the full count and select their relations, so a changelist costs a fixed number of
queries at any size.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from inventory import profiles
from inventory.models import (
    Allocation,
    Cluster,
    Device,
    DeviceClass,
    DeviceShape,
    DriverProfile,
    Gang,
    Node,
    Pool,
    ResourceClaim,
    ResourceSlice,
    SyncState,
    VersionBaseline,
    VersionDeviation,
)
from inventory.versions import (
    deviation_is_active,
    most_common_version_pairs,
    set_baseline,
    version_drivers,
)
from teams.admin import ADMIN_CSS, AuditedAdmin


class _TimestampSetFilter(admin.SimpleListFilter):
    """Yes/no on whether a nullable timestamp (`gone_at`, `released_at`, `end`) is set."""

    field_name: str
    set_label: str
    unset_label: str

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", self.unset_label), ("yes", self.set_label)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() in {"yes", "no"}:
            return queryset.filter(**{f"{self.field_name}__isnull": self.value() == "no"})
        return queryset


class GoneFilter(_TimestampSetFilter):
    title = "presence"
    parameter_name = "gone"
    field_name = "gone_at"
    unset_label = "present"
    set_label = "gone"


class ReleasedFilter(_TimestampSetFilter):
    title = "state"
    parameter_name = "released"
    field_name = "released_at"
    unset_label = "live"
    set_label = "released"


class EndedFilter(_TimestampSetFilter):
    title = "state"
    parameter_name = "ended"
    field_name = "end"
    unset_label = "open"
    set_label = "ended"


class NodeFilter(admin.SimpleListFilter):
    """Devices of one node (`?node=<id>`, linked from the node list).

    The sidebar shows only the chosen node: listing thousands of nodes there would make the
    page heavier than the table it filters.
    """

    title = "node"
    parameter_name = "node"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        value = self.value()
        if not value or not value.isdigit():
            return []
        return [
            (str(pk), name) for pk, name in Node.objects.filter(pk=value).values_list("pk", "name")
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value and value.isdigit():
            return queryset.filter(node_id=value)
        return queryset


class SyncedAdmin(admin.ModelAdmin):
    """A model the sync owns: viewable, never added, changed or deleted by hand."""

    class Media:
        css = {"all": (ADMIN_CSS,)}

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    """A cluster is created by its first sync; operators set its baselines (below) from here."""

    list_display = ("name", "created_at", "baselines_link", "deviations_link")
    search_fields = ("name",)
    fields = ("name", "created_at")
    readonly_fields = ("name", "created_at")
    actions = ("set_baselines_to_most_common",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """Nothing here is editable; a full save would write back a stale `fleet_version`."""

    @admin.display(description="baselines")
    def baselines_link(self, cluster: Cluster) -> str:
        url = reverse("admin:inventory_versionbaseline_changelist")
        return format_html('<a href="{}?cluster__id__exact={}">baselines</a>', url, cluster.pk)

    @admin.display(description="deviations")
    def deviations_link(self, cluster: Cluster) -> str:
        url = reverse("admin:inventory_versiondeviation_changelist")
        return format_html('<a href="{}?cluster__id__exact={}">deviations</a>', url, cluster.pk)

    @admin.action(
        description="Set each model's baseline to the pair on most of its GPUs",
        permissions=["change"],
    )
    def set_baselines_to_most_common(
        self, request: HttpRequest, queryset: QuerySet[Cluster]
    ) -> None:
        for cluster in queryset:
            pairs = most_common_version_pairs(cluster=cluster)
            if not pairs:
                self.message_user(
                    request, f"{cluster}: no GPU publishes a driver version", messages.WARNING
                )
                continue
            for (driver, product), pair in pairs.items():
                set_baseline(
                    cluster=cluster,
                    driver=driver,
                    product_name=product,
                    driver_version=pair["driver_version"],
                    cuda_driver_version=pair["cuda_driver_version"],
                    actor=request.user.get_username(),
                    note="Set to the pair on most of its GPUs (admin action).",
                )
                self.message_user(
                    request,
                    f"{cluster}: baseline of {product or '(unknown model)'} ({driver}) set to "
                    "driver "
                    f"{pair['driver_version']}, CUDA {pair['cuda_driver_version'] or '(none)'}",
                    messages.SUCCESS,
                )


class VersionBaselineForm(forms.ModelForm):
    class Meta:
        model = VersionBaseline
        fields = (
            "cluster",
            "driver",
            "product_name",
            "architecture",
            "driver_version",
            "cuda_driver_version",
            "note",
        )

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        if not cleaned.get("driver_version") and not cleaned.get("cuda_driver_version"):
            raise forms.ValidationError("Give the driver version, the CUDA version or both.")
        cluster = cleaned.get("cluster")
        scoped = any(cleaned.get(name) for name in ("driver", "product_name", "architecture"))
        if (
            cluster is not None
            and not scoped
            and len(drivers := version_drivers(cluster=cluster)) > 1
        ):
            raise forms.ValidationError(
                f"{cluster} has devices of {len(drivers)} drivers ({', '.join(drivers)}): name "
                "the driver a cluster-wide baseline judges."
            )
        return cleaned


@admin.register(VersionBaseline)
class VersionBaselineAdmin(AuditedAdmin):
    """The validated driver/CUDA pair of a cluster's product, architecture or whole fleet.

    Rows the policy file declares (source "policy") are rewritten by its next apply.
    """

    class Media:
        css = {"all": (ADMIN_CSS,)}

    list_display = (
        "cluster",
        "driver",
        "product_name",
        "architecture",
        "driver_version",
        "cuda_driver_version",
        "source",
        "updated_at",
    )
    list_filter = ("cluster", "source")
    search_fields = ("product_name", "architecture", "driver_version", "note")
    list_select_related = ("cluster",)
    form = VersionBaselineForm
    fields = (*VersionBaselineForm.Meta.fields, "source", "updated_at")
    readonly_fields = ("source", "updated_at")


class VersionDeviationForm(forms.ModelForm):
    class Meta:
        model = VersionDeviation
        fields = (
            "cluster",
            "driver",
            "node_name",
            "pool",
            "driver_version",
            "cuda_driver_version",
            "reason",
            "owner",
            "expires_at",
        )

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean() or {}
        if not cleaned.get("node_name") and not cleaned.get("pool"):
            raise forms.ValidationError("Give the node, the pool or both that deviate.")
        if not cleaned.get("driver_version") and not cleaned.get("cuda_driver_version"):
            raise forms.ValidationError(
                "Give the driver version, the CUDA version or both that are allowed."
            )
        return cleaned


@admin.register(VersionDeviation)
class VersionDeviationAdmin(AuditedAdmin):
    """Documented deviations: kept out of general scheduling, not flagged, until they expire."""

    class Media:
        css = {"all": (ADMIN_CSS,)}

    form = VersionDeviationForm
    list_display = (
        "cluster",
        "driver",
        "node_name",
        "pool",
        "driver_version",
        "cuda_driver_version",
        "owner",
        "expires_at",
        "is_active",
        "source",
    )
    list_filter = ("cluster", "source")
    search_fields = ("node_name", "pool", "owner", "reason", "driver_version")
    list_select_related = ("cluster",)
    readonly_fields = ("source", "created_at")
    ordering = ("expires_at",)

    fields = (*VersionDeviationForm.Meta.fields, "source", "created_at")

    @admin.display(description="active", boolean=True)
    def is_active(self, deviation: VersionDeviation) -> bool:
        return deviation_is_active(deviation, timezone.now())


class DriverProfileForm(forms.ModelForm):
    """A driver name and a profile spec, checked as the policy file's `drivers:` section is
    (`inventory.profiles.validate_spec`), so that the next sync reads the row as saved."""

    spec = forms.JSONField(
        required=False,
        help_text=(
            "Profile keys over the driver's built-in profile, e.g. "
            '{"unit": "accelerator", "model_attributes": ["model"]}; see inventory/profiles.py.'
        ),
    )

    class Meta:
        model = DriverProfile
        fields = ("driver", "spec")

    def clean_driver(self) -> str:
        driver = str(self.cleaned_data.get("driver") or "").strip()
        if not profiles.is_driver_name(driver):
            raise forms.ValidationError(
                "Not a DRA driver name (lowercase DNS subdomain, at most 63 characters)."
            )
        return driver

    def clean_spec(self) -> dict[str, Any]:
        spec = self.cleaned_data.get("spec")
        try:
            return profiles.validate_spec({} if spec is None else spec)
        except profiles.ProfileError as exc:
            raise forms.ValidationError(str(exc)) from None


@admin.register(DriverProfile)
class DriverProfileAdmin(AuditedAdmin):
    """How to read one DRA driver's devices, over its built-in profile; every write audited.

    Rows the policy file declares (source "policy") are rewritten by its next apply, and
    pruned by it when no longer declared; rows added here (source "admin") are never its.
    """

    class Media:
        css = {"all": (ADMIN_CSS,)}

    form = DriverProfileForm
    list_display = ("driver", "unit", "description", "source", "updated_at")
    list_filter = ("source",)
    search_fields = ("driver",)
    fields = ("driver", "spec", "source", "updated_at")
    readonly_fields = ("source", "updated_at")
    ordering = ("driver",)

    @admin.display(description="unit")
    def unit(self, row: DriverProfile) -> str:
        spec = row.spec if isinstance(row.spec, dict) else {}
        return str(spec.get("unit") or "(built in)")

    @admin.display(description="description")
    def description(self, row: DriverProfile) -> str:
        spec = row.spec if isinstance(row.spec, dict) else {}
        return str(spec.get("description") or "")


@admin.register(Node)
class NodeAdmin(SyncedAdmin):
    list_display = ("name", "cluster", "clique", "first_seen", "gone_at", "devices_link")
    list_filter = ("cluster", GoneFilter)
    search_fields = ("name", "clique")
    list_select_related = ("cluster",)
    show_full_result_count = False

    @admin.display(description="devices")
    def devices_link(self, node: Node) -> str:
        url = reverse("admin:inventory_device_changelist")
        return format_html('<a href="{}?node={}&gone=no">devices</a>', url, node.pk)


@admin.register(DeviceClass)
class DeviceClassAdmin(SyncedAdmin):
    list_display = ("name", "cluster", "extended_resource_name", "api_version", "gone_at")
    list_filter = ("cluster", GoneFilter)
    search_fields = ("name", "extended_resource_name")
    list_select_related = ("cluster",)


@admin.register(ResourceSlice)
class ResourceSliceAdmin(SyncedAdmin):
    list_display = ("name", "cluster", "driver", "pool", "generation", "node_name", "gone_at")
    list_filter = ("cluster", "driver", GoneFilter)
    search_fields = ("name", "uid", "pool", "node_name")
    list_select_related = ("cluster",)
    show_full_result_count = False


@admin.register(Pool)
class PoolAdmin(SyncedAdmin):
    list_display = (
        "name",
        "cluster",
        "driver",
        "counted_generation",
        "newest_generation",
        "slices_seen",
        "slices_expected",
        "is_complete",
        "updated_at",
    )
    list_filter = ("cluster", "driver")
    search_fields = ("name", "driver")
    list_select_related = ("cluster",)
    show_full_result_count = False

    @admin.display(description="complete", boolean=True)
    def is_complete(self, pool: Pool) -> bool:
        return pool.complete


@admin.register(DeviceShape)
class DeviceShapeAdmin(SyncedAdmin):
    list_display = ("key", "cluster", "driver", "kind", "gpu_share")
    list_filter = ("kind", "driver")
    search_fields = ("key", "driver")
    list_select_related = ("cluster",)


@admin.register(Device)
class DeviceAdmin(SyncedAdmin):
    list_display = (
        "name",
        "cluster",
        "node",
        "kind",
        "product_name",
        "profile",
        "uuid",
        "driver_version",
        "cuda_driver_version",
        "gpu_share",
        "gone_at",
    )
    list_filter = (
        "kind",
        "product_name",
        "driver_version",
        "cuda_driver_version",
        NodeFilter,
        GoneFilter,
        "cluster",
    )
    search_fields = (
        "name",
        "uuid",
        "parent_uuid",
        "physical_gpu_key",
        "product_name",
        "node__name",
    )
    list_select_related = ("cluster", "node")
    show_full_result_count = False


@admin.register(ResourceClaim)
class ResourceClaimAdmin(SyncedAdmin):
    list_display = ("name", "namespace", "cluster", "uid", "created_at", "released_at")
    list_filter = (ReleasedFilter, "cluster")
    search_fields = ("name", "namespace", "uid")
    list_select_related = ("cluster",)
    show_full_result_count = False


class GangEndedFilter(_TimestampSetFilter):
    title = "state"
    parameter_name = "ended"
    field_name = "ended_at"
    unset_label = "live"
    set_label = "ended"


@admin.register(Gang)
class GangAdmin(SyncedAdmin):
    list_display = ("key", "namespace", "cluster", "source", "size", "first_seen", "ended_at")
    list_filter = (GangEndedFilter, "source", "cluster")
    search_fields = ("key", "namespace")
    list_select_related = ("cluster",)
    show_full_result_count = False


@admin.register(Allocation)
class AllocationAdmin(SyncedAdmin):
    list_display = (
        "claim",
        "request",
        "device_name",
        "device",
        "job",
        "username",
        "start",
        "end",
    )
    list_filter = (EndedFilter, "cluster", "driver")
    search_fields = (
        "claim__name",
        "job",
        "username",
        "claim__namespace",
        "device_name",
        "device__uuid",
        "device__product_name",
        "device__node__name",
    )
    list_select_related = ("claim", "device", "cluster")
    show_full_result_count = False


@admin.register(SyncState)
class SyncStateAdmin(SyncedAdmin):
    list_display = (
        "cluster",
        "kind",
        "resource_version",
        "last_event_at",
        "last_relist_at",
        "relists",
        "events_applied",
    )
    list_filter = ("cluster", "kind")
    list_select_related = ("cluster",)
