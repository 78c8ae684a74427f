"""Time to first token against bandwidth, per method.

For a KV method the clock runs from the request to the first generated token and
covers what a user's load does, because it *is* a user's load: the
:class:`~cachegen.stream.loader.StreamingLoader` at the method's level (no
deadline) plans against the store, fetches the context's chunks through the link
(a pipelined fetch stage, one transfer at a time), decodes each chunk as it
arrives (overlapping later transfers) and stitches them; then the cache is
injected into the model and the first decoding step (the prompt tail after the
context) runs. For ``recompute`` it covers fetching the token ids (4 bytes each)
and prefilling context and tail. Encoding is offline (done at ingest) and not
counted.

Links: ``inproc`` reads a local store (``file://``, a temporary directory) and
sleeps as long as the bytes would take at that bandwidth
(:class:`cachegen.stream.link.ThrottledLink`); ``netns`` reads a Redis store on a
redis-server behind a tc-shaped veth (:mod:`cachegen.bench.netns`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cachegen.bench.baselines import CHUNK_TOKENS, Variant
from cachegen.bench.quality import text_ids
from cachegen.engine.hf_cache import to_transformers
from cachegen.engine.prefill import prefill
from cachegen.errors import ConfigError
from cachegen.store import ContextStore, Namespace, open_backend, token_bytes
from cachegen.store.backend import ChunkWrite
from cachegen.stream import DirectLink, LoaderOptions, StreamingLoader, ThrottledLink, constant

log = logging.getLogger(__name__)

TTFT_FIELDS = ("method", "level", "bandwidth_gbps", "ttft_s")


class _Bench:
    """The store the methods load from and the link to it, at one bandwidth at a time."""

    def __init__(self, link: str, latency_s: float, root: Path):
        if link not in ("inproc", "netns"):
            raise ConfigError(f"unknown link {link!r}: use inproc or netns")
        self.kind, self.latency_s = link, latency_s
        self.netns = None
        if link == "netns":
            if latency_s:
                raise ConfigError("--link netns cannot add latency (the kernel here has no netem)")
            from cachegen.bench.netns import NetnsRedis

            self.netns = NetnsRedis(gbps=10.0, port=6390).start()
            self.backend = open_backend(self.netns.url)
        else:
            self.backend = open_backend(f"file://{root / 'store'}")
        self.link: ThrottledLink | DirectLink = DirectLink()

    def set_bandwidth(self, gbps: float) -> None:
        if self.netns is not None:
            self.netns.set_rate(gbps)
        else:
            self.link = ThrottledLink(constant(gbps), latency_s=self.latency_s)

    def store(self, fingerprint: str, method: str, chunk_tokens: int, codec=None) -> ContextStore:
        return ContextStore(self.backend, Namespace(f"ttft-{fingerprint}", 1, method), codec, chunk_tokens=chunk_tokens)

    def close(self) -> None:
        self.backend.close()
        if self.netns is not None:
            self.netns.close()


@torch.inference_mode()
def _first_token(model, cache, tail: Sequence[int]) -> int:
    ids = torch.as_tensor(list(tail), dtype=torch.long).view(1, -1)
    kwargs = {"cache": cache} if cache is not None else {}
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
    return int(out.logits[0, -1].argmax())


@torch.inference_mode()
def _recompute_first_token(model, ids: Sequence[int], step: int = 2048) -> int:
    from transformers import DynamicCache

    t = torch.as_tensor(list(ids), dtype=torch.long).view(1, -1)
    cache = DynamicCache(config=model.config)
    logits = None
    for a in range(0, t.shape[1], step):
        out = model(input_ids=t[:, a : a + step], cache=cache, use_cache=True, logits_to_keep=1)
        cache, logits = out.cache, out.logits
    if logits is None:
        raise ConfigError("nothing to prefill")
    return int(logits[0, -1].argmax())


def time_kv_method(
    model, bench: _Bench, store: ContextStore, variant: Variant, ctx: Sequence[int], tail: Sequence[int]
) -> dict:
    """One request: the loader at the variant's level, then the cache into the model and the first token."""
    opts = LoaderOptions(policy=variant.level, slo_s=None, dtype=model.dtype)
    loader = StreamingLoader(
        store, variant.codec, lambda prefix, ids: prefill(model, ids, prefix=prefix), opts, link=bench.link
    )
    t0 = time.perf_counter()
    res = loader.load(ctx, t0=t0)
    t1 = time.perf_counter()
    if res.kv is None or res.faults or res.cached_tokens != len(ctx):  # then this would not time the method
        raise ConfigError(f"{variant.label}: the load did not read the stored context: {res.summary()}")
    cache = to_transformers(res.kv, model.config, dtype=model.dtype)
    t2 = time.perf_counter()
    tok = _first_token(model, cache, tail)
    t3 = time.perf_counter()
    fetched = max(d.fetch_end or 0.0 for d in res.decisions)  # when the last chunk had crossed the link
    return {
        "ttft_s": t3 - t0,
        "fetch_s": fetched,
        "decode_s": res.decode_s,
        "plan_s": res.plan_s,
        "stitch_s": res.stitch_s,
        "load_s": t1 - t0,
        "inject_s": t2 - t1,
        "first_step_s": t3 - t2,
        "first_token": tok,
    }


