from tests.quota.fixtures import fleet

__all__ = ["fleet"]
