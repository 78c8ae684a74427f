"""``cachegen bench quality|needle|ttft|all`` and the benchmarks listed in :data:`cachegen.bench.cli.BENCHES`.

Each command checks its inputs (text file, context length against the
model's positions) before loading the model, then calls the one function per
benchmark in :mod:`cachegen.bench.all` that ``bench all`` calls too, prints its
table and writes ``--json``/``--plot``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Sequence

from cachegen.bench.cli import BENCHES, DEFAULT_CODECS, DTYPES, NEEDLE_COLS, QUALITY_COLS, TTFT_COLS
from cachegen.cli import checks, options
from cachegen.cli.output import write_json

log = logging.getLogger(__name__)


def _csv(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected a comma-separated list, e.g. fp16,kivi2")
    return out


def _prepare(args: argparse.Namespace) -> tuple:
    """Checks first, then the model and its codecs."""
    from cachegen.bench.baselines import check_specs
    from cachegen.bench.cli import codecs_for, load

    check_specs(args.codecs)  # before the model loads
    checks.output_path(args.json, "--json")
    checks.output_path(args.plot, "--plot")
    if getattr(args, "text", None):
        checks.text_source(args.text)
    tokens = getattr(args, "context_tokens", 0) + getattr(args, "continuation_tokens", 0)
    if tokens:
        checks.context_length(
            args.model,
            tokens,
            "--context-tokens" + (" + --continuation-tokens" if getattr(args, "continuation_tokens", 0) else ""),
        )
    lm = load(args.model, args.dtype)
    return lm, codecs_for(lm, args.codecs)


def _report(res: dict, cols: Sequence[str], args: argparse.Namespace) -> int:
    from cachegen.bench.plots import table

    print(table(res["rows"], cols))
    write_json(res, args.json)
    return 0


def cmd_quality(args: argparse.Namespace) -> int:
    from cachegen.bench import all as benches

    lm, cods = _prepare(args)
    res = benches.quality(
        lm,
        cods,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        text=args.text,
        plot=args.plot,
    )
    return _report(res, QUALITY_COLS, args)


def cmd_needle(args: argparse.Namespace) -> int:
    from cachegen.bench import all as benches

    lm, cods = _prepare(args)
    res = benches.needle(
        lm,
        cods,
        cases=args.cases,
        context_tokens=args.context_tokens,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        text=args.text,
        plot=args.plot,
    )
    return _report(res, NEEDLE_COLS, args)


def cmd_ttft(args: argparse.Namespace) -> int:
    from cachegen.bench import all as benches

    lm, cods = _prepare(args)
    res = benches.ttft(
        lm,
        cods,
        context_tokens=args.context_tokens,
        bandwidths_gbps=args.bandwidth_gbps,
        link=args.link,
        latency_s=args.latency_ms / 1000.0,
        repeats=args.repeats,
        recompute_repeats=args.recompute_repeats,
        text=args.text,
        plot=args.plot,
        adaptive=not args.no_adaptive,
    )
    return _report(res, TTFT_COLS, args)


def cmd_all(args: argparse.Namespace) -> int:
    from cachegen.bench.all import run_all
    from cachegen.bench.baselines import check_specs

    checks.model_positions(args.model)  # an unknown model fails here, before the first benchmark
    if args.codecs:
        check_specs(args.codecs)
    checks.output_dir(args.out)
    run_all(
        args.out,
        model=args.model,
        dtype=args.dtype,
        codecs=args.codecs,
        needle_cases=args.needle_cases,
        quick=args.quick,
        link=args.link,
        codec_bench=not args.skip_codec,
        stream=not args.skip_stream,
        serve=not args.skip_serve,
        vllm=not args.skip_vllm,
        scale=not args.skip_scale,
        ttft_dtype=args.ttft_dtype,
    )
    return 0


# -- argparse -----------------------------------------------------------------------


def _common(p: argparse.ArgumentParser, results: bool = True) -> None:
    options.model(p)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="model precision (default float32)")
    p.add_argument(
        "--codecs",
        type=_csv,
        default=_csv(DEFAULT_CODECS),
        metavar="NAME[:LEVEL],...",
        help=f"comma-separated codecs, name or name:level (default {DEFAULT_CODECS}; also bf16)",
    )
    if results:
        options.add_json(p)
        p.add_argument("--plot", metavar="PATH", help="draw the results as a PNG at PATH")


def _text(p: argparse.ArgumentParser, what: str = "text") -> None:
    p.add_argument(
        "--text",
        default="pydoc-eval",
        metavar="FILE|NAME",
        help=f"{what}: a UTF-8 text file, or a corpus name such as pydoc-eval (the default)",
    )


def _link(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--link",
        choices=("inproc", "netns"),
        default="inproc",
        help="inproc: an in-process throttle (default); netns: redis-server behind a tc-shaped veth (root)",
    )


def _selected(argv: Sequence[str] | None) -> str | None:
    """The word after ``bench`` in ``argv``: the one bench command whose module must be imported."""
    if not argv or "bench" not in argv:
        return None
    rest = [a for a in list(argv)[list(argv).index("bench") + 1 :] if not a.startswith("-")]
    return rest[0] if rest else None


def _json_dash(p: argparse.ArgumentParser) -> None:
    """Give a bench module's command ``--json -``: it writes a temporary file, the CLI copies it to stdout.

    The modules write their JSON themselves (to a path); this keeps the one
    meaning of ``--json -`` without each of them knowing about stdout.
    """
    func = p.get_default("func")
    if func is None or "--json" not in p._option_string_actions:
        return

    def run(args: argparse.Namespace):
        if getattr(args, "json", None) != "-":
            return func(args)
        import json
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory(prefix="cachegen-json-") as d:
            args.json = str(Path(d) / "result.json")
            rc = func(args)
            if Path(args.json).is_file():
                write_json(json.loads(Path(args.json).read_text()), "-")
            args.json = "-"
        return rc

    p.set_defaults(func=run)


def register(subparsers, argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Add ``bench`` and its subcommands; of :data:`BENCHES` only the one named in ``argv`` is imported."""
    bench = subparsers.add_parser("bench", help="evaluate codecs: size vs quality, needle accuracy, TTFT vs bandwidth")
    names = ["quality", "needle", "ttft", *BENCHES, "all"]
    sub = bench.add_subparsers(dest="bench_command", metavar="{" + ",".join(names) + "}")
    sub.required = True

    p = sub.add_parser("quality", help="size against quality (KL, perplexity, top-1) for every codec and level")
    _common(p)
    _text(p)
    options.context_tokens(p, 2048)
    p.add_argument(
        "--continuation-tokens",
        type=checks.positive_int,
        default=256,
        metavar="N",
        help="tokens scored after the context (default 256)",
    )
    p.set_defaults(func=cmd_quality)

    p = sub.add_parser("needle", help="needle retrieval accuracy per codec and level, with 95%% Wilson intervals")
    _common(p)
    p.add_argument("--cases", type=checks.positive_int, default=50, metavar="N", help="cases per codec (default 50)")
    options.context_tokens(p, 1024)
    p.add_argument(
        "--max-new-tokens",
        type=checks.positive_int,
        default=7,
        metavar="N",
        help="tokens generated for each answer (default 7)",
    )
    p.add_argument("--seed", type=int, default=0, help="picks the needles and their depths (default 0)")
    _text(p, "haystack text")
    p.set_defaults(func=cmd_needle)

    p = sub.add_parser("ttft", help="time to first token against bandwidth, per method")
    _common(p)
    options.context_tokens(p, 4096)
    options.bandwidths_gbps(p, [0.1, 1.0, 10.0])
    _link(p)
    p.add_argument("--latency-ms", type=float, default=0.0, help="added per chunk fetch, inproc only (default 0)")
    p.add_argument(
        "--repeats",
        type=checks.positive_int,
        default=1,
        help="runs per point of a KV method; the best is reported (default 1)",
    )
    p.add_argument(
        "--recompute-repeats", type=checks.positive_int, default=1, help="runs per point of recompute (default 1)"
    )
    p.add_argument(
        "--no-adaptive",
        action="store_true",
        help="leave out the adaptive method (per chunk the format or text that ends the load soonest)",
    )
    _text(p)
    p.set_defaults(func=cmd_ttft)

    wanted = _selected(argv)
    for name, (module, help_text) in BENCHES.items():
        if name == wanted or (argv is None):
            importlib.import_module(module).register(sub)
            _json_dash(sub.choices[name])
        else:  # listed for --help; its module loads only when it runs
            sub.add_parser(name, help=help_text)

    p = sub.add_parser("all", help="run every benchmark at default sizes; write results.md, JSON and plots")
    _common(p, results=False)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for results.md, the JSON files and plots")
    p.add_argument(
        "--needle-cases",
        type=checks.positive_int,
        default=None,
        metavar="N",
        help="needle cases per codec (default 50, quick 10)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes), for a smoke test")
    _link(p)
    p.add_argument("--skip-codec", action="store_true", help="leave out `bench codec`")
    p.add_argument("--skip-stream", action="store_true", help="leave out `bench stream`")
    p.add_argument("--skip-serve", action="store_true", help="leave out `bench serve`")
    p.add_argument("--skip-scale", action="store_true", help="leave out `bench scale`")
    p.add_argument(
        "--skip-vllm", action="store_true", help="leave out `bench vllm` (skipped anyway without .venv-vllm)"
    )
    p.add_argument(
        "--ttft-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="the serving dtype of the time-to-first-token, stream, scale and serve runs (default auto: "
        "bfloat16 on a CPU with AVX512-BF16 or AMX, else float32)",
    )
    p.set_defaults(func=cmd_all)
    return bench
