"""The baselines' common chunk format: a tiny binary header, then raw numpy buffers (nothing pickled).

``b"CGBL" | u8 version | u8 name_len | name | 16-byte key digest | u8 level (255: none) | u32 start | u16 layers |``
per layer ``u8 kind | u32 window | u16 heads | u32 tokens | u16 k_dim | u16 v_dim``. The key digest
(:func:`cachegen.codec.container.key_digest`, version 2) binds a chunk to its store key as the
project codec's does: ``decode(data, key=K)`` raises KeyMismatch for another key's chunk. Reads go
through :class:`cachegen.codec.container.Reader` (the one bounds-checked reader).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from numba import carray, njit, types
from numba.extending import intrinsic

from cachegen.codec import _numba_env  # noqa: F401  # before numba
from cachegen.codec.container import DIGEST_SIZE, Reader, key_digest
from cachegen.codec.protocol import empty_layers_cache
from cachegen.errors import ConfigError, CorruptChunk, KeyMismatch
from cachegen.kv import KVCache, KVLayer, LayerKind

MAGIC = b"CGBL"
FORMAT_VERSION = 2  # 2: + the chunk key's digest
CHUNK_TOKENS = 256

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


@dataclass(frozen=True)
class _LayerShape:
    kind: LayerKind
    window: int | None
    heads: int
    tokens: int
    dk: int
    dv: int


def _write_header(w: _Writer, name: str, level: int | None, kv: KVCache, key: str | None = None) -> list[_LayerShape]:
    nb = name.encode()
    w.raw(MAGIC)
    w.pack("BB", FORMAT_VERSION, len(nb))
    w.raw(nb)
    w.raw(key_digest(key))
    w.pack("BIH", 255 if level is None else level, kv.start, kv.num_layers)
    shapes = []
    for l in kv.layers:
        h, t, dk = l.k.shape
        dv = l.v.shape[2]
        w.pack("BIHIHH", _KINDS[l.kind], l.window or 0, h, t, dk, dv)
        shapes.append(_LayerShape(l.kind, l.window, h, t, dk, dv))
    return shapes


def _read_header(r: Reader, name: str, key: str | None = None) -> tuple[int | None, int, list[_LayerShape]]:
    if bytes(r.take(4)) != MAGIC:
        raise CorruptChunk("bad magic")
    version, n = r.unpack("BB")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"format version {version}, expected {FORMAT_VERSION}")
    got = bytes(r.take(n)).decode(errors="replace")
    if got != name:
        raise CorruptChunk(f"these bytes were written by codec {got!r}, not {name!r}")
    digest = bytes(r.take(DIGEST_SIZE))
    if key is not None and digest != key_digest(key):
        raise KeyMismatch("chunk was written for another key (a foreign or swapped chunk)")
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


def _check_slot(shapes: list[_LayerShape], start: int, out: KVCache, what: str) -> None:
    """:class:`CorruptChunk` unless a chunk of ``shapes`` from ``start`` is exactly ``out``'s range
    and layout (what :func:`cachegen.codec.protocol.check_fits` asks of a decoded chunk)."""
    tokens = {s.tokens for s in shapes}
    if start != out.start or tokens != {out.num_tokens}:
        n = min(tokens)
        raise CorruptChunk(f"{what} holds tokens [{start}, {start + n}), expected [{out.start}, {out.end})")
    if len(shapes) != out.num_layers or any(
        (s.kind, s.window, s.heads, s.dk, s.dv) != (l.kind, l.window, l.k.shape[0], l.k.shape[2], l.v.shape[2])
        for s, l in zip(shapes, out.layers)
    ):
        raise CorruptChunk(f"{what} has a different layout from the cache it is written into")


def read_layout(data: bytes, name: str, body_size: Callable[[list[_LayerShape]], int]) -> KVCache:
    """A baseline chunk's start and layout as a cache of no tokens, in float32 as ``decode`` gives
    it (:class:`~cachegen.codec.protocol.ReadsLayout`), from the header alone. The bytes after the
    header must be ``body_size(shapes)``, so a header cannot claim more values than the chunk holds."""
    what = f"{name} chunk"
    r = Reader(memoryview(data), what)
    _, start, shapes = _read_header(r, name, None)
    if len({s.tokens for s in shapes}) != 1:
        raise CorruptChunk(f"{what}: its layers hold different numbers of tokens")
    need = body_size(shapes)
    if need != r.left:
        raise CorruptChunk(f"{what}: {r.left} bytes after the header, its layers need {need}")
    return empty_layers_cache(((s.kind, s.window, s.heads, s.dk, s.dv) for s in shapes), start, torch.float32)


def _check_level(codec, level: int) -> None:
    if level not in codec.levels:
        raise ConfigError(f"{codec.name} has no level {level} (levels: {codec.levels})")


def header_size(name: str, num_layers: int) -> int:
    """Bytes of the common header (for size-accounting tests)."""
    return 4 + 2 + len(name.encode()) + DIGEST_SIZE + struct.calcsize("<BIH") + num_layers * struct.calcsize("<BIHIHH")


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _build(shapes: list[_LayerShape], start: int, ks: list[np.ndarray], vs: list[np.ndarray]) -> KVCache:
    if not all(np.isfinite(a).all() for a in (*ks, *vs)):
        raise CorruptChunk("non-finite values")
    layers = [
        KVLayer(
            torch.from_numpy(np.ascontiguousarray(k, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)),
            s.kind,
            s.window,
        )
        for s, k, v in zip(shapes, ks, vs)
    ]
    return KVCache(layers, start=start)


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


# asymmetric min/max quantization (shared by uniform and KIVI)


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


def _dequant_minmax_into(q: np.ndarray, lo16: np.ndarray, step16: np.ndarray, dst: torch.Tensor) -> None:
    """:func:`_dequant_minmax` written into ``dst`` (a view of a preallocated cache) and cast to
    its dtype: the same values as decoding and then copying, in one pass without a float32 copy
    of the chunk (float32 and bfloat16 caches whose rows are contiguous, as
    :meth:`~cachegen.kv.KVCache.allocate` makes them; others go through numpy). ``lo16`` and
    ``step16`` (``[heads, 1, dim]``) must be finite (the result then is)."""
    h, t, d = q.shape
    lo, step = lo16.astype(np.float32).reshape(h, d), step16.astype(np.float32).reshape(h, d)
    if dst.dtype in (torch.float32, torch.bfloat16) and dst.shape == q.shape and dst.stride()[1:] == (d, 1):
        # the storage as one flat array: the kernel's inner loop runs over contiguous memory
        bits = dst if dst.dtype == torch.float32 else dst.view(torch.int16)
        flat = bits.as_strided((bits.untyped_storage().nbytes() // bits.element_size(),), (1,), 0).numpy()
        kernel = _dequant_f32 if dst.dtype == torch.float32 else _dequant_bf16
        kernel(q.reshape(h, t * d), step, lo, flat, dst.storage_offset(), dst.stride(0))
    else:
        dst.copy_(torch.from_numpy(_dequant_minmax(q, lo16, step16)))


# Without fastmath numba keeps the multiply and the add apart (no fused multiply-add), so the
# kernels give numpy's float32 values bit for bit; nogil lets the fetch thread run beside them.
# ``out`` is the cache's whole storage, flat; head i's rows start at ``off + i * head_stride``.
# The loops index slices from 0 (no negative-index wraparound), so LLVM vectorizes them.
@njit(nogil=True, cache=True, inline="always")
def _dequant_row(q, step, lo, out):  # pragma: no cover - compiled
    """One token's row: the arithmetic every kernel here shares."""
    for k in range(out.shape[0]):
        out[k] = np.float32(q[k]) * step[k] + lo[k]


