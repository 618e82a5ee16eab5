"""The fleet API counts each model in its own unit (issue 18): capacity rows and free blocks
carry `unit`, `unit_label` and, for capacity, `equivalents`, as `inventory.selectors` computes
them, on `/api/v1/inventory/capacity/` and in `/api/v1/inventory/summary/`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from inventory import services
from inventory.dumps import iter_objects
from tests.api.cast import Cast
from tests.fixtures import DRA

pytestmark = pytest.mark.django_db

VENDORS = ("tpu.yaml", "gaudi2.yaml", "vgpu.yaml", "amd-mi300x.yaml")
# unit, unit_label, product_name, physical units, equivalents: what the vendors' fixtures publish.
CAPACITY = [
    ("gpu", "GPUs", "AMD_Instinct_MI300X_OAM", 9, "9.000000"),  # 8 whole, 1 in CPX partitions
    # VMs' vGPUs (an A100-4C, two A100-10C): shares of A100s, under the GPU's model.
    ("gpu", "GPUs", "NVIDIA A100", 3, "0.600000"),
    ("tpu", "TPU chips", "v4", 4, "4.000000"),
    ("gaudi", "Gaudi cards", "Gaudi2", 8, "8.000000"),
]


@pytest.fixture
def vendors() -> None:
    objects = [obj for name in VENDORS for obj in iter_objects(DRA / "vendors" / name)]
    report = services.import_snapshot(
        cluster=services.get_cluster("fx"),
        objects=objects,
        at=datetime(2026, 12, 1, 8, 0, tzinfo=UTC),
        kinds=["ResourceSlice"],
    )
    assert report.errors == []


def capacity_rows(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (row["unit"], row["unit_label"], row["product_name"], row["gpus"], row["equivalents"])
        for row in rows
    ]


@pytest.mark.usefixtures("vendors")
def test_capacity_rows_carry_their_unit_and_equivalents(cast: Cast) -> None:
    client = cast.client("operator")
    response = client.get("/api/v1/inventory/capacity/")
    assert response.status_code == 200, response.content
    assert capacity_rows(response.json()["results"]) == CAPACITY

    summary = client.get("/api/v1/inventory/summary/", {"cluster": "fx"}).json()
    assert capacity_rows(summary["capacity"]) == CAPACITY


@pytest.mark.usefixtures("vendors")
def test_capacity_orders_by_unit_and_equivalents(cast: Cast) -> None:
    client = cast.client("finance")
    rows = client.get("/api/v1/inventory/capacity/", {"ordering": "unit,-equivalents"}).json()
    keys = [(row["unit"], row["product_name"]) for row in rows["results"]]
    assert keys == [
        ("gaudi", "Gaudi2"),
        ("gpu", "AMD_Instinct_MI300X_OAM"),
        ("gpu", "NVIDIA A100"),
        ("tpu", "v4"),
    ]
    refused = client.get("/api/v1/inventory/capacity/", {"ordering": "unit_label"})
    assert refused.status_code == 400
    assert "cannot order by 'unit_label'" in refused.json()["ordering"][0]


@pytest.mark.usefixtures("vendors")
def test_free_blocks_are_per_unit_and_model_in_the_summary(cast: Cast) -> None:
    spread = (
        cast.client("operator")
        .get("/api/v1/inventory/summary/", {"cluster": "fx"})
        .json()["fragmentation"]
    )
    blocks = {
        (block["unit"], block["unit_label"], block["product_name"]): block["largest_free_block"]
        for block in spread["free_blocks"]
    }
    assert blocks[("tpu", "TPU chips", "v4")] == 4
    assert blocks[("gaudi", "Gaudi cards", "Gaudi2")] == 8
    assert blocks[("gpu", "GPUs", "AMD_Instinct_MI300X_OAM")] == 8
    assert all(
        set(block)
        == {"unit", "unit_label", "product_name", "largest_free_block"}
        | {"largest_free_clique_block"}
        for block in spread["free_blocks"]
    )
    # The headline is the largest block, never a sum over units or models.
    assert spread["largest_free_block"] == max(blocks.values()) == 8


def test_the_schema_documents_the_unit_fields(cast: Cast) -> None:
    schema = (
        cast.client("operator")
        .get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
        .json()["components"]["schemas"]
    )
    assert {"unit", "unit_label", "equivalents"} <= set(schema["Capacity"]["properties"])
    assert schema["Capacity"]["properties"]["equivalents"]["type"] == "string"
    assert "free_blocks" in schema["Fragmentation"]["properties"]
    assert {"unit", "unit_label", "product_name"} <= set(schema["FreeBlock"]["properties"])
