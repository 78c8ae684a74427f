"""Baseline KV codecs for the evaluation harness, behind one small protocol.

Every codec turns a :class:`~cachegen.kv.KVCache` (usually one 256-token
chunk) into real bytes and back. Sizes are ``len(bytes)``: headers, scales,
zero points, probability tables and stream offsets are all inside, so
``bits_per_value = 8 * len(bytes) / kv.num_values`` is honest. Nothing is
pickled: a tiny binary header (:class:`_Writer`/:class:`_Reader`) is followed
by raw numpy buffers.

Codecs (the ``name`` is the contract used in JSON results):

- ``fp16`` / ``bf16``: the raw KV cast to 16 bits.
- ``uniform8`` / ``uniform4``: asymmetric min/max per channel (per layer, K/V,
  head and channel, over the chunk's tokens), fp16 min and step.
- ``kivi2`` / ``kivi4``: KIVI-style asymmetric quantization; K per channel in
  groups of 32 tokens, V per token in groups of 32 channels; fp16 scale and
  zero per group.
- ``cachegen-released`` (levels 1, 2, 3): CacheGen as released with LMCache,
  see :class:`CacheGenReleasedCodec` and ``docs/evaluation.md``.
- ``cachegen``: the project codec (:class:`ProjectCodec` adapter).

Text recompute (``recompute``) is not a codec: the harness prefills it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from cachegen.errors import CodecError, ConfigError, CorruptChunk
from cachegen.kv import KVCache, KVLayer, LayerKind

MAGIC = b"CGBL"
FORMAT_VERSION = 1
CHUNK_TOKENS = 256


@runtime_checkable
class KVCodec(Protocol):
    """What the harness needs from a codec: a name, a level, and a byte round trip."""

    name: str
    level: int | None

    def encode(self, kv: KVCache) -> bytes: ...

    def decode(self, data: bytes) -> KVCache: ...


def label(codec: KVCodec) -> str:
    """``name`` or ``name/Lk`` for display."""
    return codec.name if codec.level is None else f"{codec.name}/L{codec.level}"


# -- serialization helpers -------------------------------------------------------

_KINDS = {LayerKind.FULL: 0, LayerKind.SLIDING: 1}
_KINDS_INV = {v: k for k, v in _KINDS.items()}


class _Writer:
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def pack(self, fmt: str, *vals) -> None:
        self.parts.append(struct.pack("<" + fmt, *vals))

    def raw(self, b: bytes) -> None:
        self.parts.append(b)

    def array(self, a: np.ndarray) -> None:
        self.parts.append(np.ascontiguousarray(a).tobytes())

    def blob(self, b: bytes) -> None:
        self.pack("I", len(b))
        self.parts.append(b)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.mv = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.mv):
            raise CorruptChunk(f"truncated: need {n} bytes at offset {self.pos}, have {len(self.mv) - self.pos}")
        out = self.mv[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        fmt = "<" + fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(dt.itemsize * count), dtype=dt, count=count)

    def blob(self) -> memoryview:
        (n,) = self.unpack("I")
        return self.take(n)

    def done(self) -> None:
        if self.pos != len(self.mv):
            raise CorruptChunk(f"{len(self.mv) - self.pos} trailing bytes")


@dataclass(frozen=True)
class _LayerShape:
    kind: LayerKind
    window: int | None
    heads: int
    tokens: int
    dk: int
    dv: int


def _write_header(w: _Writer, name: str, level: int | None, kv: KVCache) -> list[_LayerShape]:
    nb = name.encode()
    w.raw(MAGIC)
    w.pack("BB", FORMAT_VERSION, len(nb))
    w.raw(nb)
    w.pack("BIH", 255 if level is None else level, kv.start, kv.num_layers)
    shapes = []
    for l in kv.layers:
        h, t, dk = l.k.shape
        dv = l.v.shape[2]
        w.pack("BIHIHH", _KINDS[l.kind], l.window or 0, h, t, dk, dv)
        shapes.append(_LayerShape(l.kind, l.window, h, t, dk, dv))
    return shapes


def _read_header(r: _Reader, name: str) -> tuple[int | None, int, list[_LayerShape]]:
    if bytes(r.take(4)) != MAGIC:
        raise CorruptChunk("bad magic")
    version, n = r.unpack("BB")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"format version {version}, expected {FORMAT_VERSION}")
    got = bytes(r.take(n)).decode(errors="replace")
    if got != name:
        raise CodecError(f"these bytes were written by codec {got!r}, not {name!r}")
    level, start, nl = r.unpack("BIH")
    shapes = []
    for _ in range(nl):
        kind, window, h, t, dk, dv = r.unpack("BIHIHH")
        if kind not in _KINDS_INV:
            raise CorruptChunk(f"unknown layer kind {kind}")
        shapes.append(_LayerShape(_KINDS_INV[kind], window or None, h, t, dk, dv))
    if not shapes:
        raise CorruptChunk("no layers")
    return (None if level == 255 else level), start, shapes


def header_size(name: str, num_layers: int) -> int:
    """Bytes of the common header (for size-accounting tests)."""
    return 4 + 2 + len(name.encode()) + struct.calcsize("<BIH") + num_layers * struct.calcsize("<BIHIHH")


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _build(shapes: list[_LayerShape], start: int, ks: list[np.ndarray], vs: list[np.ndarray]) -> KVCache:
    layers = [
        KVLayer(torch.from_numpy(np.ascontiguousarray(k, dtype=np.float32)),
                torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)), s.kind, s.window)
        for s, k, v in zip(shapes, ks, vs)
    ]
    return KVCache(layers, start=start)


# -- bit packing -----------------------------------------------------------------

def pack_bits(q: np.ndarray, bits: int) -> bytes:
    """Pack unsigned integers < 2**bits (bits in 1, 2, 4, 8) little-end first into bytes."""
    if bits not in (1, 2, 4, 8):
        raise ConfigError(f"cannot pack {bits}-bit values")
    q = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return q.tobytes()
    per = 8 // bits
    pad = (-q.size) % per
    if pad:
        q = np.concatenate([q, np.zeros(pad, np.uint8)])
    q = q.reshape(-1, per)
    out = np.zeros(q.shape[0], np.uint8)
    for i in range(per):
        out |= (q[:, i] << (i * bits)).astype(np.uint8)
    return out.tobytes()


def unpack_bits(b: bytes | memoryview, bits: int, count: int) -> np.ndarray:
    raw = np.frombuffer(b, dtype=np.uint8)
    if bits == 8:
        if raw.size != count:
            raise CorruptChunk("packed size mismatch")
        return raw
    per = 8 // bits
    if raw.size != -(-count // per):
        raise CorruptChunk("packed size mismatch")
    mask = (1 << bits) - 1
    out = np.empty((raw.size, per), np.uint8)
    for i in range(per):
        out[:, i] = (raw >> (i * bits)) & mask
    return out.reshape(-1)[:count]


def packed_len(count: int, bits: int) -> int:
    return -(-count * bits // 8)


# -- asymmetric min/max quantization (shared by uniform and KIVI) ----------------

def _quant_minmax(x: np.ndarray, axis: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantize along ``axis`` groups: returns (q uint8, min fp16, step fp16).

    The fp16-rounded min and step are the ones used to quantize, so the decoder
    reproduces exactly what the encoder assumed.
    """
    levels = (1 << bits) - 1
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    lo16 = lo.astype(np.float16)
    step16 = ((hi - lo16.astype(np.float32)) / levels).astype(np.float16)
    step = step16.astype(np.float32)
    step16 = np.where(step > 0, step16, np.float16(1.0)).astype(np.float16)
    step = step16.astype(np.float32)
    q = np.clip(np.rint((x - lo16.astype(np.float32)) / step), 0, levels).astype(np.uint8)
    return q, lo16, step16