@njit(nogil=True, cache=True)
def _dequant_f32(q, step, lo, out, off, head_stride):  # pragma: no cover - compiled
    h, n = q.shape
    for i in range(h):
        _rows_f32(q[i], step[i], lo[i], out[off + i * head_stride : off + i * head_stride + n])


@njit(nogil=True, cache=True)
def _dequant_bf16(q, step, lo, out, off, head_stride):  # pragma: no cover - compiled
    """``out``: bfloat16 storage as int16 (:func:`_rows_bf16`)."""
    h, n = q.shape
    row = np.empty(step.shape[1], np.float32)
    for i in range(h):
        _rows_bf16(q[i], step[i], lo[i], out[off + i * head_stride : off + i * head_stride + n], row)


@njit(nogil=True, cache=True, inline="always")
def _rows_f32(q, step, lo, out):  # pragma: no cover - compiled
    """A head's rows (``q`` and ``out`` flat); each row's loop runs over a slice, which LLVM vectorizes."""
    d = step.shape[0]
    for j in range(0, q.shape[0], d):
        _dequant_row(q[j : j + d], step, lo, out[j : j + d])


@njit(nogil=True, cache=True, inline="always")
def _rows_bf16(q, step, lo, out, row):  # pragma: no cover - compiled
    """:func:`_rows_f32` into bfloat16 bits (``out``: int16), through the float32 scratch ``row``,
    rounded to nearest even as torch casts."""
    d = step.shape[0]
    bits = row.view(np.uint32)
    for j in range(0, q.shape[0], d):
        _dequant_row(q[j : j + d], step, lo, row)
        oj = out[j : j + d]
        for k in range(d):
            b = bits[k]
            oj[k] = np.int16(
                np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
            )


