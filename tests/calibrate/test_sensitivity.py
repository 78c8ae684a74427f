"""The Fisher samples' gradients: the KV's only, with the model left as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen.calibrate.sensitivity import fisher_matrices, token_sensitivity


def _pairs(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 512, (40,), generator=g), torch.randint(0, 512, (8,), generator=g)) for _ in range(n)]


def _reference_fisher(model, pairs, n_sink=4, samples=2, seed=0):
    """The same empirical Fisher written out plainly, with the weights requiring gradients as loaded."""
    from cachegen.calibrate.sensitivity import context_kv
    from cachegen.engine.hf_cache import to_transformers
    from cachegen.kv import KVCache, KVLayer

    g = torch.Generator().manual_seed(seed)
    acc = None
    for ctx, cont in pairs:
        kv = context_kv(model, ctx)
        for _ in range(samples):
            leaves = [(l.k.clone().requires_grad_(True), l.v.clone().requires_grad_(True)) for l in kv.layers]
            kv_g = KVCache([KVLayer(k, v, l.kind, l.window) for (k, v), l in zip(leaves, kv.layers)], start=0)
            out = model(input_ids=cont[None], cache=to_transformers(kv_g, model.config), use_cache=True)
            logp = torch.log_softmax(out.logits[0].float(), dim=-1)
            y = torch.multinomial(logp.detach().exp(), 1, generator=g)[:, 0]
            grads = torch.autograd.grad(logp.gather(1, y[:, None]).sum(), [t for kv_ in leaves for t in kv_])
            mats = [
                torch.einsum("htd,hte->hde", gr[:, n_sink:].double(), gr[:, n_sink:].double()).numpy()
                / (len(cont) * samples * len(pairs))
                for gr in grads
            ]
            acc = mats if acc is None else [a + m for a, m in zip(acc, mats)]
    return acc


def test_fisher_equals_a_plain_computation_and_leaves_no_gradient_on_the_model(tiny_llama):
    pairs = _pairs()
    assert all(p.requires_grad for p in tiny_llama.parameters())
    got = fisher_matrices(tiny_llama, pairs, samples=2)
    # the weights need no gradient for this, and none is left on them (it was 4 bytes per parameter, kept)
    assert all(p.grad is None for p in tiny_llama.parameters())
    assert all(p.requires_grad for p in tiny_llama.parameters())  # restored
    want = _reference_fisher(tiny_llama, pairs)
    assert len(got) == len(want) == 2 * tiny_llama.config.num_hidden_layers
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)
        assert a.shape == (2, 16, 16) and np.abs(a).max() > 0


def test_token_sensitivity_restores_the_weights_after_an_error(tiny_llama, monkeypatch):
    pairs = _pairs(1)
    ((kv, traces),) = token_sensitivity(tiny_llama, pairs, samples=1)
    assert [tuple(l.k.shape) for l in kv.layers] == [(2, 40, 16)] * 2  # the context's own KV comes back
    assert traces.shape == (2, 2, 2, 40) and (traces >= 0).all() and traces.max() > 0
    assert all(p.grad is None and p.requires_grad for p in tiny_llama.parameters())

    def broken(*a, **k):
        raise RuntimeError("backward failed")

    monkeypatch.setattr(torch.Tensor, "backward", broken)
    with pytest.raises(RuntimeError, match=r"^backward failed$"):
        token_sensitivity(tiny_llama, pairs, samples=1)
    assert all(p.requires_grad for p in tiny_llama.parameters())  # an error inside does not leave them frozen
