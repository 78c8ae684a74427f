"""A self-describing blob of column streams (the simple API of :mod:`cachegen.codec.rans`).

``b"RANS" | u32 n_streams | u32 n | u8 precision | u32 lengths[n_streams] | u16 words[...]`` (little endian).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from cachegen.codec.rans.columns import decode_columns, encode_columns
from cachegen.codec.rans.model import Categorical, Tables, check_budget
from cachegen.errors import CodecError, CorruptChunk

_HDR = struct.Struct("<4sIIB")


def _as_tables(models: Sequence[Categorical] | Tables) -> Tables:
    return models if isinstance(models, Tables) else Tables.build(list(models))


def encode(
    symbols: np.ndarray, models: Sequence[Categorical] | Tables, table_index: Sequence[int] | np.ndarray | None = None
) -> bytes:
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
    col = np.ascontiguousarray(
        sym.T.astype(tables.symbol_dtype if sym.size == 0 or sym.max() < tables.alphabet_size else np.int64)
    )
    if col.dtype == np.int64:
        raise CodecError("symbol outside the alphabet")
    words, lengths = encode_columns(col, idx, tables)
    if lengths.size and lengths.max() >= 1 << 32:
        raise CodecError("stream too long")
    return _HDR.pack(b"RANS", S, n, tables.precision) + lengths.astype("<u4").tobytes() + words.astype("<u2").tobytes()


def decode(
    data: bytes, models: Sequence[Categorical] | Tables, table_index: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
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
    check_budget(n, S, words.size, tables, "rANS blob")  # bound n before allocating
    idx = np.zeros(S, dtype=np.int64) if table_index is None else np.asarray(table_index, dtype=np.int64)
    out = decode_columns(words, lengths, int(n), idx, tables)
    return np.ascontiguousarray(out.T)
