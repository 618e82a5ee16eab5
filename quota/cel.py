"""DRA CEL selectors, as quota rules, claims and device classes use them: evaluated by
`inventory.cel` (the inventory's sync checks device classes' selectors with it, and an app
never imports from one above it). Re-exported here, where the webhook's callers read them."""

from inventory.cel import (
    KUBERNETES_MAX_COST,
    MAX_CLAIM_ESTIMATED_COST,
    MAX_CLAIM_STEPS,
    MAX_ESTIMATED_COST,
    MAX_EVALUATION_STEPS,
    CELCostError,
    CELError,
    CompiledSelector,
    DeviceShape,
    Evaluation,
    Quantity,
    Semver,
    compile_selector,
)

__all__ = [
    "KUBERNETES_MAX_COST",
    "MAX_CLAIM_ESTIMATED_COST",
    "MAX_CLAIM_STEPS",
    "MAX_ESTIMATED_COST",
    "MAX_EVALUATION_STEPS",
    "CELCostError",
    "CELError",
    "CompiledSelector",
    "DeviceShape",
    "Evaluation",
    "Quantity",
    "Semver",
    "compile_selector",
]
