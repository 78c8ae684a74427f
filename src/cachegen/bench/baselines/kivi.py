"""kivi2 / kivi4: KIVI-style asymmetric quantization (K per channel over token groups, V per token over channel groups)."""

from __future__ import annotations

import numpy as np

from cachegen.bench.baselines._format import (
    _build,
    _check_level,
    _dequant_minmax,
    _np32,
    _quant_minmax,
    _read_header,
    _write_header,
    _Writer,
    pack_bits,
    packed_len,
    unpack_bits,
)
from cachegen.codec.container import Reader
from cachegen.errors import ConfigError
from cachegen.kv import KVCache


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

    levels = (0,)  # one setting: the chunk header records no level

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

    def encode(self, kv: KVCache, level: int = 0, *, key: str | None = None) -> bytes:
        _check_level(self, level)
        w = _Writer()
        _write_header(w, self.name, None, kv, key)
        for l in kv.layers:
            for t, enc in ((l.k, self._enc_k), (l.v, self._enc_v)):
                q, lo, step = enc(_np32(t))
                w.array(lo)
                w.array(step)
                w.raw(pack_bits(q, self.bits))
        return w.getvalue()

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        r = Reader(memoryview(data), f"{self.name} chunk")
        _, start, shapes = _read_header(r, self.name, key)
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
