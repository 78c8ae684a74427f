"""``cachegen bench stream``: time to first token and quality of streamed loads under a bandwidth trace.

For each method the clock runs from the request to the first token: the
store plan, fetching (through the in-process throttle or the netns link),
decoding, recomputing, stitching, injecting the cache, and prefilling the
prompt tail. ``recompute`` prefills the whole prompt. Rows:
``method, trace, ttft_s_p50, ttft_s_p95, deadline_miss_rate, mean_kl`` (plus
detail fields). ``mean_kl`` is the KL (nats/token) of the next-token
distributions over a continuation, against the exact cache; it is computed once
per distinct per-chunk choice pattern and reused.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cachegen.bench.replay import replay_load
from cachegen.errors import ConfigError
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import (
    TEXT,
    LoaderOptions,
    StreamingLoader,
    ThrottledLink,
    ThroughputEstimator,
    make_trace,
)
from cachegen.stream.costs import calibrate_decode, calibrate_recompute, default_path, load_or_measure
from cachegen.stream.planner import RECENCY_BOOST, RISK_QUANTILE, PlanChunk, simulate

if TYPE_CHECKING:
    from cachegen.codec import ChunkCodec

_log = logging.getLogger(__name__)

FIELDS = ("method", "trace", "ttft_s_p50", "ttft_s_p95", "deadline_miss_rate", "mean_kl")
CHUNK_TOKENS = 256
TAIL_TOKENS = 16  # the prompt after the cached context
CONT_TOKENS = 32  # continuation scored for KL


def _baseline_codecs() -> dict[str, ChunkCodec]:
    from cachegen.bench.baselines import RawCodec, UniformCodec

    return {"fp16": RawCodec("fp16"), "uniform8": UniformCodec(8)}


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[k]


def kl_nats(logits: torch.Tensor, ref: torch.Tensor) -> float:
    p = torch.log_softmax(ref.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


QUICK: dict[str, Any] = {
    "context_tokens": 1024,
    "runs": 2,
    "sim_runs": 50,
    "methods": ("adaptive", "cachegen-rule", "cachegen-L7", "uniform8", "recompute"),
}
SIM_METHODS = ("adaptive", "cachegen-rule")  # plus cachegen-L<n>: the ones the cost model knows


def _slo_value(slo, chunks, levels, traces, costs, reserve: float, log, eight_bit_bytes: int | None = None) -> float:
    """``reserve``: what follows the load (stitch and tail prefill).
    ``auto``: every chunk at the median level at the traces' median bandwidth (+ reserve + 50 ms);
    ``trace-auto``: every chunk at the median level at its own bandwidth in the trace (median over
    the traces; + reserve + 50 ms): for a step, whose median bandwidth no chunk sees;
    ``fastest[:M]``: every chunk at the most aggressive level at the median bandwidth, plus
    the reserve, times ``1 + M`` (default 0.25); ``8bit:F``: F times what 8-bit KV needs at the
    median bandwidth (its bytes' transfer + reserve): a deadline that *is* a TTFT target;
    a number: itself."""
    if not isinstance(slo, str):
        return float(slo)
    med_bw = statistics.median(g for tr in traces for _, g in tr.points)
    n = len(chunks)
    if slo == "trace-auto":
        lv = levels[len(levels) // 2]
        v = round(statistics.median(simulate(chunks, [lv] * n, tr.gbps_at, costs) for tr in traces) + reserve + 0.05, 3)
        log(f"[stream] slo trace-auto = {v:.3f}s (L{lv} at each chunk's bandwidth + reserve + 50 ms)")
        return v
    if slo.startswith("8bit:"):
        if not eight_bit_bytes:
            raise ConfigError("the 8bit:F deadline needs the uniform8 baseline in the store")
        f = float(slo.partition(":")[2])
        v = round(f * (eight_bit_bytes * 8 / (med_bw * 1e9) + reserve), 3)
        log(
            f"[stream] slo {slo} = {v:.3f}s ({f:g} x (8-bit KV's {eight_bit_bytes / 1e6:.1f} MB at {med_bw:.2f} Gbps + reserve))"
        )
        return v
    if slo == "auto":
        lv = levels[len(levels) // 2]
        v = round(simulate(chunks, [lv] * n, med_bw, costs) + reserve + 0.05, 3)
        log(f"[stream] slo auto = {v:.3f}s (L{lv} at {med_bw:.2f} Gbps + reserve + 50 ms)")
        return v
    if slo.startswith("fastest"):
        _, _, m = slo.partition(":")
        margin = float(m) if m else 0.25
        lv = levels[-1]
        v = round((simulate(chunks, [lv] * n, med_bw, costs) + reserve) * (1 + margin), 3)
        log(f"[stream] slo {slo} = {v:.3f}s ((L{lv} at {med_bw:.2f} Gbps + reserve) x {1 + margin:g})")
        return v
    return float(slo)


def run_stream_bench(
    model: str = "smollm2-135m",
    trace: str = "constant",
    slo: float | str = "auto",
    runs: int = 10,
    context_tokens: int = 4096,
    json_path: str | None = None,
    link: str = "inproc",
    gbps: float = 0.1,
    methods: Sequence[str] | None = None,
    dtype: str = "auto",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    sim_runs: int = 0,
    quick: bool = False,
    store_dir: str | None = None,
    prefetch: int = 8,
    risk_quantile: float | None = None,
    recency_boost: int = RECENCY_BOOST,
) -> list[dict]:
    """Run the bench; returns the rows (and writes ``json_path``).

    ``prefetch``, ``risk_quantile`` and ``recency_boost``: the loader's (and the replay's) settings,
    for measuring their effect (see :class:`cachegen.stream.loader.StreamingLoader`).
    ``runs``: wall-clock loads per method (through ``link``: ``inproc`` or ``netns``).
    ``sim_runs``: additional virtual-time loads per cachegen method: the same loader driven by a
    virtual clock (:mod:`cachegen.bench.replay`, rows with ``timing="virtual"``). ``quick``: a small configuration for ``cachegen bench all``
    (1K-token context, 2 wall runs, 50 virtual runs, five methods; a few minutes cold, ~1 min warm).
    The encoded context is kept in a persistent store (``$CACHEGEN_HOME/bench-store``), so
    only the first call encodes.
    """
    from transformers.utils import logging as hf_logging

    log = log or _log.info  # progress lines; the table itself is printed

    from cachegen import paths
    from cachegen.bench.baselines import FORMAT_VERSION as BASELINE_FORMAT
    from cachegen.calibrate import load_or_calibrate
    from cachegen.codec import LEVELS, Codec
    from cachegen.codec.container import FORMAT_VERSION
    from cachegen.corpus import take_tokens, text
    from cachegen.engine.dtype import cast_model, resolve_dtype
    from cachegen.engine.models import load_model
    from cachegen.engine.prefill import continue_from, prefill
    from cachegen.store.backend import ChunkWrite
    from cachegen.store.keys import token_bytes

    if quick:
        context_tokens, runs, sim_runs = QUICK["context_tokens"], min(runs, QUICK["runs"]), QUICK["sim_runs"]
        methods = list(methods or QUICK["methods"])
    hf_logging.disable_progress_bar()
    t_setup = time.perf_counter()
    lm = load_model(model, progress=False)  # fp32: the codec profile is calibrated in fp32 (as the Engine does)
    profile = load_or_calibrate(lm)
    m: Any = lm.model
    tok: Any = lm.tokenizer
    dtype = str(resolve_dtype(dtype)).removeprefix("torch.")
    if dtype != "float32":
        cast_model(m, getattr(torch, dtype))
    src = text("pydoc-eval") if "pydoc-eval" in _sources() else text(_sources()[0])
    ids = tok(take_tokens(tok, src, context_tokens + TAIL_TOKENS + CONT_TOKENS + 64), add_special_tokens=False)[
        "input_ids"
    ]
    ctx, tail = ids[:context_tokens], ids[context_tokens : context_tokens + TAIL_TOKENS]
    cont = ids[context_tokens : context_tokens + TAIL_TOKENS + CONT_TOKENS]

    def recompute(prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        return prefill(m, token_ids, prefix=prefix)

    log(f"[stream] prefill {len(ctx)} context tokens ({dtype})")
    exact = prefill(m, ctx)
    ref_logits = continue_from(m, exact, cont).logits
    codec = Codec(profile)
    levels = tuple(LEVELS)
    # a persistent, content-addressed store: only the first call encodes
    sdir = Path(store_dir) if store_dir else paths.subdir("bench-store")
    file_backend = open_backend(f"file://{sdir}")
    ns = Namespace(f"{lm.fingerprint}-{dtype}", FORMAT_VERSION, profile.id)
    specs: dict[str, tuple[Namespace, ChunkCodec, tuple[int, ...]]] = {"cachegen": (ns, codec, levels)}
    for name, c in _baseline_codecs().items():
        specs[name] = (Namespace(f"{lm.fingerprint}-{dtype}", BASELINE_FORMAT, f"baseline-{name}"), c, c.levels)
    t = time.perf_counter()
    for nsp, cdc, lv in specs.values():
        ContextStore(file_backend, nsp, cdc, chunk_tokens=CHUNK_TOKENS).put_context(ctx, exact, levels=lv)
    log(f"[stream] store {sdir}: ready in {time.perf_counter() - t:.1f}s")
    netns = None
    backend = file_backend
    if link == "netns":
        from cachegen.bench.netns import NetnsRedis, available

        ok, why = available()
        if ok:
            try:
                netns = NetnsRedis(gbps=10.0, port=6395).start()
                backend = open_backend(netns.url)
            except Exception as e:
                ok, why = False, f"{type(e).__name__}: {e}"
                if netns is not None:
                    netns.close()
                netns = None
        if not ok:
            log(f"[stream] netns link unavailable ({why}); using the in-process throttle")
            link = "inproc"
        else:  # copy the stored payloads into redis (no re-encoding)
            raw = token_bytes(ctx)
            for nsp, cdc, _lv in specs.values():
                src_store = ContextStore(file_backend, nsp, cdc, chunk_tokens=CHUNK_TOKENS)
                writes = [
                    ChunkWrite(
                        i.ref.key,
                        raw[i.ref.start * 4 : i.ref.end * 4],
                        {l: src_store.get(i.ref, l) for l in i.sizes},
                        start=i.ref.start,
                        ends_context=i.ref.end == len(ctx),
                    )
                    for i in src_store.plan(ctx)
                ]
                backend.put_chunks(writes)
            log(f"[stream] netns: redis at {netns.url if netns else '?'} behind tbf-shaped veths")
    stores = {
        name: (ContextStore(backend, nsp, cdc, chunk_tokens=CHUNK_TOKENS), cdc, lv)
        for name, (nsp, cdc, lv) in specs.items()
    }
    st = stores["cachegen"][0]

    # cost models (cached per model, dtype, codec profile)
    cpath = default_path(f"{model}-{dtype}-{profile.id}-{CHUNK_TOKENS}")

    def measure():
        c = calibrate_decode(codec, exact.slice(CHUNK_TOKENS, 2 * CHUNK_TOKENS), levels)
        return calibrate_recompute(recompute, ctx, CHUNK_TOKENS, min(1024, len(ctx) - CHUNK_TOKENS), base=c)

    costs = load_or_measure(cpath, measure)  # measured again on another machine or after costs.MAX_AGE_S
    continue_from(m, exact, tail)  # warm-up: the first call after loading is slower
    tails = []
    for _ in range(5):
        t = time.perf_counter()
        continue_from(m, exact, tail)
        tails.append(time.perf_counter() - t)
    tail_s = statistics.median(tails)
    reserve = tail_s * 1.3 + 0.02
    t = time.perf_counter()
    plan = st.plan(ctx)
    plan_s = time.perf_counter() - t
    vpt = exact.num_values // exact.num_tokens
    n_chunks = len(plan)
    chunks = [
        PlanChunk(i.ref.index, i.ref.start, i.ref.end - i.ref.start, (i.ref.end - i.ref.start) * vpt, i.sizes)
        for i in plan
    ]
    slo_arg = slo
    u8 = stores.get("uniform8")
    # what follows the last decode: joining the chunks (the loader keeps it back itself) and the tail prefill
    stitch = costs.stitch_s(exact.num_values, m.dtype.itemsize)
    slo = _slo_value(
        slo,
        chunks,
        levels,
        [make_trace(trace, n_chunks, seed=seed + s, gbps=gbps) for s in range(max(runs, sim_runs, 1))],
        costs,
        reserve + stitch,
        log,
        eight_bit_bytes=sum(sum(i.sizes.values()) for i in u8[0].plan(ctx)) if u8 else None,
    )
    log(
        f"[stream] setup {time.perf_counter() - t_setup:.1f}s; {n_chunks} chunks, tail prefill {tail_s * 1000:.0f} ms, "
        f"sizes L{levels[0]} {sum(c.sizes[levels[0]] for c in chunks) / 1e6:.2f} MB .. "
        f"L{levels[-1]} {sum(c.sizes[levels[-1]] for c in chunks) / 1e6:.2f} MB"
    )

    all_methods = [
        "adaptive",
        "cachegen-rule",
        *[f"cachegen-L{l}" for l in levels],
        *[k for k in stores if k != "cachegen"],
        "recompute",
    ]
    methods = list(methods) if methods else all_methods
    kl_cache: dict[tuple, float] = {}
    decoded: dict[tuple[int, int], KVCache] = {}

    def kl_of(key: tuple, kv: KVCache | None) -> float:
        if key not in kl_cache:
            kl_cache[key] = kl_nats(continue_from(m, kv, cont).logits, ref_logits)
        return kl_cache[key]

    def kl_pattern(choices: Sequence) -> float:
        """KL of a cachegen choice pattern, built as the loader would (text: recomputed on the prefix)."""
        key = ("cachegen", tuple(choices))
        if key in kl_cache:
            return kl_cache[key]
        parts: list[KVCache] = []
        for info, c in zip(plan, choices):
            if c == TEXT:
                prefix = KVCache.concat(parts) if parts else None
                parts.append(recompute(prefix, ctx[info.ref.start : info.ref.end]))
            else:
                if (info.ref.index, c) not in decoded:
                    decoded[(info.ref.index, c)] = codec.decode(st.get(info.ref, c)).to(m.dtype)
                parts.append(decoded[(info.ref.index, c)])
        return kl_of(key, KVCache.concat(parts))

    rows = []
    estimators: dict[str, ThroughputEstimator] = {}
    try:
        for method in methods:
            if method not in all_methods:
                raise ConfigError(f"unknown method {method!r}: one of {', '.join(all_methods)}")
            ttfts, kls, misses, patterns = [], [], 0, []
            n_runs = min(runs, 2) if method == "recompute" else runs
            for r in range(n_runs):
                tr = make_trace(trace, n_chunks, seed=seed + r, gbps=gbps)
                if method == "recompute":
                    t0 = time.perf_counter()
                    out = continue_from(m, None, ctx + tail)
                    int(out.logits[-1].argmax())
                    ttft = time.perf_counter() - t0
                    ttfts.append(ttft)
                    misses += ttft > slo
                    kls.append(0.0)
                    continue
                store, cdc, lv, policy = _policy(method, stores)
                # one estimator per method, kept across loads (as the Engine keeps one per link)
                est = estimators.setdefault(method, ThroughputEstimator())
                lk = ThrottledLink(tr) if netns is None else _netns_link(netns, tr)
                opts = LoaderOptions(
                    policy=policy,
                    slo_s=slo,
                    reserve_s=reserve,
                    levels=lv,
                    prefetch=prefetch,
                    risk_quantile=risk_quantile,
                    recency_boost=recency_boost,
                    dtype=m.dtype,
                    values_per_token=vpt,
                )
                loader = StreamingLoader(store, cdc, recompute, opts, costs=costs, link=lk, estimator=est)
                t0 = time.perf_counter()
                res = loader.load(ctx + tail, t0=t0)
                out = continue_from(m, res.kv, tail)
                int(out.logits[-1].argmax())
                ttft = time.perf_counter() - t0
                ttfts.append(ttft)
                misses += ttft > slo
                if store is st:
                    kls.append(kl_pattern(res.choices) if not res.faults else kl_of(("fault", r, method), res.kv))
                else:
                    kls.append(kl_of((method, tuple(res.choices)), res.kv))
                patterns.append("".join("T" if c == TEXT else str(c) for c in res.choices))
            if ttfts:
                rows.append(_row(method, trace, ttfts, misses, kls, patterns, slo, link, len(ctx), gbps, "wall"))
                log(_line(rows[-1]))
            if sim_runs and (method in SIM_METHODS or method.startswith("cachegen-L")):
                _, _, lv, policy = _policy(method, stores)
                est = ThroughputEstimator()
                ttfts, kls, misses, patterns = [], [], 0, []
                for r in range(sim_runs):
                    tr = make_trace(trace, n_chunks, seed=seed + r, gbps=gbps)
                    opts = LoaderOptions(
                        policy=policy,
                        slo_s=slo,
                        reserve_s=reserve,
                        levels=lv,
                        prefetch=prefetch,
                        risk_quantile=risk_quantile,
                        recency_boost=recency_boost,
                        dtype=m.dtype,
                        values_per_token=vpt,
                    )
                    sr = replay_load(chunks, tr, costs, opts, estimator=est, seed=seed + r)
                    ttft = plan_s + sr.load_s + tail_s
                    ttfts.append(ttft)
                    misses += ttft > slo
                    kls.append(kl_pattern(sr.choices))
                    patterns.append("".join("T" if c == TEXT else str(c) for c in sr.choices))
                rows.append(
                    _row(method, trace, ttfts, misses, kls, patterns, slo, "virtual", len(ctx), gbps, "virtual")
                )
                log(_line(rows[-1]))
    finally:
        if backend is not file_backend:
            backend.close()
        file_backend.close()
        if netns is not None:
            netns.close()
    summary = _ratios(rows)
    print_table(rows)
    for k, v in summary.items():
        log(f"[stream] {k} = {v:.3f}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "ratios": summary,
                    "slo_s": slo,
                    "slo_arg": slo_arg,
                    "tail_prefill_s": tail_s,
                    "reserve_s": reserve,
                    "plan_s": plan_s,
                    "costs": costs.to_json(),
                    "dtype": dtype,
                    "quick": quick,
                    "prefetch": prefetch,
                    "risk_quantile": risk_quantile,
                    "recency_boost": recency_boost,
                    "sizes_mb": {f"L{l}": sum(c.sizes[l] for c in chunks) / 1e6 for l in levels},
                },
                indent=1,
            )
        )
    return rows


def _policy(method: str, stores: dict):
    if method in ("adaptive", "cachegen-rule") or method.startswith("cachegen-L"):
        store, cdc, lv = stores["cachegen"]
        policy = "adaptive" if method == "adaptive" else "rule" if method == "cachegen-rule" else int(method[10:])
        return store, cdc, lv, policy
    store, cdc, lv = stores[method]
    return store, cdc, lv, 0


def _row(method, trace, ttfts, misses, kls, patterns, slo, link, ctx_tokens, gbps, timing) -> dict:
    return {
        "method": method,
        "trace": trace,
        "ttft_s_p50": _pct(ttfts, 0.5),
        "ttft_s_p95": _pct(ttfts, 0.95),
        "deadline_miss_rate": misses / max(len(ttfts), 1),
        "mean_kl": statistics.fmean(kls) if kls else None,
        "runs": len(ttfts),
        "timing": timing,
        "slo_s": slo,
        "link": link,
        "context_tokens": ctx_tokens,
        "gbps": gbps if trace.startswith("constant") else None,
        "example_choices": patterns[:3],
    }


def _line(r: dict) -> str:
    return (
        f"[stream] {r['method']:15s} {r['timing']:7s} n={r['runs']:3d} p50 {r['ttft_s_p50']:.3f}s "
        f"p95 {r['ttft_s_p95']:.3f}s miss {r['deadline_miss_rate']:.3f} kl {r['mean_kl']:.5f} "
        f"{r['example_choices'][:1]}"
    )


def _ratios(rows: list[dict]) -> dict[str, float]:
    """TTFT p50 of adaptive over 8-bit KV and over recompute (wall rows)."""
    wall = {r["method"]: r for r in rows if r["timing"] == "wall"}
    out = {}
    if "adaptive" in wall:
        for base in ("uniform8", "recompute", "fp16"):
            if base in wall and wall[base]["ttft_s_p50"] > 0:
                out[f"adaptive/{base} ttft p50"] = wall["adaptive"]["ttft_s_p50"] / wall[base]["ttft_s_p50"]
    return out


def _netns_link(netns, tr):
    from cachegen.bench.netns import NetnsLink

    return NetnsLink(netns, tr)


def _sources() -> list[str]:
    from cachegen.corpus import source_names

    return source_names()


def print_table(rows: list[dict]) -> None:
    print(
        f"{'method':16s} {'trace':10s} {'timing':8s} {'runs':>4s} {'p50 s':>8s} {'p95 s':>8s} {'miss':>6s} {'mean_kl':>9s}"
    )
    for r in rows:
        print(
            f"{r['method']:16s} {r['trace']:10s} {r['timing']:8s} {r['runs']:4d} {r['ttft_s_p50']:8.3f} "
            f"{r['ttft_s_p95']:8.3f} {r['deadline_miss_rate']:6.3f} {r['mean_kl']:9.5f}"
        )


def _slo(s: str):
    return s if s in ("auto", "trace-auto") or s.startswith(("fastest", "8bit:")) else float(s)


def register(sub) -> argparse.ArgumentParser:
    """Add ``stream`` to the ``bench`` subcommand group."""
    p = sub.add_parser("stream", help="TTFT and quality of streamed loads under a bandwidth trace")
    p.add_argument("--model", default="smollm2-135m", help="model name or directory (default smollm2-135m)")
    p.add_argument("--trace", default="constant", help="constant[:GBPS], step, random, random-log, or a JSON/CSV file")
    p.add_argument(
        "--bandwidth-gbps", type=float, default=0.1, help="bandwidth of the constant trace, Gbit/s (default 0.1)"
    )
    p.add_argument(
        "--slo-s",
        type=_slo,
        default="auto",
        help="deadline in seconds, 'auto' (median level at the median bandwidth), 'trace-auto' (median "
        "level at each chunk's own bandwidth), '8bit:F' (F x 8-bit KV's transfer + reserve) or 'fastest[:MARGIN]' "
        "(the most aggressive level at the median bandwidth, plus the tail prefill, x (1+MARGIN))",
    )
    p.add_argument("--runs", type=int, default=10, help="wall-clock loads per method")
    p.add_argument(
        "--sim-runs",
        type=int,
        default=0,
        help="virtual-time loads per cachegen method (the loader on a virtual clock, "
        "cachegen.bench.replay), rows with timing=virtual",
    )
    p.add_argument("--quick", action="store_true", help="small configuration (1K tokens, few runs) for bench all")
    p.add_argument("--context-tokens", type=int, default=4096, help="tokens of real text in the context (default 4096)")
    p.add_argument("--methods", default=None, help="comma-separated subset")
    p.add_argument(
        "--link",
        choices=("inproc", "netns"),
        default="inproc",
        help="inproc: an in-process throttled link; netns: Redis behind a shaped veth pair (root, ip, tc)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="serving dtype of the model (default auto: bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON ('-': stdout)")
    p.add_argument("--prefetch", type=int, default=8, help="fetched chunks that may wait for decoding (default 8)")
    p.add_argument(
        "--risk-quantile",
        type=float,
        default=0.0,
        help=f"risk planning: the adaptive plan must finish in time in this fraction of sampled "
        f"futures (e.g. {RISK_QUANTILE}); default 0 = plan at the estimated rate alone",
    )
    p.add_argument(
        "--recency-boost",
        type=int,
        default=RECENCY_BOOST,
        help=f"levels better for the last chunk in the adaptive plan (default {RECENCY_BOOST}; 0 = even plan)",
    )
    p.set_defaults(
        func=lambda a: (
            run_stream_bench(
                a.model,
                a.trace,
                a.slo_s,
                a.runs,
                a.context_tokens,
                a.json,
                a.link,
                a.bandwidth_gbps,
                a.methods.split(",") if a.methods else None,
                a.dtype,
                sim_runs=a.sim_runs,
                quick=a.quick,
                prefetch=a.prefetch,
                risk_quantile=a.risk_quantile or None,
                recency_boost=a.recency_boost,
            )
            and 0
        )
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="cachegen bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    register(sub)
    a = ap.parse_args(argv)
    a.func(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
