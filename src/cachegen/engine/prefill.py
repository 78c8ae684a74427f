"""Prefill, continuation and the one decoding loop on a transformers model, in KVCache terms.

:class:`Decoder` is a batch-1 session over a *recording* cache (sliding
layers keep every token), so whatever it computed — a prompt's suffix, a
generated answer — can be read back as a :class:`~cachegen.kv.KVCache` and
stored. :func:`prefill`, :func:`generate` and :func:`greedy_generate` all run
through it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from cachegen.engine.hf_cache import (
    GrowingLayer,
    fill_cache,
    finish_recording,
    layer_kinds,
    recording_cache,
    to_transformers,
)
from cachegen.errors import ConfigError
from cachegen.kv import KVCache, KVLayer
from cachegen.progress import bar


def _ids(tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.long)
    return t.view(1, -1)


class Decoder:
    """A model and its cache after ``prefix``: feed tokens, get the last logits, read the KV back."""

    def __init__(self, model, prefix: KVCache | None = None):
        self.model = model
        self.cache = recording_cache(model.config)
        self.start = 0  # a model cache starts at token 0
        self.length = prefix.end if prefix is not None else 0
        if prefix is not None:  # no copy here: the first step appends into its room, or copies it once
            fill_cache(self.cache, prefix, model.dtype)

    @torch.inference_mode()
    def feed(
        self,
        tokens: Sequence[int],
        step: int = 512,
        progress: bool = False,
        cancelled: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` after what is cached; the float logits of the last one (``[vocab]``).

        Runs in steps of ``step`` tokens (bounded memory, a progress bar, a
        cancellation point between steps: ``cancelled()`` true stops early)."""
        ids = _ids(tokens)
        for layer in self.cache.layers:
            if isinstance(layer, GrowingLayer):
                layer.reserve(self.length + ids.shape[1])  # one copy for the whole feed, not one per step
        logits = None
        with bar(ids.shape[1], "prefill", enabled=progress) as pb:
            for a in range(0, ids.shape[1], step):
                if cancelled is not None and a and cancelled():
                    break
                # logits of the last position only: the LM head over every position would cost
                # tokens x vocab x hidden (a fifth of SmolLM2's prefill, most of Gemma-3's)
                out = self.model(input_ids=ids[:, a : a + step], cache=self.cache, use_cache=True, logits_to_keep=1)
                self.cache = out.cache
                self.length += min(step, ids.shape[1] - a)
                logits = out.logits[0, -1]
                pb.update(min(step, ids.shape[1] - a))
        return logits.float() if logits is not None else torch.empty(0)

    def kv(self, a: int | None = None, b: int | None = None) -> KVCache:
        """A copy of the KV of tokens ``[a, b)`` (default: all of it), without copying the rest."""
        a = self.start if a is None else a
        b = self.length if b is None else b
        if not self.start <= a <= b <= self.length:
            raise ConfigError(f"tokens [{a}, {b}) outside the decoder's [{self.start}, {self.length})")
        layers = []
        for layer, (kind, window) in zip(self.cache.layers, layer_kinds(self.model.config)):
            k, v = layer.keys, layer.values  # type: ignore[union-attr]  # transformers' layer union: attention layers here
            if k is None or k.shape[2] != self.length:
                raise ConfigError("a cache layer lost tokens: the decoder must use a recording cache")
            layers.append(KVLayer(k[0, :, a:b].clone(), v[0, :, a:b].clone(), kind, window))  # type: ignore[index]  # values set with keys
        return KVCache(layers, start=a)


def prefill(
    model, tokens: Sequence[int], prefix: KVCache | None = None, step: int = 512, progress: bool = False
) -> KVCache:
    """KV of ``tokens`` (positions ``[prefix.end, ...)``), computed after ``prefix`` if given.

    Runs in steps of ``step`` tokens (bounded memory, a progress bar), keeping
    every token of sliding layers so the result can be stored and sliced.
    Returns only the new tokens' KV.
    """
    dec = Decoder(model, prefix)
    start = dec.length
    dec.feed(tokens, step=step, progress=progress)
    return dec.kv(start, dec.length)


def generate(
    dec: Decoder,
    tail: Sequence[int],
    pick: Callable[[torch.Tensor], int],
    max_new_tokens: int,
    eos_ids: set[int] | frozenset[int] = frozenset(),
    cancelled: Callable[[], bool] | None = None,
) -> Generator[int, None, None]:
    """Yield up to ``max_new_tokens`` tokens after feeding ``tail``: the one decoding loop.

    The first token comes after the prefill of ``tail``; an end-of-sequence
    token is yielded and ends the loop. The last token yielded is not fed back
    (nothing would read its logits), so ``dec`` then holds the KV of
    everything before it. ``cancelled()`` is checked between steps.
    """
    logits = dec.feed(tail, cancelled=cancelled)
    for n in range(max_new_tokens):
        if cancelled is not None and cancelled():
            return
        nxt = pick(logits)
        yield nxt
        if nxt in eos_ids or n + 1 == max_new_tokens:
            return
        logits = dec.feed([nxt])


def greedy_generate(
    model, kv: KVCache | None, prompt_tail: Sequence[int], max_new_tokens: int, eos_ids: set[int] | None = None
) -> list[int]:
    """Greedy decoding after a cached prefix: the first step prefills ``prompt_tail``."""
    return list(
        generate(
            Decoder(model, kv), prompt_tail, lambda lg: int(torch.argmax(lg)), max_new_tokens, frozenset(eos_ids or ())
        )
    )


@dataclass
class Continuation:
    logits: torch.Tensor  # [tokens, vocab] for the continuation positions
    cache: object  # the transformers cache after the continuation


@torch.inference_mode()
def continue_from(model, kv: KVCache | None, tokens: Sequence[int]) -> Continuation:
    """Run ``tokens`` after a cached prefix ``kv`` (or from scratch) and return all their logits."""
    cache = to_transformers(kv, model.config, dtype=model.dtype) if kv is not None else None
    kwargs = {"cache": cache} if cache is not None else {}
    out = model(input_ids=_ids(tokens), use_cache=True, **kwargs)
    return Continuation(out.logits[0].float(), out.cache)


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids


__all__ = [
    "Continuation",
    "Decoder",
    "continue_from",
    "eos_token_ids",
    "finish_recording",
    "generate",
    "greedy_generate",
    "prefill",
]
