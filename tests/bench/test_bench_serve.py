"""bench serve's pure parts: the auto arrival rate and deadline, the summary, the flags."""

from __future__ import annotations

import argparse

import pytest

from cachegen.bench import serve_bench as sb
from cachegen.stream.costs import CostModel


def test_sustainable_qps_leaves_headroom_over_the_predicted_service_time():
    cm = CostModel(recompute_fixed_s=0.5, recompute_s_per_token=1e-3, recompute_s_per_token_ctx=0.0)
    # prefill of 3000 tokens: 0.5 + 3.0; 10 decoding steps of 0.5 + 0.001 each
    service = 3.5 + 10 * 0.501
    assert sb.sustainable_qps(cm, 3000, 10) == pytest.approx(1 / (sb.AUTO_HEADROOM * service))
    assert sb.AUTO_HEADROOM > 1.0
    # longer prompts arrive less often
    assert sb.sustainable_qps(cm, 6000, 10) < sb.sustainable_qps(cm, 3000, 10)


def test_summarize_counts_errors_and_splits_later_rounds():
    reqs = [
        {"round": 0, "ttft_s": 9.0, "prompt_tokens": 100, "cached_tokens": 0, "completion_tokens": 4, "error": None},
        {"round": 1, "ttft_s": 1.0, "prompt_tokens": 120, "cached_tokens": 100, "completion_tokens": 4, "error": None},
        {"round": 1, "ttft_s": 3.0, "prompt_tokens": 120, "cached_tokens": 20, "completion_tokens": 4, "error": None},
        {"round": 2, "ttft_s": None, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "error": "boom"},
    ]
    row = sb.summarize("m", reqs, wall_s=6.0, link="none")
    assert row["requests"] == 4 and row["errors"] == 1
    assert row["ttft_s_p50"] == 3.0 and row["ttft_s_p95"] == 9.0
    assert row["ttft_s_p50_r2"] == 1.0 and row["ttft_s_p95_r2"] == 3.0
    assert row["cached_token_fraction"] == pytest.approx(120 / 340)
    assert row["throughput_tok_s"] == pytest.approx(12 / 6.0)


def test_qps_and_slo_take_auto_or_a_positive_number():
    ap = argparse.ArgumentParser()
    sb.register(ap.add_subparsers())
    a = ap.parse_args(["serve"])
    assert a.qps == "auto" and a.slo_s == "auto"
    a = ap.parse_args(["serve", "--qps", "0.2", "--slo-s", "2"])
    assert a.qps == 0.2 and a.slo_s == 2.0
    with pytest.raises(SystemExit):
        ap.parse_args(["serve", "--qps", "0"])


def test_run_refuses_an_unknown_mode_before_loading_anything():
    from cachegen.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown mode"):
        sb.run(modes=["nope"])
