"""PostgreSQL-specific helpers."""
