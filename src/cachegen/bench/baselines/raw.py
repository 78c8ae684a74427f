"""fp16 / bf16: the raw KV cast to 16 bits, as is."""

from __future__ import annotations

import numpy as np
import torch

from cachegen.bench.baselines._format import (
    _build,
    _check_level,
    _check_slot,
    _LayerShape,
    _read_header,
    _write_header,
    _Writer,
    read_layout,
)
from cachegen.codec.container import Reader
from cachegen.errors import ConfigError, CorruptChunk
from cachegen.kv import KVCache


def _body_size(shapes: list[_LayerShape]) -> int:
    """Bytes after the header: every layer's K and V, two bytes a value."""
    return sum(2 * s.heads * s.tokens * (s.dk + s.dv) for s in shapes)


class RawCodec:
    """The KV cast to fp16 or bf16, as is."""

    levels = (0,)  # one setting: the chunk header records no level

    def __init__(self, dtype: str = "fp16") -> None:
        if dtype not in ("fp16", "bf16"):
            raise ConfigError(f"raw dtype must be fp16 or bf16, not {dtype!r}")
        self.name = dtype
        self._torch = torch.float16 if dtype == "fp16" else torch.bfloat16
        self._inf_bits = 0x7C00 if dtype == "fp16" else 0x7F80  # the exponent field, all ones

    def encode(self, kv: KVCache, level: int = 0, *, key: str | None = None) -> bytes:
        _check_level(self, level)
        w = _Writer()
        _write_header(w, self.name, None, kv, key)
        for l in kv.layers:
            for t in (l.k, l.v):
                # bf16 has no numpy dtype: ship its bit pattern as int16
                w.array(t.detach().to(self._torch).contiguous().view(torch.int16).cpu().numpy())
        return w.getvalue()

    def layout(self, data: bytes) -> KVCache:
        """The chunk's start and layout, without decoding it (a :class:`~cachegen.codec.protocol.ReadsLayout`)."""
        return read_layout(data, self.name, _body_size)

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        r = Reader(memoryview(data), f"{self.name} chunk")
        _, start, shapes = _read_header(r, self.name, key)
        ks: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        for s in shapes:
            for d, out in ((s.dk, ks), (s.dv, vs)):
                a = r.array(np.int16, s.heads * s.tokens * d).reshape(s.heads, s.tokens, d)
                out.append(torch.from_numpy(a.copy()).view(self._torch).float().numpy())
        r.done()
        return _build(shapes, start, ks, vs)

    def decode_into(self, data: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
        """:meth:`decode` written straight into ``out`` (a :class:`~cachegen.codec.protocol.DecodesInto`),
        cast once from 16 bits to ``out``'s dtype instead of through a float32 copy of the chunk.
        The chunk's size is checked before anything is written."""
        what = f"{self.name} chunk"
        r = Reader(memoryview(data), what)
        _, start, shapes = _read_header(r, self.name, key)
        _check_slot(shapes, start, out, what)
        need = _body_size(shapes)
        if need != r.left:
            raise CorruptChunk(f"{what}: {r.left} bytes after the header, its layers need {need}")
        body = np.frombuffer(r.rest(), dtype=np.int16)
        # one pass over the bit patterns finds an inf or NaN (every exponent bit set), before any write
        if body.size and int(np.bitwise_and(body, 0x7FFF).max()) >= self._inf_bits:
            raise CorruptChunk("non-finite values")
        src = torch.from_numpy(body.copy()).view(self._torch)  # a writable copy: torch warns on a read-only buffer
        pos = 0
        for s, layer in zip(shapes, out.layers):
            for d, dst in ((s.dk, layer.k), (s.dv, layer.v)):
                n = s.heads * s.tokens * d
                dst.copy_(src[pos : pos + n].view(s.heads, s.tokens, d))
                pos += n
        return out
