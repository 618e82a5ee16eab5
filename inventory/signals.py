"""Signals the inventory sends, so other apps can follow it without the sync knowing them."""

from django.dispatch import Signal

# Sent inside the sync's transaction after claims were written or released, with
# `cluster`, `claim_ids` (ResourceClaim primary keys) and `at`.
claims_changed = Signal()
