"""The login forms of the portal and the admin: Django's, with the username's length enforced.

Django's AuthenticationForm sets the username field's `max_length` after the field is built,
so no validator checks it, and a username of any length reached `authenticate()`, whose
failure django-axes records in a 255-character column: a 500 (issue 40, finding 5). Here a
username longer than the user model's is a form error that names the limit, and no login
attempt is made or counted.
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.validators import MaxLengthValidator


class BoundedUsernameMixin:
    """Validates the username's length before the form tries to authenticate it."""

    fields: dict[str, Any]
    username_field: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.username_field.max_length or 254
        self.fields["username"].validators.append(MaxLengthValidator(limit))


class LoginForm(BoundedUsernameMixin, AuthenticationForm):
    """The portal's login form."""


class AdminLoginForm(BoundedUsernameMixin, AdminAuthenticationForm):
    """The admin's login form."""
