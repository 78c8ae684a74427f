"""Interleaved streams: a whole token-major block as ONE word stream with :data:`LANES` shared states.

The lossy codec's format: 64 bytes of state per section instead of 8 bytes per
column. On AVX-512 and AVX2 hosts, blocks with 12-bit tables and a width that is a multiple of 16 are
decoded several at a time by :mod:`.simd`; elsewhere the decoder for 12-bit tables is generated
(:mod:`._lanes`, ``tools/gen_rans_lanes.py``), and :func:`_decode_il_kernel_generic` serves any
other precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numba import njit

from cachegen.codec import _numba_env  # noqa: F401  (sets NUMBA_CACHE_DIR before numba loads)
from cachegen.codec.rans import simd
from cachegen.codec.rans._lanes import decode_lanes
from cachegen.codec.rans.model import Tables
from cachegen.errors import CodecError, CorruptChunk

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
    """:func:`~cachegen.codec.rans._lanes.decode_lanes` for any precision / alphabet (separate freq, cum and slot tables)."""
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


@njit(nogil=True, cache=True, boundscheck=False)
def _decode_column_kernel(words, starts, obeg, oend, freq, cum, lut, prec, out):
    """:func:`_decode_il_kernel_generic` of one-column streams of model 0, one after another: stream
    ``i`` (words ``starts[i]:starts[i+1]``, at least two) into ``out[obeg[i]:oend[i]]`` (``out`` is
    ``(N, 1)``). Returns per stream 0 iff it ended cleanly."""
    tab = np.zeros(1, dtype=np.int64)
    rows = np.zeros(out.shape[0], dtype=np.int64)
    bad = np.zeros(obeg.shape[0], dtype=np.int64)
    for i in range(obeg.shape[0]):
        o, e = obeg[i], oend[i]
        bad[i] = _decode_il_kernel_generic(
            words[starts[i] : starts[i + 1]], tab, rows[: e - o], freq, cum, lut, prec, out[o:e]
        )
    return bad


def _table_indexes(
    n: int, S: int, table_index: np.ndarray, row_shift: np.ndarray | None, n_tables: int, err: type
) -> tuple[np.ndarray, np.ndarray]:
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


def encode_interleaved(
    sym: np.ndarray, table_index: np.ndarray, tables: Tables, row_shift: np.ndarray | None = None
) -> np.ndarray:
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


def decode_column_many(streams: Sequence[np.ndarray], counts: Sequence[int], tables: Tables) -> list[np.ndarray]:
    """:func:`decode_interleaved` of one-column blocks (``counts[i]`` symbols of model 0 from
    ``streams[i]``), each as a 1-D array, in one kernel call.

    Why: a lossy chunk carries one such stream per section (its tokens' step multipliers), and
    sixteen chunks decoded together hold 960 of them; one call per stream spent more time in
    Python than in the coder. CorruptChunk names the first stream that is inconsistent."""
    if len(streams) != len(counts):
        raise CodecError("need one symbol count per stream")
    arrays = [np.asarray(w, dtype=np.uint16) for w in streams]
    sizes = np.array([w.size for w in arrays], dtype=np.int64)
    ns = np.array(counts, dtype=np.int64)
    if ns.size and int(ns.min()) < 0:
        raise CodecError("negative symbol count")
    if np.any((ns == 0) & (sizes > 0)):
        raise CorruptChunk("empty block with a non-empty rANS stream")
    if np.any((ns > 0) & (sizes < 2)):
        raise CorruptChunk("rANS stream shorter than its states")
    offs = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(ns, out=offs[1:])
    out = np.empty((int(offs[-1]), 1), dtype=tables.symbol_dtype)
    kept = np.flatnonzero(ns > 0)  # an empty block has no words and decodes to nothing
    if kept.size:
        starts = np.zeros(kept.size + 1, dtype=np.int64)
        np.cumsum(sizes[kept], out=starts[1:])
        words = np.concatenate([arrays[i] for i in kept.tolist()])
        bad = _decode_column_kernel(
            words, starts, offs[kept], offs[kept + 1], tables.freq, tables.cum, tables.lut, tables.precision, out
        )
        if bad.any():
            raise CorruptChunk(f"rANS stream {int(kept[int(np.argmax(bad > 0))])} did not end in the initial state")
    return [out[a:b, 0] for a, b in pairwise(offs.tolist())]


@dataclass(frozen=True)
class Block:
    """One token-major block ``(n, S)`` to decode from its interleaved stream (arguments of
    :func:`decode_interleaved`)."""

    words: np.ndarray
    n: int
    table_index: np.ndarray
    row_shift: np.ndarray | None = None
    out: np.ndarray | None = None


def decode_interleaved(
    words: np.ndarray,
    n: int,
    table_index: np.ndarray,
    tables: Tables,
    out: np.ndarray | None = None,
    row_shift: np.ndarray | None = None,
) -> np.ndarray:
    """Inverse of :func:`encode_interleaved` into token-major (n, S); CorruptChunk if the stream is inconsistent.

    Never reads outside ``words``; the caller bounds ``n`` against the payload size before allocating."""
    return decode_interleaved_many([Block(words, n, table_index, row_shift, out)], tables)[0]


def decode_interleaved_many(blocks: Sequence[Block], tables: Tables) -> list[np.ndarray]:
    """:func:`decode_interleaved` of several blocks: with a SIMD kernel (:mod:`.simd`) several at
    a time, whose independent chains overlap (AVX-512, four at a time: 3.5x one block's rate on
    one core; AVX2, two at a time: about 2x the numba kernel). Every
    block is checked before any is decoded; the first inconsistent one raises CorruptChunk."""
    jobs = []
    for b in blocks:
        S = np.asarray(b.table_index).shape[0]
        n = b.n
        cols, rows = _table_indexes(n, S, b.table_index, b.row_shift, tables.n_tables, CorruptChunk)
        out = b.out
        if out is None:
            out = np.empty((n, S), dtype=tables.symbol_dtype)
        elif out.shape != (n, S) or out.dtype != tables.symbol_dtype:
            raise CodecError("bad output buffer")
        words = np.asarray(b.words)
        if n * S == 0:
            if words.size:
                raise CorruptChunk("empty block with a non-empty rANS stream")
        elif words.size < 2 * min(LANES, S):
            raise CorruptChunk("rANS stream shorter than its states")
        if tables.packed is not None and not out.flags.c_contiguous:
            raise CodecError("output buffer must be C-contiguous")
        jobs.append((words, cols, rows, out))
    fast = simd.available() and tables.packed is not None
    vector, bad = [], 0
    for words, cols, rows, out in jobs:
        if out.size == 0:
            continue
        if fast and out.shape[1] % LANES == 0:
            vector.append((words, cols, rows, out))
        elif tables.packed is not None:
            padded = np.zeros(words.size + out.shape[1] + 1, dtype=np.uint16)
            padded[: words.size] = words
            bad += decode_lanes(padded, words.size, cols, rows, tables.packed, tables.precision, out)
        else:
            words = np.ascontiguousarray(words, dtype=np.uint16)
            bad += _decode_il_kernel_generic(
                words, cols, rows, tables.freq, tables.cum, tables.lut, tables.precision, out
            )
    if vector:
        assert tables.packed is not None
        streams = simd.prepare_many(vector, tables.precision)
        bad += sum(simd.decode_streams(streams, tables.packed, tables.precision))
    if bad:
        raise CorruptChunk("rANS stream did not end in the initial state")
    return [j[3] for j in jobs]
