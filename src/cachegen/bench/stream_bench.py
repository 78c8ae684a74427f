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
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from cachegen.errors import ConfigError
from cachegen.kv import KVCache
from cachegen.store import ContextStore, Namespace, open_backend
from cachegen.stream import TEXT, CostModel, StreamingLoader, ThrottledLink, ThroughputEstimator, make_trace
from cachegen.stream.costs import calibrate_decode, calibrate_recompute, default_path
from cachegen.stream.planner import PlanChunk, simulate

FIELDS = ("method", "trace", "ttft_s_p50", "ttft_s_p95", "deadline_miss_rate", "mean_kl")
CHUNK_TOKENS = 256
TAIL_TOKENS = 16  # the prompt after the cached context
CONT_TOKENS = 32  # continuation scored for KL


class _Fixed:
    """A baseline codec (``encode(kv)``) stored as a single level."""

    def __init__(self, codec):
        self.codec, self.levels = codec, (0,)

    def encode(self, kv, level):
        return self.codec.encode(kv)

    def decode(self, data):
        return self.codec.decode(data)


def _baseline_codecs() -> dict[str, object]:
    try:
        from cachegen.bench.baselines import RawCodec, UniformCodec

        return {"fp16": RawCodec("fp16"), "uniform8": UniformCodec(8)}
    except ImportError:  # pragma: no cover
        return {}


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


def run_stream_bench(model: str = "smollm2-135m", trace: str = "constant", slo: float | str = "auto", runs: int = 10,
                     context_tokens: int = 4096, json_path: str | None = None, link: str = "inproc", gbps: float = 0.1,
                     methods: Sequence[str] | None = None, dtype: str = "float32", seed: int = 0,
                     log: Callable[[str], None] = print) -> list[dict]:
    from transformers.utils import logging as hf_logging

    from cachegen.codec import LEVELS, Codec, load_or_calibrate
    from cachegen.codec.container import FORMAT_VERSION
    from cachegen.corpus import take_tokens, text
    from cachegen.engine.models import load_model
    from cachegen.engine.prefill import continue_from, prefill

    hf_logging.disable_progress_bar()
    t_setup = time.perf_counter()
    lm = load_model(model, dtype=getattr(torch, dtype), progress=False)
    m, tok = lm.model, lm.tokenizer
    src = text("pydoc-eval") if "pydoc-eval" in _sources() else text(_sources()[0])
    ids = tok(take_tokens(tok, src, context_tokens + TAIL_TOKENS + CONT_TOKENS + 64), add_special_tokens=False)["input_ids"]
    ctx, tail = ids[:context_tokens], ids[context_tokens:context_tokens + TAIL_TOKENS]
    cont = ids[context_tokens:context_tokens + TAIL_TOKENS + CONT_TOKENS]
    torch.set_num_threads(max(torch.get_num_threads(), 1))

    def recompute(prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        return prefill(m, token_ids, prefix=prefix)

    log(f"[stream] prefill {len(ctx)} context tokens")
    exact = prefill(m, ctx)
    ref_logits = continue_from(m, exact, cont).logits
    profile = load_or_calibrate(lm)
    codec = Codec(profile)
    levels = tuple(LEVELS)
    tmp = tempfile.TemporaryDirectory(prefix="cg-stream-bench-")
    netns = None
    if link == "netns":
        from cachegen.stream.netns import NetnsRedis, available

        ok, why = available()
        if not ok:
            log(f"[stream] netns link unavailable ({why}); using the in-process throttle")
            link = "inproc"
        else:
            netns = NetnsRedis(gbps=1.0, port=6395).start()
    url = netns.url if netns else f"file://{tmp.name}/store"
    stores: dict[str, tuple[ContextStore, object, tuple]] = {}
    backend = open_backend(url)
    ns = Namespace(lm.fingerprint, FORMAT_VERSION, profile.id)
    st = ContextStore(backend, ns, codec, chunk_tokens=CHUNK_TOKENS)
    log(f"[stream] encoding {len(ctx)} tokens at levels {levels}")
    st.put_context(ctx, exact, levels=levels)
    stores["cachegen"] = (st, codec, levels)
    for name, c in _baseline_codecs().items():
        w = _Fixed(c)
        s2 = ContextStore(backend, Namespace(lm.fingerprint, 1, f"baseline-{name}"), w, chunk_tokens=CHUNK_TOKENS)
        s2.put_context(ctx, exact, levels=(0,))
        stores[name] = (s2, w, (0,))

    # cost models (cached per model + codec profile)
    cpath = default_path(f"{model}-{dtype}-{profile.id}-{CHUNK_TOKENS}")
    try:
        costs = CostModel.load(cpath)
    except (OSError, ValueError, KeyError, TypeError):
        sample = exact.slice(CHUNK_TOKENS, 2 * CHUNK_TOKENS)
        costs = calibrate_decode(codec, sample, levels)
        costs = calibrate_recompute(recompute, ctx, CHUNK_TOKENS, min(1024, len(ctx) - CHUNK_TOKENS), base=costs)
        costs.save(cpath)
    t = time.perf_counter()
    continue_from(m, exact, tail)
    tail_s = time.perf_counter() - t
    reserve = tail_s * 1.3 + 0.02
    plan = st.plan(ctx)
    vpt = exact.num_values // exact.num_tokens
    n_chunks = len(plan)
    chunks = [PlanChunk(i.ref.index, i.ref.start, i.ref.end - i.ref.start, (i.ref.end - i.ref.start) * vpt, i.sizes)
              for i in plan]
    if slo == "auto":  # meetable at the median level and the median bandwidth
        traces = [make_trace(trace, n_chunks, seed=s, gbps=gbps) for s in range(max(runs, 1))]
        med_bw = statistics.median(g for tr in traces for _, g in tr.points)
        med_level = levels[len(levels) // 2]
        slo = round(simulate(chunks, [med_level] * n_chunks, med_bw, costs) + reserve + 0.05, 3)
        log(f"[stream] auto slo {slo:.3f}s (level {med_level} at {med_bw:.2f} Gbps)")
    slo = float(slo)
    log(f"[stream] setup {time.perf_counter() - t_setup:.1f}s; {n_chunks} chunks, tail prefill {tail_s * 1000:.0f} ms, "
        f"sizes L{levels[0]} {sum(c.sizes[levels[0]] for c in chunks) / 1e6:.1f} MB .. "
        f"L{levels[-1]} {sum(c.sizes[levels[-1]] for c in chunks) / 1e6:.1f} MB")

    all_methods = ["adaptive", "cachegen-rule", *[f"cachegen-L{l}" for l in levels], *stores.keys() - {"cachegen"},
                   "recompute"]
    methods = list(methods) if methods else all_methods
    kl_cache: dict[tuple, float] = {}
    rows = []
    estimators: dict[str, ThroughputEstimator] = {}
    try:
        for method in methods:
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
                if method in ("adaptive", "cachegen-rule") or method.startswith("cachegen-L"):
                    store, cdc, lv = stores["cachegen"]
                    policy = "adaptive" if method == "adaptive" else "rule" if method == "cachegen-rule" else int(method[10:])
                else:
                    store, cdc, lv = stores[method]
                    policy = 0
                est = estimators.setdefault(method, ThroughputEstimator(prior_gbps=gbps if trace.startswith("constant") else 1.0))
                lk = ThrottledLink(tr) if netns is None else _netns_link(netns, tr)
                loader = StreamingLoader(store, cdc, recompute, costs=costs, slo_s=slo, link=lk, policy=policy,
                                         estimator=est, levels=lv, reserve_s=reserve, values_per_token=vpt)
                t0 = time.perf_counter()
                res = loader.load(ctx + tail, t0=t0)
                out = continue_from(m, res.kv, tail)
                int(out.logits[-1].argmax())
                ttft = time.perf_counter() - t0
                ttfts.append(ttft)
                misses += ttft > slo
                key = (method if policy == 0 else "cachegen", tuple(res.choices))
                if key not in kl_cache:
                    kl_cache[key] = kl_nats(continue_from(m, res.kv, cont).logits, ref_logits)
                kls.append(kl_cache[key])
                patterns.append("".join("T" if c == TEXT else str(c) for c in res.choices))
            row = {"method": method, "trace": trace, "ttft_s_p50": _pct(ttfts, 0.5), "ttft_s_p95": _pct(ttfts, 0.95),
                   "deadline_miss_rate": misses / max(len(ttfts), 1), "mean_kl": statistics.fmean(kls) if kls else None,
                   "runs": len(ttfts), "slo_s": slo, "link": link, "context_tokens": len(ctx),
                   "gbps": gbps if trace.startswith("constant") else None,
                   "example_choices": patterns[:3]}
            rows.append(row)
            log(f"[stream] {method:15s} p50 {row['ttft_s_p50']:.3f}s p95 {row['ttft_s_p95']:.3f}s "
                f"miss {row['deadline_miss_rate']:.2f} kl {row['mean_kl']:.5f} {patterns[:1]}")
    finally:
        backend.close()
        if netns is not None:
            netns.close()
        tmp.cleanup()
    print_table(rows)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"rows": rows, "costs": costs.to_json()}, indent=1))
    return rows


