"""`waited`: a wait in whole seconds as people read it (pending claims, stranded gangs)."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()

MINUTE, HOUR, DAY = 60, 3600, 86400


@register.filter
def waited(seconds: Any) -> str:
    """`seconds` as its two largest units: "45 s", "12 min", "3 h 20 min", "7 d 0 h". A value
    that is not a whole number of seconds is shown as it is."""
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        return str(seconds)
    seconds = max(seconds, 0)
    if seconds < MINUTE:
        return f"{seconds} s"
    if seconds < HOUR:
        return f"{seconds // MINUTE} min"
    if seconds < DAY:
        return f"{seconds // HOUR} h {seconds % HOUR // MINUTE} min"
    return f"{seconds // DAY} d {seconds % DAY // HOUR} h"
