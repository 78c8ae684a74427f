"""Needle retrieval accuracy per codec and level, with Wilson 95% intervals.

Each case hides ``The secret number is NNNNN.`` in real text
(:func:`cachegen.corpus.needle_case`). The context's KV is computed once per
case, round-tripped through every codec in 256-token chunks, and the model
answers the question greedily from each decoded cache (all codecs of a case
in one batch). ``recompute`` is the
uncompressed cache (what prefilling the text gives): the reference accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch

from cachegen import corpus
from cachegen.bench.baselines import CHUNK_TOKENS, Variant
from cachegen.engine.hf_cache import layer_kinds
from cachegen.engine.prefill import eos_token_ids, prefill
from cachegen.errors import ConfigError
from cachegen.kv import KVCache

NEEDLE_FIELDS = ("codec", "level", "cases", "correct", "accuracy", "ci_low", "ci_high", "bits_per_value")


def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for ``k`` successes in ``n`` trials (95% by default)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def batched_cache(kvs: Sequence[KVCache], config, dtype: torch.dtype | None = None):
    """One transformers cache holding several same-length KV caches as a batch (row i = ``kvs[i]``)."""
    from transformers import DynamicCache

    kinds = layer_kinds(config)
    n = kvs[0].num_tokens
    if any(kv.start != 0 or kv.num_tokens != n or kv.num_layers != len(kinds) for kv in kvs):
        raise ConfigError("batched caches must start at 0 and share their length and layers")
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        k = torch.stack([kv.layers[i].k for kv in kvs])
        v = torch.stack([kv.layers[i].v for kv in kvs])
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        layer.update(k, v)  # type: ignore[union-attr]  # transformers' layer union
    return cache


@torch.inference_mode()
def batched_greedy(
    model, kvs: Sequence[KVCache], tail: Sequence[int], max_new_tokens: int, eos_ids: set[int] | None = None
) -> list[list[int]]:
    """Greedy decoding after each of ``kvs`` (same prompt tail), all rows in one batch.

    The same computation as :func:`cachegen.engine.prefill.greedy_generate` per row
    (every row has the same length, so no padding or mask), done for all
    codecs at once: decoding steps are weight-bound on a CPU, so a batch of
    16 costs little more than one.
    """
    b = len(kvs)
    cache = batched_cache(kvs, model.config, dtype=model.dtype)
    ids = torch.as_tensor(list(tail), dtype=torch.long).view(1, -1).expand(b, -1).contiguous()
    outs: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    for _ in range(max_new_tokens):
        res = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        cache = res.cache
        nxt = res.logits[:, -1].float().argmax(-1)
        for i in range(b):
            if not done[i]:
                t = int(nxt[i])
                outs[i].append(t)
                done[i] = bool(eos_ids) and t in cast("set[int]", eos_ids)  # bool() excludes None
        if all(done):
            break
        ids = nxt.view(b, 1)
    return outs


def run_needle(
    lm,
    codecs: Sequence[Variant],
    cases: int = 50,
    context_tokens: int = 1024,
    include_recompute: bool = True,
    max_new_tokens: int = 8,
    seed: int = 0,
    source: str = "pydoc-eval",
    chunk_tokens: int = CHUNK_TOKENS,
    log: Callable[[str], None] | None = None,
) -> dict:
    if cases < 1:
        raise ConfigError("--cases must be at least 1")
    if not codecs and not include_recompute:
        raise ConfigError("nothing to evaluate")
    model, tok = lm.model, lm.tokenizer
    eos = eos_token_ids(model, tok)
    keys = (["recompute"] if include_recompute else []) + [c.label for c in codecs]
    correct = {k: 0 for k in keys}
    nbytes = {k: 0 for k in keys}
    nvalues = 0
    answers: dict[str, list[str]] = {k: [] for k in keys}
    for i in range(cases):
        case = corpus.needle_case(tok, context_tokens, seed=seed + i, source=source)
        kv = prefill(model, case.context_ids)
        nvalues += kv.num_values

        caches = [kv] if include_recompute else []
        for c in codecs:
            blobs = c.encode_context(kv, chunk_tokens)
            nbytes[c.label] += sum(len(b) for b in blobs)
            caches.append(KVCache.concat([c.codec.decode(b) for b in blobs]))
        for key, out in zip(keys, batched_greedy(model, caches, case.question_ids, max_new_tokens, eos)):
            text = tok.decode(out, skip_special_tokens=True)
            answers[key].append(text)
            correct[key] += corpus.is_correct(text, case)
        if log:
            log(f"case {i + 1}/{cases}: " + " ".join(f"{k}={correct[k]}" for k in keys))
    rows = []
    byname = {c.label: c for c in codecs}
    for k in keys:
        lo, hi = wilson(correct[k], cases)
        var = byname.get(k)
        rows.append(
            {
                "codec": var.name if var else "recompute",
                "level": var.row_level if var else None,
                "cases": cases,
                "correct": correct[k],
                "accuracy": correct[k] / cases,
                "ci_low": lo,
                "ci_high": hi,
                # recompute stores token ids (4 bytes each), not KV
                "bits_per_value": 8.0 * nbytes[k] / nvalues if var else None,
                "sample_answers": answers[k][:3],
            }
        )
    return {
        "kind": "needle",
        "model": lm.name,
        "source": source,
        "context_tokens": context_tokens,
        "cases": cases,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "rows": rows,
    }
