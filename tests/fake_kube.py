"""The tests' old path to `devtools.fake_kube` (the benchmarks use it too, and bench/ imports
nothing of tests/); kept because many tests import `tests.fake_kube`."""

from devtools.fake_kube import *  # noqa: F403
