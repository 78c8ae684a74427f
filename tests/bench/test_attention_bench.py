"""``bench attention`` on the tiny model: both implementations timed in turns, the same logits, the model left as it was."""

from __future__ import annotations

import pytest
from tests.tiny_models import tiny_llama

from cachegen.bench.attention_bench import IMPLEMENTATIONS, run_attention
from cachegen.engine import attention
from cachegen.errors import ConfigError


def test_rows_compare_both_and_restore_the_model():
    model = tiny_llama()
    attention.install(model)
    rows = run_attention(model, list(range(1, 101)), list(range(200, 208)), rounds=2)
    assert [r["attention"] for r in rows] == list(IMPLEMENTATIONS)
    for r in rows:
        assert (r["context_tokens"], r["tail_tokens"], r["rounds"]) == (100, 8, 2)
        assert 0 < r["step_s_min"] <= r["step_s_median"]
        assert r["max_logit_diff"] < 1e-5
    assert model.config._attn_implementation == attention.NAME


def test_refuses_what_it_cannot_compare():
    model = tiny_llama()
    with pytest.raises(ConfigError, match="at least one round"):
        run_attention(model, [1, 2], [3], rounds=0)
    model.set_attn_implementation("eager")
    with pytest.raises(ConfigError, match="runs 'eager' attention"):
        run_attention(model, [1, 2], [3])


def test_compares_both_while_the_environment_keeps_sdpa(monkeypatch):
    """With CACHEGEN_ATTENTION=sdpa no model is switched, so nothing may have registered cachegen_sdpa yet:
    the benchmark registers it itself."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    monkeypatch.delitem(AttentionInterface._global_mapping, attention.NAME, raising=False)
    monkeypatch.delitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, attention.NAME, raising=False)
    monkeypatch.setenv(attention.ENV, "sdpa")
    model = tiny_llama()
    assert not attention.install(model)
    rows = run_attention(model, list(range(1, 41)), list(range(50, 54)), rounds=1)
    assert [r["attention"] for r in rows] == list(IMPLEMENTATIONS)
    assert model.config._attn_implementation == "sdpa"
