"""Per-section sensitivity of a model's output to KV noise (empirical Fisher, one backward pass).

Why: KL added by small noise of variance ``v`` on one value is about
``0.5 * v * F`` with ``F`` the Fisher information of that value. We sample the
continuation's next tokens from the model itself, back-propagate their
log-likelihood to the (non-sink) context KV, and average ``grad**2`` per
section: ``s[i] = sum_tokens mean_channels grad**2 / n_continuation``. The
profile sets steps so that ``0.5 * sum s * step**2 / 12`` meets each level's
KL target. Only torch is used; ``model`` is any transformers causal LM.
"""

from __future__ import annotations

import torch

from cachegen.engine.hf_cache import from_transformers, recording_cache, to_transformers
from cachegen.kv import KVCache, KVLayer


def fisher_sensitivity(model, context_ids: torch.Tensor, cont_ids: torch.Tensor, n_sink: int = 4, samples: int = 2, seed: int = 0) -> tuple[list[float], KVCache]:
    """Return (sensitivity per section ``2*layer + kv``, the context KV). ids are 1-D token tensors."""
    cfg = model.config
    with torch.no_grad():
        c = recording_cache(cfg)
        out = model(input_ids=context_ids[None], cache=c, use_cache=True)
        kv = from_transformers(out.cache, cfg)
    acc = [0.0] * (2 * kv.num_layers)
    g = torch.Generator().manual_seed(seed)
    for _ in range(samples):
        leaves = [(l.k.clone().requires_grad_(True), l.v.clone().requires_grad_(True)) for l in kv.layers]
        kv_g = KVCache([KVLayer(k, v, l.kind, l.window) for (k, v), l in zip(leaves, kv.layers)], start=0)
        logits = model(input_ids=cont_ids[None], cache=to_transformers(kv_g, cfg), use_cache=True).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        with torch.no_grad():
            y = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
        loss = logp.gather(1, y[:, None]).sum()
        loss.backward()
        for li, (k, v) in enumerate(leaves):
            for j, t in enumerate((k, v)):
                gr = t.grad[:, n_sink:]
                acc[2 * li + j] += float((gr.double() ** 2).sum(dim=1).mean()) / len(cont_ids) / samples
    return acc, kv
