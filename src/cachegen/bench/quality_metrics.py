"""How much a KV round trip changes a model's next-token predictions.

``measure_quality`` runs the continuation once on the exact context KV and
once on ``roundtrip_fn(kv_context)``, and compares the two next-token
distributions at every continuation position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cachegen.engine.hf_cache import to_transformers
from cachegen.kv import KVCache


def _logits(model, kv: KVCache, cont_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return (
            model(input_ids=cont_ids[None], cache=to_transformers(kv, model.config), use_cache=True).logits[0].float()
        )


def measure_quality(
    model, kv_context: KVCache, cont_ids: torch.Tensor, roundtrip_fn: Callable[[KVCache], KVCache]
) -> dict:
    """Return ``kl`` (mean KL(ref || test), nats/token), ``top1_agreement`` and ``ppl_delta_pct``.

    Perplexity is over ``cont_ids[1:]`` (the first continuation token is predicted by the context).
    """
    cont_ids = torch.as_tensor(cont_ids, dtype=torch.long).reshape(-1)
    ref = _logits(model, kv_context, cont_ids)
    test = _logits(model, roundtrip_fn(kv_context), cont_ids)
    lp_r, lp_t = torch.log_softmax(ref, -1), torch.log_softmax(test, -1)
    kl = (lp_r.exp() * (lp_r - lp_t)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == test.argmax(-1)).float().mean().item()
    tgt = cont_ids[1:]
    nll_r = -lp_r[:-1].gather(1, tgt[:, None]).mean().item()
    nll_t = -lp_t[:-1].gather(1, tgt[:, None]).mean().item()
    ppl_delta = (torch.tensor(nll_t - nll_r).exp().item() - 1.0) * 100.0
    return {"kl": kl, "top1_agreement": top1, "ppl_delta_pct": ppl_delta}
