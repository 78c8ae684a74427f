"""Static rANS entropy coder in numba: many independent streams, decoded in lockstep.

Why this shape: a KV chunk is naturally thousands of short symbol streams (one
per layer, K/V and channel). Coding each stream with one 32-bit state keeps
the per-stream overhead at 4 bytes, and decoding 16 streams in lockstep gives
the instruction-level parallelism that interleaved states would, without their
size cost. Renormalisation is branchless (16-bit words), encoder division is a
float reciprocal multiply, and everything runs with the GIL released so two
Python threads use two cores.

A probability model is a plain value, :class:`Categorical`: integer
frequencies summing to ``2**precision`` (precision <= 14). A symbol with
frequency 0 cannot be coded.

Usage::

    from cachegen.codec import rans
    m = rans.Categorical.from_counts(np.bincount(sym.ravel(), minlength=16))
    data = rans.encode(sym, [m])               # sym: (n_streams, n) uint8/uint16
    back = rans.decode(data, [m])              # bit-exact
    # several models: rans.encode(sym, [m0, m1], table_index=[0, 1, 1, 0, ...])

Lower level: :class:`Tables` stacks models; :func:`encode_columns` /
:func:`decode_columns` take token-major arrays ``(n, n_streams)`` where column
``s`` is stream ``s`` (one state and one length per column: lossless path);
:func:`encode_interleaved` / :func:`decode_interleaved` code a whole
token-major block as ONE word stream with :data:`LANES` shared states (column
``c`` on lane ``c % LANES``): the lossy codec's format, 64 bytes of state per
section instead of 8 bytes per column.

Stream format: each stream is its final 32-bit state (two 16-bit words, high
first) followed by its renormalisation words in decode order. :func:`encode`
wraps all streams as ``b"RANS" | u32 n_streams | u32 n | u8 precision |
u32 lengths[n_streams] | u16 words[...]`` (little endian).
"""

from __future__ import annotations

from cachegen.codec import _numba_env  # noqa: F401  (sets NUMBA_CACHE_DIR before numba loads)

import struct
from dataclasses import dataclass
from typing import Sequence

import numba
import numpy as np
from numba import njit

from cachegen.codec._rans_lanes import decode_lanes
from cachegen.errors import CodecError, CorruptChunk

RANS_L = 1 << 16
MAX_PRECISION = 14
LOCKSTEP = 16
_EPS = 2.0**-14  # floor(x/f) == int(x * (1/f) + eps) exactly for x < 2**32, f <= 2**14


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
        return isinstance(other, Categorical) and self.precision == other.precision and np.array_equal(self.freqs, other.freqs)

    def __hash__(self) -> int:
        return hash((self.precision, self.freqs.tobytes()))

    @classmethod
    def from_counts(cls, counts: np.ndarray, precision: int = 12) -> "Categorical":
        """Quantize counts to ``2**precision``; every symbol with a count > 0 keeps a frequency >= 1."""
        return cls(quantize_counts(np.asarray(counts, dtype=np.float64), precision), precision)

    def entropy_bits(self) -> float:
        p = self.freqs[self.freqs > 0] / float(1 << self.precision)
        return float(-(p * np.log2(p)).sum())


def quantize_counts(counts: np.ndarray, precision: int) -> np.ndarray:
    """Integer frequencies summing to ``2**precision``, nonzero exactly where counts > 0."""
    m = 1 << precision
    c = np.asarray(counts, dtype=np.float64)
    nz = c > 0
    k = int(nz.sum())
    if k == 0:
        raise CodecError("cannot build a model from all-zero counts")
    if k > m:
        raise CodecError(f"{k} symbols do not fit precision {precision}")
    f = np.zeros(c.size, dtype=np.int64)
    f[nz] = np.maximum(1, np.floor(c[nz] / c.sum() * m + 0.5)).astype(np.int64)
    # fix the total: take from / give to the largest entries, never below 1
    diff = m - int(f.sum())
    order = np.argsort(-f, kind="stable")
    i = 0
    while diff != 0:
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
        i += 1
    return f


