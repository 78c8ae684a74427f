"""Column streams: one rANS state and one length per column of a token-major block (the lossless path).

Each stream is its final 32-bit state (two 16-bit words, high first) followed
by its renormalisation words in decode order; 16 streams are decoded in
lockstep for instruction-level parallelism.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cachegen.codec import _numba_env  # noqa: F401  (sets NUMBA_CACHE_DIR before numba loads)
from cachegen.codec.rans.model import Tables
from cachegen.errors import CodecError, CorruptChunk


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


def check_symbols(sym: np.ndarray, table_index: np.ndarray, tables: Tables) -> None:
    """Raise CodecError if some symbol has frequency 0 in its stream's model (it could not be coded)."""
    if sym.size == 0:
        return
    if int(sym.max()) >= tables.alphabet_size:
        raise CodecError("symbol outside the alphabet")
    f = tables.freq[table_index[None, :], sym.astype(np.int64)]
    if (f == 0).any():
        raise CodecError("a symbol has probability 0 in its model")


def encode_columns(
    sym: np.ndarray, table_index: np.ndarray, tables: Tables, check: bool = True
) -> tuple[np.ndarray, np.ndarray]:
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
    words: np.ndarray,
    lengths: np.ndarray,
    n: int,
    table_index: np.ndarray,
    tables: Tables,
    out: np.ndarray | None = None,
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
