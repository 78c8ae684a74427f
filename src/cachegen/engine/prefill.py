"""Prefill, continuation and greedy generation on a transformers model, in KVCache terms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cachegen.engine.hf_cache import finish_recording, from_transformers, recording_cache, to_transformers
from cachegen.kv import KVCache
from cachegen.progress import bar


def _ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.long)
    return t.view(1, -1)


@torch.inference_mode()
def prefill(model, tokens: Sequence[int], prefix: KVCache | None = None, step: int = 512, progress: bool = False) -> KVCache:
    """KV of ``tokens`` (positions ``[prefix.end, ...)``), computed after ``prefix`` if given.

    Runs in steps of ``step`` tokens (bounded memory, a progress bar), keeping
    every token of sliding layers so the result can be stored and sliced.
    Returns only the new tokens' KV.
    """
    cfg = model.config
    start = prefix.end if prefix is not None else 0
    cache = recording_cache(cfg)
    if prefix is not None:
        for layer, l in zip(cache.layers, prefix.layers):
            layer.update(l.k.unsqueeze(0).to(model.dtype), l.v.unsqueeze(0).to(model.dtype))
    ids = _ids(tokens)
    with bar(ids.shape[1], "prefill", enabled=progress) as pb:
        for a in range(0, ids.shape[1], step):
            out = model(input_ids=ids[:, a : a + step], cache=cache, use_cache=True)
            cache = out.cache
            pb.update(min(step, ids.shape[1] - a))
    kv = from_transformers(cache, cfg, start=0)
    return kv.slice(start, kv.end)


@dataclass
class Continuation:
    logits: torch.Tensor  # [tokens, vocab] for the continuation positions
    cache: object  # the transformers cache after the continuation


@torch.inference_mode()
def continue_from(model, kv: KVCache | None, tokens: Sequence[int]) -> Continuation:
    """Run ``tokens`` after a cached prefix ``kv`` (or from scratch) and return their logits."""
    cache = to_transformers(kv, model.config, dtype=model.dtype) if kv is not None else None
    kwargs = {"cache": cache} if cache is not None else {}
    out = model(input_ids=_ids(tokens), use_cache=True, **kwargs)
    return Continuation(out.logits[0].float(), out.cache)


@torch.inference_mode()
def greedy_generate(model, kv: KVCache | None, prompt_tail: Sequence[int], max_new_tokens: int, eos_ids: set[int] | None = None) -> list[int]:
    """Greedy decoding after a cached prefix: the first step prefills ``prompt_tail``."""
    step = continue_from(model, kv, prompt_tail)
    cache, logits = step.cache, step.logits[-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        if eos_ids and nxt in eos_ids:
            break
        res = model(input_ids=_ids([nxt]), cache=cache, use_cache=True)
        cache, logits = res.cache, res.logits[0, -1].float()
    return out


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids


__all__ = ["prefill", "continue_from", "greedy_generate", "eos_token_ids", "Continuation", "finish_recording"]
