"""An import runs with the garbage collector at the import's thresholds, and leaves them as
they were, also when it fails."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from inventory import services
from tests.inventory.test_import import T0, claim, gpu, slice_

pytestmark = pytest.mark.django_db


def _objects(seen: list[tuple[int, int, int]], fail: bool = False) -> Iterator[dict[str, Any]]:
    seen.append(gc.get_threshold())
    yield slice_("node-a-gpu", [gpu("gpu-0", "GPU-0")])
    seen.append(gc.get_threshold())
    if fail:
        raise RuntimeError("the dump broke off")
    yield claim("train", [("node-a", "gpu-0")])


def test_the_import_collects_less_often_and_puts_the_thresholds_back() -> None:
    original = gc.get_threshold()
    before = (1234, 11, 12)
    gc.set_threshold(*before)
    try:
        seen: list[tuple[int, int, int]] = []
        report = services.import_snapshot(
            cluster=services.get_cluster("test"), objects=_objects(seen), at=T0
        )
        assert report.created["Allocation"] == 1
        assert seen == [services._IMPORT_GC_THRESHOLDS] * 2
        assert gc.get_threshold() == before
        with pytest.raises(RuntimeError):
            services.import_snapshot(
                cluster=services.get_cluster("test"), objects=_objects([], fail=True), at=T0
            )
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*original)