def _dequant_minmax(q: np.ndarray, lo16: np.ndarray, step16: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * step16.astype(np.float32) + lo16.astype(np.float32)


# -- raw ---------------------------------------------------------------------------

class RawCodec:
    """The KV cast to fp16 or bf16, as is."""

    level = None

    def __init__(self, dtype: str = "fp16") -> None:
        if dtype not in ("fp16", "bf16"):
            raise ConfigError(f"raw dtype must be fp16 or bf16, not {dtype!r}")
        self.name = dtype
        self._torch = torch.float16 if dtype == "fp16" else torch.bfloat16

    def encode(self, kv: KVCache) -> bytes:
        w = _Writer()
        _write_header(w, self.name, None, kv)
        for l in kv.layers:
            for t in (l.k, l.v):
                # bf16 has no numpy dtype: ship its bit pattern as int16
                w.array(t.detach().to(self._torch).contiguous().view(torch.int16).cpu().numpy())
        return w.getvalue()

    def decode(self, data: bytes) -> KVCache:
        r = _Reader(data)
        _, start, shapes = _read_header(r, self.name)
        ks, vs = [], []
        for s in shapes:
            for d, out in ((s.dk, ks), (s.dv, vs)):
                a = r.array(np.int16, s.heads * s.tokens * d).reshape(s.heads, s.tokens, d)
                out.append(torch.from_numpy(a.copy()).view(self._torch).float().numpy())
        r.done()
        return _build(shapes, start, ks, vs)


# -- uniform per channel ------------------------------------------------------------

class UniformCodec:
    """``bits``-bit asymmetric quantization with one min/step per (layer, K/V, head, channel)."""

    level = None

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4, 8):
            raise ConfigError("uniform bits must be 2, 4 or 8")
        self.bits = bits
        self.name = f"uniform{bits}"

    def encode(self, kv: KVCache) -> bytes:
        w = _Writer()
        _write_header(w, self.name, None, kv)
        for l in kv.layers:
            for t in (l.k, l.v):
                q, lo, step = _quant_minmax(_np32(t), axis=1, bits=self.bits)  # over tokens
                w.array(lo)
                w.array(step)
                w.raw(pack_bits(q, self.bits))
        return w.getvalue()

    def decode(self, data: bytes) -> KVCache:
        r = _Reader(data)
        _, start, shapes = _read_header(r, self.name)
        ks, vs = [], []
        for s in shapes:
            for d, out in ((s.dk, ks), (s.dv, vs)):
                lo = r.array(np.float16, s.heads * d).reshape(s.heads, 1, d)
                step = r.array(np.float16, s.heads * d).reshape(s.heads, 1, d)
                n = s.heads * s.tokens * d
                q = unpack_bits(r.take(packed_len(n, self.bits)), self.bits, n).reshape(s.heads, s.tokens, d)
                out.append(_dequant_minmax(q, lo, step))
        r.done()
        return _build(shapes, start, ks, vs)


