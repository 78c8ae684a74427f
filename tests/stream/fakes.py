"""Small stand-ins for loader tests without a model: a toy codec, a toy "model" for
recompute, and wrappers that inject faults into a store or a codec.

:class:`ToyCodec` implements ``cachegen.codec.ChunkCodec``: level 0 is lossless
(float32); level ``L >= 1`` quantizes each (layer, K/V, head) to ``8 - 2 * (L - 1)``
bits (8, 6, 4, 2), packed into bytes, so sizes shrink with the level. Each payload
carries the chunk's start, shape, a digest of the key it was encoded for and a
checksum; bad bytes raise :class:`~cachegen.errors.CorruptChunk`, a chunk decoded
under another key :class:`~cachegen.errors.KeyMismatch`.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cachegen.errors import ChunkNotFound, CorruptChunk, KeyMismatch, StoreUnavailable
from cachegen.kv import KVCache, KVLayer
from cachegen.store import ContextStore, Namespace, open_backend

MAGIC = b"TOYKV2"
_HDR = struct.Struct("<6sBIIIII8s")  # magic, level, start, layers, heads, tokens, head_dim, key digest
_NO_KEY = bytes(8)


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=8).digest()


class ToyCodec:
    levels = (0, 1, 2, 3, 4)

    def __init__(self, delay_s_per_mvalue: float = 0.0, sleep: Callable[[float], None] = time.sleep):
        self.delay_s_per_mvalue = delay_s_per_mvalue  # simulated decode cost (sleeps; releases the GIL)
        self.sleep = sleep  # a VirtualClock's sleep in virtual-time tests
        self.decodes = 0  # calls of decode, for tests that count them
        self._lock = threading.Lock()

    @staticmethod
    def bits(level: int) -> int:
        return 32 if level == 0 else 8 - 2 * (level - 1)

    def encode(self, kv: KVCache, level: int, *, key: str | None = None) -> bytes:
        if level not in self.levels:
            raise ValueError(f"no level {level}")
        l0 = kv.layers[0]
        h, t, d = l0.k.shape
        out = [_HDR.pack(MAGIC, level, kv.start, kv.num_layers, h, t, d, _digest(key) if key else _NO_KEY)]
        for layer in kv.layers:
            for x in (layer.k, layer.v):
                a = x.float().numpy().reshape(h, t * d)
                if level == 0:
                    out.append(a.astype("<f4").tobytes())
                    continue
                b = self.bits(level)
                lo, hi = a.min(axis=1, keepdims=True), a.max(axis=1, keepdims=True)
                scale = np.maximum(hi - lo, 1e-12) / (2**b - 1)
                q = np.rint((a - lo) / scale).astype(np.uint8)
                out.append(np.concatenate([lo, scale], axis=1).astype("<f4").tobytes())
                out.append(np.packbits(np.unpackbits(q[..., None], axis=-1)[..., 8 - b :], axis=None).tobytes())
        body = b"".join(out)
        return body + hashlib.blake2b(body, digest_size=8).digest()

    def decode(self, blob: bytes, *, key: str | None = None) -> KVCache:
        with self._lock:
            self.decodes += 1
        if len(blob) < _HDR.size + 8:
            raise CorruptChunk("too short")
        body, tag = blob[:-8], blob[-8:]
        if hashlib.blake2b(body, digest_size=8).digest() != tag:
            raise CorruptChunk("checksum mismatch")
        magic, level, start, nl, h, t, d, kd = _HDR.unpack_from(body)
        if magic != MAGIC:
            raise CorruptChunk("bad magic")
        # a chunk written without a key (an older store) cannot be checked; one written with a key must match
        if key is not None and kd != _NO_KEY and kd != _digest(key):
            raise KeyMismatch("chunk was written for another key")
        off = _HDR.size
        layers = []
        for _ in range(nl):
            kv = []
            for _ in range(2):
                if level == 0:
                    n = h * t * d * 4
                    a = np.frombuffer(body, "<f4", h * t * d, off).reshape(h, t, d)
                    off += n
                else:
                    b = self.bits(level)
                    side = np.frombuffer(body, "<f4", 2 * h, off).reshape(h, 2)
                    off += 8 * h
                    nbits = h * t * d * b
                    nb = (nbits + 7) // 8
                    bits = np.unpackbits(np.frombuffer(body, np.uint8, nb, off))[:nbits].reshape(-1, b)
                    off += nb
                    q = np.packbits(np.concatenate([np.zeros((bits.shape[0], 8 - b), np.uint8), bits], 1), axis=1)
                    a = (q.reshape(h, t * d).astype(np.float32) * side[:, 1:2] + side[:, 0:1]).reshape(h, t, d)
                kv.append(torch.from_numpy(a.copy()))
            layers.append(KVLayer(kv[0], kv[1]))
        if off != len(body):
            raise CorruptChunk("trailing bytes")
        out = KVCache(layers, start=start)
        if self.delay_s_per_mvalue:
            self.sleep(self.delay_s_per_mvalue * out.num_values / 1e6)
        return out


class LayoutToyCodec(ToyCodec):
    """:class:`ToyCodec` that also decodes into a slot (a DecodesInto: decode, check the range, copy)
    and reads a chunk's layout from its header (a ReadsLayout; ``layout_none``: says it cannot).
    ``calls`` records ``decode``, ``into`` and ``layout`` in order."""

    def __init__(self, *args, layout_none: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.layout_none = layout_none
        self.calls: list[str] = []

    def decode(self, blob: bytes, *, key: str | None = None) -> KVCache:
        self.calls.append("decode")
        return super().decode(blob, key=key)

    def decode_into(self, blob: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
        self.calls.append("into")
        kv = super().decode(blob, key=key)
        if (kv.start, kv.num_tokens) != (out.start, out.num_tokens) or not kv.same_layout(out):
            raise CorruptChunk("chunk does not fit its slot")
        out.write(kv)
        return out

    def layout(self, blob: bytes) -> KVCache | None:
        self.calls.append("layout")
        if self.layout_none:
            return None
        if len(blob) < _HDR.size:
            raise CorruptChunk("too short")
        magic, _level, start, nl, h, _t, d, _kd = _HDR.unpack_from(blob)
        if magic != MAGIC:
            raise CorruptChunk("bad magic")
        return KVCache([KVLayer(torch.empty(h, 0, d), torch.empty(h, 0, d)) for _ in range(nl)], start=start)


class FaultyCodec:
    """Wraps a codec; decoding the chunk that starts at a token in ``fail_at`` raises the
    exception given for it (``MemoryError``, ``OverflowError``, a bug's ``TypeError``...)."""

    def __init__(self, codec, fail_at: dict[int, BaseException]):
        self.codec, self.fail_at = codec, dict(fail_at)
        self.levels = codec.levels
        self.decoded: list[int] = []  # start token of every decode call, in order

    def encode(self, kv: KVCache, level: int, *, key: str | None = None) -> bytes:
        return self.codec.encode(kv, level, key=key)

    def decode(self, data: bytes, *, key: str | None = None) -> KVCache:
        kv = self.codec.decode(data, key=key)
        self.decoded.append(kv.start)
        if kv.start in self.fail_at:
            raise self.fail_at[kv.start]
        return kv


class ToyModel:
    """A deterministic stand-in for prefill: the KV of a token depends on the token,
    its position and the prefix's last key, like a real model depends on its prefix."""

    def __init__(
        self,
        layers: int = 2,
        heads: int = 2,
        head_dim: int = 8,
        s_per_token: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        self.s_per_token = s_per_token
        self.sleep = sleep
        self.calls: list[tuple[int, int]] = []  # (prefix end, tokens)
        self._lock = threading.Lock()

    def recompute(self, prefix: KVCache | None, token_ids: list[int]) -> KVCache:
        start = prefix.end if prefix is not None else 0
        with self._lock:
            self.calls.append((start, len(token_ids)))
        if self.s_per_token:
            self.sleep(self.s_per_token * len(token_ids))
        n = len(token_ids)
        pos = torch.arange(start, start + n, dtype=torch.float32)
        tok = torch.as_tensor(token_ids, dtype=torch.float32)
        d = torch.arange(self.head_dim, dtype=torch.float32)
        layers = []
        for li in range(self.layers):
            # each token depends on the mean key of every token before it (as attention would)
            total = float(prefix.layers[li].k.float().mean(dim=(0, 2)).sum()) if prefix is not None else 0.0
            base = torch.stack(
                [torch.sin(tok[:, None] * 0.37 * (d + 1) + pos[:, None] * 0.01 + h + li) for h in range(self.heads)]
            )
            k = torch.empty_like(base)
            for t in range(n):
                ctx = total / (start + t) if start + t else 0.0
                k[:, t] = base[:, t] + 0.5 * ctx
                total += float(k[:, t].mean())
            layers.append(KVLayer(k, torch.cos(base) + 0.5 * k.mean(dim=2, keepdim=True)))
        return KVCache(layers, start=start)

    def full(self, token_ids: list[int], chunk_tokens: int | None = None) -> KVCache:
        """KV of all ``token_ids``, computed chunk by chunk as a streaming recompute would."""
        if not chunk_tokens:
            return self.recompute(None, token_ids)
        parts: list[KVCache] = []
        for a in range(0, len(token_ids), chunk_tokens):
            prefix = KVCache.concat(parts) if parts else None
            parts.append(self.recompute(prefix, token_ids[a : a + chunk_tokens]))
        return KVCache.concat(parts)


class FaultyStore:
    """Wraps a ContextStore; makes chosen chunks fail.

    ``faults``: chunk index -> ``corrupt`` (a flipped byte), ``missing``, ``timeout`` (waits
    ``timeout_s``, then ``StoreUnavailable``), ``stall`` (blocks until :meth:`release`, as a
    store that ignores its timeout would), ``memory`` (``MemoryError``), ``bug`` (``TypeError``).
    ``slow`` (sleeps ``timeout_s`` with ``sleep``, then answers: a stall on a virtual clock).
    ``stall_plan``: :meth:`plan` blocks until :meth:`release`. Records every get and the
    timeouts the loader passed."""

    def __init__(
        self,
        store,
        faults: dict[int, str] | None = None,
        timeout_s: float = 0.0,
        stall_plan: bool = False,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.store = store
        self.faults = dict(faults or {})
        self.timeout_s = timeout_s
        self.stall_plan = stall_plan
        self.sleep = sleep
        self.gets: list[tuple[int, int]] = []
        self.timeouts: list[float | None] = []  # the timeout= of each plan and get, in call order
        self._released = threading.Event()
        self._lock = threading.Lock()

    def release(self) -> None:
        """Unblock stalled calls (a test's clean-up: no thread is left waiting)."""
        self._released.set()

    def plan(self, tokens, *, timeout: float | None = None):
        with self._lock:
            self.timeouts.append(timeout)
        if self.stall_plan:
            self._released.wait(60)
        return self.store.plan(tokens)

    def get(self, ref, level, *, timeout: float | None = None):
        with self._lock:
            self.gets.append((ref.index, level))
            self.timeouts.append(timeout)
        f = self.faults.get(ref.index)
        if f == "missing":
            raise ChunkNotFound(f"chunk {ref.index} (injected)")
        if f == "timeout":
            time.sleep(self.timeout_s)
            raise StoreUnavailable(f"timed out fetching chunk {ref.index} (injected)")
        if f == "stall":
            self._released.wait(60)
        if f == "slow":
            self.sleep(self.timeout_s)
        if f == "memory":
            raise MemoryError("injected")
        if f == "bug":
            raise TypeError("injected bug in the store")
        data = self.store.get(ref, level)
        if f == "corrupt":
            b = bytearray(data)
            b[len(b) // 2] ^= 0xFF
            return bytes(b)
        return data

    def __getattr__(self, name):
        return getattr(self.store, name)


# -- a stored context, written once per process ----------------------------------------------

_TEMPLATES: dict[tuple, Path] = {}
_TEMPLATE_ROOT: Path | None = None


def stored_context(
    root: Path, namespace: Namespace, codec, chunk_tokens: int, tokens: list[int], kv: KVCache
) -> ContextStore:
    """A file store at ``root`` holding ``tokens``' chunks at every level of ``codec``.

    The loader tests each need the same small stored context; writing it (a file and an fsync per
    payload, an index transaction per chunk) was most of each test's time. It is written once per
    process through the real store, closed, and copied for each test, which gets a store of its own."""
    global _TEMPLATE_ROOT
    digest = hashlib.blake2b(digest_size=16)
    for layer in kv.layers:
        digest.update(layer.k.numpy().tobytes())
        digest.update(layer.v.numpy().tobytes())
    key = (namespace, chunk_tokens, tuple(tokens), tuple(codec.levels), type(codec).__name__, digest.hexdigest())
    template = _TEMPLATES.get(key)
    if template is None:
        if _TEMPLATE_ROOT is None:
            _TEMPLATE_ROOT = Path(tempfile.mkdtemp(prefix="cachegen-test-stores-"))
            atexit.register(shutil.rmtree, _TEMPLATE_ROOT, True)
        template = _TEMPLATE_ROOT / str(len(_TEMPLATES))
        store = ContextStore(open_backend(f"file://{template}"), namespace, codec, chunk_tokens=chunk_tokens)
        store.put_context(tokens, kv, levels=codec.levels)
        store.backend.close()
        _TEMPLATES[key] = template
    shutil.copytree(template, root, copy_function=_link_blob)
    return ContextStore(open_backend(f"file://{root}"), namespace, codec, chunk_tokens=chunk_tokens)


def _link_blob(src: str, dst: str) -> None:
    # the store never changes a payload file in place (it writes a new one and renames it), so the
    # copies can share the template's; the index and the marker are copied
    if Path(src).parent.parent.name == "blobs":
        try:
            os.link(src, dst)
            return
        except OSError:  # another filesystem (TMPDIR elsewhere than pytest's temporary directory)
            pass
    shutil.copyfile(src, dst)


class BatchingToyCodec(ToyCodec):
    """A :class:`ToyCodec` that also decodes into a cache, one chunk (``decode_into``) or several
    consecutive ones in one call (``decode_many_into``), recording each call as ``(kind, chunks)``.
    On ``sleep`` (a VirtualClock's) a decode takes ``first_s`` (``decode``: the loader's first
    chunk, which allocates the cache), ``alone_s`` (``decode_into``) or ``share_s`` per chunk
    (``decode_many_into``)."""

    def __init__(self, sleep: Callable[[float], None], first_s: float = 1.0, alone_s: float = 0.01, share_s=0.002):
        super().__init__()
        self._sleep, self.first_s, self.alone_s, self.share_s = sleep, first_s, alone_s, share_s
        self.calls: list[tuple[str, int]] = []

    def decode(self, blob: bytes, *, key: str | None = None) -> KVCache:
        self.calls.append(("decode", 1))
        self._sleep(self.first_s)
        return super().decode(blob, key=key)

    def _into(self, blob: bytes, out: KVCache, key: str | None) -> None:
        kv = ToyCodec.decode(self, blob, key=key)
        if (kv.start, kv.end) != (out.start, out.end):
            raise CorruptChunk(f"chunk holds [{kv.start}, {kv.end}), expected [{out.start}, {out.end})")
        out.write(kv)

    def decode_into(self, blob: bytes, out: KVCache, *, key: str | None = None) -> KVCache:
        self.calls.append(("into", 1))
        self._sleep(self.alone_s)
        self._into(blob, out, key)
        return out

    def decode_many_into(self, blobs, out: KVCache, sizes, *, keys=None) -> KVCache:
        self.calls.append(("many", len(blobs)))
        self._sleep(self.share_s * len(blobs))
        pos = out.start
        for j, (blob, n) in enumerate(zip(blobs, sizes, strict=True)):
            self._into(blob, out.slice(pos, pos + n), keys[j] if keys else None)
            pos += n
        return out
