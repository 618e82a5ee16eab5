"""The fleet report's shape (`inventory.selectors.fleet_report`), for the schema and output."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers


class CapacitySerializer(serializers.Serializer[Any]):
    product_name = serializers.CharField()
    gpus = serializers.IntegerField()
    allocated = serializers.IntegerField()
    free = serializers.IntegerField()
    mig_devices = serializers.IntegerField()


class VersionPairSerializer(serializers.Serializer[Any]):
    driver_version = serializers.CharField()
    cuda_driver_version = serializers.CharField()


class BaselineSerializer(VersionPairSerializer):
    # A field named like Field.source: DRF moves declared fields off the class, so it works.
    source = serializers.ChoiceField(choices=("operator", "most_common"))  # type: ignore[assignment]


class DriverMatrixRowSerializer(VersionPairSerializer):
    cluster = serializers.CharField()
    nodes = serializers.IntegerField(help_text="How many nodes run this pair.")
    node_names = serializers.ListField(child=serializers.CharField())
    gpus = serializers.IntegerField()
    baseline = serializers.BooleanField()


class FragmentationSerializer(serializers.Serializer[Any]):
    nodes_free = serializers.IntegerField()
    nodes_partial = serializers.IntegerField()
    nodes_full = serializers.IntegerField()
    largest_free_block = serializers.IntegerField()
    largest_free_clique_block = serializers.IntegerField()
    gpus_partial = serializers.IntegerField(help_text="Physical GPUs partly held now.")
    partial_free_share = serializers.DecimalField(
        max_digits=15,
        decimal_places=6,
        help_text="GPU-equivalents free on partly held GPUs (in no whole-GPU count).",
    )


class PartialGpuSerializer(serializers.Serializer[Any]):
    cluster = serializers.CharField()
    node = serializers.CharField(allow_blank=True)
    physical_gpu_key = serializers.CharField()
    product_name = serializers.CharField(allow_blank=True)
    held_share = serializers.DecimalField(max_digits=9, decimal_places=6)
    free_share = serializers.DecimalField(max_digits=9, decimal_places=6)
    held_label = serializers.CharField(help_text='"3/7" for sevenths, else a percentage.')
    held_devices = serializers.DictField(
        child=serializers.IntegerField(), help_text="Held devices by profile (else name)."
    )
    free_slices = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="Unheld statically created MIG devices by profile.",
    )
    overlapping_unheld = serializers.BooleanField(
        help_text="Unheld partitionable devices exist; only the free share is known."
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
    outlier_nodes = serializers.ListField(child=serializers.CharField())
    fragmentation = FragmentationSerializer()
    partial_gpus = PartialGpuSerializer(many=True)
