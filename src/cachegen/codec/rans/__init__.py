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
section instead of 8 bytes per column. :func:`decode_interleaved_many` decodes
several such :class:`Block` s at once; on AVX-512 and AVX2 hosts :mod:`.simd` steps
four or two of them side by side in one pass. :func:`decode_column_many` decodes many
one-column streams (a lossy chunk's per-token multipliers) in one kernel call.

Stream format: each stream is its final 32-bit state (two 16-bit words, high
first) followed by its renormalisation words in decode order. :func:`encode`
wraps all streams as ``b"RANS" | u32 n_streams | u32 n | u8 precision |
u32 lengths[n_streams] | u16 words[...]`` (little endian).

Modules: :mod:`.model` (models, tables, the allocation bound), :mod:`.columns`,
:mod:`.interleaved` (with the generated :mod:`._lanes` decoder), :mod:`.simd`
(the AVX-512 and AVX2 decoders of interleaved streams, LLVM IR compiled by llvmlite),
:mod:`.blob`.
"""

from __future__ import annotations

import numba

from cachegen.codec import _numba_env  # noqa: F401  (sets NUMBA_CACHE_DIR before numba loads)
from cachegen.codec.rans import simd
from cachegen.codec.rans.blob import decode, encode
from cachegen.codec.rans.columns import check_symbols, decode_columns, encode_columns
from cachegen.codec.rans.interleaved import (
    LANES,
    Block,
    decode_column_many,
    decode_interleaved,
    decode_interleaved_many,
    encode_interleaved,
)
from cachegen.codec.rans.model import (
    MAX_PRECISION,
    MAX_SYMBOLS,
    RANS_L,
    Categorical,
    Tables,
    check_budget,
    min_bits,
    quantize_counts,
)

__all__ = [
    "LANES",
    "MAX_PRECISION",
    "MAX_SYMBOLS",
    "RANS_L",
    "Block",
    "Categorical",
    "Tables",
    "check_budget",
    "check_symbols",
    "decode",
    "decode_column_many",
    "decode_columns",
    "decode_interleaved",
    "decode_interleaved_many",
    "encode",
    "encode_columns",
    "encode_interleaved",
    "min_bits",
    "num_threads_default",
    "quantize_counts",
    "simd",
]


def num_threads_default() -> int:
    return max(1, min(2, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]  # numba config is set at runtime
