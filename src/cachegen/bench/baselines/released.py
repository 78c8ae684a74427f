"""cachegen-released: CacheGen as released with LMCache (levels 1, 2, 3); see ``docs/evaluation.md``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachegen.bench.baselines._format import CHUNK_TOKENS, _build, _np32, _read_header, _write_header, _Writer
from cachegen.codec import rans
from cachegen.codec.container import Reader
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache

CDF_ENTRIES = 33  # LMCache's value_range = 32, plus the leading 0
CDF_TOTAL = 1 << 16
RANS_PRECISION = 12


@dataclass(frozen=True)
class ReleasedBins:
    """LMCache's ``CacheGenConfig``: bins for K in three layer groups, for V in two."""

    key_first_layers: int
    key_second_layers: int
    key_first_bins: int
    key_second_bins: int
    key_third_bins: int
    value_first_layers: int
    value_first_bins: int
    value_second_bins: int

    def key_bins(self, layer: int) -> int:
        if layer < self.key_first_layers:
            return self.key_first_bins
        if layer < self.key_second_layers:
            return self.key_second_bins
        return self.key_third_bins

    def value_bins(self, layer: int) -> int:
        return self.value_first_bins if layer < self.value_first_layers else self.value_second_bins


# Level 2 is the released Mistral-7B / LongChat-7B config (32/16/16 for K at
# layer boundaries 10 and 20, 32/16 for V at 2); levels 1 and 3 are the
# coarser (16/16/12, V 16/12) and finer (32 everywhere) settings of the
# CacheGen artifact's QUANT_LEVEL switch. See docs/evaluation.md.
RELEASED_LEVELS: dict[int, ReleasedBins] = {
    1: ReleasedBins(10, 20, 16, 16, 12, 2, 16, 12),
    2: ReleasedBins(10, 20, 32, 16, 16, 2, 32, 16),
    3: ReleasedBins(10, 20, 32, 32, 32, 2, 32, 32),
}


def released_quantize(x: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """LMCache ``torch_quant``: symmetric absmax per row (token) over all channels.

    ``x`` is ``[tokens, channels]``; returns (symbols in ``[0, bins - 2]`` uint8, absmax fp32 per token).
    """
    c = bins // 2 - 1
    mx = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32)
    safe = np.where(mx > 0, mx, np.float32(1.0))
    q = np.clip(np.rint(x * (np.float32(c) / safe)), -c, c).astype(np.int16) + c
    return q.astype(np.uint8), mx[:, 0]


def released_dequantize(q: np.ndarray, mx: np.ndarray, bins: int) -> np.ndarray:
    c = bins // 2 - 1
    return (q.astype(np.float32) - c) / np.float32(c) * mx[:, None].astype(np.float32)


def released_cdf(q: np.ndarray) -> np.ndarray:
    """LMCache's 16-bit CDF per channel of ``q`` ``[tokens, channels]``: ``[channels, 33]`` uint16.

    As in LMCache's ``_convert_to_int_and_normalize``: the float CDF is scaled
    to ``2**16 - 33`` and ``arange(33)`` is added, so every one of the 32
    symbols keeps a frequency of at least 1 (here the top entry is 65535).
    """
    t, ch = q.shape
    counts = np.zeros((ch, CDF_ENTRIES - 1), np.float64)
    np.add.at(counts, (np.broadcast_to(np.arange(ch), q.shape), q.astype(np.int64)), 1.0)
    cdf = np.zeros((ch, CDF_ENTRIES), np.float64)
    cdf[:, 1:] = np.cumsum(counts, axis=1) / max(t, 1)
    return (np.rint(cdf * (CDF_TOTAL - CDF_ENTRIES)) + np.arange(CDF_ENTRIES)).astype(np.uint16)


