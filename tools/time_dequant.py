"""What decoding one 8-bit chunk into the load's cache costs: in one compiled call
(``dequant8_chunk_into``) against the layer-by-layer loop it replaced, alone and beside a thread
running Python (the loader's fetch thread deciding the next chunk holds the GIL like that).

    .venv/bin/python tools/time_dequant.py [--repeats 50]

Random KV of SmolLM2's shape (30 layers, 3 KV heads of 64, a 256-token chunk) written into a
4K-token cache in float32 and bfloat16; best and median of ``--repeats``, milliseconds. Quoted in
``cachegen.bench.baselines._format`` and the README.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from collections.abc import Callable
from unittest import mock

import torch

from cachegen.bench.baselines import uniform
from cachegen.kv import KVCache, KVLayer


def times_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return min(ts), statistics.median(ts)


def beside_python(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``fn`` timed while another thread works as the fetch thread does at 10 Gbit/s: 0.3 ms of
    Python (a decision) after each 2.5 ms wait (a fetch, which releases the GIL)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.wait(0.0025):
            end = time.perf_counter() + 0.0003
            while time.perf_counter() < end:
                pass

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        return times_ms(fn, repeats)
    finally:
        stop.set()
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    torch.manual_seed(0)
    kv = KVCache([KVLayer(torch.randn(3, 256, 64), torch.randn(3, 256, 64)) for _ in range(30)], start=256)
    codec = uniform.UniformCodec(8)
    data = codec.encode(kv)
    for dtype in (torch.float32, torch.bfloat16):
        slot = KVCache.allocate(kv, 4096, start=0, dtype=dtype).slice(256, 512)
        one = functools.partial(codec.decode_into, data, slot)
        one()  # compile (or load the cached kernel)
        with mock.patch.object(uniform, "dequant8_chunk_into", return_value=False):
            loop = functools.partial(codec.decode_into, data, slot)
            loop()
            rows = {"layer loop": (times_ms(loop, a.repeats), beside_python(loop, a.repeats))}
        rows["one call"] = (times_ms(one, a.repeats), beside_python(one, a.repeats))
        name = str(dtype).replace("torch.", "")
        for what, ((best, med), (best_b, med_b)) in rows.items():
            print(
                f"{name:8s} {what:10s} alone best {best:5.2f} median {med:5.2f} ms;"
                f" beside Python best {best_b:5.2f} median {med_b:6.2f} ms"
            )


if __name__ == "__main__":
    main()
