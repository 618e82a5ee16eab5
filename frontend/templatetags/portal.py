"""`{% portal_nav %}`: the navigation every page shows, from what the user may see; and the
filters that round figures for people (exports keep the exact values)."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from django import template

from frontend import selectors
from inventory.profiles import shown_number

register = template.Library()

# Slice shares read as a fraction of the GPU when one this small is exact to the stored digits.
MAX_SHARE_DENOMINATOR = 16
SHARE_TOLERANCE = Decimal("0.000001")


@register.inclusion_tag("frontend/_nav.html", takes_context=True)
def portal_nav(context: template.Context) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None)
    role = selectors.portal_role(user) if user is not None else None
    # Leads get a link per team they lead; operators and finance see all teams on the home
    # page, which would make too long a menu.
    return {
        "user": user,
        "role": role,
        "led_teams": selectors.team_list(user=user) if role == "lead" else [],
        "current_path": request.path if request is not None else "",
    }


def _decimal(value: Any) -> Decimal | None:
    if isinstance(value, bool) or value is None or value == "":
        return None
    try:
        number = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError):
        return None
    return number if number.is_finite() else None


@register.filter
def rounded(value: Any) -> Any:
    """`value` to two decimals at most, without trailing zeros or an exponent: 3.999996 reads
    4, 3.50 reads 3.5, 100 reads 100. Anything not a number is shown as it is."""
    number = _decimal(value)
    return value if number is None else shown_number(number)


@register.filter
def gpu_fraction(value: Any) -> Any:
    """A slice's share of its GPU as people say it: 0.142857 reads 1/7, 1 reads 1, and a share
    that is no small fraction reads as `rounded` does."""
    share = _decimal(value)
    if share is None:
        return value
    fraction = Fraction(share).limit_denominator(MAX_SHARE_DENOMINATOR)
    if abs(Decimal(fraction.numerator) / fraction.denominator - share) > SHARE_TOLERANCE:
        return rounded(share)
    return str(fraction)