@dataclass(frozen=True, eq=False)
class Tables:
    """Several :class:`Categorical` models of one precision, stacked for the kernels."""

    precision: int
    freq: np.ndarray  # (n_tables, A) int64
    cum: np.ndarray  # (n_tables, A) int64
    inv: np.ndarray  # (n_tables, A) float64, 1/freq (0 where freq == 0)
    lut: np.ndarray  # (n_tables, 2**precision) uint8 or uint16 slot -> symbol
    packed: np.ndarray | None = None  # (n_tables, 2**precision) int32: sym<<24 | (freq-1)<<12 | (slot-cum); prec<=12, A<=256
    fc: np.ndarray | None = None  # (n_tables, A) int64: freq | cum << 16 (encoder)

    @classmethod
    def build(cls, models: Sequence[Categorical]) -> "Tables":
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

    @property
    def n_tables(self) -> int:
        return int(self.freq.shape[0])

    @property
    def alphabet_size(self) -> int:
        return int(self.freq.shape[1])

    @property
    def symbol_dtype(self) -> np.dtype:
        return self.lut.dtype


# -- kernels -------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _encode_kernel(sym, tab_idx, freq, cum, inv, prec, scratch, starts):
    """Encode columns of ``sym`` (n, S) backwards into ``scratch`` (S, n + 2); ``starts[s]`` = first word.

    Returns the number of symbols whose frequency was 0 (the output is then invalid)."""
    bad = 0
    n = sym.shape[0]
    S = sym.shape[1]
    G = 16
    shift_max = 32 - prec
    states = np.empty(G, dtype=np.int64)
    ptrs = np.empty(G, dtype=np.int64)
    tb = np.empty(G, dtype=np.int64)
    for s0 in range(0, S, G):
        g = min(G, S - s0)
        for j in range(g):
            states[j] = 65536
            ptrs[j] = n + 2
            tb[j] = tab_idx[s0 + j]
        for t in range(n - 1, -1, -1):
            row = sym[t]
            for j in range(g):
                s = s0 + j
                y = np.int64(row[s])
                k = tb[j]
                f = freq[k, y]
                bad += f == 0
                x = states[j]
                flag = np.int64(x >= (f << shift_max))
                p = ptrs[j] - 1
                scratch[s, p] = np.uint16(x & 0xFFFF)
                ptrs[j] = p + 1 - flag
                x = x >> (flag << 4)
                q = np.int64(x * inv[k, y] + 6.103515625e-05)
                states[j] = (q << prec) + (x - q * f) + cum[k, y]
        for j in range(g):
            s = s0 + j
            p = ptrs[j]
            x = states[j]
            scratch[s, p - 1] = np.uint16(x & 0xFFFF)
            scratch[s, p - 2] = np.uint16(x >> 16)
            starts[s] = p - 2
    return bad


@njit(nogil=True, cache=True)
def _gather_kernel(scratch, starts, offsets, out):
    """Copy each stream's used words ``scratch[s, starts[s]:]`` to ``out[offsets[s]:offsets[s+1]]``."""
    S = scratch.shape[0]
    w = scratch.shape[1]
    for s in range(S):
        o = offsets[s]
        a = starts[s]
        for i in range(w - a):
            out[o + i] = scratch[s, a + i]


@njit(nogil=True, cache=True)
def _decode_kernel(words, offsets, tab_idx, freq, cum, lut, prec, out):
    """Decode ``out`` (n, S) token-major; returns the number of streams that did not end cleanly."""
    n = out.shape[0]
    S = out.shape[1]
    G = 16
    mask = (np.int64(1) << prec) - 1
    last = words.shape[0] - 1
    states = np.empty(G, dtype=np.int64)
    ptrs = np.empty(G, dtype=np.int64)
    tb = np.empty(G, dtype=np.int64)
    bad = 0
    for s0 in range(0, S, G):
        g = min(G, S - s0)
        for j in range(g):
            a = offsets[s0 + j]
            hi = np.int64(words[min(a, last)])
            lo = np.int64(words[min(a + 1, last)])
            states[j] = (hi << 16) | lo
            ptrs[j] = a + 2
            tb[j] = tab_idx[s0 + j]
        for t in range(n):
            row = out[t]
            for j in range(g):
                x = states[j]
                k = tb[j]
                slot = x & mask
                y = lut[k, slot]
                yi = np.int64(y)
                x = freq[k, yi] * (x >> prec) + slot - cum[k, yi]
                flag = np.int64(x < 65536)
                p = ptrs[j]
                w = np.int64(words[min(p, last)])
                x = (x << (flag << 4)) | (w & (-flag))
                ptrs[j] = p + flag
                states[j] = x & 0xFFFFFFFF
                row[s0 + j] = y
        for j in range(g):
            if states[j] != 65536 or ptrs[j] != offsets[s0 + j + 1]:
                bad += 1
    return bad


