"""The columns of Tally's FOCUS export (`billing.focus`): each column's name, data type,
nullability and allowed values as the FinOps Open Cost and Usage Specification 1.2 states
them (specification/columns/*.md at the v1.2 tag of FinOps-Open-Cost-and-Usage-Spec/FOCUS_Spec),
then Tally's own `x_` columns, which the specification asks to come after its own.

Data, no logic: the export, its API schema, its docs page and its tests all read this table,
so a column is described once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

FOCUS_VERSION: Final = "1.2"

# The specification's data types (its "Data type" constraint).
DECIMAL, STRING, DATE_TIME, JSON = "Decimal", "String", "Date/Time", "JSON"

CHARGE_CATEGORIES = ("Usage", "Purchase", "Tax", "Credit", "Adjustment")
CHARGE_CLASSES = ("Correction",)
CHARGE_FREQUENCIES = ("One-Time", "Recurring", "Usage-Based")
PRICING_CATEGORIES = ("Standard", "Dynamic", "Committed", "Other")
COMMITMENT_DISCOUNT_CATEGORIES = ("Spend", "Usage")
COMMITMENT_DISCOUNT_STATUSES = ("Used", "Unused")
# What the provider's columns hold.
PROVIDER = "the setting `TALLY_FOCUS_PROVIDER_NAME` (`Tally` unless set)"
# ServiceSubcategory's allowed values, under their one parent ServiceCategory.
SERVICE_SUBCATEGORIES: Final[dict[str, tuple[str, ...]]] = {
    "AI and Machine Learning": (
        "AI Platforms",
        "Bots",
        "Generative AI",
        "Machine Learning",
        "Natural Language Processing",
        "Other (AI and Machine Learning)",
    ),
    "Analytics": (
        "Analytics Platforms",
        "Business Intelligence",
        "Data Processing",
        "Search",
        "Streaming Analytics",
        "Other (Analytics)",
    ),
    "Business Applications": (
        "Productivity and Collaboration",
        "Other (Business Applications)",
    ),
    "Compute": (
        "Containers",
        "End User Computing",
        "Quantum Compute",
        "Serverless Compute",
        "Virtual Machines",
        "Other (Compute)",
    ),
    "Databases": (
        "Caching",
        "Data Warehouses",
        "Ledger Databases",
        "NoSQL Databases",
        "Relational Databases",
        "Time Series Databases",
        "Other (Databases)",
    ),
    "Developer Tools": (
        "Developer Platforms",
        "Continuous Integration and Deployment",
        "Development Environments",
        "Source Code Management",
        "Quality Assurance",
        "Other (Developer Tools)",
    ),
    "Identity": (
        "Identity and Access Management",
        "Other (Identity)",
    ),
    "Integration": (
        "API Management",
        "Messaging",
        "Workflow Orchestration",
        "Other (Integration)",
    ),
    "Internet of Things": (
        "IoT Analytics",
        "IoT Platforms",
        "Other (Internet of Things)",
    ),
    "Management and Governance": (
        "Architecture",
        "Compliance",
        "Cost Management",
        "Data Governance",
        "Disaster Recovery",
        "Endpoint Management",
        "Observability",
        "Support",
        "Other (Management and Governance)",
    ),
    "Media": (
        "Content Creation",
        "Gaming",
        "Media Streaming",
        "Mixed Reality",
        "Other (Media)",
    ),
    "Migration": (
        "Data Migration",
        "Resource Migration",
        "Other (Migration)",
    ),
    "Mobile": ("Other (Mobile)",),
    "Multicloud": (
        "Multicloud Integration",
        "Other (Multicloud)",
    ),
    "Networking": (
        "Application Networking",
        "Content Delivery",
        "Network Connectivity",
        "Network Infrastructure",
        "Network Routing",
        "Network Security",
        "Other (Networking)",
    ),
    "Security": (
        "Secret Management",
        "Security Posture Management",
        "Threat Detection and Response",
        "Other (Security)",
    ),
    "Storage": (
        "Backup Storage",
        "Block Storage",
        "File Storage",
        "Object Storage",
        "Storage Platforms",
        "Other (Storage)",
    ),
    "Web": (
        "Application Platforms",
        "Other (Web)",
    ),
    "Other": ("Other (Other)",),
}
SERVICE_CATEGORIES = tuple(SERVICE_SUBCATEGORIES)


@dataclass(frozen=True)
class FocusColumn:
    """One column: its data type, whether it may be null, and (for an enumerated one) the
    values it may take; `source` says where Tally's value comes from (the docs page)."""

    name: str
    data_type: str
    nullable: bool
    source: str
    allowed: tuple[str, ...] = ()

    @property
    def custom(self) -> bool:
        """Tally's own column, not the specification's (`x_` prefixed)."""
        return self.name.startswith("x_")


def _column(
    name: str, data_type: str, nullable: bool, source: str, allowed: tuple[str, ...] = ()
) -> FocusColumn:
    return FocusColumn(
        name=name, data_type=data_type, nullable=nullable, source=source, allowed=allowed
    )


