"""What a decoding step costs after a long context: transformers' concatenating layers against
:class:`cachegen.engine.hf_cache.GrowingLayer` (what :func:`to_transformers` builds), which appends in place.

    .venv/bin/python tools/time_decode_steps.py [--context 4096] [--steps 32] [--rounds 6]

SmolLM2 (the embedded default) in fp32, a random-token context, then a 16-token first step and
``--steps`` greedy steps, each way in turn for ``--rounds`` rounds, with the CLI's malloc tuning
(:func:`cachegen.allocator.keep_freed_memory`). Prints best and median seconds of the first step
and of one later step; both ways must give the same tokens. Quoted in ``hf_cache`` and the README.
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
from cachegen.kv import KVCache, KVLayer


def concatenating(kv: KVCache, config) -> DynamicCache:
    """transformers' own cache holding ``kv`` (full layers only), as before GrowingLayer."""
    cache = DynamicCache(config=config)
    for layer, l in zip(cache.layers, kv.layers, strict=True):
        layer.lazy_initialization(l.k, l.v)
        layer.keys, layer.values = l.k.unsqueeze(0), l.v.unsqueeze(0)
    return cache


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
    args = ap.parse_args()
    keep_freed_memory()
    lm = load_model("smollm2-135m", progress=False)
    model = lm.model
    ids = torch.randint(100, 20000, (1, args.context + 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        base = model(input_ids=ids[:, : args.context], use_cache=True, logits_to_keep=1).cache
    kv = KVCache([KVLayer(l.keys[0].clone(), l.values[0].clone()) for l in base.layers])
    del base
    ways = {
        "concatenating": lambda: concatenating(kv, model.config),
        "in place": lambda: to_transformers(kv, model.config),
    }
    times: dict[str, tuple[list[float], list[float]]] = {w: ([], []) for w in ways}
    tokens = {}
    for r in range(args.rounds):
        for w in ways if r % 2 == 0 else reversed(list(ways)):
            first, step, seq = run(model, ways[w](), ids[:, args.context :], args.steps)
            times[w][0].append(first)
            times[w][1].append(step)
            tokens.setdefault(w, seq)
    assert len({tuple(s) for s in tokens.values()}) == 1, "the two caches gave different tokens"
    for w, (firsts, steps) in times.items():
        print(
            f"{w:14s} first step best {min(firsts):.4f} s median {statistics.median(firsts):.4f} s | "
            f"later step best {min(steps):.4f} s median {statistics.median(steps):.4f} s"
        )


if __name__ == "__main__":
    main()