def time_recompute(model, bench: _Bench, store: ContextStore, ctx: Sequence[int], tail: Sequence[int]) -> dict:
    """One request without a cache: the token ids cross the link (4 bytes each), then a prefill of everything."""
    ref = store.refs(ctx)[0]
    bench.link.begin()
    t0 = time.perf_counter()
    blob = bench.link.fetch(store.get, ref, 0)
    ids = np.frombuffer(blob, dtype="<u4").tolist()
    t1 = time.perf_counter()
    tok = _recompute_first_token(model, ids + list(tail))
    t2 = time.perf_counter()
    return {
        "ttft_s": t2 - t0,
        "fetch_s": t1 - t0,
        "decode_s": 0.0,
        "plan_s": 0.0,
        "stitch_s": 0.0,
        "load_s": 0.0,
        "inject_s": 0.0,
        "first_step_s": t2 - t1,
        "first_token": tok,
    }


BREAKDOWN = ("fetch_s", "decode_s", "plan_s", "stitch_s", "load_s", "inject_s", "first_step_s", "first_token")


def run_ttft(
    lm,
    codecs: Sequence[Variant],
    context_tokens: int = 4096,
    bandwidths_gbps: Sequence[float] = (0.1, 1.0, 10.0),
    link: str = "inproc",
    latency_s: float = 0.0,
    tail_tokens: int = 16,
    include_recompute: bool = True,
    repeats: int = 1,
    recompute_repeats: int = 1,
    text: str = "pydoc-eval",
    chunk_tokens: int = CHUNK_TOKENS,
) -> dict:
    """Rows of :data:`TTFT_FIELDS` plus a breakdown (:data:`BREAKDOWN`).

    ``ttft_s`` is the best of ``repeats`` runs (``recompute_repeats`` for
    recompute, whose long prefill is less sensitive to noise): on a shared
    machine the noise only ever adds time. Each codec's chunks are stored once
    (encoded with the store's chunk keys) before the clock runs.
    """
    if not bandwidths_gbps or any(b <= 0 for b in bandwidths_gbps):
        raise ConfigError("bandwidths must be positive")
    model = lm.model
    ids = text_ids(lm.tokenizer, text, context_tokens + tail_tokens)
    ctx, tail = ids[:context_tokens], ids[context_tokens:]
    kv = prefill(model, ctx)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cachegen-ttft-") as tmp:
        bench = _Bench(link, latency_s, Path(tmp))
        try:
            staged: list[tuple[str, Variant | None, ContextStore, int]] = []
            if include_recompute:  # the token ids as one payload
                st = bench.store(lm.fingerprint, "recompute", len(ctx))
                raw = token_bytes(ctx)
                ref = st.refs(ctx)[0]
                bench.backend.put_chunks([ChunkWrite(ref.key, raw, {0: raw}, start=0, ends_context=True)])
                staged.append(("recompute", None, st, len(raw)))
            for c in codecs:
                st = bench.store(lm.fingerprint, c.label, chunk_tokens, c.codec)
                st.put_context(ctx, kv, levels=[c.level])
                size = sum(i.sizes[c.level] for i in st.plan(ctx))
                staged.append((c.label, c, st, size))
            for gbps in bandwidths_gbps:
                bench.set_bandwidth(gbps)
                for key, v, st, size in staged:
                    runs = []
                    for _ in range(max(1, recompute_repeats if v is None else repeats)):
                        if v is None:
                            runs.append(time_recompute(model, bench, st, ctx, tail))
                        else:
                            runs.append(time_kv_method(model, bench, st, v, ctx, tail))
                    r = min(runs, key=lambda r: r["ttft_s"])
                    row = {
                        "method": v.name if v else "recompute",
                        "level": v.row_level if v else None,
                        "bandwidth_gbps": gbps,
                        "ttft_s": r["ttft_s"],
                        "size_bytes": size,
                    }
                    row.update({k: r[k] for k in BREAKDOWN})
                    rows.append(row)
                    log.info("%g Gbit/s %-22s TTFT %.3fs", gbps, key, r["ttft_s"])
        finally:
            bench.close()
    return {
        "kind": "ttft",
        "model": lm.name,
        "context_tokens": context_tokens,
        "tail_tokens": len(tail),
        "link": link,
        "latency_s": latency_s,
        "repeats": repeats,
        "recompute_repeats": recompute_repeats,
        "dtype": str(model.dtype).replace("torch.", ""),
        "rows": rows,
    }
