"""LoaderOptions refuses every bad setting with its exact message, and accepts each bound it names."""

from __future__ import annotations

import re

import pytest

from cachegen.errors import ConfigError
from cachegen.stream import ADAPTIVE, FASTEST, RULE, TEXT, LoaderOptions


def _refused(message: str, **kw) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        LoaderOptions(**kw)


@pytest.mark.parametrize("policy", [ADAPTIVE, RULE, FASTEST, TEXT, 0, 1, 7])
def test_every_policy_and_any_level_is_accepted(policy):
    assert LoaderOptions(policy=policy).policy == policy


@pytest.mark.parametrize("policy", ["fast", "", None, -1, 2.0, "4"])
def test_an_unknown_policy_is_refused_by_name(policy):
    _refused(f"unknown policy {policy!r}: use adaptive, rule, fastest, text or a level", policy=policy)


def test_the_deadline_is_positive_or_none():
    assert LoaderOptions(slo_s=None).slo_s is None
    assert LoaderOptions(slo_s=1e-9).slo_s == 1e-9
    for bad in (0.0, -1.0, float("nan")):
        _refused(f"slo_s must be positive (or None for no deadline), not {bad}", slo_s=bad)


def test_the_numeric_bounds_at_their_value_and_one_past():
    assert LoaderOptions(reserve_s=0.0).reserve_s == 0.0
    _refused("reserve_s must be >= 0", reserve_s=-1e-9)
    assert LoaderOptions(prefetch=1).prefetch == 1
    _refused("prefetch must be >= 1", prefetch=0)
    assert LoaderOptions(safety=1.0).safety == 1.0
    assert LoaderOptions(safety=1e-9).safety == 1e-9
    _refused("safety must be in (0, 1]", safety=0.0)
    _refused("safety must be in (0, 1]", safety=1.0 + 1e-9)
    assert LoaderOptions(risk_quantile=None).risk_quantile is None
    assert LoaderOptions(risk_quantile=0.5).risk_quantile == 0.5
    _refused("risk_quantile must be in (0, 1)", risk_quantile=0.0)
    _refused("risk_quantile must be in (0, 1)", risk_quantile=1.0)
    assert LoaderOptions(recency_boost=0).recency_boost == 0
    _refused("recency_boost must be >= 0", recency_boost=-1)


def test_levels_become_a_tuple_of_ints():
    opts = LoaderOptions(levels=[3, 1.0, "5"])  # type: ignore[list-item]
    assert opts.levels == (3, 1, 5) and all(type(l) is int for l in opts.levels)
    assert LoaderOptions(levels=None).levels is None
    assert LoaderOptions(levels=()).levels == ()
