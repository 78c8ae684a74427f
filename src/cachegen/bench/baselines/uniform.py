"""uniform8 / uniform4: asymmetric min/max per (layer, K/V, head, channel) over the chunk's tokens, fp16 min and step."""

from __future__ import annotations

import numpy as np

from cachegen.bench.baselines._format import (
    _build,
    _check_level,
    _check_slot,
    _dequant_minmax,
    _dequant_minmax_into,
    _LayerShape,
    _np32,
    _quant_minmax,
    _read_header,
    _write_header,
    _Writer,
    dequant8_chunk_into,
    pack_bits,
    packed_len,
    read_layout,
    unpack_bits,
)
from cachegen.codec.container import Reader
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache


class UniformCodec:
    """``bits``-bit asymmetric quantization with one min/step per (layer, K/V, head, channel)."""

    levels = (0,)  # one setting: the chunk header records no level

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4, 8):
            raise ConfigError("uniform bits must be 2, 4 or 8")
        self.bits = bits
        self.name = f"uniform{bits}"

    def encode(self, kv: KVCache, level: int = 0, *, key: str | None = None) -> bytes:
        _check_level(self, level)
        w = _Writer()
        _write_header(w, self.name, None, kv, key)
        for l in kv.layers:
            for t in (l.k, l.v):
                q, lo, step = _quant_minmax(_np32(t), axis=1, bits=self.bits)  # over tokens
                w.array(lo)
                w.array(step)
                w.raw(pack_bits(q, self.bits))
        return w.getvalue()

    def layout(self, data: bytes) -> KVCache:
        """The chunk's start and layout, without decoding it (a :class:`~cachegen.codec.protocol.ReadsLayout`)."""
        return read_layout(data, self.name, self._body_size)

    def _body_size(self, shapes: list[_LayerShape]) -> int:
        """Bytes after the header: per layer and K/V, fp16 min and step per channel, then the codes."""
        return sum(
            4 * s.heads * d + packed_len(s.heads * s.tokens * d, self.bits) for s in shapes for d in (s.dk, s.dv)
        )

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        r = Reader(memoryview(data), f"{self.name} chunk")
        _, start, shapes = _read_header(r, self.name, key)
        ks: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        for s in shapes:
            for d, out in ((s.dk, ks), (s.dv, vs)):
                lo = r.array(np.float16, s.heads * d).reshape(s.heads, 1, d)
                step = r.array(np.float16, s.heads * d).reshape(s.heads, 1, d)
                n = s.heads * s.tokens * d
                q = unpack_bits(r.take(packed_len(n, self.bits)), self.bits, n).reshape(s.heads, s.tokens, d)
                out.append(_dequant_minmax(q, lo, step))
        r.done()
        return _build(shapes, start, ks, vs)

    def decode_into(self, data: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
        """:meth:`decode` written straight into ``out`` (a :class:`~cachegen.codec.protocol.DecodesInto`):
        the loader's fixed 8-bit method and the adaptive ladder's 8-bit rung decode without a
        float32 copy of the chunk and a second pass to place it. The chunk's size is checked
        before anything is written."""
        what = f"{self.name} chunk"
        r = Reader(memoryview(data), what)
        _, start, shapes = _read_header(r, self.name, key)
        _check_slot(shapes, start, out, what)
        need = self._body_size(shapes)
        if need != r.left:
            raise CorruptChunk(f"{what}: {r.left} bytes after the header, its layers need {need}")
        body = r.rest()
        if self.bits == 8 and dequant8_chunk_into(body, shapes, out):
            return out
        r = Reader(body, what)  # caches the compiled call does not write: layer by layer
        for s, layer in zip(shapes, out.layers):
            for d, dst in ((s.dk, layer.k), (s.dv, layer.v)):
                lo = r.array(np.float16, s.heads * d).reshape(s.heads, 1, d)
                step = r.array(np.float16, s.heads * d).reshape(s.heads, 1, d)
                if not (np.isfinite(lo).all() and np.isfinite(step).all()):
                    raise CorruptChunk("non-finite values")
                n = s.heads * s.tokens * d
                q = unpack_bits(r.take(packed_len(n, self.bits)), self.bits, n).reshape(s.heads, s.tokens, d)
                _dequant_minmax_into(q, lo, step, dst)
        r.done()
        return out
