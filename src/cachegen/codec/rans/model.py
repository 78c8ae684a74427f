"""rANS probability models: :class:`Categorical` values, stacked as :class:`Tables` for the kernels.

Also the one allocation bound every decoder applies before it allocates: a
symbol costs at least ``-log2(max p)`` bits, so a payload of ``w`` words
cannot hold more than about ``16 w / min_bits`` symbols.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cachegen.errors import CodecError, CorruptChunk

RANS_L = 1 << 16
MAX_PRECISION = 14
LOCKSTEP = 16
_EPS = 2.0**-14  # floor(x/f) == int(x * (1/f) + eps) exactly for x < 2**32, f <= 2**14
MAX_SYMBOLS = 1 << 31  # per decode call, whatever the tables allow


@dataclass(frozen=True, eq=False)
class Categorical:
    """A static probability model: ``freqs`` (int64, sum ``2**precision``)."""

    freqs: np.ndarray
    precision: int = 12

    def __post_init__(self) -> None:
        f = np.asarray(self.freqs, dtype=np.int64)
        if f.ndim != 1 or f.size == 0:
            raise CodecError("Categorical freqs must be a non-empty 1-D array")
        if not (1 <= self.precision <= MAX_PRECISION):
            raise CodecError(f"precision must be 1..{MAX_PRECISION}")
        if f.min() < 0 or int(f.sum()) != (1 << self.precision):
            raise CodecError(f"freqs must be >= 0 and sum to 2**{self.precision}, sum is {int(f.sum())}")
        object.__setattr__(self, "freqs", f)

    @property
    def alphabet_size(self) -> int:
        return int(self.freqs.size)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Categorical)
            and self.precision == other.precision
            and np.array_equal(self.freqs, other.freqs)
        )

    def __hash__(self) -> int:
        return hash((self.precision, self.freqs.tobytes()))

    @classmethod
    def from_counts(cls, counts: np.ndarray, precision: int = 12) -> Categorical:
        """Quantize counts to ``2**precision``; every symbol with a count > 0 keeps a frequency >= 1."""
        return cls(quantize_counts(np.asarray(counts, dtype=np.float64), precision), precision)

    def entropy_bits(self) -> float:
        p = self.freqs[self.freqs > 0] / float(1 << self.precision)
        return float(-(p * np.log2(p)).sum())


def quantize_counts(counts: np.ndarray, precision: int) -> np.ndarray:
    """Integer frequencies summing to ``2**precision``, nonzero exactly where counts > 0."""
    m = 1 << precision
    c = np.asarray(counts, dtype=np.float64)
    if not np.isfinite(c).all():
        raise CodecError("counts must be finite numbers")
    nz = c > 0
    k = int(nz.sum())
    if k == 0:
        raise CodecError("cannot build a model from all-zero counts")
    if k > m:
        raise CodecError(f"{k} symbols do not fit precision {precision}")
    f = np.zeros(c.size, dtype=np.int64)
    f[nz] = np.maximum(1, np.floor(c[nz] / c.sum() * m + 0.5)).astype(np.int64)
    # fix the total: take from / give to the largest entries, never below 1. Each step moves diff towards 0
    # by at least 1, or (diff < 0) skips an entry at 1; some entry is above 1 while the total exceeds m >= k,
    # so every k steps gain at least 1 and k * |diff| steps always suffice: the bound costs nothing and
    # turns a rule broken by a later edit into a wrong total, which the tests see, instead of a hang
    diff = m - int(f.sum())
    order = np.argsort(-f, kind="stable")
    for i in range(k * abs(diff)):
        if diff == 0:
            break
        j = order[i % k]
        if diff > 0:
            step = max(1, min(diff, f[j] // 8 + 1)) if diff > k else 1
            f[j] += step
            diff -= step
        elif f[j] > 1:
            step = min(-diff, max(1, (f[j] - 1) // 8)) if -diff > k else 1
            step = min(step, f[j] - 1)
            f[j] -= step
            diff += step
    return f


@dataclass(frozen=True, eq=False)
class Tables:
    """Several :class:`Categorical` models of one precision, stacked for the kernels."""

    precision: int
    freq: np.ndarray  # (n_tables, A) int64
    cum: np.ndarray  # (n_tables, A) int64
    inv: np.ndarray  # (n_tables, A) float64, 1/freq (0 where freq == 0)
    lut: np.ndarray  # (n_tables, 2**precision) uint8 or uint16 slot -> symbol
    packed: np.ndarray | None = (
        None  # (n_tables, 2**precision) int32: sym<<24 | (freq-1)<<12 | (slot-cum); prec<=12, A<=256
    )
    fc: np.ndarray | None = None  # (n_tables, A) int64: freq | cum << 16 (encoder)

    @classmethod
    def build(cls, models: Sequence[Categorical]) -> Tables:
        if not models:
            raise CodecError("need at least one model")
        prec = models[0].precision
        if any(m.precision != prec for m in models):
            raise CodecError("all models of one Tables must share a precision")
        a = max(m.alphabet_size for m in models)
        if a > 65536:
            raise CodecError("alphabet larger than 65536")
        freq = np.zeros((len(models), a), dtype=np.int64)
        for i, m in enumerate(models):
            freq[i, : m.alphabet_size] = m.freqs
        cum = np.zeros_like(freq)
        cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
        with np.errstate(divide="ignore"):
            inv = np.where(freq > 0, 1.0 / np.maximum(freq, 1), 0.0)
        sym_dtype = np.uint8 if a <= 256 else np.uint16
        lut = np.empty((len(models), 1 << prec), dtype=sym_dtype)
        for i in range(len(models)):
            lut[i] = np.repeat(np.arange(a, dtype=sym_dtype), freq[i])
        packed = None
        if prec <= 12 and a <= 256:
            sl = np.arange(1 << prec, dtype=np.int64)[None, :]
            li = lut.astype(np.int64)
            fr = np.take_along_axis(freq, li, axis=1)
            cu = np.take_along_axis(cum, li, axis=1)
            packed = ((li << 24) | ((fr - 1) << 12) | (sl - cu)).astype(np.int32)
        return cls(prec, freq, cum, inv, lut, packed, np.ascontiguousarray(freq | (cum << 16)))

    @functools.cached_property
    def fewest_bits(self) -> float:
        """:func:`min_bits` of these tables, computed once: every section's decode checks its budget
        against it (a scan of all the padded tables, 20 us, was 3% of a 256-token chunk's decode)."""
        return min_bits(self)

    @property
    def n_tables(self) -> int:
        return int(self.freq.shape[0])

    @property
    def alphabet_size(self) -> int:
        return int(self.freq.shape[1])

    @property
    def symbol_dtype(self) -> np.dtype:
        return self.lut.dtype


def min_bits(tables: Tables) -> float:
    """The fewest bits any symbol of ``tables`` can cost (from its most probable symbol)."""
    pmax = tables.freq.max(axis=1) / float(1 << tables.precision)
    return float(-np.log2(pmax.max()))


def check_budget(n: int, streams: int, nwords: int, tables: Tables, what: str) -> None:
    """Refuse (CorruptChunk) to decode more symbols than ``nwords`` words could code with ``tables``.

    This bounds a decoder's allocation by the payload only as far as the tables do: a table
    that gives one symbol probability ~1 bounds nothing, so callers that read their tables
    from the input bound the symbol count independently too."""
    total = n * streams
    if total > MAX_SYMBOLS or total * tables.fewest_bits > 16 * nwords + 64 * streams + 64:
        raise CorruptChunk(f"{what}: symbol count inconsistent with payload size")