def _cdf_to_freqs(cdf: np.ndarray) -> np.ndarray:
    """Symbol frequencies at the rANS coder's precision, derived from the stored 16-bit CDFs.

    Deterministic and vectorized, so encoder and decoder derive the same
    tables: scale each frequency to ``2**RANS_PRECISION`` (at least 1), then
    put the rounding residue on each row's most frequent symbol.
    """
    d = np.diff(cdf.astype(np.int64), axis=1)
    if (d <= 0).any():
        raise CorruptChunk("CDF table is not strictly increasing")
    m = 1 << RANS_PRECISION
    f = np.maximum(1, (d * m) // d.sum(axis=1, keepdims=True))
    top = np.argmax(f, axis=1)
    rows = np.arange(f.shape[0])
    f[rows, top] += m - f.sum(axis=1)
    if (f[rows, top] < 1).any():
        raise CorruptChunk("CDF table cannot be scaled to the coder's precision")
    return f


def _rans_tables(freqs: np.ndarray, with_lut: bool):
    """A :class:`cachegen.codec.rans.Tables` for many models at once, built with vectorized numpy."""
    freq = np.ascontiguousarray(freqs, dtype=np.int64)
    n, a = freq.shape
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1)[:, :-1]
    inv = 1.0 / freq  # every frequency is >= 1 here
    if with_lut:
        lut = np.repeat(np.tile(np.arange(a, dtype=np.uint8), n), freq.ravel()).reshape(n, 1 << RANS_PRECISION)
    else:
        lut = np.zeros((n, 1), np.uint8)
    return rans.Tables(RANS_PRECISION, freq, cum, inv, lut, None)


class CacheGenReleasedCodec:
    """CacheGen as released in LMCache (the ``cachegen`` serde), level 1, 2 or 3.

    Per 256-token chunk and per layer, K and V are reshaped token-major to
    ``[tokens, heads * head_dim]`` and quantized with a symmetric absmax per
    token over all channels (fp32 scale), with the level's bin count for that
    layer. The symbols of each (layer, K/V, channel) are entropy-coded with
    that channel's own 33-entry 16-bit CDF, which is stored in the chunk. The
    coder is the project's static rANS (12-bit, frequencies derived
    deterministically from the stored CDF) instead of torchac's arithmetic
    coder; each (layer, K/V, channel) is one stream with a u16 word count.
    Every byte (tables, scales, lengths) is in the output.
    """

    name = "cachegen-released"
    levels = tuple(sorted(RELEASED_LEVELS))

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.chunk_tokens = chunk_tokens

    @staticmethod
    def _bins(level: int, layer: int, is_key: bool) -> int:
        b = RELEASED_LEVELS[level]
        return b.key_bins(layer) if is_key else b.value_bins(layer)

    def encode(self, kv: KVCache, level: int, *, key: str | None = None) -> bytes:
        if level not in RELEASED_LEVELS:
            raise ConfigError(f"cachegen-released level must be 1, 2 or 3, not {level!r}")
        w = _Writer()
        _write_header(w, self.name, level, kv, key)
        for part in kv.chunks(self.chunk_tokens) if kv.num_tokens else []:
            for i, l in enumerate(part.layers):
                for is_key, t in ((True, l.k), (False, l.v)):
                    x = _np32(t).transpose(1, 0, 2).reshape(t.shape[1], -1)  # [tokens, heads*dim]
                    q, mx = released_quantize(x, self._bins(level, i, is_key))
                    cdf = released_cdf(q)
                    tables = _rans_tables(_cdf_to_freqs(cdf), with_lut=False)
                    words, lengths = rans.encode_columns(q, np.arange(q.shape[1]), tables)
                    w.array(cdf.astype("<u2"))
                    w.array(mx.astype("<f4"))
                    w.array(lengths.astype("<u2"))
                    w.array(words.astype("<u2"))
        return w.getvalue()

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        r = Reader(memoryview(data), f"{self.name} chunk")
        level, start, shapes = _read_header(r, self.name, key)
        if level not in RELEASED_LEVELS:
            raise CorruptChunk(f"cachegen-released chunk of unknown level {level}")
        ks: list[list[np.ndarray]] = [[] for _ in shapes]
        vs: list[list[np.ndarray]] = [[] for _ in shapes]
        total = shapes[0].tokens
        for a in range(0, total, self.chunk_tokens):
            n = min(self.chunk_tokens, total - a)
            for i, s in enumerate(shapes):
                for is_key, d, out in ((True, s.dk, ks), (False, s.dv, vs)):
                    ch = s.heads * d
                    cdf = r.array("<u2", ch * CDF_ENTRIES).reshape(ch, CDF_ENTRIES)
                    mx = r.array("<f4", n)
                    lengths = r.array("<u2", ch).astype(np.int64)
                    words = r.array("<u2", int(lengths.sum())).astype(np.uint16)
                    tables = _rans_tables(_cdf_to_freqs(cdf), with_lut=True)
                    q = rans.decode_columns(words, lengths, n, np.arange(ch), tables)
                    x = released_dequantize(q, mx, self._bins(level, i, is_key))
                    out[i].append(x.reshape(n, s.heads, d).transpose(1, 0, 2))
        r.done()
        return _build(shapes, start, [np.concatenate(p, axis=1) for p in ks], [np.concatenate(p, axis=1) for p in vs])