# The specification's columns in alphabetical order, then Tally's.
COLUMNS: Final[tuple[FocusColumn, ...]] = (
    _column("BilledCost", DECIMAL, False, "the statement line's amount, shared out to the cent"),
    _column("BillingAccountId", STRING, False, "`tally`: one billing account"),
    _column("BillingAccountName", STRING, True, PROVIDER),
    _column("BillingCurrency", STRING, False, "the statement's currency (ISO 4217)"),
    _column("BillingPeriodEnd", DATE_TIME, False, "the billing period's end (exclusive)"),
    _column("BillingPeriodStart", DATE_TIME, False, "the billing period's start"),
    _column(
        "ChargeCategory",
        STRING,
        False,
        "`Usage` for usage, `Adjustment` for adjustment lines",
        CHARGE_CATEGORIES,
    ),
    _column(
        "ChargeClass",
        STRING,
        True,
        "`Correction` on an adjustment for a closed period's late data, else null",
        CHARGE_CLASSES,
    ),
    _column(
        "ChargeDescription", STRING, True, "what was used at what price; an adjustment's reason"
    ),
    _column(
        "ChargeFrequency",
        STRING,
        False,
        "`Usage-Based` for usage, `One-Time` for adjustments",
        CHARGE_FREQUENCIES,
    ),
    _column("ChargePeriodEnd", DATE_TIME, False, "the end of the row's day (or of the window)"),
    _column("ChargePeriodStart", DATE_TIME, False, "the start of the row's day (or of the window)"),
    _column(
        "CommitmentDiscountCategory",
        STRING,
        True,
        "null: Tally has no commitment discounts",
        COMMITMENT_DISCOUNT_CATEGORIES,
    ),
    _column("CommitmentDiscountId", STRING, True, "null"),
    _column("CommitmentDiscountName", STRING, True, "null"),
    _column("CommitmentDiscountQuantity", DECIMAL, True, "null"),
    _column("CommitmentDiscountStatus", STRING, True, "null", COMMITMENT_DISCOUNT_STATUSES),
    _column("CommitmentDiscountType", STRING, True, "null"),
    _column("CommitmentDiscountUnit", STRING, True, "null"),
    _column(
        "ConsumedQuantity",
        DECIMAL,
        True,
        "allocated hours of the device's unit; null on adjustments",
    ),
    _column("ConsumedUnit", STRING, True, "`GPU-Hours`, `TPU Chip-Hours`, `Gaudi Card-Hours`..."),
    _column("ContractedCost", DECIMAL, False, "ContractedUnitPrice x PricingQuantity, rounded"),
    _column("ContractedUnitPrice", DECIMAL, True, "the rate card's price per PricingUnit"),
    _column("EffectiveCost", DECIMAL, False, "BilledCost: Tally amortises nothing"),
    _column("InvoiceId", STRING, True, "the statement: `<period>/<team>/<currency>`"),
    _column("InvoiceIssuerName", STRING, False, PROVIDER),
    _column("ListCost", DECIMAL, False, "ListUnitPrice x PricingQuantity, rounded"),
    _column("ListUnitPrice", DECIMAL, True, "the rate card's price per PricingUnit"),
    _column(
        "PricingCategory",
        STRING,
        True,
        "`Standard` (a rate card), `Other` (no rate card), null on adjustments",
        PRICING_CATEGORIES,
    ),
    _column("PricingQuantity", DECIMAL, True, "allocated hours of what the rate card prices"),
    _column("PricingUnit", STRING, True, "`GPU-Hours` (and the like) or `Slice-Hours`"),
    _column("ProviderName", STRING, False, PROVIDER),
    _column("PublisherName", STRING, False, PROVIDER),
    _column("RegionId", STRING, True, "null: clusters are not regions"),
    _column("RegionName", STRING, True, "null"),
    _column("ResourceId", STRING, True, "`<cluster>/<namespace>/<Kind>/<name>` of the job"),
    _column("ResourceName", STRING, True, "the job's name (the namespace without a job)"),
    _column("ResourceType", STRING, True, "the job's kind (`Namespace` without a job)"),
    _column("ServiceCategory", STRING, False, "`Compute`", SERVICE_CATEGORIES),
    _column("ServiceName", STRING, False, "`Kubernetes accelerators`"),
    _column(
        "ServiceSubcategory",
        STRING,
        False,
        "`Containers`",
        tuple(sub for subs in SERVICE_SUBCATEGORIES.values() for sub in subs),
    ),
    _column("SkuId", STRING, True, "the accelerator model, and its MIG profile"),
    _column("SkuMeter", STRING, True, "`Allocated ` and the ConsumedUnit"),
    _column("SkuPriceDetails", JSON, True, "the rate card's idle factor (and slice share)"),
    _column("SkuPriceId", STRING, True, "the rate card: `rate-card-<id>`"),
    _column("SubAccountId", STRING, True, "the team's slug"),
    _column("SubAccountName", STRING, True, "the team's name"),
    _column("SubAccountType", STRING, True, "`Team`"),
    _column("Tags", JSON, True, "`tally/cluster`, `tally/namespace`, `tally/job`, `tally/person`"),
    _column("x_AllocatedHours", DECIMAL, False, "allocated hours of the device's unit"),
    _column("x_UtilisedHours", DECIMAL, False, "hours the devices were measured busy"),
    _column("x_IdleHours", DECIMAL, False, "hours the devices were measured idle"),
    _column("x_UnmeasuredHours", DECIMAL, False, "hours no sample measured"),
    _column("x_IdleFactor", DECIMAL, True, "share of the rate idle hours pay; null: no rate card"),
    _column("x_CorrectsPeriod", STRING, True, "an adjustment's corrected period (`2026-11`)"),
)
COLUMN_NAMES: Final = tuple(column.name for column in COLUMNS)
