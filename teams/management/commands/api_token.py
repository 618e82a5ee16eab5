"""`manage.py api_token create|list|revoke USER`: finance's API tokens (teams/tokens.py)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from teams import tokens


class Command(BaseCommand):
    help = (
        "Create, list or revoke a user's API tokens (`Authorization: Token <token>`). A new "
        "token is printed once: only its hash is stored."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        create = actions.add_parser("create", help="Make a token and print it, once.")
        create.add_argument("username")
        create.add_argument(
            "--expires-in",
            type=int,
            default=None,
            metavar="DAYS",
            help=f"Days the token is valid (default: TALLY_API_TOKEN_DAYS; 1 to "
            f"{tokens.MAX_DAYS}).",
        )
        listing = actions.add_parser("list", help="The user's tokens: key, created, expiry.")
        listing.add_argument("username")
        revoke = actions.add_parser("revoke", help="Revoke one token (by key) or all of them.")
        revoke.add_argument("username")
        which = revoke.add_mutually_exclusive_group(required=True)
        which.add_argument("key", nargs="?", help="The token's key, as `list` shows it.")
        which.add_argument("--all", action="store_true", help="Revoke every token of the user.")
        for sub in (create, revoke):
            sub.add_argument(
                "--actor",
                default="api_token",
                help="Who the audit trail names (default: api_token).",
            )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            user = tokens.user_named(options["username"])
            if options["action"] == "create":
                self._create(user, options)
            elif options["action"] == "list":
                self._list(user)
            else:
                revoked = tokens.revoke_tokens(
                    user=user,
                    key=None if options["all"] else options["key"],
                    actor=options["actor"],
                )
                self.stdout.write(f"revoked {revoked} token(s) of {user.get_username()}")
        except tokens.TokenError as exc:
            raise CommandError(str(exc)) from exc

    def _create(self, user: Any, options: dict[str, Any]) -> None:
        days = options["expires_in"]
        if days is None:
            days = tokens.default_days()
        new = tokens.create_token(user=user, days=days, actor=options["actor"])
        self.stderr.write(
            f"token {new.key} for {user.get_username()}, valid until "
            f"{new.expiry:%Y-%m-%d %H:%M} UTC; it is shown only now:"
        )
        self.stdout.write(new.token)

    def _list(self, user: Any) -> None:
        rows = tokens.list_tokens(user=user)
        if not rows:
            self.stdout.write(f"{user.get_username()} has no API token")
            return
        for token in rows:
            state = "expired" if tokens.is_expired(token) else "valid"
            expiry = f"{token.expiry:%Y-%m-%d %H:%M}" if token.expiry else "never"
            self.stdout.write(
                f"{token.token_key}  created {token.created:%Y-%m-%d %H:%M}  "
                f"expires {expiry}  {state}"
            )