@njit(nogil=True, cache=True)
def _decode_kernel_packed(words, offsets, tab_idx, packed, prec, out):
    """:func:`_decode_kernel` with one packed table lookup per symbol (precision <= 12, uint8 symbols)."""
    n = out.shape[0]
    S = out.shape[1]
    G = 16
    mask = (np.int64(1) << prec) - 1
    last = words.shape[0] - 1
    states = np.empty(G, dtype=np.int64)
    ptrs = np.empty(G, dtype=np.int64)
    tb = np.empty(G, dtype=np.int64)
    bad = 0
    for s0 in range(0, S, G):
        g = min(G, S - s0)
        for j in range(g):
            a = offsets[s0 + j]
            hi = np.int64(words[min(a, last)])
            lo = np.int64(words[min(a + 1, last)])
            states[j] = (hi << 16) | lo
            ptrs[j] = a + 2
            tb[j] = tab_idx[s0 + j]
        for t in range(n):
            row = out[t]
            for j in range(g):
                x = states[j]
                e = np.int64(packed[tb[j], x & mask])
                x = (((e >> 12) & 0xFFF) + 1) * (x >> prec) + (e & 0xFFF)
                flag = np.int64(x < 65536)
                p = ptrs[j]
                w = np.int64(words[min(p, last)])
                states[j] = (x << (flag << 4)) | (w & (-flag))
                ptrs[j] = p + flag
                row[s0 + j] = np.uint8(e >> 24)
        for j in range(g):
            if states[j] != 65536 or ptrs[j] != offsets[s0 + j + 1]:
                bad += 1
    return bad



# -- interleaved kernels: one word stream per section, LANES states shared by all columns ----------------
#
# Column ``c`` of a token-major block ``(n, S)`` is coded by lane ``c % LANES``;
# symbols are visited token by token, column by column (decode order), and
# every lane renormalises into the same word stream. Per section the only
# overhead is LANES 32-bit final states (vs one state and one length per
# column), and the decoder writes its output rows contiguously.

LANES = 16


@njit(nogil=True, cache=True, boundscheck=False)
def _encode_il_kernel(sym, tab_idx, row_idx, fc, inv, prec, out):
    """Encode ``sym`` (n, S) backwards into the end of ``out``; returns (first word index, bad symbol count).

    ``fc[k, y] = freq | cum << 16`` (one load per symbol for both), ``inv[k, y] = 1/freq``; the
    model of ``(t, c)`` is ``tab_idx[c] + row_idx[t]``."""
    n = sym.shape[0]
    S = sym.shape[1]
    nl = min(16, S)
    shift_max = 32 - prec
    A = fc.shape[1]
    fcf = fc.ravel()
    invf = inv.ravel()
    tb = tab_idx * A
    states = np.empty(16, dtype=np.int64)
    for j in range(16):
        states[j] = 65536
    p = out.shape[0]
    bad = 0
    for t in range(n - 1, -1, -1):
        row = sym[t]
        ro = row_idx[t] * A
        for c in range(S - 1, -1, -1):
            j = c & 15
            ix = tb[c] + ro + np.int64(row[c])
            e = fcf[ix]
            f = e & 0xFFFF
            bad += f == 0
            x = states[j]
            flag = np.int64(x >= (f << shift_max))
            out[p - 1] = np.uint16(x & 0xFFFF)
            p -= flag
            x = x >> (flag << 4)
            q = np.int64(x * invf[ix] + 6.103515625e-05)
            states[j] = (q << prec) + (x - q * f) + (e >> 16)
    for j in range(nl - 1, -1, -1):
        x = states[j]
        out[p - 1] = np.uint16(x & 0xFFFF)
        out[p - 2] = np.uint16(x >> 16)
        p -= 2
    return p, bad


