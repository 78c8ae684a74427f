"""The grouped-query attention swap: the same logits and cache as transformers' sdpa, in every kind of step."""

from __future__ import annotations

import pytest
import torch
from tests.tiny_models import tiny_llama

from cachegen.engine import attention
from cachegen.errors import ConfigError


def _steps(model, ids: list[int], split: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """A prefill of ``ids[:split]``, a multi-token step for the rest, then one single-token step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:split]]), cache=cache, use_cache=True)
        out = model(input_ids=torch.tensor([ids[split:]]), cache=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        one = model(input_ids=nxt, cache=cache, use_cache=True)
    keys = [layer.keys.clone() for layer in cache.layers]
    return out.logits, keys, one.logits


def test_install_switches_sdpa_and_keeps_every_result():
    ids = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_model = tiny_llama()
    assert ref_model.config._attn_implementation == "sdpa"
    ref = _steps(ref_model, ids, 50)
    model = tiny_llama()
    assert attention.install(model)
    assert model.config._attn_implementation == attention.NAME
    got = _steps(model, ids, 50)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-6)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-6)


def test_masked_multi_token_step_takes_the_grouped_kernel(monkeypatch):
    """The case the swap exists for goes to SDPA with enable_gqa and the cache's own heads, not repeated ones."""
    calls: list[tuple[int, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((int(k.shape[1]), bool(kwargs.get("enable_gqa", False))))
        return real(q, k, v, *args, **kwargs)

    model = tiny_llama()
    attention.install(model)
    ids = list(range(1, 41))
    _steps(model, ids, 30)  # registers before the spy, so only the spied steps count
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:30]]), cache=cache, use_cache=True)
        calls.clear()
        model(input_ids=torch.tensor([ids[30:]]), cache=cache, use_cache=True)  # 10 queries under a mask
    assert calls == [(2, True), (2, True)]  # both layers: the 2 KV heads as stored, grouped in the kernel


def test_install_leaves_other_implementations():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    assert not attention.install(model)
    assert model.config._attn_implementation == "eager"


def test_stock_sdpa_switches_back_even_after_an_error():
    model = tiny_llama()
    attention.install(model)
    with attention.stock_sdpa(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == attention.NAME
    try:
        with attention.stock_sdpa(model):
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert model.config._attn_implementation == attention.NAME
    plain = tiny_llama()
    with attention.stock_sdpa(plain):  # a model that was never switched stays as it is
        assert plain.config._attn_implementation == "sdpa"
    assert plain.config._attn_implementation == "sdpa"


def test_the_environment_can_keep_transformers_attention(monkeypatch):
    monkeypatch.setenv(attention.ENV, "sdpa")
    model = tiny_llama()
    assert not attention.install(model)
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.setenv(attention.ENV, "flash")
    with pytest.raises(ConfigError, match="CACHEGEN_ATTENTION='flash': use cachegen_sdpa"):
        attention.install(model)
