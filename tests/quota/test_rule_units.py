"""A rule's unit over every cluster's fleet (`shapes.rule_units`, which the webhook asks on
every admission and the API on every read) is `rule_unit` of every shape the rule covers in
any of them, whether or not the fleets have worked it out before: kept per snapshot and rule
definition (`FleetShapes.accelerator_units`) since issue 38, walked shape by shape before."""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from quota import cel
from quota.admission import shapes
from quota.admission.shapes import FleetShapes, Shape

CLASS = "units.example.com"
# Rules over the same class: all of it, or the shapes of one model.
SELECTORS = ("", "device.attributes['units.example.com'].model == 'a'")
KINDS = ("gpu", "other", "tpu")
UNITS = ("gpu", "tpu_chip", "gaudi_card")


@dataclass
class _Rule:
    pk: int
    device_class: str
    selector: str


def _shape(shape_id: int, kind: str, unit: str, model: str) -> Shape:
    return Shape(
        id=shape_id,
        driver=CLASS,
        kind=kind,
        gpu_share=Decimal(1),
        memory_bytes=None,
        shareable=False,
        view=cel.DeviceShape.from_device(
            driver=CLASS, attributes={"model": {"string": model}}, capacity={}
        ),
        unit=unit,
    )


_shape_specs = st.tuples(st.sampled_from(KINDS), st.sampled_from(UNITS), st.sampled_from("ab"))


@settings(max_examples=60, deadline=None)
@given(
    fleets=st.lists(st.lists(_shape_specs, max_size=5), min_size=1, max_size=3),
    asked_before=st.lists(st.integers(min_value=0, max_value=5), max_size=4),
    known_class=st.booleans(),
)
def test_a_rules_unit_is_that_of_every_shape_it_covers_in_any_fleet(
    fleets: list[list[tuple[str, str, str]]], asked_before: list[int], known_class: bool
) -> None:
    made = []
    for number, specs in enumerate(fleets):
        # Shape ids far from those of other tests: the cache of evaluations is per process.
        first = 9_100_000 + 100 * number
        made.append(
            FleetShapes(
                shapes={
                    first + i: _shape(first + i, kind, unit, model)
                    for i, (kind, unit, model) in enumerate(specs)
                },
                class_selectors={CLASS: []} if known_class else {},
            )
        )
    rules = [
        _Rule(pk=1, device_class=CLASS, selector=SELECTORS[0]),
        _Rule(pk=2, device_class=CLASS, selector=SELECTORS[1]),
        _Rule(pk=3, device_class="other.example.com", selector=""),
    ]
    expected = {
        rule.pk: shapes.rule_unit(
            shape
            for fleet in made
            for shape in fleet.shapes.values()
            if shapes.covers(fleet.class_selectors, rule.device_class, rule.selector, shape)
        )
        for rule in rules
    }
    for index in asked_before:  # some fleets asked before, alone, as another read would
        if index < len(made):
            shapes.rule_units(rules, [made[index]])
    assert shapes.rule_units(rules, made) == expected
    assert shapes.rule_units(rules, made) == expected  # and again, from what is kept