@njit(nogil=True, cache=True, boundscheck=False)
def _decode_il_kernel_generic(words, tab_idx, row_idx, freq, cum, lut, prec, out):
    """:func:`~cachegen.codec._rans_lanes.decode_lanes` for any precision / alphabet (separate freq, cum and slot tables)."""
    n = out.shape[0]
    S = out.shape[1]
    nl = min(16, S)
    mask = (np.int64(1) << prec) - 1
    last = words.shape[0] - 1
    states = np.empty(16, dtype=np.int64)
    for j in range(nl):
        states[j] = (np.int64(words[min(2 * j, last)]) << 16) | np.int64(words[min(2 * j + 1, last)])
    p = 2 * nl
    for t in range(n):
        row = out[t]
        ro = row_idx[t]
        for c in range(S):
            j = c & 15
            x = states[j]
            k = tab_idx[c] + ro
            slot = x & mask
            y = lut[k, slot]
            yi = np.int64(y)
            x = freq[k, yi] * (x >> prec) + slot - cum[k, yi]
            flag = np.int64(x < 65536)
            w = np.int64(words[min(p, last)])
            states[j] = (x << (flag << 4)) | (w & (-flag))
            p += flag
            row[c] = y
    bad = np.int64(p != words.shape[0])
    for j in range(nl):
        bad += states[j] != 65536
    return bad


def _table_indexes(n: int, S: int, table_index: np.ndarray, row_shift: np.ndarray | None, n_tables: int,
                   err: type) -> tuple[np.ndarray, np.ndarray]:
    """Split the models ``table_index[c] + row_shift[t]`` into non-negative column and row parts (checked)."""
    table_index = np.ascontiguousarray(table_index, dtype=np.int64)
    if table_index.shape != (S,):
        raise err("need one table index per column")
    if row_shift is None:
        rows = np.zeros(n, dtype=np.int64)
    else:
        rows = np.ascontiguousarray(row_shift, dtype=np.int64)
        if rows.shape != (n,):
            raise err("need one row shift per row")
    if n * S == 0:
        return table_index, rows
    lo = int(rows.min())
    if int(table_index.min()) + lo < 0 or int(table_index.max()) + int(rows.max()) >= n_tables:
        raise err("table index out of range")
    return table_index + lo, rows - lo


def encode_interleaved(sym: np.ndarray, table_index: np.ndarray, tables: Tables,
                       row_shift: np.ndarray | None = None) -> np.ndarray:
    """Encode token-major ``sym`` (n, S) into one word stream (uint16): ``min(S, LANES)`` states, then words.

    Symbol ``(t, c)`` uses model ``table_index[c] + row_shift[t]`` (``row_shift`` default 0: a
    row-dependent shift lets a row quantized with a coarser step use the tables of a smaller
    spread). Empty input gives an empty stream."""
    sym = np.ascontiguousarray(sym)
    if sym.ndim != 2:
        raise CodecError("symbols must be 2-D")
    n, S = sym.shape
    cols, rows = _table_indexes(n, S, table_index, row_shift, tables.n_tables, CodecError)
    if n * S == 0:
        return np.empty(0, dtype=np.uint16)
    if int(sym.max()) >= tables.alphabet_size:
        raise CodecError("symbol outside the alphabet")
    out = np.empty(n * S + 2 * LANES + 1, dtype=np.uint16)
    fc = tables.fc if tables.fc is not None else np.ascontiguousarray(tables.freq | (tables.cum << 16))
    p, bad = _encode_il_kernel(sym, cols, rows, fc, tables.inv, tables.precision, out)
    if bad:
        raise CodecError("a symbol has probability 0 in its model")
    return out[p:]


