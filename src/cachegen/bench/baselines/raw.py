"""fp16 / bf16: the raw KV cast to 16 bits, as is."""

from __future__ import annotations

import numpy as np
import torch

from cachegen.bench.baselines._format import (
    _build,
    _check_level,
    _read_header,
    _write_header,
    _Writer,
)
from cachegen.codec.container import Reader
from cachegen.errors import ConfigError
from cachegen.kv import KVCache


class RawCodec:
    """The KV cast to fp16 or bf16, as is."""

    levels = (0,)  # one setting: the chunk header records no level

    def __init__(self, dtype: str = "fp16") -> None:
        if dtype not in ("fp16", "bf16"):
            raise ConfigError(f"raw dtype must be fp16 or bf16, not {dtype!r}")
        self.name = dtype
        self._torch = torch.float16 if dtype == "fp16" else torch.bfloat16

    def encode(self, kv: KVCache, level: int = 0, *, key: str | None = None) -> bytes:
        _check_level(self, level)
        w = _Writer()
        _write_header(w, self.name, None, kv, key)
        for l in kv.layers:
            for t in (l.k, l.v):
                # bf16 has no numpy dtype: ship its bit pattern as int16
                w.array(t.detach().to(self._torch).contiguous().view(torch.int16).cpu().numpy())
        return w.getvalue()

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
