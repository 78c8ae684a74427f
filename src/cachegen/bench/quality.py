"""Size against quality: every codec and level on one context of real text.

The context's KV is computed once (the model's own precision), encoded in
256-token chunks as the store keeps it, decoded, and handed back to the model,
which then reads a continuation of the same text. Quality compares the
continuation's next-token distributions with those after the unmodified cache:

- ``kl``: mean KL(reference || codec) over the continuation positions, nats/token;
- ``top1_agreement``: fraction of positions whose argmax token is unchanged;
- ``ppl_delta_pct``: change of the continuation's perplexity, in percent.

``bits_per_value = 8 * size_bytes / num_values``, side information included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cachegen import corpus
from cachegen.bench.baselines import CHUNK_TOKENS, Variant
from cachegen.engine.prefill import continue_from, prefill
from cachegen.errors import ConfigError
from cachegen.kv import KVCache

QUALITY_FIELDS = ("codec", "level", "bits_per_value", "size_bytes", "kl", "ppl_delta_pct", "top1_agreement")


def text_ids(tokenizer, source: str, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` token ids of a text (a corpus name or any file), repeating it if short."""
    txt = corpus.text(source)
    ids = list(tokenizer(txt, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ConfigError(f"text {source!r} has no tokens")
    while len(ids) < n_tokens:
        ids += list(tokenizer("\n\n" + txt, add_special_tokens=False)["input_ids"])
    return ids[:n_tokens]


@dataclass
class Reference:
    """The unmodified context KV and the continuation's reference log-probabilities."""

    kv: KVCache
    cont_ids: list[int]
    logp: torch.Tensor  # [M, vocab] float32 log-softmax
    nll: float  # mean NLL of cont_ids[1:] (nats)
    top1: torch.Tensor  # [M]


def _logp(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def _nll(logp: torch.Tensor, cont_ids: Sequence[int]) -> float:
    """Mean NLL of the continuation tokens that its own positions predict (``cont[1:]``)."""
    if len(cont_ids) < 2:
        return float("nan")
    tgt = torch.as_tensor(cont_ids[1:], dtype=torch.long)
    return float(-logp[:-1].gather(1, tgt[:, None]).mean())


def reference(model, context_ids: Sequence[int], cont_ids: Sequence[int]) -> Reference:
    kv = prefill(model, context_ids)
    logp = _logp(continue_from(model, kv, cont_ids).logits)
    return Reference(kv, list(cont_ids), logp, _nll(logp, cont_ids), logp.argmax(-1))


def compare(ref: Reference, logits: torch.Tensor) -> dict:
    """KL, top-1 agreement and perplexity change of ``logits`` against the reference."""
    logp = _logp(logits)
    kl = float((ref.logp.exp() * (ref.logp - logp)).sum(-1).clamp_min(0).mean())
    top1 = float((logp.argmax(-1) == ref.top1).float().mean())
    nll = _nll(logp, ref.cont_ids)
    ppl_delta = 100.0 * (math.exp(nll - ref.nll) - 1.0) if not math.isnan(nll) else float("nan")
    return {"kl": kl, "top1_agreement": top1, "ppl_delta_pct": ppl_delta}


def measure(model, ref: Reference, codec: Variant, chunk_tokens: int = CHUNK_TOKENS) -> dict:
    """One result row for ``codec`` (encode in chunks, decode, continue, compare)."""
    t0 = time.perf_counter()
    blobs = codec.encode_context(ref.kv, chunk_tokens)
    t1 = time.perf_counter()
    back = KVCache.concat([codec.codec.decode(b) for b in blobs])
    t2 = time.perf_counter()
    size = sum(len(b) for b in blobs)
    row = {
        "codec": codec.name,
        "level": codec.row_level,
        "bits_per_value": 8.0 * size / ref.kv.num_values,
        "size_bytes": size,
    }
    row.update(compare(ref, continue_from(model, back, ref.cont_ids).logits))
    row.update({"encode_s": t1 - t0, "decode_s": t2 - t1})
    return row


def run_quality(
    lm,
    codecs: Sequence[Variant],
    text: str = "pydoc-eval",
    context_tokens: int = 2048,
    continuation_tokens: int = 256,
    chunk_tokens: int = CHUNK_TOKENS,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Rows of :data:`QUALITY_FIELDS` (plus timings) for every codec, and the run's parameters."""
    if context_tokens < 1 or continuation_tokens < 2:
        raise ConfigError("need at least 1 context token and 2 continuation tokens")
    ids = text_ids(lm.tokenizer, text, context_tokens + continuation_tokens)
    ref = reference(lm.model, ids[:context_tokens], ids[context_tokens:])
    rows = []
    for c in codecs:
        rows.append(measure(lm.model, ref, c, chunk_tokens))
        if log:
            r = rows[-1]
            log(f"{c.label:22s} {r['bits_per_value']:6.2f} bits/value  KL {r['kl']:.2e}")
    return {
        "kind": "quality",
        "model": lm.name,
        "text": text,
        "context_tokens": context_tokens,
        "continuation_tokens": continuation_tokens,
        "chunk_tokens": chunk_tokens,
        "num_values": ref.kv.num_values,
        "reference_ppl": math.exp(ref.nll),
        "rows": rows,
    }
