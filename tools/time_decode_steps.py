"""What a decoding step costs after a long context: transformers' concatenating layers against
:class:`cachegen.engine.hf_cache.GrowingLayer` (what :func:`to_transformers` and the Engine's
:class:`~cachegen.engine.prefill.Decoder` build), which appends in place.

    .venv/bin/python tools/time_decode_steps.py [--context 4096] [--steps 32] [--rounds 6] [--decoder]

With ``--decoder`` the ways are the Engine's decoding session: the Decoder as it was (its cache
filled by ``update()``, a copy, then concatenating every step), the Decoder now over a plain cache
(the prefix's tensors held, copied once at the first step) and over a cache with room after its
tokens, as the streaming loader allocates it (nothing copied); "first step" includes building it.

SmolLM2 (the embedded default) in fp32, a random-token context, then a 16-token first step and
``--steps`` greedy steps, each way in turn for ``--rounds`` rounds, with the CLI's malloc tuning
(:func:`cachegen.allocator.keep_freed_memory`). Prints best and median seconds of the first step
and of one later step; every way must give the same tokens. Quoted in ``hf_cache`` and the README.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from cachegen.allocator import keep_freed_memory
from cachegen.engine.hf_cache import to_transformers
from cachegen.engine.models import load_model
from cachegen.engine.prefill import Decoder
from cachegen.kv import ROOM_TOKENS, KVCache, KVLayer


def concatenating(kv: KVCache, config) -> DynamicCache:
    """transformers' own cache holding ``kv`` (full layers only), as before GrowingLayer."""
    cache = DynamicCache(config=config)
    for layer, l in zip(cache.layers, kv.layers, strict=True):
        layer.lazy_initialization(l.k, l.v)
        layer.keys, layer.values = l.k.unsqueeze(0), l.v.unsqueeze(0)
    return cache


class ConcatenatingDecoder(Decoder):
    """The Engine's Decoder as before GrowingLayer: transformers' layers, filled by ``update()``."""

    def __init__(self, model, prefix: KVCache):
        super().__init__(model)
        self.cache = DynamicCache(config=model.config)
        for layer, l in zip(self.cache.layers, prefix.layers, strict=True):
            layer.update(l.k.unsqueeze(0), l.v.unsqueeze(0))
        self.length = prefix.end


def with_room(kv: KVCache) -> KVCache:
    """A copy of ``kv`` allocated as the streaming loader allocates its cache: with room after it."""
    out = KVCache.allocate(kv, kv.num_tokens, room_tokens=ROOM_TOKENS)
    out.write(kv)
    return out


def run_decoder(make, prefix: KVCache, tail: torch.Tensor, steps: int) -> tuple[float, float, list[int]]:
    """(building the decoder over ``prefix`` and its first step s, mean later step s, tokens)."""
    t = time.perf_counter()
    dec = make(prefix)
    logits = dec.feed(tail[0].tolist())
    first = time.perf_counter() - t
    seq: list[int] = []
    t = time.perf_counter()
    for _ in range(steps):
        logits = dec.feed([int(logits.argmax())])
        seq.append(int(logits.argmax()))
    return first, (time.perf_counter() - t) / max(1, steps), seq


@torch.inference_mode()
def run(model, cache, tail: torch.Tensor, steps: int) -> tuple[float, float, list[int]]:
    """(first step s, mean later step s, tokens)."""
    t = time.perf_counter()
    out = model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
    first = time.perf_counter() - t
    tok, seq = out.logits[0, -1].argmax().view(1, 1), []
    t = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, cache=out.cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[0, -1].argmax().view(1, 1)
        seq.append(int(tok))
    return first, (time.perf_counter() - t) / max(1, steps), seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--decoder", action="store_true", help="time the Engine's Decoder, as before and now")
    args = ap.parse_args()
    keep_freed_memory()
    lm = load_model("smollm2-135m", progress=False)
    model = lm.model
    ids = torch.randint(100, 20000, (1, args.context + 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        base = model(input_ids=ids[:, : args.context], use_cache=True, logits_to_keep=1).cache
    kv = KVCache([KVLayer(l.keys[0].clone(), l.values[0].clone()) for l in base.layers])
    del base
    tail = ids[:, args.context :]
    if args.decoder:
        ways = {
            "concatenating": lambda: run_decoder(lambda p: ConcatenatingDecoder(model, p), kv, tail, args.steps),
            "in place": lambda: run_decoder(lambda p: Decoder(model, p), kv, tail, args.steps),
            "in the room": lambda: run_decoder(lambda p: Decoder(model, p), with_room(kv), tail, args.steps),
        }
    else:
        ways = {
            "concatenating": lambda: run(model, concatenating(kv, model.config), tail, args.steps),
            "in place": lambda: run(model, to_transformers(kv, model.config), tail, args.steps),
        }
    times: dict[str, tuple[list[float], list[float]]] = {w: ([], []) for w in ways}
    tokens = {}
    for r in range(args.rounds):
        for w in ways if r % 2 == 0 else reversed(list(ways)):
            first, step, seq = ways[w]()
            times[w][0].append(first)
            times[w][1].append(step)
            tokens.setdefault(w, seq)
    assert len({tuple(s) for s in tokens.values()}) == 1, "the caches gave different tokens"
    for w, (firsts, steps) in times.items():
        print(
            f"{w:14s} first step best {min(firsts):.4f} s median {statistics.median(firsts):.4f} s | "
            f"later step best {min(steps):.4f} s median {statistics.median(steps):.4f} s"
        )


if __name__ == "__main__":
    main()
