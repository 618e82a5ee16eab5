"""Signals the inventory sends, so other apps can follow it without the sync knowing them."""

from django.dispatch import Signal

# Sent inside the sync's transaction after claims were written or released (or their
# allocations tied to their devices), with:
# - `cluster`, `claim_ids` (ResourceClaim primary keys) and `at`;
# - `spans`: [(start, end)], the times whose usage can have changed because of what changed:
#   a new allocation's (its start, `at`), an ended one's (`at`, `at`); empty when nothing
#   the usage rows read changed. A receiver given no `spans` (a sender that does not say)
#   takes every hour of the claims' allocations;
# - `reattributed`: claim ids whose allocations' attribution (job) changed: all their hours;
# - `unfilled`: {allocation id: (username, job)} of the claims' allocations that had no
#   username or no job when sent: a receiver may fill them in (quota records who the webhook
#   saw create the claim), and those it filled change all their hours.
claims_changed = Signal()

# Sent inside the sync's transaction when devices' meter ids changed (a device published again
# with a UUID it lacked), with `cluster` and `devices`: {device id: when its meter id changed}.
# The hours from then on are marked with `claims_changed`; a receiver whose metering source
# keeps the past under the new id (a Prometheus engine keeps DCGM's series by UUID) may roll
# up the hours before it again.
meters_changed = Signal()

# Sent by a dry run (`sync_inventory --from-file ... --dry-run`) inside its transaction, which
# it rolls back, before and after the change it tries, with `now`. A receiver that bills
# returns the money as it stands once it has caught up with every change marked so far:
# {(team slug, period label, currency): amount}. The dry run prints the difference.
charges_requested = Signal()

# Sent by the sync when an allocation began before its cluster's first sync, to learn until
# when usage is closed to new charges: a receiver that bills returns the end of the last
# closed billing period (None if none is closed). Such an allocation is charged from no
# earlier than that, so an import never rewrites a closed period.
usage_closed_until = Signal()
