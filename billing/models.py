"""billing: see the issues; built on the inventory."""
