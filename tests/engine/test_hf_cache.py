"""KV plumbing on the real models: extract, chunk, concatenate, inject; logits must be bit-identical."""

import pytest
import torch

from cachegen.engine.hf_cache import from_transformers, layer_kinds, recording_cache, to_transformers
from cachegen.engine.prefill import eos_token_ids, greedy_generate
from cachegen.errors import ConfigError
from cachegen.kv import KVCache, LayerKind

pytestmark = pytest.mark.model


def _ids(tok, n, seed=0):
    from cachegen import corpus

    text = corpus.take_tokens(tok, corpus.text("pydoc-eval"), n, offset=seed * 997)
    return tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :n]


def _reference(model, ctx, cont):
    """The model's own path: prefill the context in one pass, then run the continuation on its cache."""
    with torch.inference_mode():
        c = model(input_ids=ctx, use_cache=True).cache
        return model(input_ids=cont, cache=c, use_cache=True).logits


def _extract(model, ctx):
    with torch.inference_mode():
        out = model(input_ids=ctx, cache=recording_cache(model.config), use_cache=True)
        return from_transformers(out.cache, model.config)


def _injected(model, kv, cont):
    with torch.inference_mode():
        return model(input_ids=cont, cache=to_transformers(kv, model.config), use_cache=True).logits


@pytest.mark.parametrize("name,ctx_len", [("smollm2", 700), ("gemma3", 1100)])
def test_extract_inject_bit_identical(request, name, ctx_len):
    lm = request.getfixturevalue(name)
    model = lm.model
    ids = _ids(lm.tokenizer, ctx_len + 16)
    ctx, cont = ids[:, :ctx_len], ids[:, ctx_len:]
    ref = _reference(model, ctx, cont)
    kv = _extract(model, ctx)
    assert kv.num_tokens == ctx_len  # sliding layers kept every token
    assert torch.equal(_injected(model, kv, cont), ref)
    # split into 256-token chunks and join again: still bit-identical
    joined = KVCache.concat(kv.chunks(256))
    assert len(kv.chunks(256)) == -(-ctx_len // 256)
    assert torch.equal(_injected(model, joined, cont), ref)


def test_gemma_sliding_layers_are_marked(gemma3):
    kinds = layer_kinds(gemma3.config)
    assert len(kinds) == 18
    assert sum(k == LayerKind.SLIDING for k, _ in kinds) == 15
    assert all(w == 512 for k, w in kinds if k == LayerKind.SLIDING)
    ids = _ids(gemma3.tokenizer, 600)
    kv = _extract(gemma3.model, ids)
    cache = to_transformers(kv, gemma3.config)
    sliding = [l for l in cache.layers if l.is_sliding]
    assert all(l.get_seq_length() == 600 and l.keys.shape[-2] == 511 for l in sliding)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_generate_from_injected_cache_gives_same_tokens(request, name):
    lm = request.getfixturevalue(name)
    model = lm.model
    ids = _ids(lm.tokenizer, 600, seed=3)
    ctx, tail = ids[:, :580], ids[0, 580:].tolist()
    eos = eos_token_ids(model, lm.tokenizer)
    with torch.inference_mode():
        full = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
    kv = KVCache.concat(_extract(model, ctx).chunks(256))
    ours = greedy_generate(model, kv, tail, 12, eos)
    assert ours == full[: len(ours)] and len(ours) >= 1


def test_to_transformers_checks_layout(smollm2):
    kv = _extract(smollm2.model, _ids(smollm2.tokenizer, 40))
    with pytest.raises(ConfigError):
        to_transformers(kv.slice(10, 40), smollm2.config)  # must start at token 0
    short = KVCache(kv.layers[:-1])
    with pytest.raises(ConfigError):
        to_transformers(short, smollm2.config)


def test_inject_holds_full_layers_without_copy_and_never_writes_them():
    """Full layers take the KV's tensors as they are (no copy before the first step); decoding on the
    cache copies them once into a buffer with room (GrowingLayer), so the KV the load produced is
    left unchanged."""
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 512, (1, 60), generator=torch.Generator().manual_seed(3))
    kv = _extract(model, ids[:, :40])
    before = [(l.k.clone(), l.v.clone()) for l in kv.layers]
    cache = to_transformers(kv, model.config)
    assert all(c.keys.data_ptr() == l.k.data_ptr() for c, l in zip(cache.layers, kv.layers))
    with torch.inference_mode():
        got = model(input_ids=ids[:, 40:], cache=cache, use_cache=True).logits
    assert cache.get_seq_length() == 60
    assert all(torch.equal(l.k, k) and torch.equal(l.v, v) for l, (k, v) in zip(kv.layers, before))
    assert torch.equal(got, _reference(model, ids[:, :40], ids[:, 40:]))
