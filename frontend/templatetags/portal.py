"""`{% portal_nav %}`: the navigation every page shows, from what the user may see."""

from __future__ import annotations

from typing import Any

from django import template

from frontend import selectors

register = template.Library()


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
