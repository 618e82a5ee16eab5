"""Currencies money may be kept in: ISO 4217 codes, from the Unicode CLDR's list that `babel`
maintains (pinned in pyproject.toml), so a rate card or an adjustment in "NAN" or "USS" is
refused instead of making a statement no one can pay."""

from __future__ import annotations

from babel.numbers import list_currencies

# XXX (no currency) and XTS (reserved for testing) are codes, but no money is in them.
ISO_4217 = frozenset(list_currencies()) - {"XXX", "XTS"}


def currency_error(code: str) -> str | None:
    """Why `code` is not a currency money can be kept in (None: it is one). Upper case only:
    callers that accept `eur` upper-case it first."""
    if code in ISO_4217:
        return None
    return f"{code!r} is not an ISO 4217 currency code such as USD, EUR or JPY"
