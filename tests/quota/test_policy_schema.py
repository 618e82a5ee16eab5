"""The policy file's declarative schema (`quota.policy.schema`, pydantic): its errors come out
as the file's own messages at their paths, and what it reads is normalised as before
(issue 37). The messages themselves are pinned by test_policy*.py."""

from __future__ import annotations

import textwrap
from decimal import Decimal

import pytest
from pydantic import ValidationError

from quota.models import Unit
from quota.policy import PolicyError, load_policy
from quota.policy.schema import RuleModel, TeamModel, path_of, problems

pytestmark = pytest.mark.django_db


def errors_of(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        load_policy(textwrap.dedent(text))
    return caught.value.errors


def test_a_location_reads_as_a_path_in_the_file() -> None:
    assert path_of(("teams", 2, "quotas", 0, "selector")) == "teams[2].quotas[0].selector"
    assert path_of(()) == ""


def test_unknown_and_missing_keys_come_first_as_the_file_always_said() -> None:
    with pytest.raises(ValidationError) as caught:
        TeamModel.model_validate({"slug": "not a slug", "colour": "blue"})
    assert problems(caught.value, at=("teams", 1)) == [
        "teams[1]: unknown key 'colour'",
        "teams[1].name: required",
        "teams[1].slug: 'not a slug' is not a slug (letters, digits, - and _)",
    ]


def test_a_rule_with_both_limits_is_named_beside_its_other_problems() -> None:
    with pytest.raises(ValidationError) as caught:
        RuleModel.model_validate(
            {"name": "h100", "deviceClass": "gpu.nvidia.com", "mode": "strict"}
        )
    assert problems(caught.value, at=("teams", 0, "quotas", 3)) == [
        "teams[0].quotas[3].mode: must be one of enforce, warn, got 'strict'",
        "teams[0].quotas[3]: set exactly one of gpus or memory",
    ]


def test_a_deep_error_keeps_its_whole_path() -> None:
    errors = errors_of(
        """
        teams:
        - {slug: a, name: A}
        - {slug: b, name: B}
        - slug: c
          name: C
          quotas:
          - {name: h100, deviceClass: gpu.nvidia.com, gpus: 1, selector: "device.driver =="}
        """
    )
    assert len(errors) == 1
    assert errors[0].startswith("teams[2].quotas[0].selector: bad CEL: ")


def test_what_it_reads_is_normalised() -> None:
    policy = load_policy(
        textwrap.dedent(
            f"""
            teams:
            - slug: {"v" * 63}
              name: Vision
              gangs: off
              quotas:
              - name: {"h" * 63}
                deviceClass: gpu.nvidia.com
                selector: '  device.driver == "gpu.nvidia.com"  '
                gpus: 2.5
              - name: mem
                deviceClass: gpu.nvidia.com
                memory: 640Gi
            """
        )
    )
    [team] = policy.teams
    gpus, memory = team.rules
    assert (team.slug, gpus.name, team.gangs) == ("v" * 63, "h" * 63, "off")
    assert gpus.selector == 'device.driver == "gpu.nvidia.com"'
    assert (gpus.unit, gpus.limit) == (Unit.GPUS, Decimal("2.5"))
    assert (memory.unit, memory.limit, memory.mode) == (Unit.MEMORY, 640 * 2**30, "enforce")


def test_names_past_kubernetes_maxima_are_refused() -> None:
    errors = errors_of(
        f"""
        teams:
        - slug: {"v" * 64}
          name: Vision
        """
    )
    assert errors == ["teams[0].slug: longer than 63 characters"]
