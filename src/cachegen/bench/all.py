"""``cachegen bench all`` and the one function per benchmark that its sections and the single commands share.

``quality``, ``needle`` and ``ttft`` run a benchmark and draw its plot; the
``bench quality|needle|ttft`` commands print their table, ``run_all`` writes
their JSON and a results.md section. Default sizes are chosen to finish in
under 20 minutes on 2 CPU cores with SmolLM2-135M in fp32 (quality: 2,048 +
256 tokens; needle: 50 cases of 1,024 tokens; TTFT: 4,096 tokens at 0.1, 1
and 10 Gbit/s). ``quick`` shrinks all of them for a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachegen.bench.cli import DEFAULT_CODECS, NEEDLE_COLS, QUALITY_COLS, TTFT_COLS, codecs_for, load
from cachegen.bench.plots import needle_plot, quality_plot, table, ttft_plot

log = logging.getLogger(__name__)

SIZES: dict[str, dict[str, Any]] = {
    "full": {"quality": (2048, 256), "needle": (1024, 50), "ttft": 4096, "codec": None, "stream": 4096},
    "quick": {"quality": (512, 64), "needle": (512, 10), "ttft": 1024, "codec": 1024, "stream": 1024},
}


# -- one function per benchmark (the command and bench all both call it) ----------------


def quality(
    lm,
    codecs,
    *,
    context_tokens: int,
    continuation_tokens: int,
    text: str = "pydoc-eval",
    plot: str | Path | None = None,
) -> dict:
    """``bench quality``: size against KL, perplexity and top-1 agreement for every codec and level."""
    from cachegen.bench.quality import run_quality

    res = run_quality(lm, codecs, text=text, context_tokens=context_tokens, continuation_tokens=continuation_tokens)
    if plot:
        quality_plot(res, plot)
    return res


def needle(
    lm,
    codecs,
    *,
    cases: int,
    context_tokens: int,
    max_new_tokens: int,
    seed: int = 0,
    text: str = "pydoc-eval",
    plot: str | Path | None = None,
) -> dict:
    """``bench needle``: retrieval accuracy per codec and level, with Wilson intervals."""
    from cachegen.bench.needle import run_needle

    res = run_needle(
        lm, codecs, cases=cases, context_tokens=context_tokens, max_new_tokens=max_new_tokens, seed=seed, source=text
    )
    if plot:
        needle_plot(res, plot)
    return res


def ttft(
    lm,
    codecs,
    *,
    context_tokens: int,
    bandwidths_gbps: Sequence[float] = (0.1, 1.0, 10.0),
    link: str = "inproc",
    latency_s: float = 0.0,
    repeats: int = 1,
    recompute_repeats: int = 1,
    text: str = "pydoc-eval",
    plot: str | Path | None = None,
    adaptive: bool = False,
) -> dict:
    """``bench ttft``: time to first token against bandwidth, per method (``adaptive``: with the
    loader's ``fastest`` policy over a ladder of formats)."""
    from cachegen.bench.ttft import run_ttft

    res = run_ttft(
        lm,
        codecs,
        context_tokens=context_tokens,
        bandwidths_gbps=bandwidths_gbps,
        link=link,
        latency_s=latency_s,
        repeats=repeats,
        recompute_repeats=recompute_repeats,
        text=text,
        adaptive=adaptive,
    )
    if plot:
        ttft_plot(res, plot)
    return res


def _save(obj: dict, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def _run_codec_bench(model: str, out: Path, context_tokens: int | None = None) -> tuple[str | None, str]:
    """Run ``cachegen bench codec`` (the codec engineer's module): (json path or None, its stdout)."""
    from cachegen.bench.codec_bench import register as reg_codec

    parser = argparse.ArgumentParser(prog="cachegen bench", exit_on_error=False)
    reg_codec(parser.add_subparsers(dest="cmd"))
    path = out / "codec.json"
    buf = io.StringIO()
    base = ["codec", "--model", model, "--json", str(path)]
    tries = ([[*base, "--context-tokens", str(context_tokens)]] if context_tokens else []) + [base, ["codec"]]
    for argv in tries:
        try:
            args = parser.parse_args(argv)
        except (argparse.ArgumentError, SystemExit):
            continue
        with contextlib.redirect_stdout(buf):
            args.func(args)
        return (str(path) if path.exists() else None), buf.getvalue()
    return None, "could not find the arguments of cachegen bench codec"


STREAM_COLS = (
    "method",
    "trace",
    "timing",
    "runs",
    "slo_s",
    "ttft_s_p50",
    "ttft_s_p95",
    "deadline_miss_rate",
    "mean_kl",
)


def _stream_section(model: str, out: Path, sizes: dict, link: str, dtype: str) -> list[str]:
    """The adaptive loader against fixed levels, 8-bit KV and recompute (``cachegen bench stream``)."""
    from cachegen.bench.stream_bench import run_stream_bench

    n = sizes["stream"]
    const = run_stream_bench(
        model,
        dtype=dtype,
        trace="constant",
        gbps=0.1,
        slo="8bit:0.4",
        runs=3,
        context_tokens=n,
        methods=["adaptive", "cachegen-rule", "cachegen-L1", "uniform8", "fp16", "recompute"],
        json_path=str(out / "stream_constant.json"),
        link=link,
        log=log.info,
    )
    rand = run_stream_bench(
        model,
        dtype=dtype,
        trace="random",
        slo="auto",
        runs=5,
        sim_runs=200,
        context_tokens=n,
        methods=["adaptive", "cachegen-rule"],
        json_path=str(out / "stream_random.json"),
        link=link,
        log=log.info,
    )
    step = run_stream_bench(
        model,
        dtype=dtype,
        trace="step",
        slo="trace-auto",
        runs=3,
        sim_runs=20,
        context_tokens=n,
        methods=["adaptive", "cachegen-rule", "cachegen-L1"],
        json_path=str(out / "stream_step.json"),
        link=link,
        log=log.info,
    )
    return [
        "## Streaming under a deadline",
        "",
        f"{n}-token context in {dtype}. Constant 100 Mbit/s with the deadline `8bit:0.4` (0.4x what 8-bit KV needs: "
        "its transfer plus the tail prefill, i.e. the TTFT target itself); then the random trace "
        "(each chunk's bandwidth uniform in 0.1-10 Gbit/s) with the deadline `auto` (every chunk at the median "
        "level at the median bandwidth); then a step from 1 to 0.1 Gbit/s in the middle of the load, deadline "
        "`trace-auto` (the median level at each chunk's own bandwidth). "
        "`wall` rows are real loads through the link; `virtual` rows replay "
        "the loader's decisions against the emulated link and the calibrated cost model "
        "(`cachegen bench stream`, see docs/streaming.md).",
        "",
        table(const, STREAM_COLS, markdown=True),
        "",
        table(rand, STREAM_COLS, markdown=True),
        "",
        table(step, STREAM_COLS, markdown=True),
        "",
    ]


def run_all(
    out: str | Path,
    model: str = "smollm2-135m",
    dtype: str = "float32",
    codecs: Sequence[str] | None = None,
    needle_cases: int | None = None,
    quick: bool = False,
    link: str = "inproc",
    codec_bench: bool = True,
    ttft_dtype: str = "auto",
    stream: bool = True,
    serve: bool = True,
    vllm: bool = True,
    scale: bool = True,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = SIZES["quick" if quick else "full"]
    if ttft_dtype == "auto":  # the dtype the Engine and `cachegen serve` pick on this CPU
        from cachegen.engine.dtype import auto_dtype_name

        ttft_dtype = auto_dtype_name()
    names = list(codecs) if codecs else DEFAULT_CODECS.split(",")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    lm = load(model, dtype)
    cods = codecs_for(lm, names)
    md = [
        "# cachegen benchmark results",
        "",
        f"Model `{lm.name}` ({dtype}), {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
        f"torch {__import__('torch').__version__}, {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
    ]

    log.info("== quality")
    t = time.perf_counter()
    ctx, cont = sizes["quality"]
    q = quality(lm, cods, context_tokens=ctx, continuation_tokens=cont, plot=out / "quality.png")
    _save(q, out / "quality.json")
    timings["quality"] = time.perf_counter() - t
    md += [
        "## Size against quality",
        "",
        f"{ctx} context tokens of `{q['text']}` encoded in 256-token chunks, then a {cont}-token continuation; "
        f"reference perplexity {q['reference_ppl']:.3f}. KL in nats/token against the unmodified cache.",
        "",
        table(q["rows"], QUALITY_COLS, markdown=True),
        "",
        "![quality](quality.png)",
        "",
    ]

    log.info("== needle")
    t = time.perf_counter()
    nctx, ncases = sizes["needle"]
    ncases = needle_cases or ncases
    n = needle(lm, cods, cases=ncases, context_tokens=nctx, max_new_tokens=8, plot=out / "needle.png")
    _save(n, out / "needle.json")
    timings["needle"] = time.perf_counter() - t
    md += [
        "## Needle retrieval",
        "",
        f"{ncases} cases of ~{nctx} tokens; accuracy with its 95% Wilson interval. `recompute` is the "
        "uncompressed cache.",
        "",
        table(n["rows"], NEEDLE_COLS, markdown=True),
        "",
        "![needle](needle.png)",
        "",
    ]

    log.info("== ttft")
    t = time.perf_counter()
    # time to first token is measured in the serving dtype (auto: bf16 only where the CPU computes it natively)
    lm_serve = load(model, ttft_dtype) if ttft_dtype != dtype else lm
    tt = ttft(
        lm_serve,
        codecs_for(lm_serve, names) if lm_serve is not lm else cods,
        context_tokens=sizes["ttft"],
        link=link,
        repeats=2,
        plot=out / "ttft.png",
        adaptive=True,  # the loader's fastest policy over raw KV and the codec's levels, per chunk
    )
    _save(tt, out / "ttft.json")
    timings["ttft"] = time.perf_counter() - t
    md += [
        "## Time to first token",
        "",
        f"Model in {ttft_dtype}. {tt['context_tokens']} context tokens, link `{tt['link']}`: fetch over the link (pipelined with "
        "decoding), decode, cache injection and the first decoding step (best of 2 runs); recompute = fetch token ids "
        "+ prefill (1 run); `adaptive` = the loader's `fastest` policy choosing per chunk among raw 16- and 8-bit "
        "KV, the codec's levels and recompute.",
        "",
        table(tt["rows"], TTFT_COLS, markdown=True),
        "",
        "![ttft](ttft.png)",
        "",
    ]

    if stream:
        log.info("== stream")
        t = time.perf_counter()
        md += _stream_section(model, out, sizes, link, ttft_dtype)
        timings["stream"] = time.perf_counter() - t

    if scale:
        from cachegen.bench.scale import section as scale_section

        log.info("== scale")
        t = time.perf_counter()
        md += scale_section(model, out, sizes, quick, project_codec="cachegen" in names, dtype=ttft_dtype)
        timings["scale"] = time.perf_counter() - t

    if serve:
        from cachegen.bench.serve_bench import section as serve_section

        log.info("== serve")
        t = time.perf_counter()
        md += serve_section(model, out, quick, dtype=ttft_dtype)
        timings["serve"] = time.perf_counter() - t

    if vllm:  # in the vLLM environment (make vllm-setup); skipped with a note without it
        from cachegen.bench.vllm_bench import section as vllm_section

        log.info("== vllm")
        t = time.perf_counter()
        md += vllm_section(model, out, quick)
        timings["vllm"] = time.perf_counter() - t

    if codec_bench:
        log.info("== codec")
        t = time.perf_counter()
        cpath, ctext = _run_codec_bench(model, out, context_tokens=sizes["codec"])
        timings["codec"] = time.perf_counter() - t
        md += ["## Codec speed", ""]
        if cpath:
            md += [f"See `{Path(cpath).name}`.", ""]
        md += ["```", ctext.strip() or "(no output)", "```", ""]

    timings["total"] = time.perf_counter() - t_start
    md += ["## Run time", "", " · ".join(f"{k} {v:.0f} s" for k, v in timings.items()), ""]
    (out / "results.md").write_text("\n".join(md))
    _save(timings, out / "timings.json")
    log.info("wrote %s in %.0f s", out / "results.md", timings["total"])
    return out / "results.md"
