"""``cachegen bench attention``: the step after a loaded cache, on transformers' ``sdpa`` and on ``cachegen_sdpa``.

The step a time to first token ends with: the prompt tail (``tail_tokens``) on a cache of
``context_tokens``. The two attention implementations take turns, round after round, in one
process and on one cache, so a machine whose speed drifts (a shared host) moves both alike;
a comparison of two separate runs would measure the drift. Rows: ``attention``,
``context_tokens``, ``tail_tokens``, ``rounds``, ``step_s_median``, ``step_s_min``, and
``max_logit_diff`` (against ``sdpa``'s logits: 0 when they are identical).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from cachegen.engine import attention
from cachegen.engine.attention import NAME
from cachegen.engine.hf_cache import to_transformers
from cachegen.engine.prefill import prefill
from cachegen.errors import ConfigError

IMPLEMENTATIONS = ("sdpa", NAME)


@torch.inference_mode()
def _step(model, kv, tail: torch.Tensor) -> tuple[float, torch.Tensor]:
    cache = to_transformers(kv, model.config, dtype=model.dtype)
    t = time.perf_counter()
    out = model(input_ids=tail, cache=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t, out.logits


def run_attention(model, ctx: Sequence[int], tail: Sequence[int], rounds: int = 8) -> list[dict]:
    """One row per implementation; ``model`` is switched back to ``cachegen_sdpa`` afterwards if it was on it."""
    if rounds < 1 or not ctx or not tail:
        raise ConfigError("need a context, a tail and at least one round")
    was = model.config._attn_implementation
    if was not in IMPLEMENTATIONS:
        raise ConfigError(f"the model runs {was!r} attention: this benchmark compares sdpa and {NAME}")
    kv = prefill(model, list(ctx))
    t = torch.as_tensor(list(tail), dtype=torch.long).view(1, -1)
    times: dict[str, list[float]] = {a: [] for a in IMPLEMENTATIONS}
    logits: dict[str, torch.Tensor] = {}
    try:
        attention.register()  # both are compared whatever $CACHEGEN_ATTENTION says
        for _ in range(rounds + 1):  # the first round warms both up and is not counted
            for a in IMPLEMENTATIONS:
                model.set_attn_implementation(a)
                s, logits[a] = _step(model, kv, t)
                times[a].append(s)
    finally:
        model.set_attn_implementation(was)
    ref = logits["sdpa"]
    return [
        {
            "attention": a,
            "context_tokens": len(ctx),
            "tail_tokens": len(tail),
            "rounds": rounds,
            "step_s_median": statistics.median(times[a][1:]),
            "step_s_min": min(times[a][1:]),
            "max_logit_diff": float((logits[a] - ref).abs().max()),
        }
        for a in IMPLEMENTATIONS
    ]


def run_attention_bench(
    model_name: str, context_tokens: int, tail_tokens: int, rounds: int, json_path: str | None
) -> list[dict]:
    from cachegen.bench.cli import load
    from cachegen.bench.quality import text_ids

    lm = load(model_name)
    ids = text_ids(lm.tokenizer, "pydoc-eval", context_tokens + tail_tokens)
    rows = run_attention(lm.model, ids[:context_tokens], ids[context_tokens:], rounds)
    print(f"{'attention':14s} {'median s':>9s} {'min s':>7s} {'max logit diff':>15s}")
    for r in rows:
        print(f"{r['attention']:14s} {r['step_s_median']:9.3f} {r['step_s_min']:7.3f} {r['max_logit_diff']:15.3g}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return rows


def register(sub) -> None:
    """Add the ``attention`` subcommand to the ``bench`` subparsers."""
    p = sub.add_parser("attention", help="the step after a loaded cache on sdpa and on cachegen_sdpa, taking turns")
    p.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    p.add_argument("--context-tokens", type=int, default=4096, help="tokens in the cache (default 4096)")
    p.add_argument("--tail-tokens", type=int, default=16, help="tokens of the step (default 16)")
    p.add_argument("--rounds", type=int, default=8, help="counted rounds of each implementation (default 8)")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON ('-': stdout)")
    p.set_defaults(func=lambda a: run_attention_bench(a.model, a.context_tokens, a.tail_tokens, a.rounds, a.json))