# -- KIVI-style ----------------------------------------------------------------------

def _pad_axis(x: np.ndarray, axis: int, mult: int) -> np.ndarray:
    pad = (-x.shape[axis]) % mult
    if not pad:
        return x
    # edge padding keeps the group's min/max unchanged
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return np.pad(x, widths, mode="edge")


class KiviCodec:
    """KIVI-style: K per channel over groups of ``group`` tokens, V per token over groups of ``group`` channels.

    Asymmetric (min and step, fp16) per group, like KIVI. A group cut short by
    the end of a chunk (or a head size that is not a multiple of ``group``) is
    padded by repeating its last element; the padding is not stored.
    """

    level = None

    def __init__(self, bits: int, group: int = 32) -> None:
        if bits not in (2, 4, 8):
            raise ConfigError("KIVI bits must be 2, 4 or 8")
        self.bits, self.group = bits, group
        self.name = f"kivi{bits}"

    def _enc_k(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        h, t, d = x.shape
        xp = _pad_axis(x, 1, self.group)
        g = xp.reshape(h, -1, self.group, d)  # [h, groups, 32 tokens, d]
        q, lo, step = _quant_minmax(g, axis=2, bits=self.bits)
        return q.reshape(h, -1, d)[:, :t], lo, step

    def _enc_v(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        h, t, d = x.shape
        xp = _pad_axis(x, 2, self.group)
        g = xp.reshape(h, t, -1, self.group)  # [h, t, groups, 32 channels]
        q, lo, step = _quant_minmax(g, axis=3, bits=self.bits)
        return q.reshape(h, t, -1)[:, :, :d], lo, step

    def encode(self, kv: KVCache) -> bytes:
        w = _Writer()
        _write_header(w, self.name, None, kv)
        for l in kv.layers:
            for t, enc in ((l.k, self._enc_k), (l.v, self._enc_v)):
                q, lo, step = enc(_np32(t))
                w.array(lo)
                w.array(step)
                w.raw(pack_bits(q, self.bits))
        return w.getvalue()

    def decode(self, data: bytes) -> KVCache:
        r = _Reader(data)
        _, start, shapes = _read_header(r, self.name)
        ks, vs = [], []
        g = self.group
        for s in shapes:
            # K: groups along tokens
            tg = -(-s.tokens // g)
            lo = r.array(np.float16, s.heads * tg * s.dk).reshape(s.heads, tg, 1, s.dk)
            step = r.array(np.float16, s.heads * tg * s.dk).reshape(s.heads, tg, 1, s.dk)
            n = s.heads * s.tokens * s.dk
            q = unpack_bits(r.take(packed_len(n, self.bits)), self.bits, n).reshape(s.heads, s.tokens, s.dk)
            qp = _pad_axis(q, 1, g).reshape(s.heads, tg, g, s.dk)
            ks.append(_dequant_minmax(qp, lo, step).reshape(s.heads, -1, s.dk)[:, : s.tokens])
            # V: groups along channels
            cg = -(-s.dv // g)
            lo = r.array(np.float16, s.heads * s.tokens * cg).reshape(s.heads, s.tokens, cg, 1)
            step = r.array(np.float16, s.heads * s.tokens * cg).reshape(s.heads, s.tokens, cg, 1)
            n = s.heads * s.tokens * s.dv
            q = unpack_bits(r.take(packed_len(n, self.bits)), self.bits, n).reshape(s.heads, s.tokens, s.dv)
            qp = _pad_axis(q, 2, g).reshape(s.heads, s.tokens, cg, g)
            vs.append(_dequant_minmax(qp, lo, step).reshape(s.heads, s.tokens, -1)[:, :, : s.dv])
        r.done()
        return _build(shapes, start, ks, vs)


# -- CacheGen as released ------------------------------------------------------------

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
    from cachegen.codec import rans

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

    def __init__(self, level: int, chunk_tokens: int = CHUNK_TOKENS) -> None:
        if level not in RELEASED_LEVELS:
            raise ConfigError(f"cachegen-released level must be 1, 2 or 3, not {level!r}")
        self.level = level
        self.bins = RELEASED_LEVELS[level]
        self.chunk_tokens = chunk_tokens

    def _bins(self, layer: int, is_key: bool) -> int:
        return self.bins.key_bins(layer) if is_key else self.bins.value_bins(layer)

    def encode(self, kv: KVCache) -> bytes:
        from cachegen.codec import rans

        w = _Writer()
        _write_header(w, self.name, self.level, kv)
        for part in kv.chunks(self.chunk_tokens) if kv.num_tokens else []:
            for i, l in enumerate(part.layers):
                for is_key, t in ((True, l.k), (False, l.v)):
                    x = _np32(t).transpose(1, 0, 2).reshape(t.shape[1], -1)  # [tokens, heads*dim]
                    q, mx = released_quantize(x, self._bins(i, is_key))
                    cdf = released_cdf(q)
                    tables = _rans_tables(_cdf_to_freqs(cdf), with_lut=False)
                    words, lengths = rans.encode_columns(q, np.arange(q.shape[1]), tables)
                    w.array(cdf.astype("<u2"))
                    w.array(mx.astype("<f4"))
                    w.array(lengths.astype("<u2"))
                    w.array(words.astype("<u2"))
        return w.getvalue()

    def decode(self, data: bytes) -> KVCache:
        from cachegen.codec import rans

        r = _Reader(data)
        level, start, shapes = _read_header(r, self.name)
        if level != self.level:
            raise CodecError(f"bytes are level {level}, this codec is level {self.level}")
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
                    x = released_dequantize(q, mx, self._bins(i, is_key))
                    out[i].append(x.reshape(n, s.heads, d).transpose(1, 0, 2))
        r.done()
        return _build(shapes, start, [np.concatenate(p, axis=1) for p in ks], [np.concatenate(p, axis=1) for p in vs])


# -- the project codec ---------------------------------------------------------------

class ProjectCodec:
    """Adapter: ``cachegen.codec.Codec`` at one level, as a :class:`KVCodec` named ``cachegen``."""

    name = "cachegen"

    def __init__(self, codec, level: int) -> None:
        self.codec, self.level = codec, level

    def encode(self, kv: KVCache) -> bytes:
        return self.codec.encode(kv, self.level)

    def decode(self, data: bytes) -> KVCache:
        return self.codec.decode(data)


def project_codecs(loaded_model, levels: Iterable[int] | None = None) -> list[ProjectCodec]:
    """The project codec at each of ``levels`` (default: all of ``cachegen.codec.LEVELS``), calibrated for the model.

    Raises ImportError while the codec package does not provide ``Codec``.
    """
    from cachegen.codec import LEVELS, Codec, load_or_calibrate  # type: ignore[attr-defined]

    profile = load_or_calibrate(loaded_model)
    codec = Codec(profile, loaded_model.fingerprint)
    return [ProjectCodec(codec, lv) for lv in (levels if levels is not None else LEVELS)]


# -- registry ------------------------------------------------------------------------

BASELINE_NAMES = ("fp16", "bf16", "uniform8", "uniform4", "kivi2", "kivi4", "cachegen-released")
DEFAULT_BASELINES = ("fp16", "uniform8", "uniform4", "kivi4", "kivi2", "cachegen-released")


def baseline(name: str, level: int | None = None) -> list[KVCodec]:
    """The baseline(s) called ``name``; ``cachegen-released`` without a level gives all three levels."""
    if name in ("fp16", "bf16"):
        return [RawCodec(name)]
    if name.startswith("uniform") and name[7:].isdigit():
        return [UniformCodec(int(name[7:]))]
    if name.startswith("kivi") and name[4:].isdigit():
        return [KiviCodec(int(name[4:]))]
    if name == "cachegen-released":
        return [CacheGenReleasedCodec(lv) for lv in ([level] if level else sorted(RELEASED_LEVELS))]
    raise ConfigError(f"unknown baseline {name!r}: use one of {', '.join(BASELINE_NAMES)}")


def make_codecs(names: Sequence[str], loaded_model=None, warn: Callable[[str], None] | None = None) -> list[KVCodec]:
    """Codecs for ``names`` (``cachegen`` = the project codec, all levels; ``name:level`` picks one level)."""
    out: list[KVCodec] = []
    for spec in names:
        name, _, lv = spec.partition(":")
        level = int(lv) if lv else None
        if name == "cachegen":
            if loaded_model is None:
                raise ConfigError("the project codec needs a loaded model (for its profile)")
            try:
                out += project_codecs(loaded_model, [level] if level is not None else None)
            except ImportError as e:
                if warn is None:
                    raise
                warn(f"skipping the project codec: {e}")
        else:
            out += baseline(name, level)
    return out


def roundtrip_chunks(codec: KVCodec, kv: KVCache, chunk_tokens: int = CHUNK_TOKENS) -> tuple[KVCache, int, list[bytes]]:
    """Encode ``kv`` in ``chunk_tokens`` chunks as stored; returns (decoded KV, total bytes, blobs)."""
    blobs = [codec.encode(c) for c in kv.chunks(chunk_tokens)]
    back = KVCache.concat([codec.decode(b) for b in blobs])
    back.meta = dict(kv.meta)
    return back, sum(len(b) for b in blobs), blobs