def decode_interleaved(words: np.ndarray, n: int, table_index: np.ndarray, tables: Tables, out: np.ndarray | None = None,
                       row_shift: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`encode_interleaved` into token-major (n, S); CorruptChunk if the stream is inconsistent.

    Never reads outside ``words``; the caller bounds ``n`` against the payload size before allocating."""
    S = np.asarray(table_index).shape[0]
    cols, rows = _table_indexes(n, S, table_index, row_shift, tables.n_tables, CorruptChunk)
    if out is None:
        out = np.empty((n, S), dtype=tables.symbol_dtype)
    elif out.shape != (n, S) or out.dtype != tables.symbol_dtype:
        raise CodecError("bad output buffer")
    words = np.asarray(words)
    if n * S == 0:
        if words.size:
            raise CorruptChunk("empty block with a non-empty rANS stream")
        return out
    if words.size < 2 * min(LANES, S):
        raise CorruptChunk("rANS stream shorter than its states")
    if tables.packed is not None:
        padded = np.zeros(words.size + S + 1, dtype=np.uint16)
        padded[: words.size] = words
        if not out.flags.c_contiguous:
            raise CodecError("output buffer must be C-contiguous")
        bad = decode_lanes(padded, words.size, cols, rows, tables.packed, tables.precision, out)
    else:
        words = np.ascontiguousarray(words, dtype=np.uint16)
        bad = _decode_il_kernel_generic(words, cols, rows, tables.freq, tables.cum, tables.lut, tables.precision, out)
    if bad:
        raise CorruptChunk("rANS stream did not end in the initial state")
    return out


# -- low level API ---------------------------------------------------------------


def check_symbols(sym: np.ndarray, table_index: np.ndarray, tables: Tables) -> None:
    """Raise CodecError if some symbol has frequency 0 in its stream's model (it could not be coded)."""
    if sym.size == 0:
        return
    if int(sym.max()) >= tables.alphabet_size:
        raise CodecError("symbol outside the alphabet")
    f = tables.freq[table_index[None, :], sym.astype(np.int64)]
    if (f == 0).any():
        raise CodecError("a symbol has probability 0 in its model")


def encode_columns(sym: np.ndarray, table_index: np.ndarray, tables: Tables, check: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Encode token-major ``sym`` (n, S): returns (words uint16, lengths int64 per stream)."""
    sym = np.ascontiguousarray(sym)
    if sym.ndim != 2:
        raise CodecError("symbols must be 2-D")
    table_index = np.ascontiguousarray(table_index, dtype=np.int64)
    if table_index.shape != (sym.shape[1],):
        raise CodecError("need one table index per stream")
    if table_index.size and (table_index.min() < 0 or table_index.max() >= tables.n_tables):
        raise CodecError("table index out of range")
    if check and sym.size and int(sym.max()) >= tables.alphabet_size:
        raise CodecError("symbol outside the alphabet")
    n, S = sym.shape
    scratch = np.empty((S, n + 2), dtype=np.uint16)
    starts = np.empty(S, dtype=np.int64)
    if _encode_kernel(sym, table_index, tables.freq, tables.cum, tables.inv, tables.precision, scratch, starts):
        raise CodecError("a symbol has probability 0 in its model")
    lengths = (n + 2) - starts
    offsets = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    words = np.empty(int(offsets[-1]), dtype=np.uint16)
    _gather_kernel(scratch, starts, offsets, words)
    return words, lengths


def decode_columns(
    words: np.ndarray, lengths: np.ndarray, n: int, table_index: np.ndarray, tables: Tables, out: np.ndarray | None = None
) -> np.ndarray:
    """Decode S streams of ``n`` symbols each into token-major (n, S); CorruptChunk if a stream is inconsistent."""
    lengths = np.asarray(lengths, dtype=np.int64)
    S = lengths.shape[0]
    table_index = np.ascontiguousarray(table_index, dtype=np.int64)
    if table_index.shape != (S,):
        raise CorruptChunk("stream count does not match table indices")
    if S and (table_index.min() < 0 or table_index.max() >= tables.n_tables):
        raise CorruptChunk("table index out of range")
    if S and lengths.min() < 2:
        raise CorruptChunk("rANS stream shorter than its state")
    offsets = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if int(offsets[-1]) != words.shape[0]:
        raise CorruptChunk("rANS stream lengths do not add up to the payload")
    if out is None:
        out = np.empty((n, S), dtype=tables.symbol_dtype)
    elif out.shape != (n, S) or out.dtype != tables.symbol_dtype:
        raise CodecError("bad output buffer")
    if S == 0 or n == 0:
        if S and (lengths != 2).any():
            raise CorruptChunk("empty stream with extra words")
        return out
    words = np.ascontiguousarray(words)
    if tables.packed is not None:
        bad = _decode_kernel_packed(words, offsets, table_index, tables.packed, tables.precision, out)
    else:
        bad = _decode_kernel(words, offsets, table_index, tables.freq, tables.cum, tables.lut, tables.precision, out)
    if bad:
        raise CorruptChunk(f"{bad} rANS stream(s) did not end in the initial state")
    return out


# -- simple API ------------------------------------------------------------------

_HDR = struct.Struct("<4sIIB")


def _as_tables(models: Sequence[Categorical] | Tables) -> Tables:
    return models if isinstance(models, Tables) else Tables.build(list(models))


def encode(symbols: np.ndarray, models: Sequence[Categorical] | Tables, table_index: Sequence[int] | np.ndarray | None = None) -> bytes:
    """Encode ``symbols`` (n_streams, n) with one model per stream (``table_index``, default all 0)."""
    tables = _as_tables(models)
    sym = np.asarray(symbols)
    if sym.ndim == 1:
        sym = sym[None, :]
    if sym.ndim != 2 or sym.dtype.kind not in "ui":
        raise CodecError("symbols must be a 2-D integer array (n_streams, n)")
    if sym.size and sym.min() < 0:
        raise CodecError("negative symbol")
    S, n = sym.shape
    idx = np.zeros(S, dtype=np.int64) if table_index is None else np.asarray(table_index, dtype=np.int64)
    col = np.ascontiguousarray(sym.T.astype(tables.symbol_dtype if sym.size == 0 or sym.max() < tables.alphabet_size else np.int64))
    if col.dtype == np.int64:
        raise CodecError("symbol outside the alphabet")
    words, lengths = encode_columns(col, idx, tables)
    if lengths.size and lengths.max() >= 1 << 32:
        raise CodecError("stream too long")
    return _HDR.pack(b"RANS", S, n, tables.precision) + lengths.astype("<u4").tobytes() + words.astype("<u2").tobytes()


def decode(data: bytes, models: Sequence[Categorical] | Tables, table_index: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`encode`: returns (n_streams, n); CorruptChunk on bad input."""
    tables = _as_tables(models)
    mv = memoryview(data)
    if len(mv) < _HDR.size:
        raise CorruptChunk("rANS blob too short")
    magic, S, n, prec = _HDR.unpack_from(mv, 0)
    if magic != b"RANS":
        raise CorruptChunk("bad rANS magic")
    if prec != tables.precision:
        raise CorruptChunk(f"blob precision {prec} != model precision {tables.precision}")
    pos = _HDR.size
    if len(mv) < pos + 4 * S:
        raise CorruptChunk("rANS blob truncated in its stream table")
    lengths = np.frombuffer(mv, dtype="<u4", count=S, offset=pos).astype(np.int64)
    pos += 4 * S
    if (len(mv) - pos) % 2:
        raise CorruptChunk("odd payload length")
    words = np.frombuffer(mv, dtype="<u2", offset=pos).astype(np.uint16)
    # every symbol costs at least -log2(max p) bits: bound n before allocating
    pmax = tables.freq.max(axis=1) / float(1 << tables.precision)
    min_bits = float(-np.log2(pmax.max())) if S else 1.0
    if n * S > (1 << 31) or (S and n * S * min_bits > 16 * words.size + 64 * S):
        raise CorruptChunk("symbol count inconsistent with payload size")
    idx = np.zeros(S, dtype=np.int64) if table_index is None else np.asarray(table_index, dtype=np.int64)
    out = decode_columns(words, lengths, int(n), idx, tables)
    return np.ascontiguousarray(out.T)


def num_threads_default() -> int:
    return max(1, min(2, numba.config.NUMBA_NUM_THREADS))
