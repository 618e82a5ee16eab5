"""The cast of users and the seeded dataset for every API test (see tests/api/cast.py)."""

from tests.api.cast import cast, seeded

__all__ = ["cast", "seeded"]
