"""Whether a claim's selectors run past the claim's steps is the same however warm the
process's cache of evaluations is, and in whatever order its shapes were evaluated before:
the same claim gets the same answer on every webhook worker (issue 40, finding 2)."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from quota import cel
from quota.admission import shapes
from quota.admission.shapes import FleetShapes, Shape

CLASS = "ports.example.com"
# Steps grow with the list it reads: about 5 per value.
SELECTOR = "device.attributes['ports.example.com'].ports.all(p, p >= 0)"


def _shape(shape_id: int, ports: int) -> Shape:
    return Shape(
        id=shape_id,
        driver=CLASS,
        kind="gpu",
        gpu_share=Decimal(1),
        memory_bytes=None,
        shareable=False,
        view=cel.DeviceShape.from_device(
            driver=CLASS, attributes={"ports": {"ints": list(range(ports))}}, capacity={}
        ),
    )


def _fleet(lengths: list[int]) -> FleetShapes:
    # Shape ids far from those of other tests: the cache of evaluations is per process.
    fleet_shapes = {9_000_000 + i: _shape(9_000_000 + i, n) for i, n in enumerate(lengths)}
    return FleetShapes(shapes=fleet_shapes, class_selectors={CLASS: ["true"]})


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=1_500), min_size=1, max_size=8),
    warm=st.lists(st.integers(min_value=0, max_value=7), max_size=8),
)
def test_the_claims_verdict_does_not_depend_on_the_cache(
    lengths: list[int], warm: list[int]
) -> None:
    shapes._matches.clear()
    cold = _fleet(lengths)
    expected = (
        [shape.id for shape in cold.candidates(CLASS, (SELECTOR,))],
        cold.unweighable(CLASS, (SELECTOR,)),
    )
    shapes._matches.clear()
    warmed = _fleet(lengths)
    ids = list(warmed.shapes)
    for index in warm:  # some shapes evaluated before, in some order, by other claims
        if index < len(ids):
            shapes.evaluate(SELECTOR, warmed.shapes[ids[index]])
    found = (
        [shape.id for shape in warmed.candidates(CLASS, (SELECTOR,))],
        warmed.unweighable(CLASS, (SELECTOR,)),
    )
    assert found == expected
    # And the verdict is the sum's: past the claim's steps exactly when the steps, summed over
    # every shape, are.
    total = sum(shapes.evaluate(SELECTOR, shape).steps for shape in warmed.shapes.values())
    refused = any(shapes.evaluate(SELECTOR, s).refused for s in warmed.shapes.values())
    assert (expected[1] is not None) == (refused or total > cel.MAX_CLAIM_STEPS)
