"""`{{ name|soft_breaks }}`: a name without spaces (a claim, a node, a service account) that may
break after its separators (`.`, `/`, `:`, `-`, `_`) and nowhere else, so a narrow column wraps
`tensorboard.experiment.` / `resnet152` rather than `tensorbo` / `ard` (issue 35, finding 8)."""

from __future__ import annotations

import re

from django import template
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

register = template.Library()

_SEPARATOR = re.compile(r"([./:_-])(?=.)")


@register.filter
def soft_breaks(value: object) -> SafeString:
    """`value`, escaped, with a `<wbr>` after each separator that something follows."""
    return mark_safe(_SEPARATOR.sub(r"\1<wbr>", str(escape(value))))
