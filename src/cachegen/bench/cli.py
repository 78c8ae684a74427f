"""``cachegen bench ...``: quality, needle, ttft, codec, stream and all.

``codec`` comes from :mod:`cachegen.bench.codec_bench` (the codec's own
speed benchmark) and ``stream`` from :mod:`cachegen.bench.stream_bench` (the
streaming loader under bandwidth traces).

:func:`register` adds the ``bench`` group to an argparse subparsers object;
every leaf command sets ``func`` (``args.func(args) -> int``). Run standalone
with ``python -m cachegen.bench.cli ...``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

DEFAULT_CODECS = "cachegen,fp16,uniform8,uniform4,kivi4,kivi2,cachegen-released"
QUALITY_COLS = ("codec", "level", "bits_per_value", "size_bytes", "kl", "ppl_delta_pct", "top1_agreement")
NEEDLE_COLS = ("codec", "level", "bits_per_value", "cases", "correct", "accuracy", "ci_low", "ci_high")
TTFT_COLS = ("method", "level", "bandwidth_gbps", "ttft_s", "size_bytes", "fetch_s", "decode_s", "inject_s", "first_step_s")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _csv_floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def load(model: str, dtype: str = "float32"):
    import torch
    from transformers.utils import logging as hf_logging

    from cachegen.engine.models import load_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    return load_model(model, dtype=dt, progress=sys.stderr.isatty())


def codecs_for(lm, names: Sequence[str]):
    from cachegen.bench.baselines import make_codecs

    return make_codecs(names, loaded_model=lm, warn=_log)


def write_json(result: dict, path: str | Path | None) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=1) + "\n")


# -- commands -----------------------------------------------------------------------

def cmd_quality(args) -> int:
    from cachegen.bench.plots import quality_plot, table
    from cachegen.bench.quality import run_quality

    lm = load(args.model, args.dtype)
    res = run_quality(lm, codecs_for(lm, args.codecs), text=args.text, context_tokens=args.context_tokens,
                      continuation_tokens=args.continuation_tokens, log=_log)
    print(table(res["rows"], QUALITY_COLS))
    write_json(res, args.json)
    if args.plot:
        quality_plot(res, args.plot)
    return 0


def cmd_needle(args) -> int:
    from cachegen.bench.needle import run_needle
    from cachegen.bench.plots import needle_plot, table

    lm = load(args.model, args.dtype)
    res = run_needle(lm, codecs_for(lm, args.codecs), cases=args.cases, context_tokens=args.context_tokens,
                     max_new_tokens=args.max_new_tokens, seed=args.seed, source=args.text, log=_log)
    print(table(res["rows"], NEEDLE_COLS))
    write_json(res, args.json)
    if args.plot:
        needle_plot(res, args.plot)
    return 0


def cmd_ttft(args) -> int:
    from cachegen.bench.plots import table, ttft_plot
    from cachegen.bench.ttft import run_ttft

    lm = load(args.model, args.dtype)
    res = run_ttft(lm, codecs_for(lm, args.codecs), context_tokens=args.context_tokens,
                   bandwidths_gbps=args.bandwidth_gbps, link=args.link, latency_s=args.latency_ms / 1000.0,
                   repeats=args.repeats, recompute_repeats=args.recompute_repeats, text=args.text, log=_log)
    print(table(res["rows"], TTFT_COLS))
    write_json(res, args.json)
    if args.plot:
        ttft_plot(res, args.plot)
    return 0


def cmd_all(args) -> int:
    from cachegen.bench.all import run_all

    run_all(args.out, model=args.model, dtype=args.dtype, codecs=args.codecs, needle_cases=args.needle_cases,
            quick=args.quick, link=args.link, log=_log, codec_bench=not args.skip_codec, stream=not args.skip_stream,
            ttft_dtype=args.ttft_dtype)
    return 0


# -- argparse -----------------------------------------------------------------------

def _common(p: argparse.ArgumentParser, json_plot: bool = True) -> None:
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, gemma3-270m or a local HF model dir")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model precision (default float32)")
    p.add_argument("--codecs", type=_csv, default=_csv(DEFAULT_CODECS),
                   help=f"comma-separated codecs, name or name:level (default {DEFAULT_CODECS}; also bf16)")
    if json_plot:
        p.add_argument("--json", metavar="PATH", help="write the results as JSON")
        p.add_argument("--plot", metavar="PATH", help="draw a PNG")


def register(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` and its subcommands to an argparse subparsers object."""
    bench = subparsers.add_parser("bench", help="evaluate codecs: size vs quality, needle accuracy, TTFT vs bandwidth")
    sub = bench.add_subparsers(dest="bench_command", metavar="{quality,needle,ttft,codec,stream,all}")
    sub.required = True

    p = sub.add_parser("quality", help="size against quality (KL, perplexity, top-1) for every codec and level")
    _common(p)
    p.add_argument("--text", default="pydoc-eval", help="a text file, or a corpus name (default pydoc-eval)")
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.set_defaults(func=cmd_quality)

    p = sub.add_parser("needle", help="needle retrieval accuracy per codec and level, with 95%% Wilson intervals")
    _common(p)
    p.add_argument("--cases", type=int, default=50)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default="pydoc-eval", help="haystack text: a file or corpus name")
    p.set_defaults(func=cmd_needle)

    p = sub.add_parser("ttft", help="time to first token against bandwidth, per method")
    _common(p)
    p.add_argument("--context-tokens", type=int, default=4096)
    p.add_argument("--bandwidth-gbps", type=_csv_floats, default=[0.1, 1.0, 10.0])
    p.add_argument("--link", choices=("inproc", "netns"), default="inproc",
                   help="inproc: an in-process throttle; netns: redis-server behind a tc-shaped veth (root)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="added per chunk fetch (inproc only)")
    p.add_argument("--repeats", type=int, default=1, help="runs per point of a KV method; the best is reported")
    p.add_argument("--recompute-repeats", type=int, default=1, help="runs per point of recompute")
    p.add_argument("--text", default="pydoc-eval")
    p.set_defaults(func=cmd_ttft)

    from cachegen.bench.codec_bench import register as reg_codec
    from cachegen.bench.stream_bench import register as reg_stream

    reg_codec(sub)
    reg_stream(sub)

    p = sub.add_parser("all", help="run every benchmark at default sizes; write results.md, JSON and plots")
    _common(p, json_plot=False)
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--needle-cases", type=int, default=None, help="needle cases per codec (default 50, quick 10)")
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes), for a smoke test")
    p.add_argument("--link", choices=("inproc", "netns"), default="inproc")
    p.add_argument("--skip-codec", action="store_true", help="leave out `bench codec`")
    p.add_argument("--skip-stream", action="store_true", help="leave out `bench stream`")
    p.add_argument("--ttft-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="model dtype for time-to-first-token runs (default bf16, the serving dtype)")
    p.set_defaults(func=cmd_all)
    return bench


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cachegen")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    register(sub)
    args = parser.parse_args(argv)
    from cachegen.errors import CachegenError

    try:
        return int(args.func(args) or 0)
    except CachegenError as e:
        _log(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
