"""The fleet API and the portal's fleet page report a GPU shared through consumable capacity
(KEP-5075) by the share its claims hold: one CPX claim on an MI300X in auto-partition mode
leaves 7/8 of it free (see tests/inventory/test_shared_fragmentation.py for the figures)."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from tests.api.cast import Cast
from tests.inventory.test_shared_fragmentation import (
    AMD_NODE,
    GPU_0,
    QUARTER,
    SHARE_NODE,
    amd,
    cpx_claims,
    h100,
)

pytestmark = pytest.mark.django_db


def test_the_summary_reports_the_shares(cast: Cast) -> None:
    amd(cpx_claims(1))
    response = cast.client("operator").get("/api/v1/inventory/summary/", {"cluster": "fx"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["fragmentation"]["nodes_partial"], body["fragmentation"]["gpus_partial"]) == (1, 1)
    assert body["fragmentation"]["partial_free_by_unit"] == {"gpu": "0.875000"}
    [gpu] = body["partial_gpus"]
    assert (gpu["held_share"], gpu["free_share"], gpu["largest_placeable_share"]) == (
        "0.125000",
        "0.875000",
        "0.125000",
    )
    assert (gpu["held_devices"], gpu["free_slices"]) == ({"cpx_nps1": 1}, {"cpx_nps1": 7})
    assert (gpu["largest_placeable"], gpu["placeable_alone"]) == ("cpx_nps1", {})
    [row] = body["partly_used_nodes"]
    assert (row["node"], row["free_share"], row["state"]) == (AMD_NODE, "1.875000", "partly used")
    [capacity] = body["capacity"]
    assert (capacity["gpus"], capacity["allocated"], capacity["free"]) == (2, 1, 1)


def test_every_share_held_leaves_no_partly_used_gpu(cast: Cast) -> None:
    amd(cpx_claims(8))
    body = cast.client("operator").get("/api/v1/inventory/summary/").json()
    assert (body["partial_gpus"], body["fragmentation"]["partial_free_by_unit"]) == ([], {})
    [row] = body["partly_used_nodes"]  # its other GPU is wholly free
    assert (row["gpus_full"], row["free_share"]) == (1, "1.000000")


def test_the_fleet_page_shows_the_free_shares(cast: Cast) -> None:
    amd(cpx_claims(1))
    client = Client()
    client.force_login(cast.operator)
    # The cells' labels (for the cards the tables become on a phone) are not what is checked.
    page = re.sub(r' data-label="[^"]*"', "", client.get(reverse("fleet")).content.decode())

    nodes = page[page.index('id="nodes"') : page.index('id="partial-heading"')]
    assert re.search(
        rf"<th scope=\"row\">{AMD_NODE}</th>\s*<td>—</td>\s*<td class=\"num\">2</td>"
        r"\s*<td class=\"num\">1</td>\s*<td class=\"num\">1</td>"
        r"\s*<td class=\"num\">1.88 GPUs</td>\s*<td>cpx_nps1: 7</td>\s*<td>spx_nps1</td>"
        r"\s*<td>partly used, 1 partly held</td>",
        nodes,
    )
    partial = page[page.index('id="partial-gpus"') :]
    # The free shares are listed once, as slices; no other mode fits beside them.
    assert re.search(
        rf"<td><code>{GPU_0}</code></td>\s*<td>AMD_Instinct_MI300X_OAM</td>"
        r"\s*<td class=\"num\">12%</td>\s*<td class=\"num\">88% GPU</td>"
        r"\s*<td>cpx_nps1: 1</td>"
        r"\s*<td>cpx_nps1: 7; partitionable, each alone: none</td>\s*<td>cpx_nps1</td>",
        partial,
    )


def test_the_fleet_page_says_how_much_one_claim_can_still_get(cast: Cast) -> None:
    h100(QUARTER)
    client = Client()
    client.force_login(cast.operator)
    # The cells' labels (for the cards the tables become on a phone) are not what is checked.
    page = re.sub(r' data-label="[^"]*"', "", client.get(reverse("fleet")).content.decode())
    partial = page[page.index('id="partial-gpus"') :]
    assert re.search(
        rf"<th scope=\"row\">{SHARE_NODE}</th>.*?<td class=\"num\">25%</td>"
        r"\s*<td class=\"num\">75% GPU</td>\s*<td>gpu-0: 1</td>"
        r"\s*<td>one claim up to 75% GPU</td>\s*<td>75% GPU</td>",
        partial,
        re.DOTALL,
    )
