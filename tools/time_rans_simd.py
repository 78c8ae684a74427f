"""How fast one core decodes interleaved rANS streams: the numba kernel against each SIMD variant the
host offers, at several pass sizes (streams stepped side by side), to choose ``Variant.group``.

    .venv/bin/python tools/time_rans_simd.py [--blocks 8] [--rows 4096] [--groups 1,2,3,4] [--repeats 5]

Synthetic blocks of SmolLM2's section width (192 columns), 24 random 12-bit tables of which every
other has one symbol of probability ~0.9 (a KV section's zero), row shifts -2..2 as a lossy chunk's
token multipliers give. Each decode is checked against the encoded symbols. Prints the best of
``--repeats`` in M symbols/s, one thread. Quoted in ``cachegen.codec.rans.simd``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from cachegen.codec import rans
from cachegen.codec.rans import interleaved, simd
from cachegen.errors import CorruptChunk

WIDTH = 192


def tables(rng: np.random.Generator, n_tables: int = 24, alphabet: int = 64) -> rans.Tables:
    models = []
    for k in range(n_tables):
        counts = 1 + (rng.dirichlet(np.full(alphabet, rng.uniform(0.05, 3))) * 5000).astype(np.int64)
        if k % 2:
            counts[rng.integers(0, alphabet)] += 9 * int(counts.sum())
        models.append(rans.Categorical.from_counts(counts, 12))
    return rans.Tables.build(models)


def block(rng: np.random.Generator, t: rans.Tables, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(words, column tables, row tables, symbols): symbols drawn from each cell's own table."""
    idx = rng.integers(2, t.n_tables - 2, WIDTH)
    shift = rng.integers(-2, 3, n)
    cdf = np.cumsum(t.freq, axis=1) / t.freq.sum(axis=1, keepdims=True)
    which = idx[None, :] + shift[:, None]
    u = rng.random((n, WIDTH))
    sym = np.empty((n, WIDTH), np.uint8)
    for k in range(t.n_tables):
        at = which == k
        sym[at] = np.minimum(np.searchsorted(cdf[k], u[at], side="right"), t.freq.shape[1] - 1)
    words = rans.encode_interleaved(sym, idx, t, row_shift=shift)
    cols, rows = interleaved._table_indexes(n, WIDTH, idx, shift, t.n_tables, CorruptChunk)
    return words, cols, rows, sym


def rate(blocks: list, decode, repeats: int) -> float:
    """Best M symbols/s of ``decode(blocks)`` over ``repeats``; the first call (which compiles) is
    untimed and its symbols are checked."""
    for out, b in zip(decode(blocks), blocks, strict=True):
        assert np.array_equal(out, b[3])
    best = min(_timed(decode, blocks) for _ in range(repeats))
    return sum(b[3].size for b in blocks) / best / 1e6


def _timed(decode, blocks) -> float:
    t = time.perf_counter()
    decode(blocks)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--groups", default="1,2,3,4")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t = tables(rng)
    blocks = [block(rng, t, args.rows) for _ in range(args.blocks)]
    assert t.packed is not None

    def numba(bs: list) -> list[np.ndarray]:
        outs = []
        for words, cols, rows, sym in bs:
            outs.append(np.empty_like(sym))
            padded = np.zeros(words.size + WIDTH + 1, np.uint16)
            padded[: words.size] = words
            assert interleaved.decode_lanes(padded, words.size, cols, rows, t.packed, t.precision, outs[-1]) == 0
        return outs

    print(f"numba kernel              {rate(blocks, numba, args.repeats):7.0f} M symbols/s")
    for v in simd.host_variants():
        for g in (int(x) for x in args.groups.split(",")):
            kernel = dataclasses.replace(v, name=f"{v.name}x{g}", group=g)

            def fast(bs: list, kernel: simd.Variant = kernel) -> list[np.ndarray]:
                streams = simd.prepare_many([(w, c, r, np.empty_like(s)) for w, c, r, s in bs], t.precision)
                with _using(kernel):
                    assert simd.decode_streams(streams, t.packed, t.precision) == [0] * len(bs)
                return [s.out for s in streams]

            print(f"{v.name:6s} {g} streams per pass {rate(blocks, fast, args.repeats):7.0f} M symbols/s")


class _using:
    """Within the block, ``simd.variant()`` is ``kernel``."""

    def __init__(self, kernel: simd.Variant) -> None:
        self.kernel = kernel

    def __enter__(self) -> None:
        self.saved = simd._variant
        simd._variant = lambda: self.kernel  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        simd._variant = self.saved  # type: ignore[assignment]


if __name__ == "__main__":
    main()
