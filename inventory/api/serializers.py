"""The fleet report's shape (`inventory.selectors.fleet_report`), for the schema and output."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from inventory.checks import CHECKS
from inventory.models import SHARE_DIGITS, SHARE_PLACES
from inventory.versions import COMPUTED, SET

# `unit` is a CharField, not a ChoiceField: DRF Spectacular names one enum per set of choices,
# and several serializers have a `unit` of their own.
UNIT_HELP = "What the model's devices count: gpu, tpu, gaudi or accelerator."


class CapacitySerializer(serializers.Serializer[Any]):
    product_name = serializers.CharField()
    unit = serializers.CharField(help_text=UNIT_HELP + " Rows of different units never add up.")
    unit_label = serializers.CharField(help_text='The unit in the plural ("GPUs", "TPU chips").')
    gpus = serializers.IntegerField(help_text="Physical units of the model (GPUs, TPU chips...).")
    allocated = serializers.IntegerField(help_text="Physical units with anything held.")
    free = serializers.IntegerField(help_text="Physical units with nothing held.")
    mig_devices = serializers.IntegerField()
    equivalents = serializers.DecimalField(
        max_digits=15,
        decimal_places=6,
        help_text="The capacity in units: 1 per physical unit published whole or as MIG "
        "devices, the shares of its partitions for one published only as partitions (a VM's "
        "A100-4C vGPU is 0.1 GPU), at most 1 per unit.",
    )


class VersionPairSerializer(serializers.Serializer[Any]):
    driver_version = serializers.CharField()
    cuda_driver_version = serializers.CharField()


class BaselineSerializer(VersionPairSerializer):
    # A field named like Field.source: DRF moves declared fields off the class, so it works.
    source = serializers.ChoiceField(choices=(SET, COMPUTED))  # type: ignore[assignment]
    scope = serializers.CharField(
        allow_blank=True,
        help_text='A set baseline\'s scope ("product", "architecture", "cluster").',
    )
    driver = serializers.CharField(
        allow_blank=True, help_text="The DRA driver a set baseline names; empty: none."
    )


class DriverMatrixRowSerializer(VersionPairSerializer):
    cluster = serializers.CharField()
    product_name = serializers.CharField(allow_blank=True)
    architecture = serializers.CharField(allow_blank=True)
    nodes = serializers.IntegerField(help_text="How many nodes run this pair for this model.")
    node_names = serializers.ListField(child=serializers.CharField())
    gpus = serializers.IntegerField()
    baseline = serializers.BooleanField(help_text="Whether this is the model's baseline pair.")
    documented_nodes = serializers.ListField(
        child=serializers.CharField(), help_text="Nodes a deviation documents on this pair."
    )
    outlier_nodes = serializers.ListField(
        child=serializers.CharField(), help_text="Nodes on this pair no deviation documents."
    )


class DeviationSerializer(VersionPairSerializer):
    id = serializers.IntegerField()
    cluster = serializers.CharField()
    driver = serializers.CharField(allow_blank=True, help_text="The DRA driver; empty: any.")
    node_name = serializers.CharField(allow_blank=True)
    pool = serializers.CharField(allow_blank=True)
    reason = serializers.CharField()
    owner = serializers.CharField()
    expires_at = serializers.DateTimeField()
    expired = serializers.BooleanField(help_text="Expired: its nodes are outliers again.")


class DeviationRegisterSerializer(VersionPairSerializer):
    """One row of the deviation register (`inventory.selectors.deviation_register`)."""

    id = serializers.IntegerField()
    cluster = serializers.CharField()
    driver = serializers.CharField(allow_blank=True, help_text="The DRA driver; empty: any.")
    node_name = serializers.CharField(allow_blank=True, help_text="The node; empty: any.")
    pool = serializers.CharField(allow_blank=True, help_text="The DRA pool; empty: any.")
    reason = serializers.CharField()
    owner = serializers.CharField()
    expires_at = serializers.DateTimeField()
    expired = serializers.BooleanField(help_text="Expired: its GPUs are outliers again.")
    documented_gpus = serializers.IntegerField(
        help_text="Physical GPUs off their baseline it documents now (0: none)."
    )
    taint_state = serializers.CharField(
        help_text='Its taint as read from the cluster: "applied", "planned, not applied", '
        '"held by the limit", or why there is none or it is unknown.'
    )


class OutlierSerializer(VersionPairSerializer):
    cluster = serializers.CharField()
    node = serializers.CharField(allow_blank=True)
    driver = serializers.CharField()
    pool = serializers.CharField()
    product_name = serializers.CharField(allow_blank=True)
    gpus = serializers.IntegerField()
    deviation = DeviationSerializer(allow_null=True, help_text="null: undocumented.")


class ModelVersionsSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    driver = serializers.CharField(help_text="The DRA driver of the model's devices.")
    product_name = serializers.CharField(allow_blank=True)
    architecture = serializers.CharField(allow_blank=True)
    baseline = BaselineSerializer()
    gpus = serializers.IntegerField()
    nodes = serializers.ListField(
        child=serializers.CharField(), help_text="Nodes whose GPUs of the model publish versions."
    )
    nodes_on_baseline = serializers.ListField(child=serializers.CharField())
    gpus_on_baseline = serializers.IntegerField()
    outliers = OutlierSerializer(many=True)
    outlier_gpus = serializers.IntegerField(help_text="Outlier GPUs no deviation documents.")
    documented_gpus = serializers.IntegerField(help_text="Outlier GPUs a deviation documents.")
    unknown_gpus = serializers.IntegerField(
        help_text="GPUs that publish no version the baseline pins: neither on it nor outliers."
    )


class FreeBlockSerializer(serializers.Serializer[Any]):
    unit = serializers.CharField(help_text=UNIT_HELP)
    unit_label = serializers.CharField(help_text='The unit in the plural ("GPUs", "TPU chips").')
    product_name = serializers.CharField()
    largest_free_block = serializers.IntegerField(
        help_text="The most wholly free units of this model on one node."
    )
    largest_free_clique_block = serializers.IntegerField(
        help_text="The most wholly free units of this model in one NVLink clique of a node."
    )


class FragmentationSerializer(serializers.Serializer[Any]):
    nodes_free = serializers.IntegerField()
    nodes_partial = serializers.IntegerField()
    nodes_full = serializers.IntegerField()
    largest_free_block = serializers.IntegerField(
        help_text="The largest of `free_blocks`: never a sum of two models or units."
    )
    largest_free_clique_block = serializers.IntegerField(
        help_text="The largest in one clique, of `free_blocks`."
    )
    free_blocks = FreeBlockSerializer(many=True, help_text="Per unit and model.")
    gpus_partial = serializers.IntegerField(help_text="Physical GPUs partly held now.")
    partial_free_share = serializers.DecimalField(
        max_digits=15,
        decimal_places=6,
        help_text="Units free on partly held GPUs (in no whole-GPU count), all units summed.",
    )
    partial_free_by_unit = serializers.DictField(
        child=serializers.DecimalField(max_digits=15, decimal_places=6),
        help_text="The same by unit (gpu, tpu, gaudi, accelerator), as they do not add up.",
    )


class PartlyUsedNodeSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    node = serializers.CharField()
    clique = serializers.CharField(allow_blank=True)
    unit = serializers.CharField(help_text='What its shares count; "accelerator" when mixed.')
    unit_label = serializers.CharField(help_text='The unit in the plural ("GPUs").')
    gpus = serializers.IntegerField()
    allocated = serializers.IntegerField(help_text="GPUs with anything held.")
    free = serializers.IntegerField(help_text="GPUs with nothing held.")
    gpus_full = serializers.IntegerField(help_text="GPUs wholly held.")
    gpus_partial = serializers.IntegerField(help_text="GPUs partly held.")
    free_share = serializers.DecimalField(
        max_digits=15, decimal_places=6, help_text="Free GPUs plus the free share of partly held."
    )
    state = serializers.ChoiceField(choices=("free", "partly used", "full"))
    free_slices = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="Unheld non-overlapping slices on its partly held GPUs, by profile.",
    )
    largest_placeable = serializers.CharField(
        allow_blank=True, help_text='The largest device a claim could get now ("3g.40gb").'
    )
    largest_placeable_share = serializers.DecimalField(
        max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES
    )


class PartialGpuSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    node = serializers.CharField(allow_blank=True)
    physical_gpu_key = serializers.CharField()
    product_name = serializers.CharField(allow_blank=True)
    unit = serializers.CharField(help_text="What the shares count (gpu, tpu, gaudi, ...).")
    unit_label = serializers.CharField(help_text='The unit\'s name ("GPU", "TPU chip").')
    held_share = serializers.DecimalField(max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES)
    free_share = serializers.DecimalField(max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES)
    held_label = serializers.CharField(help_text='"3/7" for sevenths, else a percentage.')
    free_label = serializers.CharField(help_text='"4/7" for sevenths, else a percentage.')
    held_devices = serializers.DictField(
        child=serializers.IntegerField(), help_text="Held devices by profile (else name)."
    )
    free_slices = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="Unheld slices that overlap nothing (static MIG, fixed partitions) and the "
        "default shares still free on held shared devices (KEP-5075), by profile.",
    )
    overlapping_unheld = serializers.BooleanField(
        help_text="Unheld devices that overlap others exist (partitionable, the whole GPU)."
    )
    placeable = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="Unheld devices a claim could get now, each on its own, by profile or share.",
    )
    placeable_alone = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="Those of them that are no free slice (overlapping devices, the largest share "
        "of a shared device): a claim gets only one of them.",
    )
    largest_placeable = serializers.CharField(
        allow_blank=True, help_text="The largest of them; empty when none is."
    )
    largest_placeable_share = serializers.DecimalField(
        max_digits=SHARE_DIGITS, decimal_places=SHARE_PLACES
    )


class SyncWarningSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    check = serializers.ChoiceField(choices=list(CHECKS), help_text="Which check found it.")
    driver = serializers.CharField()
    pool = serializers.CharField()
    generation = serializers.IntegerField(
        allow_null=True, help_text="The pool generation concerned (an incomplete pool's newest)."
    )
    devices = serializers.ListField(
        child=serializers.CharField(), help_text="The devices concerned, if any."
    )
    message = serializers.CharField(help_text="One line saying what is wrong, and where.")
    since = serializers.DateTimeField(
        help_text="Since when it has been true: when the generation concerned was first seen "
        "(an incomplete pool's newest)."
    )


class FleetReportSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField(allow_null=True)
    nodes = serializers.IntegerField()
    gpus_by_model = serializers.DictField(child=serializers.IntegerField())
    mig_devices = serializers.IntegerField()
    capacity = CapacitySerializer(many=True)
    driver_matrix = DriverMatrixRowSerializer(many=True)
    baseline = BaselineSerializer(allow_null=True)
    baselines = serializers.DictField(child=BaselineSerializer(allow_null=True))
    version_models = ModelVersionsSerializer(
        many=True, help_text="Per cluster and model: its baseline, the GPUs on it, outliers."
    )
    outlier_nodes = serializers.ListField(
        child=serializers.CharField(), help_text="Nodes with GPUs off their model's baseline."
    )
    documented_nodes = serializers.ListField(
        child=serializers.CharField(), help_text="Nodes whose outliers a deviation documents."
    )
    unknown_nodes = serializers.ListField(
        child=serializers.CharField(),
        help_text="Nodes whose GPUs publish no version their baseline pins: neither on it nor "
        "outliers, never tainted.",
    )
    outlier_gpus = serializers.IntegerField(
        help_text="Physical GPUs off their baseline that no deviation documents."
    )
    deviations = DeviationSerializer(many=True, help_text="The deviation register.")
    fragmentation = FragmentationSerializer()
    partly_used_nodes = PartlyUsedNodeSerializer(many=True)
    partial_gpus = PartialGpuSerializer(many=True)
    sync_warnings = SyncWarningSerializer(
        many=True, help_text="What the sync stored but cannot trust (inventory.checks)."
    )