def _netns_link(netns, tr):
    from cachegen.stream.netns import NetnsLink

    return NetnsLink(netns, tr)


def _sources() -> list[str]:
    from cachegen.corpus import source_names

    return source_names()


def print_table(rows: list[dict]) -> None:
    print(f"{'method':16s} {'trace':10s} {'p50 s':>8s} {'p95 s':>8s} {'miss':>6s} {'mean_kl':>9s}")
    for r in rows:
        print(f"{r['method']:16s} {r['trace']:10s} {r['ttft_s_p50']:8.3f} {r['ttft_s_p95']:8.3f} "
              f"{r['deadline_miss_rate']:6.2f} {r['mean_kl']:9.5f}")


def _slo(s: str):
    return s if s == "auto" else float(s)


def register(sub) -> argparse.ArgumentParser:
    """Add ``stream`` to the ``bench`` subcommand group."""
    p = sub.add_parser("stream", help="TTFT and quality of streamed loads under a bandwidth trace")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--trace", default="constant", help="constant[:GBPS], step, random, random-log, or a JSON/CSV file")
    p.add_argument("--gbps", type=float, default=0.1, help="bandwidth of the constant trace (default 0.1)")
    p.add_argument("--slo", type=_slo, default="auto", help="deadline in seconds, or 'auto'")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--methods", default=None, help="comma-separated subset")
    p.add_argument("--link", choices=("inproc", "netns"), default="inproc")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None)
    p.set_defaults(func=lambda a: (run_stream_bench(
        a.model, a.trace, a.slo, a.runs, a.context_tokens, a.json, a.link, a.gbps,
        a.methods.split(",") if a.methods else None, a.dtype) and 0))
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
