"""Time to first token against bandwidth, per method.

For a KV method the clock runs from the request to the first generated token and
covers what a user's load does, because it *is* a user's load: the
:class:`~cachegen.stream.loader.StreamingLoader` at the method's level (no
deadline) plans against the store, fetches the context's chunks through the link
(a pipelined fetch stage, one transfer at a time), decodes each chunk as it
arrives (overlapping later transfers) into its range of the cache; then the cache is
injected into the model and the first decoding step (the prompt tail after the
context) runs. For ``recompute`` it covers fetching the token ids (4 bytes each)
and prefilling context and tail. For ``adaptive`` it is the loader's ``fastest`` policy over
a ladder of formats (:func:`adaptive_ladder`: raw 16- and 8-bit KV and the project codec's
levels, every chunk stored at each): per chunk the format, or text, that ends the load
soonest by its cost model (measured here once, before the clock runs) and the link's
estimate. Encoding is offline (done at ingest) and not counted.

Links: ``inproc`` reads a local store (``file://``, a temporary directory) and
sleeps as long as the bytes would take at that bandwidth
(:class:`cachegen.stream.link.ThrottledLink`); ``netns`` reads a Redis store on a
redis-server behind a tc-shaped veth (:mod:`cachegen.bench.netns`).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cachegen.bench.baselines import CHUNK_TOKENS, RawCodec, UniformCodec, Variant
from cachegen.bench.quality import text_ids
from cachegen.engine.hf_cache import to_transformers
from cachegen.engine.prefill import prefill
from cachegen.errors import ConfigError
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend, token_bytes
from cachegen.store.backend import ChunkWrite
from cachegen.stream import (
    FASTEST,
    TEXT,
    ComputeRates,
    CostModel,
    DirectLink,
    FormatLadder,
    LoaderOptions,
    Rung,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    constant,
)
from cachegen.stream.costs import calibrate_decode, calibrate_recompute

log = logging.getLogger(__name__)

TTFT_FIELDS = ("method", "level", "bandwidth_gbps", "ttft_s")
# per fetch on top of the emulated link: a local file read (the adaptive method's cost model)
FETCH_OVERHEAD_S = 0.5e-3


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


def _recompute_fn(model):
    return lambda prefix, ids: prefill(model, ids, prefix=prefix)


def _time_load(model, loader: StreamingLoader, ctx: Sequence[int], tail: Sequence[int], label: str) -> tuple[dict, Any]:
    """One request through ``loader``: the load, the cache into the model and the first token."""
    t0 = time.perf_counter()
    res = loader.load(ctx, t0=t0)
    t1 = time.perf_counter()
    if res.kv is None or res.faults or res.cached_tokens != len(ctx):  # then this would not time the method
        raise ConfigError(f"{label}: the load did not read the stored context: {res.summary()}")
    cache = to_transformers(res.kv, model.config, dtype=model.dtype)
    t2 = time.perf_counter()
    tok = _first_token(model, cache, tail)
    t3 = time.perf_counter()
    fetched = max(d.fetch_end or 0.0 for d in res.decisions)  # when the last chunk had crossed the link
    chunks = [_chunk_times(d) for d in res.decisions]
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
        "chunks": chunks,
    }, res


def _chunk_times(d) -> dict:
    """One chunk of a load as a row's ``chunks`` lists it: its index, its choice (a level or rung
    index, or ``"text"``), bytes, and when (seconds from the load's start) it was fetched and decoded
    (a chunk decoded in a batch has the batch's span and its share of the batch's time as ``decode_s``),
    and whether it kept a steady choice without a decision (``kept``, :class:`LoaderOptions`)."""
    keep = ("index", "choice", "bytes", "fetch_start", "fetch_end", "decode_start", "decode_end", "decode_s", "kept")
    return {k: getattr(d, k) for k in keep}


def time_kv_method(
    model,
    bench: _Bench,
    store: ContextStore,
    variant: Variant,
    ctx: Sequence[int],
    tail: Sequence[int],
    values_per_token: int | None = None,
) -> dict:
    """One request: the loader at the variant's level, then the cache into the model and the first
    token (``values_per_token``: the loader's, as the adaptive method's; it lets the loader allocate
    the cache from the first chunk's header)."""
    opts = LoaderOptions(policy=variant.level, slo_s=None, dtype=model.dtype, values_per_token=values_per_token)
    loader = StreamingLoader(store, variant.codec, _recompute_fn(model), opts, link=bench.link)
    return _time_load(model, loader, ctx, tail, variant.label)[0]


def adaptive_ladder(codecs: Sequence[Variant]) -> FormatLadder:
    """What the ``adaptive`` method chooses from per chunk (besides text): raw 16- and 8-bit KV
    (big, cheap to decode) and the project codec's levels among ``codecs`` (small, slower to decode)."""
    rungs = [Rung("fp16", RawCodec("fp16"), 0), Rung("uniform8", UniformCodec(8), 0)]
    rungs += [Rung(v.label, v.codec, v.level) for v in codecs if v.name == "cachegen" and v.level != 0]
    return FormatLadder(rungs)


def adaptive_costs(
    model, ladder: FormatLadder, kv: KVCache, ctx: Sequence[int], chunk_tokens: int, latency_s: float
) -> CostModel:
    """The loader's cost model for ``model`` on this machine: decode per rung (into the model's
    dtype), recompute (two prefills of a chunk, at prefix 0 and after up to 1,024 tokens) and
    the link's per-fetch latency. Measured once per model; it does not depend on the context."""
    a = chunk_tokens if kv.end >= 2 * chunk_tokens else 0  # a chunk past the attention sink, when there is one
    sample = kv.slice(a, min(a + chunk_tokens, kv.end))
    costs = calibrate_decode(ladder, sample, ladder.levels, dtype=model.dtype)
    prefix = min(1024, len(ctx) - chunk_tokens)
    if prefix > 0:
        costs = calibrate_recompute(_recompute_fn(model), ctx, chunk_tokens, prefix, base=costs)
    costs.fetch_latency_s = latency_s + FETCH_OVERHEAD_S
    return costs


def time_adaptive(
    model,
    bench: _Bench,
    store: ContextStore,
    ladder: FormatLadder,
    costs: CostModel,
    estimator: ThroughputEstimator,
    ctx: Sequence[int],
    tail: Sequence[int],
    values_per_token: int,
    rates: ComputeRates | None = None,
) -> dict:
    """One request by the ``fastest`` policy over ``ladder``: per chunk the rung (or text) that
    ends the load soonest by the cost model (corrected by ``rates``, the decode and recompute
    times of earlier loads) and the estimate of the link (``estimator``: one per link); both
    kept across loads, as the engine keeps them."""
    opts = LoaderOptions(policy=FASTEST, slo_s=None, dtype=model.dtype, values_per_token=values_per_token)
    loader = StreamingLoader(
        store, ladder, _recompute_fn(model), opts, costs=costs, link=bench.link, estimator=estimator, rates=rates
    )
    row, res = _time_load(model, loader, ctx, tail, "adaptive")
    row["formats"] = dict(Counter("text" if c == TEXT else ladder.label(int(c)) for c in res.choices))
    row["fetched_bytes"] = sum(d.bytes for d in res.decisions)
    return row


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
    adaptive: bool = False,
) -> dict:
    """Rows of :data:`TTFT_FIELDS` plus a breakdown (:data:`BREAKDOWN`).

    ``ttft_s`` is the best of ``repeats`` runs (``recompute_repeats`` for
    recompute, whose long prefill is less sensitive to noise): on a shared
    machine the noise only ever adds time. The methods take turns, one run of each per
    round, so that a machine whose speed drifts during the benchmark moves them all alike.
    Each codec's chunks are stored once (encoded with the store's chunk keys) before the
    clock runs. ``adaptive``:
    also the ``adaptive`` method (:func:`time_adaptive` over :func:`adaptive_ladder`,
    its cost model measured before the clock runs and corrected by the decode times of its
    earlier loads, one untimed load per bandwidth first so that its estimator knows the link
    and its rates the decode speeds beside this link's fetches (one estimator and one
    :class:`ComputeRates` per bandwidth, each standing for one engine on its link); its rows add ``formats``, the rungs it chose, and
    ``size_bytes`` is what it fetched). Every row that loads a cache adds ``chunks``: per chunk of
    the reported run, its choice and when it was fetched and decoded (:func:`_chunk_times`).
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
            staged = stage_methods(bench, lm.fingerprint, ctx, kv, codecs, chunk_tokens, include_recompute, adaptive)
            costs = None
            if adaptive:
                ladder = next(m.codec for m in staged if m.kind == "adaptive")
                costs = adaptive_costs(model, ladder, kv, ctx, chunk_tokens, latency_s)
            vpt = kv.num_values // kv.num_tokens
            want = [max(1, recompute_repeats if m.kind == "recompute" else repeats) for m in staged]
            for gbps in bandwidths_gbps:
                bench.set_bandwidth(gbps)
                # each bandwidth stands for one engine on its link, which keeps one estimator and one
                # measure of its decode speeds across loads; the speeds depend on the link: a big
                # fetch's read and checksum take a core from the decode beside it (at 10 Gbit/s an
                # L7 decode took 24-35 ms beside 8-bit KV fetches, 15 ms alone)
                estimator = ThroughputEstimator()
                rates = ComputeRates()
                for m in staged:
                    if m.kind == "adaptive":  # untimed: the estimator has seen this link once, as a server's has
                        time_method(model, bench, m, ctx, tail, costs, estimator, vpt, rates)
                runs: list[list[dict]] = [[] for _ in staged]
                for rep in range(max(want)):  # round-robin: a machine that slows down mid-run slows every method
                    for i, m in enumerate(staged):
                        if rep < want[i]:
                            runs[i].append(time_method(model, bench, m, ctx, tail, costs, estimator, vpt, rates))
                for m, mruns in zip(staged, runs):
                    r = min(mruns, key=lambda r: r["ttft_s"])
                    row = {"method": m.method, "level": m.level, "bandwidth_gbps": gbps, "ttft_s": r["ttft_s"]}
                    row["size_bytes"] = r.get("fetched_bytes", m.size)
                    row.update({k: r[k] for k in (*BREAKDOWN, "formats", "chunks") if k in r})
                    rows.append(row)
                    log.info("%g Gbit/s %-22s TTFT %.3fs", gbps, m.label, r["ttft_s"])
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


@dataclass(frozen=True)
class Staged:
    """One method's stored context: ``kind`` recompute (the token ids), kv (one codec at one level) or adaptive."""

    kind: str
    method: str
    level: int | None
    label: str
    store: ContextStore
    size: int  # stored bytes the method reads (adaptive: the smallest rung's)
    codec: Any = None  # the variant (kv) or the ladder (adaptive)


def stage_methods(
    bench: _Bench,
    fingerprint: str,
    ctx: Sequence[int],
    kv: KVCache,
    codecs: Sequence[Variant],
    chunk_tokens: int,
    include_recompute: bool,
    adaptive: bool,
) -> list[Staged]:
    """Store ``ctx`` for every method before any clock runs (encoding is offline, at ingest)."""
    staged: list[Staged] = []
    if include_recompute:  # the token ids as one payload
        st = bench.store(fingerprint, "recompute", len(ctx))
        raw = token_bytes(ctx)
        ref = st.refs(ctx)[0]
        bench.backend.put_chunks([ChunkWrite(ref.key, raw, {0: raw}, start=0, ends_context=True)])
        staged.append(Staged("recompute", "recompute", None, "recompute", st, len(raw)))
    for c in codecs:
        st = bench.store(fingerprint, c.label, chunk_tokens, c.codec)
        st.put_context(ctx, kv, levels=[c.level])
        size = sum(i.sizes[c.level] for i in st.plan(ctx))
        staged.append(Staged("kv", c.name, c.row_level, c.label, st, size, c))
    if adaptive:
        ladder = adaptive_ladder(codecs)
        st = bench.store(fingerprint, "adaptive", chunk_tokens, ladder)
        st.put_context(ctx, kv, levels=ladder.levels)
        size = sum(min(i.sizes.values()) for i in st.plan(ctx))
        staged.append(Staged("adaptive", "adaptive", None, "adaptive", st, size, ladder))
    return staged


def time_method(
    model,
    bench: _Bench,
    m: Staged,
    ctx: Sequence[int],
    tail: Sequence[int],
    costs: CostModel | None,
    estimator: ThroughputEstimator,
    values_per_token: int,
    rates: ComputeRates | None = None,
) -> dict:
    """One request of a staged method (``rates``: the adaptive method's, see :func:`time_adaptive`)."""
    if m.kind == "recompute":
        return time_recompute(model, bench, m.store, ctx, tail)
    if m.kind == "adaptive":
        if costs is None:
            raise ConfigError("the adaptive method needs its cost model")
        return time_adaptive(model, bench, m.store, m.codec, costs, estimator, ctx, tail, values_per_token, rates)
    return time_kv_method(model, bench, m.store, m.codec, ctx, tail, values_per_token)
