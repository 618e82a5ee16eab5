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
