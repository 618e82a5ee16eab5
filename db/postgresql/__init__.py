"""Django's PostgreSQL backend, with connect timeouts under two seconds honoured."""
