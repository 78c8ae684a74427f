"""Where a decode's time goes: a context as one chunk against the same context as many chunks.

    .venv/bin/python tools/profile_decode.py [--level 6] [--chunk-tokens 256] [--context-tokens 4096]
        [--jobs-per-thread 2,8] [--busy] [--no-profile]

Prints the best-of-15 times on two threads (one chunk, the chunks in one ``decode_many_into``
call, one ``decode_into`` per chunk) for each ``--jobs-per-thread`` (how many decode jobs the
codec splits a chunk's sections into per thread, :func:`cachegen.codec.codec.decode_jobs`; the
values take turns over three rounds; ``--busy``: with another process keeping a core half busy,
as the loader's fetches do), then a cProfile of ten decodes of each kind on one thread
(``Codec(threads=1)``: a pool thread's work is invisible to cProfile), sorted by own time. The
batched decode's extra over one chunk is per-chunk work: Python that holds the GIL, so two
threads do not shrink it. docs/codec.md quotes its output.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys

from cachegen.codec import LEVELS

# hashes for 4 ms, sleeps for 4 ms: about what a store read and its checksum take of a core at 1 Gbit/s
_HALF_BUSY = """
import hashlib, time
b = bytes(1 << 18)
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.004:
        hashlib.blake2b(b).digest()
    time.sleep(0.004)
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--level", type=int, default=6, choices=LEVELS, help="a lossy level (default 6)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--context-tokens", type=int, default=4096)
    ap.add_argument("--top", type=int, default=20, help="rows of each profile (default 20)")
    ap.add_argument("--jobs-per-thread", default="2", help="comma-separated values to compare (default 2)")
    ap.add_argument("--busy", action="store_true", help="time with another process keeping a core half busy")
    ap.add_argument("--no-profile", action="store_true", help="only the times, no cProfile")
    a = ap.parse_args(argv)
    try:
        per_thread = [int(x) for x in a.jobs_per_thread.split(",")]
    except ValueError:
        ap.error("--jobs-per-thread takes integers, e.g. 2,8")
    if not per_thread or min(per_thread) < 1:
        ap.error("--jobs-per-thread takes integers >= 1")
    if a.chunk_tokens < 1 or a.context_tokens < a.chunk_tokens:
        ap.error("need 1 <= --chunk-tokens <= --context-tokens")

    from cachegen.bench.codec_bench import _text_ids
    from cachegen.calibrate import context_kv, load_or_calibrate
    from cachegen.codec import Codec
    from cachegen.engine.models import load_model
    from cachegen.kv import KVCache
    from cachegen.stream.costs import best_time

    m = load_model(a.model, progress=False)
    prof = load_or_calibrate(m)
    kv = context_kv(m.model, _text_ids(m.tokenizer, a.context_tokens))
    parts = [kv.slice(s, min(s + a.chunk_tokens, kv.end)) for s in range(kv.start, kv.end, a.chunk_tokens)]
    sizes = [p.num_tokens for p in parts]
    out = KVCache.allocate(kv, kv.num_tokens, start=kv.start)
    for threads in (2, 1):
        codec = Codec(prof, threads=threads)
        whole = codec.encode(kv, a.level, context_end=kv.end)
        datas = [codec.encode(p, a.level, context_end=kv.end) for p in parts]

        def one() -> None:
            codec.decode_into(whole, out)  # noqa: B023  (called within this iteration)

        def batched() -> None:
            codec.decode_many_into(datas, out, sizes)  # noqa: B023

        def chunked() -> None:
            for p, d in zip(parts, datas, strict=True):  # noqa: B023
                codec.decode_into(d, out.slice(p.start, p.end))  # noqa: B023

        if threads == 2:
            hog = subprocess.Popen([sys.executable, "-c", _HALF_BUSY]) if a.busy else None
            try:
                for rnd in range(3):
                    for k in per_thread:
                        codec.jobs_per_thread = k
                        print(
                            f"round {rnd + 1}, level {a.level}, {kv.num_tokens} tokens, {len(parts)} chunks, "
                            f"2 threads, {k} jobs per thread{', a core half busy' if hog else ''}: "
                            f"one chunk {best_time(one, 15):.4f} s, batched {best_time(batched, 15):.4f} s, "
                            f"chunk by chunk {best_time(chunked, 9):.4f} s",
                            flush=True,
                        )
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
            codec.close()
            continue
        if a.no_profile:
            break
        for name, fn in (("one chunk", one), ("batched", batched)):
            fn()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                fn()
            pr.disable()
            print(f"\n== {name}, one thread, 10 decodes ==", flush=True)
            pstats.Stats(pr).sort_stats("tottime").print_stats(a.top)
        codec.close()


if __name__ == "__main__":
    main()
