"""What a load of the raw formats spends besides the link: decoding, and touching a fresh cache.

    .venv/bin/python tools/profile_raw_decode.py [--context-tokens 4096] [--chunk-tokens 256] [--dtype float32]

A real SmolLM2 context's KV, as 256-token chunks of 8-bit KV (``uniform8``) and fp16, decoded
chunk by chunk into a cache of the model's layout (best of 10, milliseconds for the whole
context): ``decode+copy`` is ``decode`` then a copy into the cache (how these codecs were loaded
before they had ``decode_into``), ``into`` is ``decode_into`` a cache already written once,
``into fresh`` allocates the cache first, as every load does. Then, in a child process that
calls :func:`cachegen.allocator.keep_freed_memory` as the CLI does, ``into fresh`` again.
docs/streaming.md quotes its output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch


def measure(context_tokens: int, chunk_tokens: int, dtype: str, keep: bool) -> dict[str, dict[str, float]]:
    from cachegen.allocator import keep_freed_memory
    from cachegen.bench.baselines import RawCodec, UniformCodec
    from cachegen.bench.codec_bench import _text_ids
    from cachegen.calibrate import context_kv
    from cachegen.codec.protocol import check_fits
    from cachegen.engine.models import load_model
    from cachegen.kv import KVCache
    from cachegen.stream.costs import best_time

    if keep and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() did not take effect here (glibc only)")
    m = load_model("smollm2-135m", progress=False)
    kv = context_kv(m.model, _text_ids(m.tokenizer, context_tokens))
    dt = getattr(torch, dtype)
    parts = kv.chunks(chunk_tokens)
    out = KVCache.allocate(kv, kv.num_tokens, start=kv.start, dtype=dt)
    rows: dict[str, dict[str, float]] = {}
    for codec in (UniformCodec(8), RawCodec("fp16")):
        datas = [codec.encode(p) for p in parts]

        def copy() -> None:
            for p, d in zip(parts, datas, strict=True):  # noqa: B023
                got = codec.decode(d)  # noqa: B023
                check_fits(got, out.slice(p.start, p.end))
                out.write(got)

        def into(cache: KVCache | None = None) -> None:
            c = cache or KVCache.allocate(kv, kv.num_tokens, start=kv.start, dtype=dt)
            for p, d in zip(parts, datas, strict=True):  # noqa: B023
                codec.decode_into(d, c.slice(p.start, p.end))  # noqa: B023

        into(out)  # compiles the kernels, touches the cache
        r = {"into fresh": best_time(into, 10) * 1e3}
        if not keep:
            r = {"decode+copy": best_time(copy, 10) * 1e3, "into": best_time(lambda: into(out), 10) * 1e3, **r}
        rows[codec.name] = r
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.chunk_tokens < 1 or a.context_tokens < a.chunk_tokens:
        ap.error("need 1 <= --chunk-tokens <= --context-tokens")
    if a.child:
        print(json.dumps(measure(a.context_tokens, a.chunk_tokens, a.dtype, keep=True)))
        return
    rows = measure(a.context_tokens, a.chunk_tokens, a.dtype, keep=False)
    args = ["--context-tokens", str(a.context_tokens), "--chunk-tokens", str(a.chunk_tokens), "--dtype", a.dtype]
    child = subprocess.run([sys.executable, __file__, *args, "--child"], capture_output=True, text=True, check=True)
    kept = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{a.context_tokens} tokens as {a.chunk_tokens}-token chunks into a {a.dtype} cache, ms (best of 10)")
    print(f"{'codec':<10}{'decode+copy':>13}{'into':>8}{'into fresh':>12}{'into fresh, kept memory':>26}")
    for name, r in rows.items():
        fresh_kept = kept[name]["into fresh"]
        print(f"{name:<10}{r['decode+copy']:>13.1f}{r['into']:>8.1f}{r['into fresh']:>12.1f}{fresh_kept:>26.1f}")


if __name__ == "__main__":
    main()