# -- one call per chunk: every layer's 8-bit K and V in one compiled pass ----------------------------
#
# Why: the loop above makes some 15 Python calls per layer and K/V. For a 256-token SmolLM2
# chunk that is 2.3 ms of Python holding the GIL against 0.5-0.6 ms of compiled work, and the
# fetch thread's Python beside it (the adaptive policy's decisions) waits on that GIL, or makes
# the decode wait (``tools/time_dequant.py``). :func:`dequant8_chunk_into` checks the slot in
# Python and hands the kernel the destinations' addresses: one call, without the GIL.


@intrinsic
def _as_ptr(typingctx, addr, dtype):  # pragma: no cover - compiled
    """An integer address as a typed pointer (for :func:`numba.carray`); the caller vouches for it."""
    ptr = types.CPointer(dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(addr, dtype), codegen


@njit(nogil=True, cache=True, inline="always")
def _half(buf, at):  # pragma: no cover - compiled
    """The little-endian IEEE half at ``buf[at:at + 2]`` as float32, exactly (a finite half: the
    caller checks the exponent first)."""
    h = np.uint32(buf[at]) | (np.uint32(buf[at + 1]) << np.uint32(8))
    e = (h >> np.uint32(10)) & np.uint32(31)
    m = np.float32(h & np.uint32(1023))
    if e == 0:  # subnormal: m * 2**-24
        v = m * np.float32(2.0**-24)
    else:
        v = (m + np.float32(1024)) * np.float32(2.0 ** (np.int64(e) - 25))
    return -v if h >> np.uint32(15) else v


@njit(nogil=True, cache=True)
def _dequant8_chunk(buf, at, dims, addrs, head_strides, bf16):  # pragma: no cover - compiled
    """Write every (layer, K/V) item of an 8-bit chunk body starting at ``buf[at]``: per item a fp16
    ``min[heads, dim]``, a fp16 ``step[heads, dim]``, then ``uint8 q[heads, tokens, dim]``. Item
    ``i`` (``dims[i]`` = heads, tokens, dim) goes to float32 (bfloat16, as int16, when ``bf16``) rows
    at ``addrs[i] + (head * head_strides[i] + token * dim) * itemsize``. Returns False, having
    written nothing, when a min or step is not finite."""
    n = dims.shape[0]
    p = at
    for i in range(n):  # every min and step checked before the first write
        h, t, d = dims[i, 0], dims[i, 1], dims[i, 2]
        for j in range(p + 1, p + 4 * h * d, 2):  # a half's high byte: all five exponent bits set
            if buf[j] & 0x7C == 0x7C:
                return False
        p += 4 * h * d + h * t * d
    p = at
    for i in range(n):
        h, t, d = dims[i, 0], dims[i, 1], dims[i, 2]
        lo, step, row = np.empty(d, np.float32), np.empty(d, np.float32), np.empty(d, np.float32)
        q0 = p + 4 * h * d
        for a in range(h):
            for k in range(d):
                lo[k] = _half(buf, p + 2 * (a * d + k))
                step[k] = _half(buf, p + 2 * (h * d + a * d + k))
            qa = buf[q0 + a * t * d : q0 + (a + 1) * t * d]
            if bf16:
                _rows_bf16(qa, step, lo, carray(_as_ptr(addrs[i] + 2 * a * head_strides[i], np.int16), (t * d,)), row)
            else:
                _rows_f32(qa, step, lo, carray(_as_ptr(addrs[i] + 4 * a * head_strides[i], np.float32), (t * d,)))
        p = q0 + h * t * d
    return True


def dequant8_chunk_into(body: memoryview, shapes: list[_LayerShape], out: KVCache) -> bool:
    """Dequantize an 8-bit chunk's body (its layers' min, step and codes, after the header) into
    ``out`` in one compiled call. False, having done nothing, when ``out``'s tensors are not what
    the kernel writes (CPU float32 or bfloat16 with contiguous rows; the caller then takes the
    per-layer path); :class:`CorruptChunk`, having written nothing, on a non-finite min or step.
    ``shapes`` must match ``out`` (:func:`_check_slot`) and ``body`` be exactly their size."""
    dsts = [x for l in out.layers for x in (l.k, l.v)]
    dtype = out.dtype
    if dtype not in (torch.float32, torch.bfloat16) or any(
        x.dtype != dtype or x.device.type != "cpu" or x.stride(2) != 1 or x.stride(1) != x.shape[2] for x in dsts
    ):
        return False
    dims = np.array([(s.heads, s.tokens, d) for s in shapes for d in (s.dk, s.dv)], np.int64).reshape(-1, 3)
    addrs = np.array([x.data_ptr() for x in dsts], np.int64)
    strides = np.array([x.stride(0) for x in dsts], np.int64)
    buf = np.frombuffer(body, np.uint8)
    if not _dequant8_chunk(buf, 0, dims, addrs, strides, dtype == torch.bfloat16):
        raise CorruptChunk("non-finite values")
    return True
