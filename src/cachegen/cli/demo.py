"""``cachegen demo``: the main job, end to end, on the default model and the local store.

1. Take a real ~4K-token document with a secret number hidden in it.
2. Prefill it once, encode its KV at every quality level, and put the chunks
   in the local store.
3. Answer "what is the secret number?" twice: by recomputing the context from
   text, and by streaming its KV from the store over an emulated link under a
   time-to-first-token deadline. Print both answers, both TTFTs, the level
   chosen for each chunk, and the sizes.
"""

from __future__ import annotations

import argparse
import logging

from cachegen.cli import checks, options
from cachegen.cli.output import write_json

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="store a long context's KV, then answer from text and from the stored KV")
    options.model(p)
    options.store(p)
    options.chunk_tokens(p)
    options.context_tokens(p, 4000)
    options.bandwidth_gbps(p, 0.1)
    options.slo_s(p, 2.0)
    p.add_argument("--seed", type=int, default=1, help="picks the document and the secret number (default 1)")
    options.add_json(p, "both answers, their TTFTs, the levels chosen and the sizes")
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def run(args: argparse.Namespace) -> int:
    from cachegen import corpus
    from cachegen.calibrate import load_or_calibrate
    from cachegen.engine.engine import Engine
    from cachegen.engine.hf_cache import values_per_token
    from cachegen.stream import ThrottledLink, constant
    from cachegen.stream.costs import TEXT

    checks.output_path(args.json)
    checks.context_length(args.model, args.context_tokens, "--context-tokens")
    checks.store(args.store)

    say = lambda *a: print(*a, flush=True)
    say(f"cachegen demo: model {args.model}, store {args.store or 'local (default)'}")
    with Engine.open(
        args.model, args.store, chunk_tokens=args.chunk_tokens, progress=True, profile=load_or_calibrate
    ) as eng:
        case = corpus.needle_case(eng.tokenizer, args.context_tokens, seed=args.seed)
        n_ctx = len(case.context_ids)
        say(f"context: {n_ctx} tokens of real text (pydoc topics) with a secret number at depth {case.depth:.0%}")

        ing = eng.ingest(case.context_ids, progress=True)
        if ing.written:
            say(
                f"stored {ing.written} chunks at levels {list(eng.store.levels)}: "
                f"prefill {ing.prefill_s:.2f}s, encode {ing.encode_s:.2f}s"
            )
        else:
            say(f"all {ing.chunks} chunks were already in the store")
        eng.costs()  # measured per model and profile, cached for a week on this machine

        say("\n[1] recompute: prefill the whole prompt from text")
        a = eng.generate(case.context_ids, case.question_ids, use_cache=False)
        say(
            f"    answer: {a.text.strip()!r}  ({'correct' if corpus.is_correct(a.text, case) else 'WRONG'}; "
            f"secret {case.answer})"
        )
        say(f"    time to first token: {a.ttft_s:.2f}s")

        slo = args.slo_s
        say(
            f"\n[2] cachegen: stream the stored KV over a {args.bandwidth_gbps * 1000:.0f} Mbps link, "
            f"deadline {slo:.2f}s"
        )
        link = ThrottledLink(constant(args.bandwidth_gbps))
        b = eng.generate(case.context_ids, case.question_ids, use_cache=True, slo_s=slo, link=link)
        res = b.load
        report: dict = {
            "model": eng.lm.name,
            "context_tokens": n_ctx,
            "secret": case.answer,
            "chunk_tokens": args.chunk_tokens,
            "bandwidth_gbps": args.bandwidth_gbps,
            "slo_s": slo,
            "recompute": {"answer": a.text.strip(), "correct": corpus.is_correct(a.text, case), "ttft_s": a.ttft_s},
            "cachegen": {"answer": b.text.strip(), "correct": corpus.is_correct(b.text, case), "ttft_s": b.ttft_s},
        }
        if res is not None:
            report["cachegen"].update(
                levels=[None if d.choice == TEXT else d.choice for d in res.decisions],
                bytes=sum(d.bytes for d in res.decisions),
                load_s=res.load_s,
                missed=res.missed,
                faults=list(res.faults),
            )
        if res is not None and res.decisions:
            picks = " ".join("text" if d.choice == TEXT else f"L{d.choice}" for d in res.decisions)
            say(f"    level per chunk: {picks}")
            sent = sum(d.bytes for d in res.decisions)
            say(
                f"    fetched {_mib(sent)} in {res.fetch_s:.2f}s of link time, decoded in {res.decode_s:.2f}s, "
                f"recomputed {res.recompute_s:.2f}s; load {res.load_s:.2f}s "
                + (f"(deadline missed by {res.load_s - slo:.2f}s)" if res.missed else "(deadline met)")
                + (f"; faults: {'; '.join(res.faults)}" if res.faults else "")
            )
        say(f"    answer: {b.text.strip()!r}  ({'correct' if corpus.is_correct(b.text, case) else 'WRONG'})")
        say(f"    time to first token: {b.ttft_s:.2f}s ({a.ttft_s / max(b.ttft_s, 1e-9):.1f}x faster than recompute)")

        plan = eng.store.plan(case.context_ids)
        values = n_ctx * values_per_token(eng.lm.config)
        say(f"\nKV size for {n_ctx} tokens ({values / 1e6:.1f} M values): bf16 {_mib(values * 2)}")
        report["sizes"] = {"values": values, "bf16_bytes": values * 2, "levels": {}}
        for lv in eng.store.levels:
            total = sum(i.sizes.get(lv, 0) for i in plan)
            say(f"    level {lv}: {_mib(total)}  ({total * 8 / values:.2f} bits/value)")
            report["sizes"]["levels"][str(lv)] = total
    write_json(report, args.json)
    return 0
