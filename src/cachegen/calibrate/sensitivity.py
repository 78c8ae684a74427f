"""Sensitivity of a model's output to KV noise (empirical Fisher from backward passes).

Why: KL added by small noise ``e`` on a head's key or value vectors is about
``0.5 * e^T F e`` with ``F`` the Fisher information. We sample the
continuation's next tokens from the model itself, back-propagate their
log-likelihood to the (non-sink) context KV, and accumulate per head the
matrix ``F = sum_tokens g g^T / n_continuation`` (D x D). The profile projects
it on its PCA basis, so every basis component gets its own weight (measured
sensitivities differ by orders of magnitude between components of one head,
not only between layers), and sets steps so the predicted KL meets each
level's target. The sink tokens are kept exact by the codec, so their
gradients are left out. Averaging over several contexts removes most of the
run-to-run noise of a single backward pass. Only torch is used; ``model`` is
any transformers causal LM.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import cast

import numpy as np
import torch

from cachegen.codec.rope import RopeSpec, unrope_grad
from cachegen.engine.hf_cache import from_transformers, recording_cache, to_transformers
from cachegen.kv import KVCache, KVLayer


def context_kv(model, context_ids: torch.Tensor) -> KVCache:
    """The KV cache of a transformers causal LM after a prefill of 1-D ``context_ids`` (no gradients)."""
    with torch.no_grad():
        c = recording_cache(model.config)
        out = model(input_ids=context_ids[None], cache=c, use_cache=True, logits_to_keep=1)  # only the cache is read
        return from_transformers(out.cache, model.config)


@contextmanager
def _frozen(model) -> Iterator[None]:
    """The model's parameters without ``requires_grad`` for the duration (restored after).

    Why: only the KV's gradients are read. With the weights requiring gradients (transformers' default),
    every backward pass also computed each weight's gradient (as much work again as the KV's, and the
    activations kept for it) and left them accumulated on the model: 4 bytes per parameter, held by the
    Engine's model for as long as it served."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _sampled_grads(
    model, kv: KVCache, cont_ids: torch.Tensor, g: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) leaves of ``kv`` per layer whose ``.grad`` holds the gradient of the log-likelihood
    of a continuation sampled from the model (one backward pass): an empirical Fisher sample."""
    leaves = [(l.k.clone().requires_grad_(True), l.v.clone().requires_grad_(True)) for l in kv.layers]
    kv_g = KVCache([KVLayer(k, v, l.kind, l.window) for (k, v), l in zip(leaves, kv.layers)], start=0)
    with _frozen(model):
        logits = model(input_ids=cont_ids[None], cache=to_transformers(kv_g, model.config), use_cache=True).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        with torch.no_grad():
            y = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
        logp.gather(1, y[:, None]).sum().backward()
    return leaves


def fisher_matrices(
    model,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    n_sink: int = 4,
    samples: int = 2,
    seed: int = 0,
    rope: Sequence[RopeSpec | None] | None = None,
) -> list[np.ndarray]:
    """Per section ``2*layer + kv``: Fisher matrices (heads, D, D) float64, averaged over ``pairs`` of (context, continuation) ids.

    With ``rope`` (per layer) the key Fisher is for pre-RoPE keys (each token's gradient rotated back)."""
    acc: list[np.ndarray] | None = None
    g = torch.Generator().manual_seed(seed)
    for context_ids, cont_ids in pairs:
        kv = context_kv(model, context_ids)
        if acc is None:
            acc = [np.zeros((t.shape[0], t.shape[2], t.shape[2])) for l in kv.layers for t in (l.k, l.v)]
        for _ in range(samples):
            leaves = _sampled_grads(model, kv, cont_ids, g)
            w = 1.0 / (len(cont_ids) * samples * len(pairs))
            with torch.no_grad():
                for li, (k, v) in enumerate(leaves):
                    for j, t in enumerate((k, v)):
                        assert t.grad is not None  # _sampled_grads ran backward through every leaf
                        gr = t.grad[:, n_sink:]
                        if j == 0 and rope is not None:
                            gr = unrope_grad(gr, rope[li], n_sink)
                        gr = gr.double()
                        acc[2 * li + j] += (torch.einsum("htd,hte->hde", gr, gr) * w).numpy()
    assert acc is not None
    return acc


def fisher_sensitivity(
    model,
    context_ids: torch.Tensor,
    cont_ids: torch.Tensor,
    n_sink: int = 4,
    samples: int = 2,
    seed: int = 0,
    per_component: bool = False,
) -> tuple[list, KVCache]:
    """Return (sensitivity per section ``2*layer + kv``, the context KV). ids are 1-D token tensors.

    Per section: a float (the mean per-channel Fisher, summed over context tokens), or with
    ``per_component`` the (heads, D, D) Fisher matrices that :func:`cachegen.codec.fit.calibrate` accepts too."""
    mats = fisher_matrices(model, [(context_ids, cont_ids)], n_sink, samples, seed)
    kv = context_kv(model, context_ids)
    if per_component:
        return mats, kv
    return [float(np.mean(np.diagonal(m, axis1=1, axis2=2))) for m in mats], kv


def token_sensitivity(
    model, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], samples: int = 2, seed: int = 0
) -> list[tuple[KVCache, np.ndarray]]:
    """Per (context, continuation) pair: the context KV and its per-token Fisher traces
    (layers, 2, heads, tokens) float64: ``sum over the head's dims of g^2``, averaged over
    ``samples`` continuations sampled from the model (the training data of
    :mod:`cachegen.codec.importance`). A trace is rotation invariant, so RoPE does not matter."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for context_ids, cont_ids in pairs:
        kv = context_kv(model, context_ids)
        acc: torch.Tensor | None = None
        for _ in range(samples):
            leaves = _sampled_grads(model, kv, cont_ids, g)
            with torch.no_grad():
                per = torch.stack(
                    [
                        # _sampled_grads ran backward through every leaf: .grad is set
                        torch.stack(
                            [
                                (cast(torch.Tensor, k.grad).double() ** 2).sum(-1),
                                (cast(torch.Tensor, v.grad).double() ** 2).sum(-1),
                            ]
                        )
                        for k, v in leaves
                    ]
                )
            acc = per if acc is None else acc + per
        out.append((kv, (cast(torch.Tensor, acc) / samples).numpy()))  # acc is None only when samples == 0
    return out
