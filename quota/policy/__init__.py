"""Quota as code: teams, their namespaces, members, quota rules and budgets, and the rate
cards, declared in a YAML file.

`load_policy` reads and checks a file and writes nothing: every problem is reported at once,
named by its path in the file (`teams[0].quotas[1].selector: bad CEL: ...`). `apply_policy`
then makes the database match the file in one transaction, every change audited; applying the
same file again changes nothing. Without `prune` nothing is ever removed.

The format (see docs/policy.example.yaml)::

    teams:
    - slug: vision
      name: Vision Research
      costCentre: CC-1234          # optional
      namespaces: [vision, vision-dev]
      leads: [lead-vision]         # usernames; missing users are created, password unusable
      members: [alice, bob]
      quotas:
      - name: h100
        deviceClass: gpu.nvidia.com
        selector: device.attributes["gpu.nvidia.com"].productName.startsWith("NVIDIA H100")
        gpus: 8                    # or `memory: 640Gi`: exactly one of the two
        mode: enforce              # enforce (default) | warn
      budget: {gpuHours: 2000, mode: hard}   # optional; per billing period; hard | soft;
                                             # unit: gpu (default) | tpu | gaudi | accelerator
      gangs: enforce               # optional; enforce (default: a gang is admitted whole or
                                   # not at all) | warn (claims decided alone, a gang that
                                   # cannot fit whole warned of) | off (claims decided alone)
      narrowToFit: true            # optional (default false); the mutating webhook narrows a
                                   # claim that could land on several models to those whose
                                   # rules have room (a selector added) instead of denying it
      idleAlert: {belowPercent: 5, forHours: 4}   # optional; a claim utilised below 5% of
                                   # what it holds in each of the last 4 rolled-up hours is
                                   # alerted to its user and the leads (billing.alerts);
                                   # `off`: never; absent: TALLY_IDLE_ALERT_DEFAULT_*
    drivers:                       # optional; absent: driver profiles are left as they are
      npu.example.com:             # a DRA driver Tally has no built-in profile for
        unit: accelerator          # gpu | tpu | gaudi | accelerator
        identity_attributes: [serial]
        model_attributes: [model]
      gpu.intel.com:               # keys given here replace the built-in profile's
        exclude: []                # count integrated GPUs too
    sso:                           # optional; absent: the group mapping is left as it is
      groups:                      # the identity provider's `groups` claim, at each SSO login
      - {group: ml-vision-leads, team: vision, role: lead}     # lead | member: in `team`
      - {group: ml-vision, team: vision, role: member}
      - {group: finops, role: finance}                        # finance | operator: no team
    versions:                      # optional; absent: baselines and deviations are left alone
      baselines:                   # the validated driver/CUDA pair, per cluster and model
      - cluster: prod              # optional: TALLY_CLUSTER_NAME
        productName: NVIDIA H100 80GB HBM3   # or architecture: Hopper; neither: cluster-wide
        driver: gpu.nvidia.com     # the DRA driver it judges; required cluster-wide where
                                   # several drivers publish versions (docs/versions.md)
        driverVersion: 580.82.07   # at least one of the two; as nvidia-smi or the driver
        cudaDriverVersion: "13.0"  # spells it (580.82.7, 13.0.0): compared as versions
      deviations:                  # documented: tainted out of general scheduling, not flagged
      - node: dgx-canary           # node, pool, or both
        driver: gpu.nvidia.com     # optional: any driver
        driverVersion: 570.172.08
        reason: canary for the 570 branch
        owner: gpu-platform
        expires: 2027-01-31        # after it, the node is an outlier again
    rates:                         # optional; absent: the rate cards are left as they are
    - productName: NVIDIA H100 80GB HBM3
      profile: 3g.40gb             # optional: the price of an hour of one slice of this
      perGpuHour: "2.50"           # profile (without: a slice pays its share of the GPU's)
      idleFactor: "0.4"            # 0..1, default 1
      currency: USD
      from: 2026-01-01
      until: 2027-01-01            # optional, exclusive

A rate card is identified by productName, profile, currency and `from`. Money already billed
stays as it was: a rate card whose validity reaches into a closed billing period is never
changed or deleted so that the period would be priced differently, and no new one may reach
into it.

A driver profile (the keys are `inventory.profiles`'s) is identified by its driver name; the
file manages the DriverProfile rows it wrote (source "policy"), never those written by hand.
A changed profile takes effect on the next full inventory sync.
"""

from quota.policy.applying import apply_policy
from quota.policy.loading import load_policy
from quota.policy.specs import (
    ApplyReport,
    BudgetSpec,
    IdleAlertSpec,
    Policy,
    PolicyError,
    RateSpec,
    RuleSpec,
    SsoGroupSpec,
    TeamSpec,
)

__all__ = [
    "ApplyReport",
    "BudgetSpec",
    "IdleAlertSpec",
    "Policy",
    "PolicyError",
    "RateSpec",
    "RuleSpec",
    "SsoGroupSpec",
    "TeamSpec",
    "apply_policy",
    "load_policy",
]
