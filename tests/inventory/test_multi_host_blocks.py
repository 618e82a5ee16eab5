"""Free blocks count multi-host devices (issue 36): a 4x4 TPU slice over four nodes is one
block of 16 chips a claim can be given, though no node row holds it."""

from __future__ import annotations

import pytest

from inventory import selectors
from tests.factories import AllocationFactory
from tests.inventory.test_vendors import accelerators, load

pytestmark = pytest.mark.django_db


def v5p_block() -> tuple[int, int]:
    blocks = [
        (block["largest_free_block"], block["largest_free_clique_block"])
        for block in selectors.fragmentation()["free_blocks"]
        if (block["unit"], block["product_name"]) == ("tpu", "v5p")
    ]
    (block,) = blocks
    return block


@pytest.mark.parametrize(
    ("held", "largest"),
    [
        ((), 16),  # the whole 4x4 slice
        (("tpu-2x4-2",), 8),  # its other half
        (("tpu-2x4-2", "tpu-2x2-1"), 4),  # one host of the first half
        (("tpu-2x2-1", "tpu-2x2-3"), 4),  # each half has a host held: no 2x4 fits
        (("tpu-4x4-1",), 0),  # nothing left
    ],
)
def test_the_largest_free_block_is_the_largest_multi_host_slice_that_fits(
    held: tuple[str, ...], largest: int
) -> None:
    load("tpu-multi-host.yaml")
    slices = {device.name: device for device in accelerators("tpu.google.com")}
    for name in held:
        AllocationFactory.create(device=slices[name], end=None)
    assert v5p_block() == (largest, largest)
    summary = selectors.fragmentation()
    assert summary["largest_free_block"] == largest
    assert summary["largest_free_clique_block"] == largest
